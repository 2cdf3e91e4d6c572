"""The Kubernetes objects of a job, as plain dicts (what the API takes and ``kubectl`` applies).

One job is, in the order ``kubectl apply -f manifests.yaml`` creates them:

==================  =========================  ============================================
kind                name                       what for
==================  =========================  ============================================
ServiceAccount      ``<job-id>-master``        the master pod's identity
Role                ``<job-id>-master``        get/list/watch/create/delete pods; get the
                                               worker template; nothing else
RoleBinding         ``<job-id>-master``        the Role to the ServiceAccount
ConfigMap           ``<job-id>-worker``        ``worker-pod.yaml``: the worker pod template
Service             ``<job-id>``               the master's HTTP API (port 50001) for agents
Pod                 ``<job-id>-master``        container ``master`` (``python -m
                                               dlrover_core.master``) and container
                                               ``controller`` (creates one worker pod per
                                               node, polls them and relaunches failed ones)
==================  =========================  ============================================

Worker pods (``<job-id>-node-<node>-<attempt>``) are made by the controller from the
template, one per node, each owned by the master pod (deleting it garbage-collects them).
Every object carries the label ``dlrover.job-id``; pods also ``dlrover.role``
(``master``/``worker``), and workers ``dlrover.node-id`` and ``dlrover.attempt``.

Nothing here talks to a cluster: :func:`render` is pure.
"""

from __future__ import annotations

import copy
import math
import posixpath
import re
from typing import Any

import attrs
import yaml

from dlrover_core import JobSpec
from dlrover_core.backend import control_plane
from dlrover_plugin_k8s._config import K8sConfig

__all__ = [
    "ANNOTATION_KIND",
    "ANNOTATION_DETAIL",
    "ANNOTATION_REPLACES",
    "LABEL_ATTEMPT",
    "LABEL_JOB",
    "LABEL_NODE",
    "LABEL_ROLE",
    "Manifests",
    "Names",
    "dump_yaml",
    "pod_job",
    "render",
    "shm_size_mb",
    "worker_pod",
]

LABEL_JOB = "dlrover.job-id"
LABEL_ROLE = "dlrover.role"
LABEL_NODE = "dlrover.node-id"
LABEL_ATTEMPT = "dlrover.attempt"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
#: on a replacement worker pod: why its predecessor failed (``evicted``, ``oom_killed``...)
ANNOTATION_KIND = "dlrover/relaunch-kind"
#: on a replacement worker pod: the predecessor's failure in words
ANNOTATION_DETAIL = "dlrover/relaunch-detail"
#: on a replacement worker pod: the name of the pod it replaces
ANNOTATION_REPLACES = "dlrover/replaces"

#: Name of the master's port on its Service (``<service>:http`` in the API server's proxy).
MASTER_PORT_NAME = "http"
#: Key of the worker template in its ConfigMap.
TEMPLATE_KEY = "worker-pod.yaml"
#: Headroom on /dev/shm beyond the checkpoint slots (MiB): DataLoader workers and
#: collective libraries use shared memory too.
SHM_HEADROOM_MB = 1024
#: Per slot beyond the state itself (MiB): the slot header and tensor table, and the
#: 4 KiB alignment of every tensor, rounded up generously.
SHM_SLOT_OVERHEAD_MB = 16

_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


@attrs.frozen
class Names:
    """Names of a job's objects, all derived from its id."""

    job_id: str

    @property
    def master_pod(self) -> str:
        return f"{self.job_id}-master"

    @property
    def account(self) -> str:
        return f"{self.job_id}-master"

    @property
    def template(self) -> str:
        return f"{self.job_id}-worker"

    @property
    def service(self) -> str:
        """A DNS-1035 label (a Service name must start with a letter; a job id may not)."""
        name = self.job_id if _DNS1035.fullmatch(self.job_id) else f"j{self.job_id}"
        return name[:63].rstrip("-")

    def worker_pod(self, node_id: int, attempt: int) -> str:
        return f"{self.job_id}-node-{node_id}-{attempt}"

    def master_addr(self, namespace: str, port: int) -> str:
        """``host:port`` of the master's API as agents reach it (the Service's DNS name)."""
        return f"{self.service}.{namespace}.svc:{port}"


def shm_size_mb(job: JobSpec, nproc: int | str, config: K8sConfig) -> int:
    """sizeLimit of the /dev/shm volume of a worker pod, in MiB.

    The rule: Flash Checkpoint keeps two snapshot slots per rank in /dev/shm, each as large
    as that rank's state (``config.checkpoint_mb``) plus a little overhead; so
    ``nproc_per_node * 2 * (checkpoint_mb + 16) + 1024`` MiB, the last GiB for DataLoader
    workers and collective libraries. No slots when the job never snapshots to memory
    (``Checkpoint(memory_every_steps=0)``). ``config.shm_size_mb`` overrides the rule.
    ``nproc_per_node="auto"`` counts as 8 ranks.
    """
    if config.shm_size_mb is not None:
        return config.shm_size_mb
    ranks = 8 if nproc == "auto" else int(nproc)
    slots = 0 if job.checkpoint.memory_every_steps == 0 else 2 * ranks * (config.checkpoint_mb + SHM_SLOT_OVERHEAD_MB)
    return slots + SHM_HEADROOM_MB


def _cpu_count(quantity: str | None) -> float | None:
    """``"8"`` -> 8.0, ``"500m"`` -> 0.5; ``None`` when unset or not a plain CPU quantity."""
    if not quantity:
        return None
    try:
        return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)
    except ValueError:
        return None


def _env_list(variables: dict[str, str]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in variables.items()]


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


@attrs.frozen(kw_only=True)
class Manifests:
    """Every object of one job (plain dicts), and the worker pod template."""

    service_account: dict[str, Any]
    role: dict[str, Any]
    role_binding: dict[str, Any]
    config_map: dict[str, Any]
    service: dict[str, Any]
    master_pod: dict[str, Any]
    worker_template: dict[str, Any]

    def objects(self) -> list[dict[str, Any]]:
        """What ``kubectl apply -f manifests.yaml`` creates, in order."""
        return [self.service_account, self.role, self.role_binding, self.config_map, self.service, self.master_pod]


class _Dumper(yaml.SafeDumper):
    """Plain YAML for people and ``kubectl``: no anchors for shared parts, multi-line
    strings (the worker template in its ConfigMap) as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def dump_yaml(*documents: dict[str, Any]) -> str:
    """YAML documents separated by ``---``, keys in the order they were built."""
    return "---\n".join(yaml.dump(d, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096)
                         for d in documents)


def pod_job(job: JobSpec, config: K8sConfig) -> JobSpec:
    """The Job as the pods see it: its workdir and log root are the paths inside the image."""
    return attrs.evolve(job, workdir=config.workdir, log_dir=config.log_root)


def render(job: JobSpec, *, job_id: str, accelerator: Any, nproc: int | str, config: K8sConfig) -> Manifests:
    """The job's objects. Pure.

    Args:
        job: the Job (``accelerator`` and ``nodes.nproc_per_node`` already resolved).
        job_id: the run's id (a label value: at most 63 characters).
        accelerator: the accelerator instance (its ``k8s_resource``, ``name``).
        nproc: workers per node.
        config: image, namespace, resources.
    """
    names = Names(job_id)
    ns = config.namespace
    port = config.master_port
    log_dir = f"{config.log_root}/{job_id}"
    master_addr = names.master_addr(ns, port)
    # the Job as the pods see it: paths inside the image
    job_json = control_plane.encode_job(pod_job(job, config))
    labels = {LABEL_JOB: job_id, LABEL_MANAGED_BY: "dlrover"}

    def meta(name: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
        return {"name": name, "namespace": ns, "labels": {**labels, **(extra or {})}}

    volumes: list[dict[str, Any]] = [{"name": "logs", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": "logs", "mountPath": config.log_root}]
    if config.checkpoint_pvc:
        ckpt = job.checkpoint.dir
        path = ckpt if posixpath.isabs(ckpt) else posixpath.normpath(posixpath.join(config.workdir, ckpt))
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": config.checkpoint_pvc}})
        mounts.append({"name": "checkpoints", "mountPath": path})
    pod_common: dict[str, Any] = {}
    if config.image_pull_secrets:
        pod_common["imagePullSecrets"] = [{"name": s} for s in config.image_pull_secrets]

    base_env = control_plane.job_env(job_json, job_id=job_id, log_dir=log_dir)

    # ----- the master pod: the master and its pod controller --------------------------------
    master_argv = list(control_plane.master_argv(config.python, job_id=job_id, host="0.0.0.0", port=port,
                                                 store_host="$(DLROVER_POD_IP)", log_dir=log_dir))
    controller_argv = [config.python, "-m", "dlrover_plugin_k8s.controller", "--job-id", job_id,
                       "--master-addr", f"127.0.0.1:{port}", "--log-dir", log_dir]
    pod_env = [_field_env("DLROVER_POD_IP", "status.podIP"), _field_env("DLROVER_K8S_NAMESPACE", "metadata.namespace")]
    master_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta(names.master_pod, {LABEL_ROLE: "master"}),
        "spec": {
            "serviceAccountName": names.account,
            # a master that crashed restarts in place and resumes from its journal (in the
            # logs emptyDir, which outlives the container)
            "restartPolicy": "OnFailure",
            **pod_common,
            "containers": [
                {
                    "name": "master",
                    "image": config.image,
                    "imagePullPolicy": config.image_pull_policy,
                    "command": master_argv,
                    "workingDir": config.workdir,
                    "env": [*pod_env, *_env_list(base_env)],
                    "ports": [{"name": MASTER_PORT_NAME, "containerPort": port}],
                    "readinessProbe": {"httpGet": {"path": "/v1/status", "port": port},
                                       "periodSeconds": 2},
                    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                    "volumeMounts": mounts,
                },
                {
                    "name": "controller",
                    "image": config.image,
                    "imagePullPolicy": config.image_pull_policy,
                    "command": controller_argv,
                    "workingDir": config.workdir,
                    "env": [*pod_env, *_env_list(base_env)],
                    "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                    "volumeMounts": mounts,
                },
            ],
            "volumes": volumes,
        },
    }

    # ----- the worker pod template (node 0, attempt 0) ---------------------------------------
    agent_env = control_plane.agent_env(base_env, accelerator=accelerator.name, master_addr=master_addr)
    cpus = _cpu_count(config.cpu_request)
    if cpus is not None and nproc != "auto":
        # torch sees the node's cores, not the pod's share: split the request between workers
        threads = control_plane.omp_num_threads(job, nproc=int(nproc), environ=None, cores=cpus)
        if threads is not None:
            agent_env[control_plane.OMP_NUM_THREADS] = threads
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if config.cpu_request:
        requests["cpu"] = config.cpu_request
    if config.memory_request:
        requests["memory"] = config.memory_request
    if config.memory_limit:
        limits["memory"] = config.memory_limit
    resource = getattr(accelerator, "k8s_resource", None)
    if resource and nproc != "auto":
        # extended resources: the request must equal the limit
        requests[resource] = limits[resource] = str(int(nproc))
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    agent_argv = list(control_plane.agent_argv(config.python, job_id=job_id, node_id=0, master_addr=master_addr,
                                               log_dir=log_dir))
    worker = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta(names.worker_pod(0, 0), {LABEL_ROLE: "worker", LABEL_NODE: "0", LABEL_ATTEMPT: "0"}),
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            # the agent stops its workers (failure.stop_grace_s) before it exits
            "terminationGracePeriodSeconds": int(math.ceil(job.failure.stop_grace_s)) + 10,
            **pod_common,
            "containers": [{
                "name": "agent",
                "image": config.image,
                "imagePullPolicy": config.image_pull_policy,
                "command": agent_argv,
                "workingDir": config.workdir,
                "env": _env_list(agent_env),
                **({"resources": resources} if resources else {}),
                "volumeMounts": [*mounts, {"name": "dshm", "mountPath": "/dev/shm"}],
            }],
            "volumes": [*volumes, {"name": "dshm", "emptyDir": {"medium": "Memory",
                                                               "sizeLimit": f"{shm_size_mb(job, nproc, config)}Mi"}}],
        },
    }

    # ----- RBAC, template, service ------------------------------------------------------------
    service_account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(names.account)}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": meta(names.account),
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]},
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [names.template], "verbs": ["get"]},
        ],
    }
    role_binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta(names.account),
        "subjects": [{"kind": "ServiceAccount", "name": names.account, "namespace": ns}],
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": names.account},
    }
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(names.template),
        "data": {TEMPLATE_KEY: dump_yaml(worker)},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(names.service),
        "spec": {
            "selector": {LABEL_JOB: job_id, LABEL_ROLE: "master"},
            "ports": [{"name": MASTER_PORT_NAME, "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }
    return Manifests(service_account=service_account, role=role, role_binding=role_binding, config_map=config_map,
                     service=service, master_pod=master_pod, worker_template=worker)


def worker_pod(
    template: dict[str, Any],
    *,
    node_id: int,
    attempt: int,
    owner: dict[str, Any] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The pod of ``node_id``'s ``attempt``-th launch, made from the template (node 0,
    attempt 0), owned by ``owner`` (the master pod: its ``metadata``) when given."""
    pod = copy.deepcopy(template)
    meta = pod["metadata"]
    job_id = meta["labels"][LABEL_JOB]
    meta["name"] = Names(job_id).worker_pod(node_id, attempt)
    meta["labels"][LABEL_NODE] = str(node_id)
    meta["labels"][LABEL_ATTEMPT] = str(attempt)
    if annotations:
        meta["annotations"] = {**meta.get("annotations", {}), **annotations}
    if owner is not None:
        meta["ownerReferences"] = [{
            "apiVersion": "v1", "kind": "Pod", "name": owner["name"], "uid": owner["uid"], "controller": True,
        }]
    container = pod["spec"]["containers"][0]
    container["command"] = list(control_plane.for_node(container["command"], node_id))
    return pod
