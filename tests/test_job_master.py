"""JobMaster decisions, driven directly (no network): restart budget, rounds, goodput."""

from __future__ import annotations

import json
import random

import pytest

from dlrover_core import Failure, Job, JobState, Nodes
from dlrover_core.master.failures import signal_name
from dlrover_core.master.goodput import GoodputTracker
from dlrover_core.master.job_master import JobMaster
from dlrover_core.protocol import (
    Action,
    AssignNode,
    Cancel,
    Exited,
    FailureReport,
    Heartbeat,
    Join,
    Poll,
    Register,
    Succeeded,
    WorkerFailure,
)
from dlrover_core.protocol.progress import CheckpointRecord, RestoreRecord, StepRecord


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def master(workdir):
    (workdir / "t.py").write_text("")
    job = Job(name="m", entrypoint="t.py", nodes=Nodes(min=2, max=2), failure=Failure(max_restarts=1, heartbeat_timeout_s=30))
    ports = iter(range(5000, 6000))
    clock = Clock()
    events = []
    m = JobMaster(job, "job-1", store_host="127.0.0.1", store_factory=lambda: (next(ports), None),
                  log_dir=workdir, emit=events.append, clock=clock)
    m.clock, m.events = clock, events
    return m


def form_round(m):
    for n in (0, 1):
        m.register(Register(node_id=n, host="h", pid=100 + n))
        m.join(Join(node_id=n, nproc=1))
    return [m.poll(Poll(node_id=n)) for n in (0, 1)]


def fail(m, node_id, round_index, rank, exit_code):
    """Node ``node_id`` reports its worker ``rank`` exited with ``exit_code``."""
    return m.failure(FailureReport(node_id=node_id, round=round_index, failures=(
        WorkerFailure.exited(rank=rank, local_rank=0, exit_code=exit_code),)))


def beat(m, node_id, round_index):
    return m.heartbeat(Heartbeat(node_id=node_id, round=round_index))


def test_round_assigns_ranks_and_fresh_store(master):
    w0, w1 = form_round(master)
    assert (w0.state, w0.node_rank, w0.rank_offset, w0.world_size) == ("ready", 0, 0, 2)
    assert (w1.node_rank, w1.rank_offset) == (1, 1)
    assert w0.store_port == 5000
    assert master.state == JobState.RUNNING


def test_failure_restarts_everyone_once_per_round(master):
    """The first failure of a round uses one restart; its consequences on other nodes do not."""
    form_round(master)
    a = fail(master, 1, 0, rank=1, exit_code=-9)
    assert a.action == "restart" and master.restarts == 1
    assert beat(master, 0, 0).action == "restart"
    b = fail(master, 0, 0, rank=0, exit_code=1)
    assert b.action == "restart" and master.restarts == 1
    w0, w1 = form_round(master)
    assert w0.round == 1 and w0.store_port == 5001 and w0.restart_count == 1
    assert beat(master, 0, 1).action == "none"
    rec = master.result().failures[0]
    assert (rec.rank, rec.signal, rec.exit_code) == (1, "SIGKILL", -9)


def test_a_worker_failing_after_the_job_was_cancelled_is_no_failure_of_the_job(master):
    """A cancel stops the nodes a heartbeat apart: a worker whose peer was stopped first
    fails in its collective. That report is answered "stop", named for what it is, and kept
    out of the result (it used to be listed as "round 0 was already being restarted")."""
    form_round(master)
    master.cancel(Cancel(reason="cancelled by the user"))
    answer = fail(master, 1, 0, rank=1, exit_code=1)
    assert answer.action == "stop" and master.restarts == 0
    result = master.result()
    assert result.state == JobState.CANCELLED and result.failures == ()
    events = [json.loads(line) for line in (master.log_dir / "events.jsonl").read_text().splitlines()]
    late = [e for e in events if e["kind"] == "worker_failed"]
    assert len(late) == 1 and late[0]["action"] == "none: the job had already ended CANCELLED"


def test_exhausted_budget_fails_with_reason(master):
    form_round(master)
    fail(master, 1, 0, rank=1, exit_code=-9)
    form_round(master)
    a = fail(master, 0, 1, rank=0, exit_code=3)
    assert a.action == "stop"
    result = master.result()
    assert result.state == JobState.FAILED
    assert "max_restarts=1" in result.reason and "exit code 3" in result.reason


def test_success_needs_every_node_of_the_round(master):
    form_round(master)
    assert master.succeeded(Succeeded(node_id=0, round=0)).action == "none"
    assert master.state == JobState.RUNNING
    assert master.succeeded(Succeeded(node_id=1, round=0)).action == "stop"
    assert master.state == JobState.SUCCEEDED
    assert not master.drained()
    master.exited(Exited(node_id=0))
    master.exited(Exited(node_id=1))
    assert master.drained()


def test_silent_node_is_declared_dead(master):
    form_round(master)
    master.clock.t += 31
    beat(master, 0, 0)
    master.tick()
    assert master.nodes[1].state == "dead"
    assert master.state == JobState.FAILED and "node 1 lost" in master.reason


def test_rendezvous_timeout(master):
    master.register(Register(node_id=0, host="h", pid=1))
    master.join(Join(node_id=0, nproc=1))
    master.clock.t += 601
    beat(master, 0, -1)
    master.tick()
    assert master.state == JobState.FAILED and "timed out" in master.reason


def test_events_are_journaled(master, workdir):
    form_round(master)
    fail(master, 1, 0, rank=1, exit_code=-9)
    kinds = [json.loads(line)["kind"] for line in (workdir / "events.jsonl").read_text().splitlines()]
    assert kinds == ["rendezvous_completed", "worker_failed", "workers_restarted"]
    assert [e.kind for e in master.events] == kinds


def test_goodput_counts_each_kept_step_once():
    """Steps after the last restore point become recomputed time; stalls are separate."""
    g = GoodputTracker()
    for s in range(6):
        g.add(StepRecord(step=s, dt_s=1.0))
    g.add(CheckpointRecord(step=3, stall_s=0.5))
    g.committed(3)
    g.add(RestoreRecord(step=3, source="storage", load_s=0.25))
    for s in range(4, 8):
        g.add(StepRecord(step=s, dt_s=1.0))
    assert g.productive_s == 8.0 and g.recomputed_s == 2.0
    assert g.checkpoint_stall_s == 0.5 and g.restore_s == 0.25 and g.last_committed_step == 3


def test_goodput_orders_rank0_records_by_live_generation():
    """Rank 0 moves to another node when the live world re-forms; that node's agent may forward
    the new generation's records before the old node's last ones. A late record of an older
    generation is productive unless the newer generation trained its step again."""
    g = GoodputTracker()
    for s in range(28):  # generation 0, rank 0 on node 0 (the one killed after step 27)
        g.add(StepRecord(step=s, dt_s=1.0))
    g.add(StepRecord(step=31, dt_s=1.0, generation=2))  # the replacement, rank 0 again
    for s in (28, 29, 30):  # the survivor's generation-1 records, forwarded later
        g.add(StepRecord(step=s, dt_s=1.0, generation=1))
    assert g.recomputed_s == 0 and g.productive_s == 32.0

    redo = GoodputTracker()  # the survivor's step 27 failed and was trained again at generation 1
    for s in range(28):
        redo.add(StepRecord(step=s, dt_s=1.0))
    redo.add(StepRecord(step=27, dt_s=2.0, generation=1))
    assert redo.recomputed_s == 1.0 and redo.productive_s == 29.0
    late = GoodputTracker()  # the same, with generation 0's record of step 27 arriving last
    for s in range(27):
        late.add(StepRecord(step=s, dt_s=1.0))
    late.add(StepRecord(step=27, dt_s=2.0, generation=1))
    late.add(StepRecord(step=27, dt_s=1.0))
    assert late.recomputed_s == 1.0 and late.productive_s == 29.0


@pytest.mark.parametrize("seed", range(100))
def test_goodput_is_independent_of_how_nodes_interleave(seed):
    """Seeded: each generation's records come in order (one agent forwards them), the
    generations interleave at random. Productive and recomputed time do not change."""
    rng = random.Random(seed)
    generations, step = [], 0
    for gen in range(rng.randint(2, 5)):
        n = rng.randint(1, 6)
        redo = rng.random() < 0.5 and step > 0  # the step in flight failed and is trained again
        first = step - 1 if redo else step
        generations.append([StepRecord(step=s, dt_s=rng.choice((0.5, 1.0, 2.0)), generation=gen)
                            for s in range(first, first + n)])
        step = first + n
    in_order = GoodputTracker()
    for records in generations:
        for r in records:
            in_order.add(r)
    queues = [list(records) for records in generations]
    shuffled = GoodputTracker()
    while any(queues):
        shuffled.add(rng.choice([q for q in queues if q]).pop(0))
    assert shuffled.productive_s == pytest.approx(in_order.productive_s)
    assert shuffled.recomputed_s == pytest.approx(in_order.recomputed_s)
    assert len(in_order._pending) == step


def test_signal_names():
    assert signal_name(-9) == "SIGKILL" and signal_name(137) == "SIGKILL"
    assert signal_name(1) is None and signal_name(None) is None


# ----- recovery without stopping (docs/design.md §5a) ------------------------------------------------


class FakeStore:
    """The round store's ``set`` (the master raises the live world's grow flag with it)."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value


def live_master(workdir, **failure):
    (workdir / "t.py").write_text("")
    job = Job(name="m", entrypoint="t.py", nodes=Nodes(min=2, max=2),
              failure=Failure(**{"max_restarts": 5, "heartbeat_timeout_s": 30, **failure}))
    ports = iter(range(5000, 6000))
    clock = Clock()
    m = JobMaster(job, "job-1", store_host="127.0.0.1", store_factory=lambda: (next(ports), FakeStore()),
                  log_dir=workdir, clock=clock)
    m.clock = clock
    form_round(m)
    return m


def ready(m, node_id):
    from dlrover_core.protocol import LiveReform

    return m.live_reform(LiveReform(node_id=node_id, local_rank=0, pid=100 + node_id, round=0, generation=0,
                                    reason="ready"))


def test_a_failed_worker_is_replaced_live_when_every_survivor_loops_with_train_steps(workdir):
    from dlrover_core.protocol import Action

    m = live_master(workdir)
    assert ready(m, 0).state == ready(m, 1).state == "ready"
    answer = fail(m, 1, 0, 1, -9)
    assert answer.action == Action.REPLACE
    record, counted = m.failures[-1]
    assert counted and record.recovery == "live" and record.action.startswith("live:")
    assert m.required_round == 0 and m.restarts == 1  # no new round: the survivors go on


def test_without_train_steps_every_worker_restarts_and_the_record_says_why(workdir):
    from dlrover_core.protocol import Action

    m = live_master(workdir)
    ready(m, 0)  # node 1's worker never reached train.steps()
    answer = fail(m, 0, 0, 0, -9)
    assert answer.action == Action.RESTART
    record, _ = m.failures[-1]
    assert record.recovery == "restart_all" and "not live" in record.action and "train.steps()" in record.action
    assert m.required_round == 1


def test_a_worker_told_by_the_live_world_that_every_worker_restarts_exits_without_a_failure(workdir):
    """A survivor whose live world closed asks for its place, hears "restart" and exits (1)
    on that order; its agent reports the exit, maybe before it heard of the new round. The
    report changes nothing and is no failure of the job; a peer's exit that nobody ordered
    still is listed (a consequence, not counted)."""
    from dlrover_core.protocol import LiveReform

    m = live_master(workdir)
    ready(m, 0)  # node 1's worker has not reached train.steps() yet: every worker restarts
    fail(m, 0, 0, 0, -9)
    assert m.required_round == 1 and len(m.failures) == 1
    answer = m.live_reform(LiveReform(node_id=1, local_rank=0, pid=101, round=0, generation=0, reason="error",
                                      error="Connection closed by peer"))
    assert answer.state == "restart"
    fail(m, 1, 0, 1, 1)  # it exited as told
    assert len(m.failures) == 1, m.failures
    events = [json.loads(line) for line in (m.log_dir / "events.jsonl").read_text().splitlines()]
    assert [e["action"] for e in events if e["kind"] == "worker_failed"][-1] == "none: round 0 was already being restarted"
    fail(m, 0, 0, 0, 1)  # not told: a consequence, listed (not counted)
    assert len(m.failures) == 2 and not m.failures[-1][1]


def test_a_restarted_master_still_knows_whom_the_live_world_sent_away(workdir):
    """The master's snapshot carries the workers told to end: after a master restart, the
    exit of one told "restart" before it is still no failure."""
    from dlrover_core.protocol import LiveReform

    m = live_master(workdir)
    ready(m, 0)
    fail(m, 0, 0, 0, -9)
    assert m.live_reform(LiveReform(node_id=1, local_rank=0, pid=101, round=0, generation=0, reason="error",
                                    error="Connection closed by peer")).state == "restart"
    snap = json.loads(json.dumps(m.snapshot()))
    assert snap["live_sent_away"] == [[0, 1, 0]]
    (workdir / "m2").mkdir()
    (workdir / "m3").mkdir()
    m2 = JobMaster(m.job, "job-1", store_host="127.0.0.1", store_factory=lambda: (7000, FakeStore()),
                   log_dir=workdir / "m2", clock=m.clock)
    m2.restore(snap)
    assert m2.livework.sent_away(0, 1, 0) and not m2.livework.sent_away(0, 0, 0)
    del snap["live_sent_away"]  # a journal from before it
    m3 = JobMaster(m.job, "job-1", store_host="127.0.0.1", store_factory=lambda: (7001, FakeStore()),
                   log_dir=workdir / "m3", clock=m.clock)
    m3.restore(snap)
    assert not m3.livework.sent_away(0, 1, 0)


def test_live_recovery_off_or_sharded_state_without_memory_restarts_every_worker(workdir):
    m = live_master(workdir, live_recovery=False)
    assert m.live is None and m.live_why == "failure.live_recovery=False"
    (workdir / "t.py").write_text("")
    from dlrover_core import Checkpoint, Parallel

    job = Job(name="m", entrypoint="t.py", nodes=2, parallel=Parallel(["fsdp"]))
    sharded = JobMaster(job, "job-2", store_host="h", store_factory=lambda: (1, FakeStore()), clock=Clock())
    assert sharded.live_why == "" and sharded.livework.sharded
    job = Job(name="m", entrypoint="t.py", nodes=2, parallel=Parallel(["fsdp"]), checkpoint=Checkpoint(memory_every_steps=0))
    sharded = JobMaster(job, "job-4", store_host="h", store_factory=lambda: (1, FakeStore()), clock=Clock())
    assert "'fsdp' shards the training state and checkpoint.memory_every_steps=0" in sharded.live_why
    replicated = Job(name="m", entrypoint="t.py", nodes=2, parallel=Parallel([("checkpoint", {"wrap_class": "Block"}), "ddp", "amp"]))
    assert JobMaster(replicated, "job-3", store_host="h", store_factory=lambda: (1, FakeStore()),
                     clock=Clock()).live_why == ""


def test_node_failures_count_within_a_window(workdir):
    m = live_master(workdir, max_node_failures=2, node_failure_window_s=60)
    ready(m, 0)
    ready(m, 1)
    fail(m, 1, 0, 1, -9)
    m.clock.t += 120  # the first failure is forgiven by now
    ready_again = m.nodes[1]
    fail(m, 1, 0, 1, -9)
    assert ready_again.state != "excluded" and m.nodes[1].failures == 2
    m.clock.t += 10
    fail(m, 1, 0, 1, -9)  # two within 60 s
    assert m.nodes[1].state == "excluded"


def test_a_step_written_only_at_a_breakpoint_on_some_nodes_does_not_fail_the_job(tmp_path):
    """After a failure each node persists what memory holds on its own schedule; a step
    written that way by some ranks only (none saved it for storage) is no misuse. A step
    saved for storage that misses a rank still is."""
    from dlrover_core.master.checkpoints import CheckpointCoordinator
    from dlrover_core.protocol import ShardReport
    from dlrover_core.storage.posix import PosixStorage

    c = CheckpointCoordinator(PosixStorage(str(tmp_path)), keep_last=2, event=lambda *a, **k: None)
    c.shard_done(ShardReport(node_id=0, rank=0, step=19, world_size=2, round=1, due=False))
    assert c.final_problem() is None
    c.shard_done(ShardReport(node_id=0, rank=0, step=20, world_size=2, round=1))
    assert "rank(s) [1] never saved it" in c.final_problem()


def test_assign_node_is_idempotent_per_launcher_and_refuses_another_job(master):
    """``dlrover run`` on each host asks for its node id: the same launcher key always gets
    the same id (a retried call, a restarted agent); new keys get ids past every known node
    while the job has fewer than ``nodes.max`` (2 here); past that a host gets no id yet
    (-1, no action: it asks again)."""
    master.register(Register(node_id=0, host="h", pid=100))  # a host given --node-rank 0
    first = master.assign_node(AssignNode(key="hostA:11"))
    assert first.node_id == 1 and first.job_id == "job-1"
    second = master.assign_node(AssignNode(key="hostB:12", rdzv_id="job-1"))
    assert (second.node_id, second.action) == (-1, Action.NONE) and "nodes.max=2" in second.reason
    assert master.assign_node(AssignNode(key="hostA:11")).node_id == 1
    other = master.assign_node(AssignNode(key="hostC:13", rdzv_id="job-9"))
    assert other.action == Action.STOP and other.node_id == -1
    assert "runs job 'job-1', not 'job-9'" in other.reason and "--rdzv-id" in other.reason
    master.cancel(Cancel(reason="done"))
    late = master.assign_node(AssignNode(key="hostD:14"))
    assert late.action == Action.STOP and "already ended CANCELLED" in late.reason


def test_a_new_host_stands_in_for_a_host_lost_in_silence_and_only_for_that(workdir):
    """``dlrover run`` on each host: when a host dies with its launcher (silence, no report),
    ``dlrover run`` started on a new host takes the lost node's id (its ranks, its shards, its
    replicas at the buddy), as a scheduler's relaunch would; the dead host's launcher, should
    it come back, gets a new id. A node whose agent alone died (its launcher reported it and
    restarts it) keeps its id for its own launcher: a new host gets a new id."""
    (workdir / "t.py").write_text("")
    job = Job(name="m", entrypoint="t.py", nodes=Nodes(min=2, max=3),
              failure=Failure(max_restarts=5, heartbeat_timeout_s=30))
    clock = Clock()
    m = JobMaster(job, "job-1", store_host="127.0.0.1", store_factory=lambda: (5000, None), log_dir=workdir,
                  clock=clock, relaunch=lambda request: None)  # (dlrover run: the launchers relaunch)
    ids = [m.assign_node(AssignNode(key=k)).node_id for k in ("hostA:1", "hostB:2")]
    assert ids == [0, 1]
    for n in ids:
        m.register(Register(node_id=n, host="h", pid=100 + n))
    # host B's agent dies, its launcher says so at once: that launcher restarts it as node 1
    m.failure(FailureReport(node_id=1, round=-1, failures=(WorkerFailure(kind="node_lost", detail="seen by its launcher"),)))
    assert m.nodes[1].state == "dead" and 1 in m.book.relaunching
    assert m.assign_node(AssignNode(key="hostC:3")).node_id == 2  # room for a third node
    m.register(Register(node_id=2, host="h", pid=102))
    waiting = m.assign_node(AssignNode(key="hostD:4"))  # 3 = nodes.max, node 1 awaited from its launcher
    assert waiting.node_id == -1 and waiting.action == Action.NONE
    # host C falls silent (the machine died, launcher and all)
    clock.t += 31
    m.heartbeat(Heartbeat(node_id=0, round=-1))
    m.register(Register(node_id=1, host="h", pid=201))  # (host B's launcher restarted its agent)
    m.tick()
    assert m.nodes[2].state == "dead" and 2 in m.book.relaunching  # awaited: its launcher is gone too
    assert m.assign_node(AssignNode(key="hostD:4")).node_id == 2  # stands in for node 2
    assert m.assign_node(AssignNode(key="hostD:4")).node_id == 2
    assert m.assign_node(AssignNode(key="hostC:3")).node_id == -1  # the old host, back: no place now
    assert m.assign_node(AssignNode(key="hostB:2")).node_id == 1  # its launcher kept its id
    # a relaunch its launcher never answers (it gave up): the next new host stands in too
    m.failure(FailureReport(node_id=1, round=-1, failures=(WorkerFailure(kind="node_lost", detail="seen by its launcher"),)))
    assert m.assign_node(AssignNode(key="hostF:6")).node_id == -1
    clock.t += 31
    for n in (0, 2):
        m.heartbeat(Heartbeat(node_id=n, round=-1))
    m.register(Register(node_id=2, host="h", pid=302))
    m.tick()
    assert m.assign_node(AssignNode(key="hostF:6")).node_id == 1


def test_an_id_whose_agent_never_registered_is_given_to_the_next_host(master):
    """A launcher that got an id and died before its agent registered does not keep the job
    full for ever: after the heartbeat timeout (30 s) the next host takes that id."""
    assert master.assign_node(AssignNode(key="hostA:1")).node_id == 0
    master.register(Register(node_id=0, host="h", pid=100))
    assert master.assign_node(AssignNode(key="hostB:2")).node_id == 1  # never registers
    assert master.assign_node(AssignNode(key="hostC:3")).node_id == -1  # nodes.max=2: full
    master.clock.t += 29
    assert master.assign_node(AssignNode(key="hostC:3")).node_id == -1
    master.clock.t += 2
    assert master.assign_node(AssignNode(key="hostC:3")).node_id == 1
    assert master.assign_node(AssignNode(key="hostB:2")).node_id == -1  # came back late: no place


@pytest.mark.parametrize("seed", range(40))
def test_hosts_asking_for_ids_never_share_a_live_node_seeded(workdir, seed):
    """Seeded schedules of ``dlrover run`` hosts (new hosts asking, agents registering,
    launcher-reported agent deaths, hosts falling silent, dead hosts' launchers coming back,
    time passing). Invariants after every step: an id is handed to a new launcher only when
    its node is not live under another launcher (gone or awaited, or its agent never
    registered within the heartbeat timeout); no more than ``nodes.max`` ids are held by
    live nodes; a launcher asking again gets its id again unless it was taken over."""
    (workdir / "t.py").write_text("")
    rng = random.Random(seed)
    job = Job(name="m", entrypoint="t.py", nodes=Nodes(min=1, max=3),
              failure=Failure(max_restarts=50, heartbeat_timeout_s=30, max_node_failures=100))
    clock = Clock()
    m = JobMaster(job, "job-1", store_host="127.0.0.1", store_factory=lambda: (5000, None), log_dir=workdir,
                  clock=clock, relaunch=lambda request: None)
    owner: dict[int, str] = {}  # node id -> the launcher key it was last handed to
    alive: set[str] = set()  # launchers whose agent registered and beats
    keys = [f"host{i}:{i}" for i in range(6)]
    for _ in range(120):
        op = rng.choice(("ask", "ask", "register", "agent_died", "host_died", "time"))
        key = rng.choice(keys)
        if op == "ask":
            before = {n: (m.nodes[n].state if n in m.nodes else None) for n in owner}
            got = m.assign_node(AssignNode(key=key)).node_id
            if got < 0:
                continue
            previous = owner.get(got)
            if previous is not None and previous != key:  # a take-over: the node was not live
                assert previous not in alive or before[got] in (None, "dead", "exited", "excluded"), (seed, got, before)
                alive.discard(previous)
            owner[got] = key
        elif op == "register":
            mine = [n for n, k in owner.items() if k == key]
            if mine:
                m.register(Register(node_id=mine[0], host="h", pid=rng.randrange(1000)))
                alive.add(key)
        elif op == "agent_died":
            mine = [n for n, k in owner.items() if k == key and k in alive]
            if mine:
                m.failure(FailureReport(node_id=mine[0], round=-1, failures=(
                    WorkerFailure(kind="node_lost", detail="seen by its launcher"),)))
                alive.discard(key)
        elif op == "host_died":
            alive.discard(key)  # silent from now on
        else:
            clock.t += rng.choice((1.0, 10.0, 31.0))
            for k in alive:
                for n in [n for n, o in owner.items() if o == k]:
                    m.heartbeat(Heartbeat(node_id=n, round=-1))
            m.tick()
        live = [n for n, rec in m.nodes.items() if not rec.gone]
        assert len(live) <= job.nodes.max, (seed, live)
        assert len(set(owner.values())) == len(owner), (seed, owner)  # no launcher holds two ids


def test_a_second_agent_of_a_running_node_restarts_the_round_not_counted(master):
    """A relaunch issued twice starts two agents for one node: the later one registers after
    the earlier one ran the round. The earlier one is fenced, so the round cannot go on
    without it: every node restarts into the next round (a membership change, not counted),
    where the new agent is expected, instead of the new agent waiting for a round never formed."""
    form_round(master)
    master.register(Register(node_id=1, host="h", pid=201))
    assert master.required_round == 1 and master.restarts == 0
    assert beat(master, 0, 0).action == "restart"
    change = [e for e in master.events if e.kind == "membership_changed"]
    assert len(change) == 1 and "node 1 has a new agent (pid 201)" in change[0].data["reason"], change
    for n in (0, 1):
        master.join(Join(node_id=n, nproc=1))
    assert [master.poll(Poll(node_id=n)).state for n in (0, 1)] == ["ready", "ready"]
    # a register of a node that is not running a round changes nothing
    master.register(Register(node_id=1, host="h", pid=202))
    assert master.required_round == 2  # it was running round 1: restarted again
    master.register(Register(node_id=1, host="h", pid=203))
    assert master.required_round == 2  # waiting for round 2, not running it: no new round


class _Agent:
    """One incarnation of a node's agent, as the agent's loop speaks to the master: it
    registers, joins, polls until placed (joining again when answered ``rejoin``), then
    heartbeats its round and restarts (joins again) when told to; a fenced one stops."""

    def __init__(self, m, node_id: int, pid: int) -> None:
        self.m, self.node_id = m, node_id
        self.token = m.register(Register(node_id=node_id, host="h", pid=pid)).token
        self.round, self.stopped = None, False  # the round it runs (None: joining)
        self.m.join(Join(node_id=node_id, nproc=1, token=self.token))

    def act(self) -> None:
        if self.stopped or self.m.fenced(self.node_id, self.token):  # the server answers a fenced one stop
            self.stopped = True
            return
        if self.round is None:
            answer = self.m.poll(Poll(node_id=self.node_id, token=self.token))
            if answer.action == "stop":
                self.stopped = True
            elif answer.state == "ready":
                self.round = answer.round
            elif answer.state == "rejoin":  # the master does not know it waits: join again
                self.m.join(Join(node_id=self.node_id, nproc=1, token=self.token))
            return
        answer = self.m.heartbeat(Heartbeat(node_id=self.node_id, round=self.round, token=self.token))
        if answer.action == "stop":
            self.stopped = True
        elif answer.action == "restart":
            self.round = None
            self.m.join(Join(node_id=self.node_id, nproc=1, token=self.token))


@pytest.mark.parametrize("seed", range(60))
def test_agent_incarnations_never_leave_the_job_without_a_round_seeded(master, seed):
    """Seeded schedules of two nodes' agents: at random moments a node gets a new agent (a
    relaunch, issued once or twice) while its earlier one may be joining, placed, or running;
    workers fail; time passes. The master is called as its server calls it (a fenced agent's
    call is answered stop, ``JobMaster.fenced``). Invariants: an agent replaced by a newer
    one is fenced; and once
    the schedule ends and the newest agents go on, within a bounded number of turns either
    the job ended or both newest agents run the same round, the newest one formed (no agent
    waits for a round that will never form)."""
    rng = random.Random(seed)
    m = master
    pid = iter(range(1000, 10_000))
    agents = {n: _Agent(m, n, next(pid)) for n in (0, 1)}
    fenced: list[_Agent] = []
    for _ in range(rng.randint(5, 40)):
        roll = rng.random()
        n = rng.randrange(2)
        if roll < 0.15:  # a new agent for node n; the old one is fenced from now on
            fenced.append(agents[n])
            agents[n] = _Agent(m, n, next(pid))
        elif roll < 0.22 and agents[n].round is not None:  # its worker fails
            a = agents[n]
            m.failure(FailureReport(node_id=n, round=a.round, token=a.token, failures=(
                WorkerFailure.exited(rank=n, local_rank=0, exit_code=1),)))
        elif roll < 0.32 and fenced:  # an old agent is still around: the server answers it stop
            old = rng.choice(fenced)
            assert m.fenced(old.node_id, old.token), seed
            old.act()
            assert old.stopped, seed
        else:
            agents[n].act()
        m.clock.t += rng.choice((0.0, 0.1, 1.0))
        m.tick()
    for _ in range(50):  # the newest agents go on; nothing else happens
        for a in agents.values():
            a.act()
        m.clock.t += 1.0
        m.tick()
        if m.state.is_terminal:
            return
        latest = m.rdzv.latest
        if latest is not None and all(a.round == latest.index for a in agents.values()):
            return
    raise AssertionError(f"seed {seed}: stuck: agents in rounds {[(a.round, a.stopped) for a in agents.values()]}, "
                         f"nodes {[(n.node_id, n.state, n.round) for n in m.nodes.values()]}, waiting {m.rdzv.waiting}, "
                         f"required {m.required_round}, latest {m.rdzv.latest and m.rdzv.latest.index}, "
                         f"state {m.state}")
