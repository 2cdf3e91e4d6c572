"""The ``k8s`` scheduler backend: a master pod that creates, watches and relaunches one
worker pod per node (objects in :mod:`dlrover_plugin_k8s._manifests`).

What lives where, so that every method works from a new process given only a JobHandle:

* in the cluster: every object, labelled ``dlrover.job-id``; the worker template in a
  ConfigMap; the result, printed by the controller as its last log line;
* under the handle's ``log_dir`` on the submitting machine: ``plan.txt``,
  ``manifests.yaml``, ``k8s.json`` (namespace and names), and, once known, ``result.json``
  and the pods' logs (``pods/*.log``, saved by ``cancel`` before it deletes the pods), or
  ``cancelled.json`` when a cancel found no result.

``JobHandle.native_id`` is ``<namespace>/<master pod>``.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import yaml

from dlrover_core import env, hookimpl
from dlrover_core.agent.launch import preview_workers
from dlrover_core.errors import JobSpecError, SchedulerError
from dlrover_core.logging import get_logger
from dlrover_core.plugins import get_host
from dlrover_core.protocol import JobResult, JobState, JobStatus
from dlrover_core.schedulers.base import Capabilities, JobHandle, Plan, SchedulerBackend
from dlrover_core.spec import JobSpec
from dlrover_core.storage.posix import PosixStorage
from dlrover_plugin_k8s._api import TRANSIENT_STATUSES, K8sApiError, KubeApi
from dlrover_plugin_k8s._config import ENV, K8sConfig
from dlrover_plugin_k8s._controller import RESULT_MARKER
from dlrover_plugin_k8s._manifests import (
    LABEL_JOB,
    MASTER_PORT_NAME,
    Names,
    dump_yaml,
    render,
)
from dlrover_plugin_k8s._workers import attempt_of, launch_worker, newest_by_node, node_of, worker_pods

__all__ = ["K8sScheduler"]

log = get_logger()

#: Kinds of a job's objects, in the order ``cancel`` deletes them (the master pod first, so
#: nothing relaunches the workers deleted after it).
_DELETE_ORDER = ("Pod", "Service", "ConfigMap", "RoleBinding", "Role", "ServiceAccount")

#: Written under the handle's log_dir by a cancel that found no result: status is CANCELLED.
_CANCELLED_FILE = "cancelled.json"
#: Lines of each container's log that ``cancel`` keeps under the handle's log_dir.
_SAVED_LOG_LINES = 20000

_WORKER_TEMPLATE_NOTE = (
    "# The worker pod template (node 0, attempt 0). The master pod's controller creates one pod per\n"
    "# node from it (stored in the ConfigMap of manifests.yaml), renamed <job-id>-node-<node>-<attempt>,\n"
    "# with --node-id and the dlrover.node-id / dlrover.attempt labels set, and an ownerReference to\n"
    "# the master pod. It is not applied by itself.\n"
)


def _state_from_master(s: dict[str, Any]) -> JobStatus:
    return JobStatus(
        state=JobState(s["state"]), step=s["step"], metrics=s["metrics"], nodes=s["nodes"],
        max_nodes=s["max_nodes"], restarts=s["restarts"], round=s["round"], message=s["message"],
        worker_pids={int(r): int(pid) for n in s.get("node_table", []) for r, pid in n["workers"].items()},
        goodput=s.get("goodput", {}),
    )


def _waiting_reason(pod: dict[str, Any]) -> str:
    """Why a pod is not running yet, from its conditions and container states."""
    status = pod.get("status") or {}
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason"):
            return f"container {cs.get('name')}: {waiting['reason']}" + (
                f": {waiting['message']}" if waiting.get("message") else "")
    for cond in status.get("conditions") or []:
        if cond.get("status") == "False" and cond.get("message"):
            return f"{cond.get('reason') or cond.get('type')}: {cond['message']}"
    return "waiting to be scheduled"


class K8sScheduler(SchedulerBackend):
    """Runs a job's master in a pod that creates one worker pod per node and relaunches them.

    Args:
        config: image, namespace, resources (default: from ``DLROVER_K8S_*`` variables).
        api: the API client (default: built from ``config`` on first use).
        cancel_wait_s: how long ``cancel`` waits for the master's result after asking it to
            stop, and then for the pods to be gone (seconds, each).
    """

    name = "k8s"
    capabilities = Capabilities(elastic=True, relaunch_node=True, follow_logs=True, multi_host=True)

    def __init__(self, config: K8sConfig | None = None, *, api: KubeApi | None = None,
                 cancel_wait_s: float = 30.0) -> None:
        self.config = config if config is not None else K8sConfig.from_env()
        self._api = api
        self.cancel_wait_s = cancel_wait_s

    @property
    def api(self) -> KubeApi:
        if self._api is None:
            self._api = KubeApi(self.config)
        return self._api

    # ----- plan --------------------------------------------------------------------------

    def dryrun(self, job: JobSpec) -> Plan:
        """The job's manifests (``Plan.files``): ``manifests.yaml`` (everything ``kubectl
        apply -f`` needs), ``master-pod.yaml`` and ``worker-pod.yaml`` (the template the
        master's controller makes every worker pod from). Pure: reads the environment,
        calls nothing. Refuses (:class:`~dlrover_core.errors.JobSpecError`) a checkpoint
        directory the pods would not share (see :meth:`_check_checkpoint_shared`)."""
        self.check(job)
        if job.accelerator == "auto":
            raise JobSpecError("accelerator", "auto", "a named accelerator for scheduler 'k8s' (the pods' devices "
                                                      "cannot be probed from here), e.g. 'cuda' or 'cpu'")
        if not self.config.image:
            raise SchedulerError(f"no container image for the k8s scheduler: set {ENV['image']} to an image with "
                                 f"python, dlrover-core, dlrover-plugin-k8s and the job's code at "
                                 f"{self.config.workdir} ({ENV['workdir']})")
        self._check_checkpoint_shared(job)
        accelerator = get_host().registries.accelerator.get(job.accelerator)()  # no probe: the devices are remote
        nproc = job.nodes.nproc_per_node
        if nproc == "auto" and getattr(accelerator, "k8s_resource", None):
            raise JobSpecError("nodes.nproc_per_node", "auto", f"a number for scheduler 'k8s': it is the count of "
                                                               f"{accelerator.k8s_resource} each worker pod requests")
        job = attrs.evolve(job, workdir=str(Path(job.workdir).resolve()), log_dir=str(Path(job.log_dir).resolve()))
        job_id = f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        manifests = render(job, job_id=job_id, accelerator=accelerator, nproc=nproc, config=self.config)
        files = {
            "manifests.yaml": dump_yaml(*manifests.objects()),
            "master-pod.yaml": dump_yaml(manifests.master_pod),
            "worker-pod.yaml": _WORKER_TEMPLATE_NOTE + dump_yaml(manifests.worker_template),
        }
        return Plan(scheduler=self.name, job_id=job_id, job=job, log_dir=str(Path(job.log_dir) / job_id),
                    files=files, workers=self._preview(job, job_id, accelerator, nproc, manifests.master_pod))

    def _check_checkpoint_shared(self, job: JobSpec) -> None:
        """Refuse a checkpoint directory that the pods would not share.

        A filesystem storage (``posix``, or one extending it) writes ``Checkpoint.dir`` inside
        each pod; without :attr:`K8sConfig.checkpoint_pvc` mounted there, that is the pod's own
        disk: every rank persists to a different disk, the master's commit marker lies on yet
        another, and a relaunched pod starts with an empty one, so the job could never restore
        from storage. Other storages name a location every pod reaches (a URL). A job that
        keeps no checkpoints (``memory_every_steps=0`` and ``persist_every_steps=0``) needs none.

        Raises:
            JobSpecError: ``checkpoint.dir`` would be on each pod's own disk; says what to set.
        """
        ckpt = job.checkpoint
        if self.config.checkpoint_pvc or (ckpt.memory_every_steps == 0 and ckpt.persist_every_steps == 0):
            return
        storage = get_host().registries.storage.get(ckpt.storage)
        if not (isinstance(storage, type) and issubclass(storage, PosixStorage)):
            return
        raise JobSpecError(
            "checkpoint.dir", ckpt.dir,
            f"a directory every pod shares: with scheduler 'k8s' and storage {ckpt.storage!r} it would be on each "
            f"pod's own disk, so the ranks persist to different disks and a relaunched pod has nothing to restore "
            f"from. Set {ENV['checkpoint_pvc']}=<claim> (or K8sConfig(checkpoint_pvc=...)) to a ReadWriteMany "
            f"PersistentVolumeClaim, mounted at the checkpoint directory in every pod; or use a checkpoint storage "
            f"every pod reaches (Checkpoint(storage=..., dir=<its URL>)); or, for a job that keeps no checkpoints, "
            f"Checkpoint(memory_every_steps=0, persist_every_steps=0)",
        )

    def _preview(self, job: JobSpec, job_id: str, accelerator: Any, nproc: int | str, master_pod: dict) -> tuple:
        """The first round's workers, as the agents will start them inside their pods."""
        if nproc == "auto":
            return ()
        nproc = int(nproc)
        names = Names(job_id)
        pod_log_dir = f"{self.config.log_root}/{job_id}"
        job_json = next(e["value"] for e in master_pod["spec"]["containers"][0]["env"] if e["name"] == env.JOB_SPEC)
        return preview_workers(
            job, job_id=job_id, nproc=nproc, master_addr=names.master_addr(self.config.namespace, self.config.master_port),
            store_host="<IP of the master pod>", accelerator=accelerator, log_dir=pod_log_dir, python=self.config.python,
            cwd=self.config.workdir, extra_env={env.JOB_SPEC: job_json})

    # ----- where a job is ----------------------------------------------------------------

    def _namespace(self, handle: JobHandle) -> str:
        if "/" in handle.native_id:
            return handle.native_id.split("/", 1)[0]
        try:
            return json.loads((Path(handle.log_dir) / "k8s.json").read_text())["namespace"]
        except (OSError, ValueError, KeyError):
            return self.config.namespace

    def _cached_result(self, handle: JobHandle) -> JobResult | None:
        try:
            return JobResult.from_dict(json.loads((Path(handle.log_dir) / "result.json").read_text()))
        except (OSError, ValueError):
            return None

    def _save(self, handle: JobHandle, name: str, data: str | bytes) -> None:
        """Write a file under the handle's log_dir atomically (best effort: inside the master
        pod that directory is not ours to fill)."""
        path = Path(handle.log_dir) / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data.encode() if isinstance(data, str) else data)
            tmp.replace(path)
        except OSError as exc:
            log.warning("k8s_save_failed", path=str(path), error=str(exc))

    # ----- side effects ------------------------------------------------------------------

    def submit(self, plan: Plan) -> JobHandle:
        """Create the ServiceAccount, Role, RoleBinding, worker template, Service and master
        pod of ``plan.files["manifests.yaml"]``, exactly as rendered. A failure removes what
        was created and raises :class:`~dlrover_core.errors.SchedulerError`."""
        objects = [o for o in yaml.safe_load_all(plan.files["manifests.yaml"]) if o]
        namespace = objects[0]["metadata"]["namespace"]
        names = Names(plan.job_id)
        log_dir = Path(plan.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / "plan.txt").write_text(str(plan) + "\n")
        (log_dir / "manifests.yaml").write_text(plan.files["manifests.yaml"])
        (log_dir / "k8s.json").write_text(json.dumps({
            "namespace": namespace, "master_pod": names.master_pod, "service": names.service,
            "worker_template": names.template}, indent=2))
        created: list[dict[str, Any]] = []
        try:
            for obj in objects:
                self._create(obj, plan.job_id)
                created.append(obj)
        except SchedulerError:
            for obj in reversed(created):
                try:
                    self.api.delete(obj["kind"], namespace, obj["metadata"]["name"])
                except SchedulerError as exc:
                    log.warning("k8s_cleanup_failed", kind=obj["kind"], name=obj["metadata"]["name"], error=str(exc))
            raise
        log.info("k8s_job_created", job_id=plan.job_id, namespace=namespace, master_pod=names.master_pod)
        return JobHandle(scheduler=self.name, job_id=plan.job_id, log_dir=str(log_dir),
                         native_id=f"{namespace}/{names.master_pod}")

    def _create(self, obj: dict[str, Any], job_id: str) -> None:
        """Create ``obj``; one that already exists counts when it is this job's (a retried
        create whose first try got through)."""
        try:
            self.api.create(obj)
        except K8sApiError as exc:
            if exc.status != 409:
                raise
            meta = obj["metadata"]
            existing = self.api.get(obj["kind"], meta["namespace"], meta["name"])
            if existing is None or (existing["metadata"].get("labels") or {}).get(LABEL_JOB) != job_id:
                raise

    def status(self, handle: JobHandle) -> JobStatus:
        """From the master when the API server's service proxy reaches it; else from the
        pods (``UNKNOWN`` when the API server cannot be reached)."""
        cached = self._cached_result(handle)
        if cached is not None:
            return self._from_result(cached)
        ns, names = self._namespace(handle), Names(handle.job_id)
        try:
            master = self.api.get("Pod", ns, names.master_pod)
            if master is None:
                if (Path(handle.log_dir) / _CANCELLED_FILE).exists():
                    return JobStatus(state=JobState.CANCELLED, message="cancelled (the master's result could not "
                                                                       "be read before its pod was deleted)")
                return JobStatus(state=JobState.FAILED, message=f"the master pod {ns}/{names.master_pod} is gone "
                                                                "(deleted?) and left no result")
            phase = (master.get("status") or {}).get("phase") or "Pending"
            if phase == "Pending":
                return JobStatus(state=JobState.PENDING, message=f"master pod pending: {_waiting_reason(master)}")
            if phase in ("Succeeded", "Failed"):
                result = self.result(handle)
                if result is not None:
                    return self._from_result(result)
                return JobStatus(state=JobState.FAILED, message=f"the master pod {phase.lower()} without a result: "
                                                                f"{_waiting_reason(master)}")
            try:
                return _state_from_master(self.api.service_proxy(ns, names.service, MASTER_PORT_NAME, "v1/status"))
            except Exception:  # the master is starting, or the proxy is not allowed: count pods
                pass
            pods = worker_pods(self.api, ns, handle.job_id)
        except K8sApiError as exc:
            if exc.status == 0 or exc.status in TRANSIENT_STATUSES:
                return JobStatus(state=JobState.UNKNOWN, message=str(exc))
            raise
        running = sum(1 for p in newest_by_node(pods).values() if (p.get("status") or {}).get("phase") == "Running")
        return JobStatus(state=JobState.RUNNING, nodes=running, message=f"{running} worker pods running (the "
                                                                        "master's API is not reachable from here)")

    @staticmethod
    def _from_result(result: JobResult) -> JobStatus:
        return JobStatus(state=result.state, step=result.final_step, metrics=result.metrics,
                         restarts=result.restarts, message=result.reason)

    def result(self, handle: JobHandle) -> JobResult | None:
        """The JobResult: cached under the handle's log_dir, or the last marked line of the
        controller's log once the controller has exited."""
        cached = self._cached_result(handle)
        if cached is not None:
            return cached
        ns, names = self._namespace(handle), Names(handle.job_id)
        try:
            master = self.api.get("Pod", ns, names.master_pod)
        except K8sApiError:
            return None
        if master is None:
            return None
        status = master.get("status") or {}
        controller = next((cs for cs in status.get("containerStatuses") or [] if cs.get("name") == "controller"), {})
        done = (controller.get("state") or {}).get("terminated") or status.get("phase") in ("Succeeded", "Failed")
        if not done:
            return None
        try:
            text = self.api.pod_log(ns, names.master_pod, "controller").decode(errors="replace")
        except K8sApiError:
            return None
        lines = [line for line in text.splitlines() if line.startswith(RESULT_MARKER)]
        if not lines:
            return None
        data = json.loads(lines[-1][len(RESULT_MARKER):])
        self._save(handle, "result.json", json.dumps(data, indent=2))
        return JobResult.from_dict(data)

    # ----- logs --------------------------------------------------------------------------

    def _sources(self, handle: JobHandle) -> list[tuple[str, str, str]]:
        """``(label, pod, container)`` of every container of the job, master first."""
        ns, names = self._namespace(handle), Names(handle.job_id)
        out = [("master", names.master_pod, "master"), ("controller", names.master_pod, "controller")]
        for pod in worker_pods(self.api, ns, handle.job_id):
            attempt = attempt_of(pod)
            label = f"node-{node_of(pod)}" + (f" attempt {attempt}" if attempt else "")
            out.append((label, pod["metadata"]["name"], "agent"))
        return out

    def logs(self, handle: JobHandle, *, follow: bool = False) -> Iterator[str]:
        """Lines of every pod's log, prefixed ``[master]``, ``[controller]``, ``[node-<i>]``;
        once the pods are gone, the logs ``cancel`` saved. With ``follow``, every container
        is streamed (new worker pods too) until the job ends."""
        ns = self._namespace(handle)
        if self.api.get("Pod", ns, Names(handle.job_id).master_pod) is None:
            yield from self._saved_logs(handle)
            return
        if not follow:
            for label, pod, container in self._sources(handle):
                try:
                    data = self.api.pod_log(ns, pod, container)
                except K8sApiError:  # not started yet, or gone
                    continue
                for line in data.decode(errors="replace").splitlines():
                    yield f"[{label}] {line}"
            return
        yield from self._follow(handle, ns)

    def _saved_logs(self, handle: JobHandle) -> Iterator[str]:
        for path in sorted((Path(handle.log_dir) / "pods").glob("*.log")):
            label = path.stem.replace("_", " ")
            for line in path.read_text(errors="replace").splitlines():
                yield f"[{label}] {line}"

    def _follow(self, handle: JobHandle, ns: str) -> Iterator[str]:
        lines: queue.Queue[str] = queue.Queue()
        stop = threading.Event()
        pumps: dict[tuple[str, str], threading.Thread] = {}

        def pump(label: str, pod: str, container: str) -> None:
            while not stop.is_set():
                partial = b""
                try:
                    for chunk in self.api.follow_pod_log(ns, pod, container):
                        parts = (partial + chunk).split(b"\n")
                        partial = parts.pop()
                        for part in parts:
                            lines.put(f"[{label}] {part.decode(errors='replace')}")
                        if stop.is_set():
                            return
                    if partial:
                        lines.put(f"[{label}] {partial.decode(errors='replace')}")
                    return
                except K8sApiError as exc:
                    if exc.status != 400:  # 400: the container has not started yet
                        return
                except Exception:  # the stream broke
                    return
                stop.wait(1.0)

        ended_at: float | None = None
        next_scan = 0.0
        try:
            while True:
                now = time.monotonic()
                if now >= next_scan:
                    next_scan = now + 2.0
                    try:
                        sources = self._sources(handle)
                    except SchedulerError:
                        sources = []
                    for label, pod, container in sources:
                        if (pod, container) not in pumps:
                            t = threading.Thread(target=pump, args=(label, pod, container), daemon=True,
                                                 name=f"dlrover-k8s-log-{pod}-{container}")
                            pumps[(pod, container)] = t
                            t.start()
                    if ended_at is None and self._ended(handle, ns):
                        ended_at = now
                try:
                    yield lines.get(timeout=0.2)
                    continue
                except queue.Empty:
                    pass
                if ended_at is not None and (not any(t.is_alive() for t in pumps.values())
                                             or time.monotonic() - ended_at > 10.0):
                    while not lines.empty():
                        yield lines.get_nowait()
                    return
        finally:
            stop.set()

    def _ended(self, handle: JobHandle, ns: str) -> bool:
        if self._cached_result(handle) is not None:
            return True
        try:
            master = self.api.get("Pod", ns, Names(handle.job_id).master_pod)
        except SchedulerError:
            return False
        return master is None or (master.get("status") or {}).get("phase") in ("Succeeded", "Failed")

    # ----- cancel, relaunch --------------------------------------------------------------

    def cancel(self, handle: JobHandle) -> None:
        """Ask the master to stop (its result is kept), save the pods' logs under the
        handle's log_dir (the last 20,000 lines of each container), then delete every object labelled with the job's id and wait
        (``cancel_wait_s``) until its pods are gone. Idempotent."""
        ns, names = self._namespace(handle), Names(handle.job_id)
        labels = {LABEL_JOB: handle.job_id}
        master = self.api.get("Pod", ns, names.master_pod)
        if master is not None and self._cached_result(handle) is None:
            if (master.get("status") or {}).get("phase") == "Running":
                try:
                    self.api.service_proxy(ns, names.service, MASTER_PORT_NAME, "v1/cancel", post=True)
                    deadline = time.monotonic() + self.cancel_wait_s
                    while self.result(handle) is None and time.monotonic() < deadline:
                        time.sleep(1.0)
                except Exception:  # unreachable master: its result is lost with it
                    pass
            else:
                self.result(handle)
        if master is not None:
            self._save_logs(handle, ns)
        deleted = 0
        for kind in _DELETE_ORDER:
            for obj in self.api.list(kind, ns, labels):
                deleted += self.api.delete(kind, ns, obj["metadata"]["name"])
        deadline = time.monotonic() + self.cancel_wait_s
        while True:
            left = self.api.list("Pod", ns, labels)
            if not left:
                break
            if time.monotonic() > deadline:
                log.warning("k8s_pods_still_terminating", job_id=handle.job_id,
                            pods=[p["metadata"]["name"] for p in left])
                break
            for pod in left:  # e.g. a relaunch that raced the master's deletion
                if not pod["metadata"].get("deletionTimestamp"):
                    self.api.delete("Pod", ns, pod["metadata"]["name"])
            time.sleep(0.5)
        if deleted:
            log.info("k8s_job_deleted", job_id=handle.job_id, namespace=ns, objects=deleted)
            if self._cached_result(handle) is None:
                self._save(handle, _CANCELLED_FILE, json.dumps({"cancelled_at": time.time()}))

    def _save_logs(self, handle: JobHandle, ns: str) -> None:
        try:
            sources = self._sources(handle)
        except SchedulerError:
            return
        for label, pod, container in sources:
            try:
                data = self.api.pod_log(ns, pod, container, tail_lines=_SAVED_LOG_LINES)
            except SchedulerError:
                continue
            self._save(handle, f"pods/{label.replace(' ', '_')}.log", data)

    def relaunch_node(self, handle: JobHandle, node_id: int) -> None:
        """Create the next attempt of ``node_id``'s worker pod, deleting the node's pods
        that are still pending or running (the master declared the node lost). Called by
        the master from inside its pod (service account) or anywhere with a kubeconfig."""
        ns = self._namespace(handle)
        name = launch_worker(self.api, ns, handle.job_id, node_id, replace_live=True)
        log.info("node_relaunched", node_id=node_id, pod=name)


@hookimpl
def dlrover_register_schedulers(register):
    register(K8sScheduler)
