"""dlrover-plugin-k8s: the ``k8s`` scheduler for dlrover-core.

A job becomes a master pod (the job master, plus a controller that creates one worker pod per
node, polls them and relaunches failed, evicted or OOM-killed ones) with its ServiceAccount,
Role, RoleBinding, worker template and Service. ``Job(scheduler="k8s").dryrun()`` renders
every manifest; ``kubectl apply -f manifests.yaml`` or ``Job.run()`` creates them.
"""

from importlib.metadata import PackageNotFoundError, version

from dlrover_plugin_k8s._api import K8sApiError, KubeApi, k8s_retrying
from dlrover_plugin_k8s._config import K8sConfig
from dlrover_plugin_k8s._controller import RESULT_MARKER, PodController
from dlrover_plugin_k8s._manifests import Manifests, Names, render, shm_size_mb, worker_pod
from dlrover_plugin_k8s._scheduler import K8sScheduler, dlrover_register_schedulers
from dlrover_plugin_k8s._workers import PodFailure, classify

try:
    __version__ = version("dlrover-plugin-k8s")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "RESULT_MARKER",
    "K8sApiError",
    "K8sConfig",
    "K8sScheduler",
    "KubeApi",
    "Manifests",
    "Names",
    "PodController",
    "PodFailure",
    "__version__",
    "classify",
    "dlrover_register_schedulers",
    "k8s_retrying",
    "render",
    "shm_size_mb",
    "worker_pod",
]
