"""Worker pods: find them, tell what killed one, and launch the next attempt of a node.

Used by the backend's ``relaunch_node`` (inside the master pod, or anywhere with a
kubeconfig) and by the master pod's controller. Which attempt of a node is current needs no
memory: it is the pod with the highest ``dlrover.attempt`` label.
"""

from __future__ import annotations

from typing import Any

import attrs
import yaml

from dlrover_core import SchedulerError
from dlrover_core.backend import get_logger
from dlrover_plugin_k8s._api import K8sApiError, KubeApi
from dlrover_plugin_k8s._manifests import (
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_NODE,
    LABEL_ROLE,
    TEMPLATE_KEY,
    Names,
    worker_pod,
)

__all__ = ["PodFailure", "attempt_of", "classify", "is_live", "launch_worker", "newest_by_node", "node_of",
           "worker_pods"]

log = get_logger()


@attrs.frozen(kw_only=True)
class PodFailure:
    """Why a worker pod ended badly.

    Attributes:
        kind: ``"evicted"`` (the kubelet evicted the pod: ``status.reason == "Evicted"``),
            ``"oom_killed"`` (a container was killed for exceeding its memory limit) or
            ``"pod_failed"`` (anything else that left the pod ``Failed``).
        detail: the failure in words, with Kubernetes' own reason and message.
        exit_code: the agent container's exit code, when it terminated.
    """

    kind: str
    detail: str
    exit_code: int | None = None


def _terminated(pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            out.append((cs.get("name", "?"), term))
    return out


def classify(pod: dict[str, Any]) -> PodFailure | None:
    """A failed (or evicted, or OOM-killed) worker pod's failure; ``None`` for a pod that is
    pending, running or succeeded."""
    status = pod.get("status") or {}
    phase, reason, message = status.get("phase"), status.get("reason") or "", status.get("message") or ""
    terminated = _terminated(pod)
    code = next((t.get("exitCode") for _, t in terminated if t.get("exitCode") is not None), None)
    if reason == "Evicted":
        return PodFailure(kind="evicted", detail=f"pod evicted: {message or 'no message'}", exit_code=code)
    for name, term in terminated:
        if term.get("reason") == "OOMKilled":
            return PodFailure(kind="oom_killed", exit_code=term.get("exitCode"),
                              detail=f"container {name} OOMKilled (exit code {term.get('exitCode')}): it used more "
                                     "memory than its limit")
    if phase != "Failed":
        return None
    for name, term in terminated:
        if term.get("exitCode") not in (None, 0):
            words = f"container {name} terminated: {term.get('reason') or 'Error'} (exit code {term['exitCode']})"
            if term.get("message"):
                words += f": {term['message'].strip()[:300]}"
            return PodFailure(kind="pod_failed", detail=words, exit_code=term["exitCode"])
    return PodFailure(kind="pod_failed", detail=f"pod failed: {reason or 'no reason'}" + (f": {message}" if message else ""),
                      exit_code=code)


def node_of(pod: dict[str, Any]) -> int:
    return int(pod["metadata"]["labels"][LABEL_NODE])


def attempt_of(pod: dict[str, Any]) -> int:
    return int(pod["metadata"]["labels"].get(LABEL_ATTEMPT, "0"))


def is_live(pod: dict[str, Any]) -> bool:
    """Pending or running, and not being deleted."""
    phase = (pod.get("status") or {}).get("phase") or "Pending"
    return phase in ("Pending", "Running", "Unknown") and not pod["metadata"].get("deletionTimestamp")


def worker_pods(api: KubeApi, namespace: str, job_id: str, node_id: int | None = None) -> list[dict[str, Any]]:
    """The job's worker pods (of one node when given), by node then attempt."""
    labels = {LABEL_JOB: job_id, LABEL_ROLE: "worker"}
    if node_id is not None:
        labels[LABEL_NODE] = str(node_id)
    return sorted(api.list("Pod", namespace, labels), key=lambda p: (node_of(p), attempt_of(p)))


def newest_by_node(pods: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The current pod (highest attempt) of every node."""
    newest: dict[int, dict[str, Any]] = {}
    for pod in pods:
        node = node_of(pod)
        if node not in newest or attempt_of(pod) > attempt_of(newest[node]):
            newest[node] = pod
    return newest


def launch_worker(
    api: KubeApi,
    namespace: str,
    job_id: str,
    node_id: int,
    *,
    replace_live: bool,
    annotations: dict[str, str] | None = None,
) -> str:
    """Create the next attempt of ``node_id``'s worker pod from the job's template, owned by
    the master pod; return its name.

    ``replace_live``: delete the node's pods that are still pending or running first (the
    master declared the node lost: its agent must not come back). Creating an attempt that
    someone else created meanwhile is not an error.

    Raises:
        SchedulerError: the master pod or the template is gone, or the API refused.
    """
    names = Names(job_id)
    master = api.get("Pod", namespace, names.master_pod)
    if master is None:
        raise SchedulerError(f"cannot relaunch node {node_id}: the master pod {namespace}/{names.master_pod} is gone")
    config_map = api.get("ConfigMap", namespace, names.template)
    if config_map is None or TEMPLATE_KEY not in (config_map.get("data") or {}):
        raise SchedulerError(f"cannot relaunch node {node_id}: the worker template "
                             f"{namespace}/{names.template} is gone")
    template = yaml.safe_load(config_map["data"][TEMPLATE_KEY])
    pods = worker_pods(api, namespace, job_id, node_id)
    attempt = max((attempt_of(p) for p in pods), default=-1) + 1
    if replace_live:
        for old in pods:
            if is_live(old):
                api.delete("Pod", namespace, old["metadata"]["name"], grace_period_s=0)
                log.info("worker_pod_replaced", node_id=node_id, pod=old["metadata"]["name"])
    owner = master["metadata"] if master["metadata"].get("uid") else None
    if owner is None:
        log.warning("worker_pod_without_owner", node_id=node_id, reason="the master pod has no uid")
    pod = worker_pod(template, node_id=node_id, attempt=attempt, owner=owner, annotations=annotations)
    try:
        api.create(pod)
    except K8sApiError as exc:
        if exc.status != 409:
            raise
    return pod["metadata"]["name"]
