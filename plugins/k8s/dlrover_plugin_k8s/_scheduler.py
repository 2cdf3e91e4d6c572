"""The ``k8s`` scheduler backend: a master pod that creates, watches and relaunches one
worker pod per node (objects in :mod:`dlrover_plugin_k8s._manifests`).

What lives where, so that every method works from a new process given only a JobHandle:

* in the cluster: every object, labelled ``dlrover.job-id``; the worker template in a
  ConfigMap; the result, printed by the controller as its last log line;
* under the handle's ``log_dir`` on the submitting machine: ``plan.txt``,
  ``manifests.yaml``, ``k8s.json`` (namespace, names, and the kubeconfig and context the job
  was submitted with), and, once known, ``result.json``
  and the pods' logs (``pods/*.log``, saved by ``cancel`` before it deletes the pods), or
  ``cancelled.json`` when a cancel found no result.

``JobHandle.native_id`` is ``<namespace>/<master pod>``.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from dlrover_core import JobSpec, JobSpecError, SchedulerError, hookimpl
from dlrover_core.backend import (
    Capabilities,
    JobHandle,
    JobResult,
    JobState,
    JobStatus,
    MasterStatus,
    NodeRelaunch,
    Plan,
    PosixStorage,
    SchedulerBackend,
    control_plane,
    env,
    get_host,
    get_logger,
    preview_workers,
    read_result,
    rundir,
    status_of_result,
    write_atomic,
)
from dlrover_plugin_k8s._api import TRANSIENT_STATUSES, K8sApiError, KubeApi
from dlrover_plugin_k8s._config import ENV, OPTIONS, K8sConfig
from dlrover_plugin_k8s._controller import RESULT_MARKER
from dlrover_plugin_k8s._manifests import (
    ANNOTATION_DETAIL,
    ANNOTATION_KIND,
    ANNOTATION_REPLACES,
    LABEL_JOB,
    MASTER_PORT_NAME,
    Manifests,
    Names,
    dump_yaml,
    pod_job,
    render,
)
from dlrover_plugin_k8s._workers import attempt_of, launch_worker, newest_by_node, node_of, worker_pods

__all__ = ["K8sRequest", "K8sScheduler"]

log = get_logger()

#: Kinds of a job's objects, in the order ``cancel`` deletes them (the master pod first, so
#: nothing relaunches the workers deleted after it).
_DELETE_ORDER = ("Pod", "Service", "ConfigMap", "RoleBinding", "Role", "ServiceAccount")

#: Written under the handle's log_dir by a cancel that found no result: status is CANCELLED.
_CANCELLED_FILE = rundir.K8S_CANCELLED
#: Lines of each container's log that ``cancel`` keeps under the handle's log_dir.
_SAVED_LOG_LINES = 20000

_WORKER_TEMPLATE_NOTE = (
    "# The worker pod template (node 0, attempt 0). The master pod's controller creates one pod per\n"
    "# node from it (stored in the ConfigMap of manifests.yaml), renamed <job-id>-node-<node>-<attempt>,\n"
    "# with --node-id and the dlrover.node-id / dlrover.attempt labels set, and an ownerReference to\n"
    "# the master pod. It is not applied by itself.\n"
)


@attrs.frozen(kw_only=True)
class K8sRequest:
    """What ``submit`` creates: the job's objects, as rendered, with the settings they were
    rendered from.

    Attributes:
        config: the resolved options (namespace, image, and the cluster: kubeconfig, context).
        manifests: every object of the job and the worker pod template.
    """

    config: K8sConfig
    manifests: Manifests

    @property
    def namespace(self) -> str:
        return self.config.namespace


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

    Its options (:data:`~dlrover_plugin_k8s._config.OPTIONS`: image, namespace, resources...)
    come from the Job's ``scheduler_options``, else from ``config``, else from the
    ``DLROVER_K8S_*`` variables.

    Args:
        config: image, namespace, resources (default: from ``DLROVER_K8S_*`` variables); the
            Job's ``scheduler_options`` win over it.
        api: the API client (default: built from the config on first use).
        cancel_wait_s: how long ``cancel`` waits for the master's result after asking it to
            stop, and then for the pods to be gone (seconds, each).
    """

    name = "k8s"
    capabilities = Capabilities(elastic=True, relaunch_node=True, follow_logs=True, multi_host=True)
    options = OPTIONS
    request_type = K8sRequest

    def __init__(self, config: K8sConfig | None = None, *, api: KubeApi | None = None,
                 cancel_wait_s: float = 30.0) -> None:
        self._configured = config
        self.config = config if config is not None else K8sConfig.from_env()
        self._api = api
        self._apis: dict[tuple[str | None, str | None], KubeApi] = {}
        self._job_apis: dict[str, KubeApi] = {}
        self.cancel_wait_s = cancel_wait_s

    def configured_options(self) -> dict[str, Any]:
        return attrs.asdict(self._configured, recurse=False) if self._configured is not None else {}

    @property
    def api(self) -> KubeApi:
        """The API client of :attr:`config`'s cluster (or the one this backend was given)."""
        if self._api is None:
            self._api = KubeApi(self.config)
        return self._api

    def _api_for(self, kubeconfig: str | None, context: str | None) -> KubeApi:
        """The API client of the cluster a job was submitted to (an injected client serves all)."""
        if self._api is not None or (kubeconfig, context) == (self.config.kubeconfig, self.config.context):
            return self.api
        key = (kubeconfig, context)
        if key not in self._apis:
            self._apis[key] = KubeApi(attrs.evolve(self.config, kubeconfig=kubeconfig, context=context))
        return self._apis[key]

    def _handle_api(self, handle: JobHandle) -> KubeApi:
        """The API client of the cluster ``handle``'s job was submitted to (``k8s.json``)."""
        if handle.job_id not in self._job_apis:
            info = self._info(handle)
            self._job_apis[handle.job_id] = (self._api_for(info.get("kubeconfig"), info.get("context"))
                                             if "kubeconfig" in info or "context" in info else self.api)
        return self._job_apis[handle.job_id]

    # ----- plan --------------------------------------------------------------------------

    def build_plan(self, job: JobSpec, *, job_id: str, log_dir: str, options: dict[str, Any]) -> Plan:
        """The job's manifests (``Plan.files``): ``manifests.yaml`` (everything ``kubectl
        apply -f`` needs), ``master-pod.yaml`` and ``worker-pod.yaml`` (the template the
        master's controller makes every worker pod from). Pure: calls nothing. Refuses
        (:class:`~dlrover_core.errors.JobSpecError`) a checkpoint directory the pods would
        not share (see :meth:`_check_checkpoint_shared`)."""
        config = K8sConfig.from_options(options)
        if job.accelerator == "auto":
            raise JobSpecError("accelerator", "auto", "a named accelerator for scheduler 'k8s' (the pods' devices "
                                                      "cannot be probed from here), e.g. 'cuda' or 'cpu'")
        if not config.image:
            raise SchedulerError(f"no container image for the k8s scheduler: set scheduler_options['image'] (or "
                                 f"{ENV['image']}) to an image with python, dlrover-core, dlrover-plugin-k8s and the "
                                 f"job's code at {config.workdir} (scheduler_options['workdir'])")
        self._check_checkpoint_shared(job, config)
        job, accelerator = self.resolve_accelerator(job, get_host())  # no probe: the devices are remote
        nproc = job.nodes.nproc_per_node
        if nproc == "auto" and getattr(accelerator, "k8s_resource", None):
            raise JobSpecError("nodes.nproc_per_node", "auto", f"a number for scheduler 'k8s': it is the count of "
                                                               f"{accelerator.k8s_resource} each worker pod requests")
        manifests = render(job, job_id=job_id, accelerator=accelerator, nproc=nproc, config=config)
        files = {
            rundir.K8S_MANIFESTS: dump_yaml(*manifests.objects()),
            "master-pod.yaml": dump_yaml(manifests.master_pod),
            "worker-pod.yaml": _WORKER_TEMPLATE_NOTE + dump_yaml(manifests.worker_template),
        }
        return Plan(scheduler=self.name, job_id=job_id, job=job, log_dir=log_dir,
                    request=K8sRequest(config=config, manifests=manifests), files=files,
                    workers=self._preview(job, job_id, accelerator, nproc, config))

    def _check_checkpoint_shared(self, job: JobSpec, config: K8sConfig) -> None:
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
        if config.checkpoint_pvc or (ckpt.memory_every_steps == 0 and ckpt.persist_every_steps == 0):
            return
        storage = get_host().registries.storage.get(ckpt.storage)
        if not (isinstance(storage, type) and issubclass(storage, PosixStorage)):
            return
        raise JobSpecError(
            "checkpoint.dir", ckpt.dir,
            f"a directory every pod shares: with scheduler 'k8s' and storage {ckpt.storage!r} it would be on each "
            f"pod's own disk, so the ranks persist to different disks and a relaunched pod has nothing to restore "
            f"from. Set scheduler_options['checkpoint_pvc'] (or {ENV['checkpoint_pvc']}) to a ReadWriteMany "
            f"PersistentVolumeClaim, mounted at the checkpoint directory in every pod; or use a checkpoint storage "
            f"every pod reaches (Checkpoint(storage=..., dir=<its URL>)); or, for a job that keeps no checkpoints, "
            f"Checkpoint(memory_every_steps=0, persist_every_steps=0)",
        )

    def _preview(self, job: JobSpec, job_id: str, accelerator: Any, nproc: int | str,
                 config: K8sConfig) -> tuple:
        """The first round's workers, as the agents will start them inside their pods."""
        if nproc == "auto":
            return ()
        nproc = int(nproc)
        names = Names(job_id)
        pod_log_dir = f"{config.log_root}/{job_id}"
        job_json = control_plane.encode_job(pod_job(job, config))
        return preview_workers(
            job, job_id=job_id, nproc=nproc, master_addr=names.master_addr(config.namespace, config.master_port),
            store_host="<IP of the master pod>", accelerator=accelerator, log_dir=pod_log_dir, python=config.python,
            cwd=config.workdir, extra_env={env.JOB_SPEC: job_json})

    # ----- where a job is ----------------------------------------------------------------

    @staticmethod
    def _info(handle: JobHandle) -> dict[str, Any]:
        """``k8s.json`` under the handle's log_dir ({} where there is none, e.g. in the master pod)."""
        try:
            return json.loads((Path(handle.log_dir) / rundir.K8S_STATE).read_text())
        except (OSError, ValueError):
            return {}

    def _namespace(self, handle: JobHandle) -> str:
        if "/" in handle.native_id:
            return handle.native_id.split("/", 1)[0]
        return self._info(handle).get("namespace") or self.config.namespace

    def _cached_result(self, handle: JobHandle) -> JobResult | None:
        try:
            return read_result(handle.log_dir)
        except (OSError, ValueError):
            return None

    def _save(self, handle: JobHandle, name: str, data: str | bytes) -> None:
        """Write a file under the handle's log_dir atomically (best effort: inside the master
        pod that directory is not ours to fill)."""
        path = Path(handle.log_dir) / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, data)
        except OSError as exc:
            log.warning("k8s_save_failed", path=str(path), error=str(exc))

    # ----- side effects ------------------------------------------------------------------

    def execute(self, plan: Plan) -> JobHandle:
        """Create the ServiceAccount, Role, RoleBinding, worker template, Service and master
        pod of ``plan.request``, exactly as rendered, in the cluster of its kubeconfig and
        context. A failure removes what was created and raises
        :class:`~dlrover_core.errors.SchedulerError`."""
        request: K8sRequest = plan.request
        namespace, config = request.namespace, request.config
        names = Names(plan.job_id)
        log_dir = Path(plan.log_dir)
        (log_dir / rundir.K8S_MANIFESTS).write_text(plan.files[rundir.K8S_MANIFESTS])
        (log_dir / rundir.K8S_STATE).write_text(json.dumps({
            "namespace": namespace, "master_pod": names.master_pod, "service": names.service,
            "worker_template": names.template, "kubeconfig": config.kubeconfig, "context": config.context},
            indent=2))
        api = self._api_for(config.kubeconfig, config.context)
        created: list[dict[str, Any]] = []
        try:
            for obj in request.manifests.objects():
                self._create(api, obj, plan.job_id)
                created.append(obj)
        except SchedulerError:
            for obj in reversed(created):
                try:
                    api.delete(obj["kind"], namespace, obj["metadata"]["name"])
                except SchedulerError as exc:
                    log.warning("k8s_cleanup_failed", kind=obj["kind"], name=obj["metadata"]["name"], error=str(exc))
            raise
        log.info("k8s_job_created", job_id=plan.job_id, namespace=namespace, master_pod=names.master_pod)
        return JobHandle(scheduler=self.name, job_id=plan.job_id, log_dir=str(log_dir),
                         native_id=f"{namespace}/{names.master_pod}")

    @staticmethod
    def _create(api: KubeApi, obj: dict[str, Any], job_id: str) -> None:
        """Create ``obj``; one that already exists counts when it is this job's (a retried
        create whose first try got through)."""
        try:
            api.create(obj)
        except K8sApiError as exc:
            if exc.status != 409:
                raise
            meta = obj["metadata"]
            existing = api.get(obj["kind"], meta["namespace"], meta["name"])
            if existing is None or (existing["metadata"].get("labels") or {}).get(LABEL_JOB) != job_id:
                raise

    def status(self, handle: JobHandle) -> JobStatus:
        """From the master when the API server's service proxy reaches it; else from the
        pods (``UNKNOWN`` when the API server cannot be reached)."""
        cached = self._cached_result(handle)
        if cached is not None:
            return status_of_result(cached)
        ns, names = self._namespace(handle), Names(handle.job_id)
        try:
            master = self._handle_api(handle).get("Pod", ns, names.master_pod)
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
                    return status_of_result(result)
                return JobStatus(state=JobState.FAILED, message=f"the master pod {phase.lower()} without a result: "
                                                                f"{_waiting_reason(master)}")
            try:
                answer = self._handle_api(handle).service_proxy(ns, names.service, MASTER_PORT_NAME, "v1/status")
                return MasterStatus.from_wire(answer).to_job_status()
            except Exception:  # the master is starting, the proxy is not allowed, or no status: count pods
                pass
            pods = worker_pods(self._handle_api(handle), ns, handle.job_id)
        except K8sApiError as exc:
            if exc.status == 0 or exc.status in TRANSIENT_STATUSES:
                return JobStatus(state=JobState.UNKNOWN, message=str(exc))
            raise
        running = sum(1 for p in newest_by_node(pods).values() if (p.get("status") or {}).get("phase") == "Running")
        return JobStatus(state=JobState.RUNNING, nodes=running, message=f"{running} worker pods running (the "
                                                                        "master's API is not reachable from here)")

    def result(self, handle: JobHandle) -> JobResult | None:
        """The JobResult: cached under the handle's log_dir, or the last marked line of the
        controller's log once the controller has exited."""
        cached = self._cached_result(handle)
        if cached is not None:
            return cached
        ns, names = self._namespace(handle), Names(handle.job_id)
        try:
            master = self._handle_api(handle).get("Pod", ns, names.master_pod)
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
            text = self._handle_api(handle).pod_log(ns, names.master_pod, "controller").decode(errors="replace")
        except K8sApiError:
            return None
        lines = [line for line in text.splitlines() if line.startswith(RESULT_MARKER)]
        if not lines:
            return None
        data = json.loads(lines[-1][len(RESULT_MARKER):])
        self._save(handle, rundir.RESULT, json.dumps(data, indent=2))
        return JobResult.from_dict(data)

    # ----- logs --------------------------------------------------------------------------

    def _sources(self, handle: JobHandle) -> list[tuple[str, str, str]]:
        """``(label, pod, container)`` of every container of the job, master first."""
        ns, names = self._namespace(handle), Names(handle.job_id)
        out = [("master", names.master_pod, "master"), ("controller", names.master_pod, "controller")]
        for pod in worker_pods(self._handle_api(handle), ns, handle.job_id):
            attempt = attempt_of(pod)
            label = f"node-{node_of(pod)}" + (f" attempt {attempt}" if attempt else "")
            out.append((label, pod["metadata"]["name"], "agent"))
        return out

    def logs(self, handle: JobHandle, *, follow: bool = False) -> Iterator[str]:
        """Lines of every pod's log, prefixed ``[master]``, ``[controller]``, ``[node-<i>]``;
        once the pods are gone, the logs ``cancel`` saved. With ``follow``, every container
        is streamed (new worker pods too) until the job ends."""
        ns = self._namespace(handle)
        if self._handle_api(handle).get("Pod", ns, Names(handle.job_id).master_pod) is None:
            yield from self._saved_logs(handle)
            return
        if not follow:
            for label, pod, container in self._sources(handle):
                try:
                    data = self._handle_api(handle).pod_log(ns, pod, container)
                except K8sApiError:  # not started yet, or gone
                    continue
                for line in data.decode(errors="replace").splitlines():
                    yield f"[{label}] {line}"
            return
        yield from self._follow(handle, ns)

    def _saved_logs(self, handle: JobHandle) -> Iterator[str]:
        for path in sorted((Path(handle.log_dir) / rundir.K8S_POD_LOGS).glob("*.log")):
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
                    for chunk in self._handle_api(handle).follow_pod_log(ns, pod, container):
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
            master = self._handle_api(handle).get("Pod", ns, Names(handle.job_id).master_pod)
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
        master = self._handle_api(handle).get("Pod", ns, names.master_pod)
        if master is not None and self._cached_result(handle) is None:
            if (master.get("status") or {}).get("phase") == "Running":
                try:
                    self._handle_api(handle).service_proxy(ns, names.service, MASTER_PORT_NAME, "v1/cancel", post=True)
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
            for obj in self._handle_api(handle).list(kind, ns, labels):
                deleted += self._handle_api(handle).delete(kind, ns, obj["metadata"]["name"])
        deadline = time.monotonic() + self.cancel_wait_s
        while True:
            left = self._handle_api(handle).list("Pod", ns, labels)
            if not left:
                break
            if time.monotonic() > deadline:
                log.warning("k8s_pods_still_terminating", job_id=handle.job_id,
                            pods=[p["metadata"]["name"] for p in left])
                break
            for pod in left:  # e.g. a relaunch that raced the master's deletion
                if not pod["metadata"].get("deletionTimestamp"):
                    self._handle_api(handle).delete("Pod", ns, pod["metadata"]["name"])
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
                data = self._handle_api(handle).pod_log(ns, pod, container, tail_lines=_SAVED_LOG_LINES)
            except SchedulerError:
                continue
            self._save(handle, f"{rundir.K8S_POD_LOGS}/{label.replace(' ', '_')}.log", data)

    def relaunch_node(self, handle: JobHandle, request: NodeRelaunch) -> None:
        """Create the next attempt of ``request.node_id``'s worker pod, deleting the node's pods
        that are still pending or running (the master declared the node lost); the new pod is
        annotated with the request's reason and the pod it replaces (the newest of
        ``request.replaces``). Called by the master from inside its pod (service account) or
        anywhere with a kubeconfig."""
        ns, api = self._namespace(handle), self._handle_api(handle)
        annotations = {ANNOTATION_KIND: "relaunch", ANNOTATION_DETAIL: (request.reason or "relaunched by the master")[:1000]}
        if request.replaces is not None:
            replaced = newest_by_node(worker_pods(api, ns, handle.job_id, request.replaces)).get(request.replaces)
            if replaced is not None:
                annotations[ANNOTATION_REPLACES] = replaced["metadata"]["name"]
        name = launch_worker(api, ns, handle.job_id, request.node_id, replace_live=True, annotations=annotations)
        log.info("node_relaunched", node_id=request.node_id, replaces=request.replaces, pod=name)


@hookimpl
def dlrover_register_schedulers(register):
    register(K8sScheduler)
