"""The master pod's controller: creates one worker pod per node, polls them, relaunches.

It runs as the ``controller`` container of the master pod, beside the ``master`` container
(``python -m dlrover_core.master``), and shares its network and its log directory:

1. waits until the master answers on ``127.0.0.1``, then creates the worker pod of every
   node that has none yet (so a restarted controller creates nothing twice);
2. every ``poll_s`` lists the job's worker pods (a list, not a watch: the poll is
   idempotent, and a watch that missed an event would never tell) and, for each node whose
   newest pod failed, classifies the failure (:func:`~dlrover_plugin_k8s.classify`:
   ``evicted``, ``oom_killed``, ``pod_failed``), reports it to the master (which counts it
   and restarts every worker into a new round) and creates the node's next attempt,
   annotated with the kind and detail of the failure it replaces;
3. when the master has written ``result.json``, prints it on one line prefixed by
   :data:`RESULT_MARKER` (how the backend reads a job's result from outside the cluster)
   and exits.

Relaunches stop when the job is over, when the master excluded the node (it launches a
replacement node itself, through ``relaunch_node``), and after
``failure.max_restarts + nodes.max`` relaunches in all (the master's own cap).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Protocol

from dlrover_core import DLRoverError, JobSpec, SchedulerError
from dlrover_core.backend import (
    Action,
    FailureReport,
    MasterClient,
    MasterStatus,
    WorkerFailure,
    configure_logging,
    control_plane,
    env,
    get_logger,
    rpc_retrying,
    rundir,
)
from dlrover_plugin_k8s._api import KubeApi
from dlrover_plugin_k8s._config import K8sConfig
from dlrover_plugin_k8s._manifests import ANNOTATION_DETAIL, ANNOTATION_KIND, ANNOTATION_REPLACES
from dlrover_plugin_k8s._workers import (
    PodFailure,
    attempt_of,
    classify,
    launch_worker,
    newest_by_node,
    worker_pods,
)

__all__ = ["RESULT_MARKER", "MasterLink", "PodController", "main"]

log = get_logger()

#: Prefix of the controller's last stdout line: the JobResult as compact JSON.
RESULT_MARKER = "DLROVER_RESULT "

class MasterLink(Protocol):
    """What the controller asks the job master."""

    def status(self) -> MasterStatus | None:
        """The master's ``/v1/status`` answer, or ``None`` when it does not answer."""

    def report_failure(self, node_id: int, round_index: int, failure: PodFailure) -> Action | None:
        """Report a node's pod failure (``/v1/failure``); the master's action, or ``None``
        when it does not answer."""


class HttpMasterLink:
    """:class:`MasterLink` over the master's HTTP API (:class:`~dlrover_core.backend.MasterClient`)."""

    def __init__(self, addr: str) -> None:
        self._client = MasterClient(addr, timeout_s=3.0, retrying=lambda: rpc_retrying(attempts=2, max_total_s=5.0))

    def status(self) -> MasterStatus | None:
        try:
            return self._client.status()
        except DLRoverError:
            return None

    def report_failure(self, node_id: int, round_index: int, failure: PodFailure) -> Action | None:
        report = FailureReport(node_id=node_id, round=round_index, failures=(WorkerFailure(
            rank=None, local_rank=None, exit_code=failure.exit_code, kind=failure.kind, detail=failure.detail),))
        try:
            return self._client.failure(report).action
        except DLRoverError as exc:
            log.warning("failure_report_failed", node_id=node_id, error=str(exc))
            return None


class PodController:
    """Creates, polls and relaunches one job's worker pods.

    Args:
        api: the Kubernetes API.
        namespace: the job's namespace.
        job_id: the run's id.
        job: the Job (node count, restart budget).
        master: the job master, or ``None`` to decide without it.
    """

    def __init__(self, *, api: KubeApi, namespace: str, job_id: str, job: JobSpec, master: MasterLink | None) -> None:
        self.api = api
        self.namespace = namespace
        self.job_id = job_id
        self.job = job
        self.master = master
        self.budget = job.failure.max_restarts + job.nodes.max
        self._handled: set[str] = set()

    def ensure_workers(self) -> list[str]:
        """Create attempt 0 of every node (``0 .. nodes.max - 1``) that has no pod yet;
        return the names created."""
        have = {int(n) for n in newest_by_node(worker_pods(self.api, self.namespace, self.job_id))}
        created = []
        for node_id in range(self.job.nodes.max):
            if node_id not in have:
                created.append(launch_worker(self.api, self.namespace, self.job_id, node_id, replace_live=False))
                log.info("worker_pod_created", node_id=node_id, pod=created[-1])
        return created

    def poll_once(self) -> list[tuple[int, PodFailure, str | None]]:
        """Handle every node whose newest pod failed since the last poll; return
        ``(node_id, failure, replacement pod or None)`` for each."""
        pods = worker_pods(self.api, self.namespace, self.job_id)
        failed = []
        for node_id, pod in sorted(newest_by_node(pods).items()):
            name = pod["metadata"]["name"]
            if name in self._handled:
                continue
            failure = classify(pod)
            if failure is not None:
                failed.append((node_id, pod, failure))
        if not failed:
            return []
        status = self.master.status() if self.master is not None else None
        relaunched = sum(1 for p in pods if attempt_of(p) > 0)
        out: list[tuple[int, PodFailure, str | None]] = []
        for node_id, pod, failure in failed:
            name = pod["metadata"]["name"]
            self._handled.add(name)
            log.warning("worker_pod_failed", node_id=node_id, pod=name, kind=failure.kind, detail=failure.detail,
                        exit_code=failure.exit_code)
            answer = None
            if status is not None and status.state.is_terminal:
                out.append((node_id, failure, None))
                log.info("worker_pod_not_relaunched", node_id=node_id, reason=f"the job is {status.state.value}")
                continue
            if self.master is not None and status is not None and status.round >= 0:
                answer = self.master.report_failure(node_id, status.round, failure)
            if answer == Action.STOP:
                out.append((node_id, failure, None))
                log.info("worker_pod_not_relaunched", node_id=node_id,
                         reason="the master stopped the node (excluded, or the job ended)")
                continue
            if relaunched >= self.budget:
                out.append((node_id, failure, None))
                log.error("worker_pod_not_relaunched", node_id=node_id,
                          reason=f"{relaunched} relaunches used (failure.max_restarts + nodes.max = {self.budget})")
                continue
            new = launch_worker(self.api, self.namespace, self.job_id, node_id, replace_live=False, annotations={
                ANNOTATION_KIND: failure.kind, ANNOTATION_DETAIL: failure.detail[:1000], ANNOTATION_REPLACES: name})
            relaunched += 1
            log.info("node_relaunched", node_id=node_id, pod=new, replaces=name, kind=failure.kind)
            out.append((node_id, failure, new))
        return out


class _StopFlag:
    """Set by the SIGTERM/SIGINT handler. Lock-free, unlike ``threading.Event``: a handler
    runs in the main thread wherever it is, possibly inside the event's own lock in ``wait``,
    and setting the event there would deadlock the controller."""

    def __init__(self) -> None:
        self.requested = False

    def set(self, *_: object) -> None:
        self.requested = True

    def is_set(self) -> bool:
        return self.requested

    def wait(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s`` seconds, waking within 0.1 s of a stop."""
        deadline = time.monotonic() + timeout_s
        while not self.requested and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def _wait_master(master: HttpMasterLink, result: Path, stop: _StopFlag, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not stop.is_set() and time.monotonic() < deadline:
        if master.status() is not None or result.exists():
            return True
        stop.wait(1.0)
    return False


def _print_result(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return False
    sys.stdout.write(RESULT_MARKER + json.dumps(data, separators=(",", ":")) + "\n")
    sys.stdout.flush()
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m dlrover_plugin_k8s.controller``: run until the job has a result."""
    parser = argparse.ArgumentParser(prog="python -m dlrover_plugin_k8s.controller")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--master-addr", required=True, help="host:port of the master's API (same pod)")
    parser.add_argument("--log-dir", required=True, help="the master's log directory (shared volume)")
    parser.add_argument("--poll-s", type=float, default=2.0, help="seconds between polls of the worker pods")
    parser.add_argument("--master-start-timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    configure_logging()
    config = K8sConfig.from_env()
    namespace = os.environ.get("DLROVER_K8S_NAMESPACE") or config.namespace
    job = control_plane.decode_job(os.environ[env.JOB_SPEC])
    stop = _StopFlag()
    signal.signal(signal.SIGTERM, stop.set)
    signal.signal(signal.SIGINT, stop.set)
    result = rundir.RunDir(args.log_dir).result
    master = HttpMasterLink(args.master_addr)
    controller = PodController(api=KubeApi(config), namespace=namespace, job_id=args.job_id, job=job, master=master)
    log.info("controller_started", job_id=args.job_id, namespace=namespace, nodes=job.nodes.max)
    if not _wait_master(master, result, stop, args.master_start_timeout_s):
        if stop.is_set():
            return 0
        log.error("master_not_answering", addr=args.master_addr, waited_s=args.master_start_timeout_s)
        return 1
    created = False
    while not stop.is_set():
        if result.exists() and _print_result(result):
            log.info("controller_exited", reason="the job has a result")
            return 0
        try:
            if not created:
                controller.ensure_workers()
                created = True
            else:
                controller.poll_once()
        except SchedulerError as exc:  # the API refused or is down: try again next poll
            log.error("controller_poll_failed", error=str(exc))
        stop.wait(args.poll_s)
    _print_result(result)
    return 0
