"""The k8s backend and the master pod's controller against an emulated API server, over
real HTTP (see k8s_emulator.py): submit, worker pods, failure classification and relaunch,
status, result, logs, cancel, and how API errors are retried or reported."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import structlog
from k8s_emulator import IMAGE, NAMESPACE

from dlrover_core import Job
from dlrover_core.errors import SchedulerError
from dlrover_core.protocol import Action, JobResult, JobState, MasterStatus, NodeRelaunch
from dlrover_core.scheduler_backend import JobHandle
from dlrover_core.spec import Failure
from dlrover_plugin_k8s import RESULT_MARKER, K8sApiError, K8sConfig, K8sScheduler, PodController
from dlrover_plugin_k8s._manifests import ANNOTATION_DETAIL, ANNOTATION_KIND, ANNOTATION_REPLACES, Names

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.timeout(60)


def _job(tmp_path, **kw) -> Job:
    kw.setdefault("nodes", 2)
    return Job(name="tiny", entrypoint="tests/scripts/tiny_train.py", accelerator="cpu", scheduler="k8s",
               workdir=str(ROOT), log_dir=str(tmp_path / "runs"), **kw)


class FakeMaster:
    """The job master as the controller sees it: a status, and failure reports recorded."""

    def __init__(self, state: str = "RUNNING", round_index: int = 0, action: str = "restart") -> None:
        self.state, self.round, self.action = state, round_index, Action(action)
        self.reports: list[tuple[int, int, str, str]] = []

    def status(self) -> MasterStatus:
        return MasterStatus.from_wire({"state": self.state, "round": self.round})

    def report_failure(self, node_id, round_index, failure) -> Action:
        self.reports.append((node_id, round_index, failure.kind, failure.detail))
        return self.action


def _result(job_id: str, **kw) -> JobResult:
    fields = {"job_id": job_id, "state": JobState.SUCCEEDED, "reason": "", "final_step": 100, "restarts": 1,
              "wall_time_s": 10.0, "productive_s": 9.0, "goodput": 0.9, "checkpoint_stall_s": 0.0, "restore_s": 0.0,
              "recomputed_s": 0.0, "detection_s": 0.0, "restart_s": 0.0, "rendezvous_s": 0.0, "startup_s": 1.0,
              "failures": (), "metrics": {"loss": 1.0}, "log_dir": "/var/log/dlrover/x"}
    return JobResult(**{**fields, **kw})


def _submitted(backend, tmp_path, **kw):
    plan = backend.dryrun(_job(tmp_path, **kw))
    return plan, backend.submit(plan)


def _controller(backend, plan, handle, master=None) -> PodController:
    return PodController(api=backend.api, namespace=NAMESPACE, job_id=handle.job_id, job=plan.job, master=master)


def test_submit_creates_rbac_template_service_and_master_pod(cluster, backend, tmp_path):
    """submit creates exactly the rendered objects, each labelled with the job id; the
    handle names the namespace and master pod, and log_dir keeps the plan and manifests."""
    plan, handle = _submitted(backend, tmp_path)
    names = Names(handle.job_id)
    stored = cluster.objects()
    assert set(stored) == {
        ("serviceaccounts", names.account), ("roles", names.account), ("rolebindings", names.account),
        ("configmaps", names.template), ("services", names.service), ("pods", names.master_pod),
    }
    for obj in stored.values():
        assert obj["metadata"]["labels"]["dlrover.job-id"] == handle.job_id
    master = stored[("pods", names.master_pod)]
    assert master["metadata"]["labels"]["dlrover.role"] == "master"
    assert master["spec"]["containers"][0]["command"][:3] == ["python", "-m", "dlrover_core.master"]
    assert master["spec"]["containers"][0]["image"] == IMAGE
    assert handle.native_id == f"{NAMESPACE}/{names.master_pod}"
    run_dir = Path(handle.log_dir)
    assert (run_dir / "manifests.yaml").read_text() == plan.files["manifests.yaml"]
    assert json.loads((run_dir / "k8s.json").read_text())["namespace"] == NAMESPACE
    assert not cluster.pods(dlrover_role="worker")  # the master pod's controller creates them


def test_controller_creates_one_owned_worker_pod_per_node(cluster, backend, tmp_path):
    """The controller makes one worker pod per node from the template, owned by the master
    pod (so deleting it garbage-collects them), and creates nothing twice."""
    plan, handle = _submitted(backend, tmp_path, nodes=3)
    controller = _controller(backend, plan, handle)
    created = controller.ensure_workers()
    assert created == [Names(handle.job_id).worker_pod(n, 0) for n in range(3)]
    assert controller.ensure_workers() == []
    master_uid = cluster.pods(dlrover_role="master")[Names(handle.job_id).master_pod]["metadata"]["uid"]
    for node in range(3):
        pod = cluster.pods(dlrover_role="worker")[Names(handle.job_id).worker_pod(node, 0)]
        labels = pod["metadata"]["labels"]
        assert (labels["dlrover.job-id"], labels["dlrover.node-id"], labels["dlrover.attempt"]) == (
            handle.job_id, str(node), "0")
        owner = pod["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"]) == ("Pod", master_uid)
        argv = pod["spec"]["containers"][0]["command"]
        assert argv[argv.index("--node-id") + 1] == str(node)
        assert pod["spec"]["restartPolicy"] == "Never"


def test_failed_worker_pod_is_reported_and_replaced(cluster, backend, tmp_path):
    """A worker pod whose phase turns Failed is classified, reported to the master, and
    replaced by the node's next attempt, once."""
    plan, handle = _submitted(backend, tmp_path)
    master = FakeMaster()
    controller = _controller(backend, plan, handle, master)
    controller.ensure_workers()
    names = Names(handle.job_id)
    cluster.fail(names.worker_pod(1, 0), exit_code=3)
    handled = controller.poll_once()
    assert [(n, f.kind, new) for n, f, new in handled] == [(1, "pod_failed", names.worker_pod(1, 1))]
    new = cluster.pods()[names.worker_pod(1, 1)]
    assert new["metadata"]["annotations"][ANNOTATION_KIND] == "pod_failed"
    assert "exit code 3" in new["metadata"]["annotations"][ANNOTATION_DETAIL]
    assert new["metadata"]["annotations"][ANNOTATION_REPLACES] == names.worker_pod(1, 0)
    assert master.reports == [(1, 0, "pod_failed", "container agent terminated: Error (exit code 3)")]
    assert controller.poll_once() == []  # handled once
    assert sorted(cluster.pods(dlrover_role="worker")) == sorted(
        [names.worker_pod(0, 0), names.worker_pod(1, 0), names.worker_pod(1, 1)])


def test_evicted_worker_pod_is_relaunched_as_evicted(cluster, backend, tmp_path):
    """An evicted pod (status.reason Evicted) is relaunched with that classification, in
    the replacement's annotations and in a structlog event."""
    plan, handle = _submitted(backend, tmp_path)
    master = FakeMaster()
    controller = _controller(backend, plan, handle, master)
    controller.ensure_workers()
    names = Names(handle.job_id)
    cluster.set_status(names.worker_pod(0, 0), {
        "phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."})
    with structlog.testing.capture_logs() as logs:
        controller.poll_once()
    new = cluster.pods()[names.worker_pod(0, 1)]
    assert new["metadata"]["annotations"][ANNOTATION_KIND] == "evicted"
    assert new["metadata"]["annotations"][ANNOTATION_DETAIL] == "pod evicted: The node was low on resource: memory."
    failed = [e for e in logs if e["event"] == "worker_pod_failed"]
    assert failed and failed[0]["kind"] == "evicted" and failed[0]["node_id"] == 0
    assert any(e["event"] == "node_relaunched" and e["kind"] == "evicted" for e in logs)
    assert master.reports[0][2] == "evicted"


def test_oom_killed_worker_pod_is_classified(cluster, backend, tmp_path):
    """A worker whose agent container was OOM-killed is classified oom_killed and relaunched."""
    plan, handle = _submitted(backend, tmp_path)
    master = FakeMaster()
    controller = _controller(backend, plan, handle, master)
    controller.ensure_workers()
    names = Names(handle.job_id)
    cluster.fail(names.worker_pod(1, 0), exit_code=137, reason="OOMKilled")
    [(node, failure, new)] = controller.poll_once()
    assert (node, failure.kind, failure.exit_code, new) == (1, "oom_killed", 137, names.worker_pod(1, 1))
    assert "OOMKilled" in failure.detail
    assert cluster.pods()[new]["metadata"]["annotations"][ANNOTATION_KIND] == "oom_killed"


def test_no_relaunch_when_the_master_stops_the_node_or_the_job_ended(cluster, backend, tmp_path):
    """The controller does not relaunch a node the master excluded (it launches a new node
    itself), nor anything once the job is over."""
    plan, handle = _submitted(backend, tmp_path)
    master = FakeMaster(action="stop")
    controller = _controller(backend, plan, handle, master)
    controller.ensure_workers()
    names = Names(handle.job_id)
    cluster.fail(names.worker_pod(0, 0))
    assert [new for _, _, new in controller.poll_once()] == [None]
    master.state = "SUCCEEDED"
    cluster.fail(names.worker_pod(1, 0))
    assert [new for _, _, new in controller.poll_once()] == [None]
    assert len(master.reports) == 1  # nothing reported to a finished job
    assert set(cluster.pods(dlrover_role="worker")) == {names.worker_pod(0, 0), names.worker_pod(1, 0)}


def test_relaunches_stop_at_the_budget(cluster, backend, tmp_path):
    """At most failure.max_restarts + nodes.max relaunches in all."""
    plan, handle = _submitted(backend, tmp_path, nodes=1, failure=Failure(max_restarts=1))
    controller = _controller(backend, plan, handle)
    controller.ensure_workers()
    names = Names(handle.job_id)
    for attempt in range(3):
        cluster.fail(names.worker_pod(0, attempt))
        [(_, _, new)] = controller.poll_once()
        assert new == (names.worker_pod(0, attempt + 1) if attempt < 2 else None)


def test_relaunch_node_replaces_a_lost_node_from_the_masters_environment(cluster, config, tmp_path, monkeypatch):
    """The master calls relaunch_node from its own process with a bare handle (no native
    id; namespace and API from the pod's environment) and a NodeRelaunch: the node's live pod
    is deleted and its next attempt created, annotated with the reason; a new node id that
    replaces an excluded node gets attempt 0, annotated with the pod it replaces."""
    backend = K8sScheduler(config)
    plan, handle = _submitted(backend, tmp_path)
    _controller(backend, plan, handle).ensure_workers()
    monkeypatch.setenv("DLROVER_K8S_NAMESPACE", NAMESPACE)
    monkeypatch.setenv("DLROVER_K8S_KUBECONFIG", str(cluster.kubeconfig))
    monkeypatch.setenv("DLROVER_K8S_IMAGE", IMAGE)
    from dlrover_core.master.__main__ import _relauncher

    relaunch = _relauncher(plan.job, handle.job_id, tmp_path / "pod-log-dir")
    names = Names(handle.job_id)
    relaunch(NodeRelaunch(node_id=1, replaces=1, reason="node 1 lost its heartbeat", attempt=0))
    pods = cluster.pods(dlrover_role="worker")
    assert names.worker_pod(1, 0) not in pods and names.worker_pod(1, 1) in pods
    assert pods[names.worker_pod(1, 1)]["metadata"]["annotations"][ANNOTATION_DETAIL] == "node 1 lost its heartbeat"
    relaunch(NodeRelaunch(node_id=2, replaces=0, reason="node 0 excluded: straggler"))
    new = cluster.pods(dlrover_role="worker")[names.worker_pod(2, 0)]
    assert new["metadata"]["annotations"][ANNOTATION_REPLACES] == names.worker_pod(0, 0)


def test_status_from_the_master_then_from_pods_then_gone(cluster, backend, tmp_path):
    """status asks the master through the API server's service proxy; without it, counts
    running worker pods; a pending master pod says why; a deleted one is a failure."""
    plan, handle = _submitted(backend, tmp_path)
    names = Names(handle.job_id)
    cluster.set_status(names.master_pod, {"phase": "Pending", "containerStatuses": [
        {"name": "master", "ready": False, "restartCount": 0, "image": IMAGE, "imageID": "",
         "state": {"waiting": {"reason": "ImagePullBackOff", "message": "pull access denied"}}}]})
    st = backend.status(handle)
    assert st.state == JobState.PENDING and "ImagePullBackOff" in st.message
    cluster.set_status(names.master_pod, {"phase": "Running"})
    _controller(backend, plan, handle).ensure_workers()
    cluster.set_status(names.worker_pod(0, 0), {"phase": "Running"})
    st = backend.status(handle)
    assert (st.state, st.nodes) == (JobState.RUNNING, 1)
    cluster.server[f"get /api/v1/namespaces/{NAMESPACE}/services/{names.service}:http/proxy/v1/status"] << {
        "state": "RUNNING", "step": 42, "metrics": {"loss": 1.5}, "nodes": 2, "max_nodes": 2, "restarts": 1,
        "round": 1, "message": "", "node_table": [{"node_id": 0, "workers": {"0": 7}}], "goodput": {"goodput": 0.9}}
    st = backend.status(handle)
    assert (st.state, st.step, st.nodes, st.restarts, st.metrics) == (JobState.RUNNING, 42, 2, 1, {"loss": 1.5})
    assert st.worker_pids == {0: 7}  # MasterStatus.to_job_status: the pids the agents reported
    cluster.core.delete_namespaced_pod(names.master_pod, NAMESPACE)
    st = backend.status(handle)
    assert st.state == JobState.FAILED and "gone" in st.message


def _serve_logs(cluster, texts: dict[tuple[str, str], bytes]) -> None:
    """Serve ``texts[(pod, container)]`` as pod logs."""

    def log(request):
        pod = request.url.path.split("/")[-2]
        return texts.get((pod, request.params.get("container", "")), b"")

    cluster.server["get", re.compile(r".*/pods/[^/]+/log")] << log


def test_result_comes_from_the_controllers_log_and_survives_cancel(cluster, backend, tmp_path):
    """When the controller has exited, its last marked line is the JobResult; it is cached
    under the handle's log_dir, so status and result still answer after cancel deleted
    every pod, from a new backend given only the handle."""
    plan, handle = _submitted(backend, tmp_path)
    names = Names(handle.job_id)
    assert backend.result(handle) is None
    result = _result(handle.job_id)
    line = RESULT_MARKER + json.dumps(result.to_dict(), separators=(",", ":"))
    _serve_logs(cluster, {(names.master_pod, "controller"): f"starting\n{line}\n".encode(),
                          (names.master_pod, "master"): b"master says hi\n"})
    cluster.set_status(names.master_pod, {"phase": "Succeeded", "containerStatuses": [
        {"name": "controller", "ready": False, "restartCount": 0, "image": IMAGE, "imageID": "",
         "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]})
    assert backend.result(handle).final_step == 100
    backend.cancel(handle)
    assert not cluster.objects()
    fresh = K8sScheduler(K8sConfig(image=IMAGE, namespace="elsewhere", kubeconfig=str(cluster.kubeconfig)))
    bare = JobHandle(scheduler="k8s", job_id=handle.job_id, log_dir=handle.log_dir, native_id=handle.native_id)
    assert fresh.result(bare) == result
    assert fresh.status(bare).state == JobState.SUCCEEDED
    assert "[master] master says hi" in list(fresh.logs(bare))  # saved by cancel before deleting


def test_logs_prefix_every_container_and_follow_ends_with_the_job(cluster, backend, tmp_path):
    """logs() prefixes lines by source (master, controller, node); with follow it streams
    until the master pod has ended."""
    plan, handle = _submitted(backend, tmp_path)
    _controller(backend, plan, handle).ensure_workers()
    names = Names(handle.job_id)
    _serve_logs(cluster, {
        (names.master_pod, "master"): b"master up\n", (names.master_pod, "controller"): b"controller up\n",
        (names.worker_pod(0, 0), "agent"): b"agent 0 up\nstep 1\n", (names.worker_pod(1, 0), "agent"): b"agent 1 up",
    })
    lines = list(backend.logs(handle))
    assert lines == ["[master] master up", "[controller] controller up", "[node-0] agent 0 up", "[node-0] step 1",
                     "[node-1] agent 1 up"]
    cluster.set_status(names.master_pod, {"phase": "Succeeded"})
    followed = list(backend.logs(handle, follow=True))
    assert sorted(followed) == sorted(lines)


def test_cancel_deletes_everything_with_the_job_label_and_is_idempotent(cluster, backend, tmp_path):
    """cancel removes every object of the job (workers too) and nothing of another job;
    cancelling again does nothing."""
    plan, handle = _submitted(backend, tmp_path)
    _controller(backend, plan, handle).ensure_workers()
    other_plan, other = _submitted(backend, tmp_path)
    assert len(cluster.objects()) == 2 * 6 + 2
    backend.cancel(handle)
    assert backend.status(handle).state == JobState.CANCELLED  # no master answered: no result, but cancelled
    left = cluster.objects()
    assert left and all(o["metadata"]["labels"]["dlrover.job-id"] == other.job_id for o in left.values())
    assert len(left) == 6
    backend.cancel(handle)
    assert len(cluster.objects()) == 6
    backend.cancel(other)
    assert not cluster.objects()


def test_forbidden_is_a_scheduler_error_with_the_api_message_and_submit_cleans_up(cluster, backend, tmp_path):
    """A 403 answer raises SchedulerError carrying the API server's message, and submit
    removes what it had created."""
    message = 'roles.rbac.authorization.k8s.io is forbidden: User "alice" cannot create resource "roles"'
    cluster.server[f"post /apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/roles"] << 403 << {
        "apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
        "message": message}
    plan = backend.dryrun(_job(tmp_path))
    with pytest.raises(SchedulerError) as info:
        backend.submit(plan)
    assert isinstance(info.value, K8sApiError)
    assert (info.value.status, info.value.reason, info.value.api_message) == (403, "Forbidden", message)
    assert message in str(info.value)
    assert not cluster.objects("serviceaccounts")  # created before the refusal, then removed
    assert cluster.requests("POST", "/roles") == 1  # a refusal is not retried


def test_invalid_is_a_scheduler_error_with_the_api_message(cluster, backend, tmp_path):
    """A 422 answer (the object is invalid) raises SchedulerError with the API's message."""
    message = 'Pod "x" is invalid: spec.containers[0].image: Required value'
    cluster.server[f"post /api/v1/namespaces/{NAMESPACE}/pods"] << 422 << {
        "apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": "Invalid", "code": 422,
        "message": message}
    with pytest.raises(K8sApiError, match=re.escape(message)) as info:
        _submitted(backend, tmp_path)
    assert info.value.status == 422
    # what was created before is removed (the emulator stores even a refused create: ignore that one)
    assert {kind for kind, _ in cluster.objects()} <= {"pods"}


def test_service_unavailable_then_ok_is_retried(cluster, backend, tmp_path):
    """A 503 answer is retried: a list succeeds on the second try, and a create whose first
    try got through before the 503 is not an error (nor created twice)."""
    plan, handle = _submitted(backend, tmp_path)
    controller = _controller(backend, plan, handle)
    controller.ensure_workers()
    cluster.fail_next(f"get /api/v1/namespaces/{NAMESPACE}/pods", 503)
    before = cluster.requests("GET", f"/namespaces/{NAMESPACE}/pods")
    assert controller.poll_once() == []
    assert cluster.requests("GET", f"/namespaces/{NAMESPACE}/pods") == before + 2
    cluster.fail_next(f"post /api/v1/namespaces/{NAMESPACE}/services", 503)
    plan2, handle2 = _submitted(backend, tmp_path)
    assert (("services", Names(handle2.job_id).service)) in cluster.objects()
    assert cluster.requests("POST", "/services") == 3  # job 1, job 2 twice


def test_transient_errors_are_retried_boundedly(cluster, backend, tmp_path):
    """503 on every try: the policy gives up after its attempts with a SchedulerError."""
    cluster.server[f"get /api/v1/namespaces/{NAMESPACE}/pods"] << 503
    with pytest.raises(K8sApiError) as info:
        backend.api.list("Pod", NAMESPACE, {"dlrover.job-id": "x"})
    assert info.value.status == 503
    assert cluster.requests("GET", f"/namespaces/{NAMESPACE}/pods") == 5


def test_unreachable_api_server_is_a_scheduler_error(tmp_path):
    """Connection refused is retried, then reported as unreachable (status 0)."""
    import socket

    from k8s_emulator import instant_retrying

    from dlrover_plugin_k8s import KubeApi

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters:\n- name: c\n  cluster:\n    server: http://127.0.0.1:{port}\n"
        "users:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\n")
    api = KubeApi(K8sConfig(image=IMAGE, kubeconfig=str(kubeconfig)), retrying=instant_retrying, timeout_s=2.0)
    with pytest.raises(K8sApiError) as info:
        api.get("Pod", NAMESPACE, "x")
    assert info.value.status == 0 and info.value.reason == "Unreachable"


def test_controller_main_prints_the_result_and_exits(cluster, tmp_path, monkeypatch, capsys):
    """``python -m dlrover_plugin_k8s.controller`` ends, printing the master's result.json
    on one marked line, once the master has written it."""
    from dlrover_core import env
    from dlrover_plugin_k8s._controller import main

    job = _job(tmp_path)
    log_dir = tmp_path / "pod-logs"
    log_dir.mkdir()
    result = _result("j", final_step=7)
    (log_dir / "result.json").write_text(json.dumps(result.to_dict()))
    monkeypatch.setenv(env.JOB_SPEC, json.dumps(job.to_dict()))
    monkeypatch.setenv("DLROVER_K8S_KUBECONFIG", str(cluster.kubeconfig))
    monkeypatch.setenv("DLROVER_K8S_NAMESPACE", NAMESPACE)
    saved = structlog.get_config()  # main() configures logging onto this test's captured stderr
    try:
        assert main(["--job-id", "j", "--master-addr", "127.0.0.1:9", "--log-dir", str(log_dir),
                     "--poll-s", "0.1"]) == 0
    finally:
        structlog.configure(**saved)
    marked = [line for line in capsys.readouterr().out.splitlines() if line.startswith(RESULT_MARKER)]
    assert JobResult.from_dict(json.loads(marked[-1][len(RESULT_MARKER):])) == result
