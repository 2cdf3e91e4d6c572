"""Settings of the k8s scheduler that are not part of a Job: image, namespace, pod resources.

Every field has an environment variable, read by :meth:`K8sConfig.from_env` when the backend
is built (``Job(scheduler="k8s")`` builds it with no arguments); tests and programs can pass
a ``K8sConfig`` to :class:`~dlrover_plugin_k8s.K8sScheduler` instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

__all__ = ["ENV", "K8sConfig"]

#: field name -> environment variable
ENV: dict[str, str] = {
    "image": "DLROVER_K8S_IMAGE",
    "namespace": "DLROVER_K8S_NAMESPACE",
    "image_pull_policy": "DLROVER_K8S_IMAGE_PULL_POLICY",
    "image_pull_secrets": "DLROVER_K8S_IMAGE_PULL_SECRETS",
    "workdir": "DLROVER_K8S_WORKDIR",
    "python": "DLROVER_K8S_PYTHON",
    "cpu_request": "DLROVER_K8S_CPU",
    "memory_request": "DLROVER_K8S_MEMORY",
    "memory_limit": "DLROVER_K8S_MEMORY_LIMIT",
    "checkpoint_mb": "DLROVER_K8S_CHECKPOINT_MB",
    "shm_size_mb": "DLROVER_K8S_SHM_SIZE_MB",
    "checkpoint_pvc": "DLROVER_K8S_CHECKPOINT_PVC",
    "log_root": "DLROVER_K8S_LOG_ROOT",
    "master_port": "DLROVER_K8S_MASTER_PORT",
    "kubeconfig": "DLROVER_K8S_KUBECONFIG",
    "context": "DLROVER_K8S_CONTEXT",
}

_INT_FIELDS = ("checkpoint_mb", "shm_size_mb", "master_port")
_TUPLE_FIELDS = ("image_pull_secrets",)


@attrs.frozen(kw_only=True)
class K8sConfig:
    """Where and how the job's pods run.

    Attributes:
        image: container image of the master and worker pods: Python with dlrover-core,
            dlrover-plugin-k8s, the accelerator's plugin and the job's code at ``workdir``.
            Required to render manifests (``$DLROVER_K8S_IMAGE``).
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
    def from_env(cls, environ: Mapping[str, str] | None = None) -> K8sConfig:
        """A config from the ``DLROVER_K8S_*`` variables (see :data:`ENV`); unset or empty
        variables keep the defaults."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for field, var in ENV.items():
            raw = environ.get(var, "").strip()
            if not raw:
                continue
            if field in _INT_FIELDS:
                try:
                    values[field] = int(raw)
                except ValueError:
                    raise ValueError(f"{var}={raw!r}: expected a whole number") from None
            elif field in _TUPLE_FIELDS:
                values[field] = tuple(s.strip() for s in raw.split(",") if s.strip())
            else:
                values[field] = raw
        return cls(**values)
