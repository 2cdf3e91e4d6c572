"""The typed protocol: every message crosses the wire as JSON and comes back equal; a newer
peer's extra fields are tolerated, a malformed message is refused naming what is wrong; the
master's server and MasterClient speak it end to end."""

from __future__ import annotations

import json
import socket
import threading
import time

import attrs
import httpx
import pytest

from dlrover_core import Failure, Job, JobState, Nodes
from dlrover_core.errors import DLRoverError, MasterUnavailableError, ProtocolError
from dlrover_core.master.job_master import JobMaster
from dlrover_core.master.server import MasterServer
from dlrover_core.protocol import (
    ENDPOINTS,
    Action,
    ActionAnswer,
    AssignNode,
    Cancel,
    CheckpointErrorReport,
    Exited,
    FailureRecord,
    FailureReport,
    Heartbeat,
    HeartbeatAnswer,
    JobResult,
    Join,
    Joined,
    LiveAssignment,
    LiveReform,
    MasterStatus,
    NodeAssigned,
    NodeCheckReport,
    NodeCheckResult,
    NodeRelaunch,
    NodeRow,
    Poll,
    PollState,
    Register,
    Registered,
    RestoreDecision,
    RestorePlanRequest,
    RestoreVerify,
    RestoreVerifyAnswer,
    RoundAssignment,
    ShardAnswer,
    ShardReport,
    StepRecord,
    Succeeded,
    WorkerException,
    WorkerFailure,
    decode,
    encode,
)
from dlrover_core.protocol.client import MasterClient
from dlrover_core.retry import rpc_retrying

EXCEPTION = WorkerException(exc_type="ValueError", message="bad batch", step=17, before_first_step=False,
                            traceback="Traceback ...")
HEARTBEAT = Heartbeat(node_id=1, round=2, workers={4: 1001, 5: 1002}, steps={4: 17, 5: 16},
                      records=(StepRecord(step=17, rank=0, dt_s=0.1, unix_time_s=1.7e9, metrics={"loss": 1.5}),),
                      saves={4: (10, 15)}, pid=42, token=7)

#: One filled-in example of every message (non-default values wherever a field has one).
EXAMPLES = [
    NodeRelaunch(node_id=3, replaces=1, reason="node 1 was lost", attempt=2),
    AssignNode(key="host-a:4242", rdzv_id="job-1"),
    NodeAssigned(node_id=3, job_id="job-1"),
    NodeAssigned(node_id=-1, job_id="job-1", action=Action.STOP, reason="job job-1 already ended SUCCEEDED"),
    Register(node_id=1, host="vm", pid=42),
    Registered(action=Action.NONE, job_id="job-1", token=7),
    Join(node_id=1, nproc=4, token=7),
    Joined(action=Action.NONE, round=2),
    Poll(node_id=1, token=7),
    RoundAssignment(state=PollState.READY, round=2, node_rank=1, num_nodes=2, rank_offset=4, nproc=4, world_size=8,
                    store_host="10.0.0.1", store_port=29500, restart_count=1, max_restarts=3),
    RoundAssignment(state=PollState.CHECK, check_round=1, group=(0, 3), group_rank=1, group_size=2,
                    store_host="10.0.0.1", store_port=29501, prefix="check1/group0", timeout_s=120.0),
    HEARTBEAT,
    HeartbeatAnswer(action=Action.RESTART),
    WorkerFailure.exited(rank=4, local_rank=0, exit_code=1, exception=EXCEPTION),
    FailureReport(node_id=1, round=2, token=7, failures=(
        WorkerFailure.exited(rank=4, local_rank=0, exit_code=-9),
        WorkerFailure(rank=5, local_rank=1, kind="hang", detail="no progress for 60 s", silent_s=61.5),
        WorkerFailure.exited(rank=6, local_rank=2, exit_code=1, exception=EXCEPTION),
    )),
    ActionAnswer(action=Action.STOP, fenced=True),
    Succeeded(node_id=1, round=2, token=7),
    Exited(node_id=1, token=7),
    NodeCheckReport(node_id=1, check_round=0, token=7, result=NodeCheckResult(
        ok=True, local_ok=True, elapsed_s=1.5, matmul_tflops=12.5, allreduce_gbps=3.25)),
    Cancel(reason="cancelled by the user"),
    ShardReport(node_id=1, rank=4, step=20, world_size=8, round=2, file="rank_00004-round2.safetensors",
                crc32=123456, bytes=4096, persist_s=0.25, token=7),
    ShardAnswer(committed=10, stale=True, reason="round 3 went back to step 10"),
    CheckpointErrorReport(node_id=1, rank=4, step=20, round=2, error="OSError: disk full", storage="file:///ck",
                          fatal=True, token=7),
    RestorePlanRequest(round=3, rank=4, world_size=8, memory=((15, 2), (20, 2)), memory_steps=(15, 20)),
    RestoreDecision(state="ready", source="memory", step=20, snapshot_round=2),
    RestoreVerify(round=3, rank=4, world_size=8, step=20, ok=False, error="CRC mismatch"),
    RestoreVerifyAnswer(state="retry", step=10, reason="rank 4's shard: CRC mismatch"),
    LiveReform(node_id=1, local_rank=0, pid=4242, round=2, generation=3, step=118, reason="error",
               error="Connection closed by peer"),
    LiveAssignment(state="ready", generation=4, rank=1, world_size=3, store_host="10.0.0.1", store_port=29400,
                   prefix="live/4/", grow_key="live/grow/4"),
    MasterStatus(job_id="job-1", state=JobState.RUNNING, step=17, metrics={"loss": 1.5}, nodes=2, max_nodes=2,
                 restarts=1, round=2, elapsed_s=12.5, goodput={"goodput": 0.9},
                 node_table=(NodeRow(node_id=1, host="vm", pid=42, state="running", round=2, workers={4: 1001},
                                     steps={4: 17}, failures=1, relaunches=0, token=7),)),
    JobResult(job_id="job-1", state=JobState.FAILED, reason="boom", final_step=17, restarts=1, wall_time_s=10.0,
              productive_s=8.0, goodput=0.8, checkpoint_stall_s=0.1, restore_s=0.2, recomputed_s=0.3,
              detection_s=0.4, restart_s=0.5, rendezvous_s=0.6, startup_s=0.7, metrics={"loss": 1.5}, log_dir="/x",
              failures=(FailureRecord(time_s=5.0, round=1, node_id=1, rank=4, local_rank=0, exit_code=-9,
                                      signal="SIGKILL", step=12, last_committed_step=10, action="restarted"),)),
]


def _wire(message):
    """``message`` as the other side receives it: encoded, through JSON text."""
    return json.loads(json.dumps(encode(message)))


def test_every_endpoint_has_an_example():
    classes = {type(m) for m in EXAMPLES}
    for endpoint in ENDPOINTS.values():
        assert endpoint.answer in classes and (endpoint.request is None or endpoint.request in classes), endpoint


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_a_message_comes_back_equal_through_json(message):
    assert decode(type(message), _wire(message)) == message


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_fields_from_a_newer_peer_are_ignored(message):
    data = {**_wire(message), "added_in_a_later_version": {"x": 1}}
    assert decode(type(message), data) == message


def _required(cls: type) -> list[str]:
    return [a.name for a in attrs.fields(cls) if a.default is attrs.NOTHING]


@pytest.mark.parametrize("message", [m for m in EXAMPLES if _required(type(m))], ids=lambda m: type(m).__name__)
def test_a_missing_required_field_is_named(message):
    for name in _required(type(message)):
        data = _wire(message)
        del data[name]
        with pytest.raises(ProtocolError, match=rf"malformed {type(message).__name__}: .*\$\.{name}\b"):
            decode(type(message), data)


def test_a_field_of_the_wrong_type_is_named():
    with pytest.raises(ProtocolError, match=r"malformed Join: .*\$\.nproc"):
        decode(Join, {"node_id": 1, "nproc": "four"})
    with pytest.raises(ProtocolError, match=r"malformed FailureReport: .*failures"):
        decode(FailureReport, {"node_id": 1, "round": 0, "failures": [{"rank": "zero"}]})
    with pytest.raises(ProtocolError, match="malformed RoundAssignment: .*state"):
        decode(RoundAssignment, {"state": "dancing"})


def test_the_wire_keeps_the_field_names():
    """JSON keys are the field names; int keys become strings (JSON's only kind) and back."""
    beat = _wire(HEARTBEAT)
    assert beat["workers"] == {"4": 1001, "5": 1002} and beat["saves"] == {"4": [10, 15]}
    assert _wire(ActionAnswer(action=Action.RESTART)) == {"action": "restart", "fenced": False}


def test_a_bool_comes_back_a_bool_and_a_non_bool_is_refused():
    decoded = decode(NodeCheckResult, {"ok": False, "local_ok": True})
    assert decoded.ok is False and decoded.local_ok is True
    with pytest.raises(ProtocolError, match="ok"):
        decode(NodeCheckResult, {"ok": "yes"})


def test_a_failure_says_what_kind_it_was():
    assert WorkerFailure.exited(rank=0, local_rank=0, exit_code=-9).kind == "signal"
    assert WorkerFailure.exited(rank=0, local_rank=0, exit_code=3).kind == "exit"
    assert WorkerFailure.exited(rank=0, local_rank=0, exit_code=1, exception=EXCEPTION).kind == "exception"
    assert WorkerException(exc_type="E", step=-1).raised_before_first_step()
    assert not WorkerException(exc_type="E", step=-1, before_first_step=False).raised_before_first_step()


# ----- the server and the client ------------------------------------------------------------------


@pytest.fixture
def served(workdir):
    (workdir / "t.py").write_text("")
    job = Job(name="p", entrypoint="t.py", nodes=Nodes(min=1, max=1), failure=Failure(heartbeat_interval_s=0.2))
    ports = iter(range(5000, 6000))
    master = JobMaster(job, "job-p", store_host="127.0.0.1", store_factory=lambda: (next(ports), None),
                       log_dir=workdir)
    server = MasterServer(master, "127.0.0.1", 0)
    server.start()
    client = MasterClient(f"127.0.0.1:{server.port}", addr_file="",
                          retrying=lambda: rpc_retrying(attempts=2, max_total_s=2.0))
    try:
        yield master, server, client
    finally:
        client.close()
        server.stop()


def test_the_server_answers_400_to_a_malformed_body(served):
    """A missing field or one of the wrong type is refused with the message and field
    named; nothing of the master changes."""
    master, server, _ = served
    url = f"http://127.0.0.1:{server.port}/v1"
    missing = httpx.post(f"{url}/join", json={"node_id": 0})
    assert missing.status_code == 400 and "malformed Join" in missing.json()["error"]
    assert "nproc" in missing.json()["error"]
    wrong = httpx.post(f"{url}/heartbeat", json={"node_id": 0, "round": "first"})
    assert wrong.status_code == 400 and "malformed Heartbeat" in wrong.json()["error"]
    assert "round" in wrong.json()["error"]
    not_json = httpx.post(f"{url}/failure", content=b"{oops", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and "malformed FailureReport" in not_json.json()["error"]
    assert master.nodes == {} and master.failures == []


def test_the_client_speaks_every_agent_call_to_the_server(served):
    """One node's life through MasterClient: typed requests, typed answers."""
    master, _, client = served
    registered = client.register(Register(node_id=0, host="vm", pid=42))
    assert registered == Registered(action=Action.NONE, job_id="job-p", token=1)
    assert client.join(Join(node_id=0, nproc=2, token=1)) == Joined(action=Action.NONE, round=0)
    master.tick()
    ready = client.poll(Poll(node_id=0, token=1))
    assert (ready.state, ready.round, ready.world_size, ready.store_port) == (PollState.READY, 0, 2, 5000)
    beat = client.heartbeat(Heartbeat(node_id=0, round=0, workers={0: 100, 1: 101}, steps={0: 3},
                                      records=(StepRecord(step=3, rank=0, dt_s=0.1, metrics={"loss": 2.0}),),
                                      pid=42, token=1))
    assert beat == HeartbeatAnswer(action=Action.NONE)
    status = client.status()
    assert (status.state, status.step, status.metrics, status.node_table[0].workers) == (
        JobState.RUNNING, 3, {"loss": 2.0}, {0: 100, 1: 101})
    answer = client.failure(FailureReport(node_id=0, round=0, token=1, failures=(
        WorkerFailure.exited(rank=1, local_rank=1, exit_code=-9),)))
    assert answer.action == Action.RESTART
    assert client.cancel(Cancel(reason="enough")).action == Action.STOP
    result = client.result()
    assert result.state == JobState.CANCELLED and result.reason == "enough"
    assert (result.failures[0].rank, result.failures[0].signal) == (1, "SIGKILL")
    assert client.exited(Exited(node_id=0, token=1)).action == Action.STOP


def test_a_replaced_agent_is_answered_fenced_and_changes_nothing(served):
    master, _, client = served
    client.register(Register(node_id=0, host="vm", pid=42))
    client.register(Register(node_id=0, host="vm", pid=43))  # a new agent for node 0: token 2
    assert client.heartbeat(Heartbeat(node_id=0, token=1)) == HeartbeatAnswer(action=Action.STOP, fenced=True)
    fenced = client.poll(Poll(node_id=0, token=1))
    assert (fenced.state, fenced.action, fenced.fenced) == (PollState.STOP, Action.STOP, True)
    assert client.checkpoint_shard(ShardReport(node_id=0, rank=0, step=1, world_size=1, token=1)).fenced
    assert client.exited(Exited(node_id=0, token=1)).fenced
    assert master.nodes[0].state == "registered"  # the stale agent's exit changed nothing


def test_a_request_the_master_refuses_raises_with_its_reason(served):
    _, _, client = served
    with pytest.raises(DLRoverError, match="does not coordinate checkpoints"):
        client.restore_plan(RestorePlanRequest(round=0, rank=0, world_size=1))


# ----- the restore agreement: a long poll ---------------------------------------------------------


@pytest.fixture
def agreeing(workdir, monkeypatch):
    """A served master with checkpoint storage; ``calls`` counts the restore calls it handles."""
    from dlrover_core.storage.posix import PosixStorage

    (workdir / "t.py").write_text("")
    job = Job(name="p", entrypoint="t.py", nodes=Nodes(min=2, max=2))
    master = JobMaster(job, "job-p", store_host="127.0.0.1", store_factory=lambda: (5000, None), log_dir=workdir,
                       storage=PosixStorage(str(workdir / "ck")))
    calls = {"restore_plan": 0, "restore_verify": 0}

    def counting(name):
        method = getattr(master, name)

        def counted(message):
            calls[name] += 1
            return method(message)
        return counted

    for name in calls:
        monkeypatch.setattr(master, name, counting(name))
    server = MasterServer(master, "127.0.0.1", 0)
    server.start()
    clients = [MasterClient(f"127.0.0.1:{server.port}", addr_file="") for _ in range(2)]
    try:
        yield server, clients, calls
    finally:
        for client in clients:
            client.close()
        server.stop()


def _in_thread(call):
    """Run ``call()`` in a thread; the returned function joins it and gives (answer, when)."""
    import threading
    import time

    out = []
    thread = threading.Thread(target=lambda: out.append((call(), time.monotonic())))
    thread.start()
    return lambda: (thread.join(10), out[0])[1]


def test_a_rank_waiting_for_the_restore_decision_is_held_not_polling(agreeing):
    """The first rank to ask for the restore decision is held by the master (a long poll)
    and answered as soon as the last rank reports: one request however long it waits (the
    master asks itself once more when woken), not one every few milliseconds; the same for
    verifying a storage step."""
    import time

    _, (first, last), calls = agreeing
    waiter = _in_thread(lambda: first.restore_plan(RestorePlanRequest(round=0, rank=0, world_size=2)))
    time.sleep(0.5)  # rank 1 is late (still importing torch, say)
    decided = last.restore_plan(RestorePlanRequest(round=0, rank=1, world_size=2))
    answered_at = time.monotonic()
    held, woken_at = waiter()
    assert decided == held == RestoreDecision(state="ready", source="fresh", step=None)
    assert woken_at - answered_at < 0.25
    assert calls["restore_plan"] == 3  # rank 0: asked, woken and asked again (one request); rank 1: once

    waiter = _in_thread(lambda: first.restore_verify(RestoreVerify(round=0, rank=0, world_size=2, step=7, ok=True)))
    time.sleep(0.5)
    assert last.restore_verify(RestoreVerify(round=0, rank=1, world_size=2, step=7, ok=True)).state == "ok"
    held, _ = waiter()
    assert held == RestoreVerifyAnswer(state="ok", step=7) and calls["restore_verify"] == 3


def test_a_held_restore_call_is_answered_waiting_when_its_hold_ends(agreeing, monkeypatch):
    """Alone, a rank is answered ``waiting`` after the hold time (the client's long-poll
    timeout covers it) and asks again; the master handled its call once per hold."""
    import time

    from dlrover_core.master import server as server_module

    monkeypatch.setattr(server_module, "POLL_HOLD_MAX_S", 0.3)
    _, (first, _), calls = agreeing
    t0 = time.monotonic()
    answer = first.restore_plan(RestorePlanRequest(round=0, rank=0, world_size=2))
    assert answer.state == "waiting" and 0.25 <= time.monotonic() - t0 < 2.0
    assert calls["restore_plan"] <= 2  # asked, and perhaps once more if something else woke it
    assert ENDPOINTS["restore_plan"].held and ENDPOINTS["restore_verify"].held and ENDPOINTS["poll"].held


@pytest.fixture
def silent_master():
    """A port that accepts connections and never answers (a master whose host hangs)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield "127.0.0.1:%d" % sock.getsockname()[1]
    finally:
        sock.close()


def test_a_client_given_up_on_its_master_stops_retrying(silent_master):
    """An agent that declared its master lost must not wait out the retry policy's patience
    (30 s by default) in a call of its main thread: the call in flight ends after its
    current attempt, and a new call is not sent at all."""
    given_up = threading.Event()
    client = MasterClient(silent_master, timeout_s=0.5, addr_file="")  # default patience: 30 s
    client.give_up_when(given_up)
    threading.Timer(1.0, given_up.set).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(MasterUnavailableError, match="heartbeat"):
            client.heartbeat(HEARTBEAT)
        assert time.monotonic() - t0 < 10.0  # (not the policy's 30 s)
        with pytest.raises(MasterUnavailableError, match="given up"):
            client.heartbeat(HEARTBEAT)
    finally:
        client.close()
