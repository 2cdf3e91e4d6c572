"""Settings of the k8s scheduler that are not part of a Job: image, namespace, pod resources.

Each is a scheduler option, declared as data in :data:`OPTIONS` (``dlrover plugins list``
shows them): ``Job(scheduler_options={"image": ..., "namespace": ...})`` sets it, and its
``DLROVER_K8S_*`` environment variable is the fallback. A program or a test can also build the
backend with a :class:`K8sConfig` (``K8sScheduler(K8sConfig(image=...))``): the Job's options
still win over it, and the environment is then not read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from dlrover_core.backend import SchedulerOption, resolve_options

__all__ = ["ENV", "OPTIONS", "K8sConfig"]

#: The k8s scheduler's options, with their environment fallbacks.
OPTIONS: tuple[SchedulerOption, ...] = (
    SchedulerOption(name="image", type=str, default="", env="DLROVER_K8S_IMAGE",
                    help="image of the master and worker pods: python, dlrover-core, dlrover-plugin-k8s, the "
                         "accelerator's plugin and the job's code at workdir (required)"),
    SchedulerOption(name="namespace", type=str, default="default", env="DLROVER_K8S_NAMESPACE",
                    help="namespace of every object of the job"),
    SchedulerOption(name="image_pull_policy", type=str, default="IfNotPresent", env="DLROVER_K8S_IMAGE_PULL_POLICY",
                    help="IfNotPresent, Always or Never"),
    SchedulerOption(name="image_pull_secrets", type=list, default=(), env="DLROVER_K8S_IMAGE_PULL_SECRETS",
                    help="names of Secrets to pull the image with"),
    SchedulerOption(name="workdir", type=str, default="/workspace", env="DLROVER_K8S_WORKDIR",
                    help="the job's working directory inside the image"),
    SchedulerOption(name="python", type=str, default="python", env="DLROVER_K8S_PYTHON",
                    help="the interpreter in the image"),
    SchedulerOption(name="cpu_request", type=str, default=None, env="DLROVER_K8S_CPU",
                    help="CPU request of each worker pod (a quantity, e.g. 8)"),
    SchedulerOption(name="memory_request", type=str, default=None, env="DLROVER_K8S_MEMORY",
                    help="memory request of each worker pod (e.g. 64Gi; keep it above the /dev/shm size)"),
    SchedulerOption(name="memory_limit", type=str, default=None, env="DLROVER_K8S_MEMORY_LIMIT",
                    help="memory limit of each worker pod"),
    SchedulerOption(name="checkpoint_mb", type=int, default=1024, env="DLROVER_K8S_CHECKPOINT_MB",
                    help="one rank's checkpointed state in MiB, to size /dev/shm"),
    SchedulerOption(name="shm_size_mb", type=int, default=None, env="DLROVER_K8S_SHM_SIZE_MB",
                    help="explicit /dev/shm sizeLimit in MiB, overriding the rule"),
    SchedulerOption(name="checkpoint_pvc", type=str, default=None, env="DLROVER_K8S_CHECKPOINT_PVC",
                    help="a ReadWriteMany PersistentVolumeClaim mounted at the checkpoint directory of every pod"),
    SchedulerOption(name="log_root", type=str, default="/var/log/dlrover", env="DLROVER_K8S_LOG_ROOT",
                    help="where every pod keeps the job's logs (an emptyDir)"),
    SchedulerOption(name="master_port", type=int, default=50001, env="DLROVER_K8S_MASTER_PORT",
                    help="port of the master's HTTP API, in its pod and on its Service"),
    SchedulerOption(name="kubeconfig", type=str, default=None, env="DLROVER_K8S_KUBECONFIG",
                    help="kubeconfig outside a cluster (default: $KUBECONFIG or ~/.kube/config)"),
    SchedulerOption(name="context", type=str, default=None, env="DLROVER_K8S_CONTEXT",
                    help="kubeconfig context (default: the current one)"),
)

#: option (= K8sConfig field) name -> environment variable
ENV: dict[str, str] = {o.name: str(o.env) for o in OPTIONS}


@attrs.frozen(kw_only=True)
class K8sConfig:
    """Where and how the job's pods run: the resolved :data:`OPTIONS` (same names).

    Attributes:
        image: container image of the master and worker pods: Python with dlrover-core,
            dlrover-plugin-k8s, the accelerator's plugin and the job's code at ``workdir``.
            Required to render manifests.
        namespace: namespace of every object of the job.
        image_pull_policy: ``IfNotPresent``, ``Always`` or ``Never``.
        image_pull_secrets: names of Secrets to pull the image with.
        workdir: the job's working directory inside the image (the Job's ``workdir`` is a
            path on the submitting machine; its entrypoint is found relative to this one).
        python: the interpreter in the image.
        cpu_request: CPU request of each worker pod (a quantity, e.g. ``"8"``); none if unset.
        memory_request: memory request of each worker pod (e.g. ``"64Gi"``); none if unset.
            The /dev/shm volume is memory too: keep this above ``shm_size_mb``.
        memory_limit: memory limit of each worker pod; none if unset.
        checkpoint_mb: size in MiB of one rank's checkpointed state (model and optimizer),
            used to size /dev/shm (see :func:`~dlrover_plugin_k8s.shm_size_mb`).
        shm_size_mb: explicit sizeLimit of /dev/shm in MiB, overriding the rule.
        checkpoint_pvc: a PersistentVolumeClaim (ReadWriteMany) mounted at the checkpoint
            directory in the master and every worker pod, so every rank persists to the same
            storage; without it checkpoints stay on each pod's own disk.
        log_root: where every pod keeps the job's logs (an emptyDir volume is mounted there;
            the master's journal in it survives a restart of the master's container).
        master_port: port of the master's HTTP API, in its pod and on its Service.
        kubeconfig: kubeconfig file for API calls outside a cluster (default: ``$KUBECONFIG``
            or ``~/.kube/config``); inside a pod the service account is used.
        context: kubeconfig context (default: the current one).
    """

    image: str = ""
    namespace: str = "default"
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    workdir: str = "/workspace"
    python: str = "python"
    cpu_request: str | None = None
    memory_request: str | None = None
    memory_limit: str | None = None
    checkpoint_mb: int = 1024
    shm_size_mb: int | None = None
    checkpoint_pvc: str | None = None
    log_root: str = "/var/log/dlrover"
    master_port: int = 50001
    kubeconfig: str | None = None
    context: str | None = None

    @classmethod
    def from_options(cls, values: Mapping[str, Any]) -> K8sConfig:
        """A config from resolved option values, by name."""
        return cls(**{o.name: values[o.name] for o in OPTIONS if o.name in values})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> K8sConfig:
        """A config from the ``DLROVER_K8S_*`` variables (see :data:`ENV`); unset or empty
        variables keep the defaults.

        Raises:
            JobSpecError: a variable that does not parse (a ValueError naming it).
        """
        return cls.from_options({o.name: o.value for o in resolve_options(OPTIONS, {}, environ=environ)})
