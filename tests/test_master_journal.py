"""The master's write-ahead journal: a master restarted from it loses nothing.

Fast tests drive JobMaster directly (no processes): each decision is in the journal before
its answer, and a second master built from the journal carries on. The slow ones run real
jobs, SIGKILL a worker (or an agent), and crash the master (``DLROVER_TEST_CRASH_AT``) right
after one journal point of that recovery; the job must still end with a result. The last
one is ``../shared/repro/master-port-taken``: the dead master's port is taken by another
process, and the restarted master must be found on another one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
from helpers import SCRIPTS, job_processes, wait_for

from dlrover_core import Checkpoint, Failure, Job, JobState, Nodes
from dlrover_core.errors import DLRoverError
from dlrover_core.master.job_master import JobMaster
from dlrover_core.master.journal import Journal
from dlrover_core.protocol import FailureReport, Heartbeat, Join, Joined, Poll, Register, Succeeded, WorkerFailure
from dlrover_core.protocol.progress import StepRecord


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Stores:
    """A fake store factory: fresh ports from 5000; ``reopen`` records the ports reopened."""

    def __init__(self, taken: bool = False) -> None:
        self.next = 5000
        self.reopened: list[int] = []
        self.taken = taken

    def make(self):
        self.next += 1
        return self.next - 1, None

    def reopen(self, port: int):
        if self.taken:
            raise OSError(98, "Address already in use")
        self.reopened.append(port)
        return object()


def job(workdir: Path, nodes=2, **failure) -> Job:
    (workdir / "t.py").write_text("")
    return Job(name="m", entrypoint="t.py", nodes=nodes,
               failure=Failure(**{"max_restarts": 3, "heartbeat_timeout_s": 30, **failure}))


def master(workdir: Path, j: Job, *, stores: Stores | None = None, clock: Clock | None = None,
           relaunch=None, restore: bool = False) -> JobMaster:
    """A JobMaster journaling to ``workdir/journal``; with ``restore``, resumed from it."""
    stores = stores or Stores()
    journal = Journal(workdir / "journal" / "master_journal.json")
    journal.path.parent.mkdir(exist_ok=True)
    m = JobMaster(j, "job-1", store_host="127.0.0.1", store_factory=stores.make, clock=clock or Clock(),
                  journal=journal, reopen_store=stores.reopen, relaunch=relaunch)
    if restore:
        snapshot, entries = journal.load()
        assert snapshot is not None
        m.restore(snapshot, entries)
    return m


def journaled(workdir: Path) -> dict:
    return json.loads((workdir / "journal" / "master_journal.json").read_text())


def pending_relaunches(workdir: Path) -> list[int]:
    """The relaunches a master restarted now would know were ordered (snapshot, then lines)."""
    snapshot, entries = Journal(workdir / "journal" / "master_journal.json", crash_at="").load()
    pending = set(snapshot["relaunching"])
    for entry in entries:
        (pending.add if entry["relaunching"] else pending.discard)(entry["node"]["node_id"])
    return sorted(pending)


def join_all(m: JobMaster, nodes=(0, 1)) -> None:
    for n in nodes:
        m.register(Register(node_id=n, host="h", pid=100 + n))
        m.join(Join(node_id=n, nproc=1))


# ----- fast: JobMaster and Journal -------------------------------------------------------------


def test_each_decision_is_journaled_before_its_answer(workdir):
    """No timer involved: the round (with its store's port) is in the journal as soon as it
    forms, the restart as soon as it is ordered."""
    m = master(workdir, job(workdir))
    join_all(m)
    snap = journaled(workdir)
    assert snap["round"] == {"index": 0, "node_ids": [0, 1], "nproc": [1, 1], "store_port": 5000}
    assert m.poll(Poll(node_id=0)).state == "ready" and m.poll(Poll(node_id=1)).state == "ready"
    sigkill = WorkerFailure.exited(rank=1, local_rank=0, exit_code=-9)
    assert m.failure(FailureReport(node_id=1, round=0, failures=(sigkill,))).action == "restart"
    snap = journaled(workdir)
    assert (snap["required_round"], snap["restarts"]) == (1, 1)


def test_heartbeats_write_nothing(workdir):
    m = master(workdir, job(workdir))
    join_all(m)
    m.poll(Poll(node_id=0)), m.poll(Poll(node_id=1))
    files = workdir / "journal"
    before = {p.name: p.stat().st_mtime_ns for p in files.iterdir()}
    sizes = {p.name: p.stat().st_size for p in files.iterdir()}
    for i in range(500):
        m.heartbeat(Heartbeat(node_id=i % 2, round=0, steps={i % 2: i}, records=(StepRecord(step=i, dt_s=0.01),)))
    assert {p.name: p.stat().st_mtime_ns for p in files.iterdir()} == before
    assert {p.name: p.stat().st_size for p in files.iterdir()} == sizes


def test_restarted_master_reopens_the_round_it_formed(workdir):
    """The master died right after forming a round, before telling anyone: its successor
    reopens the round's store on the same port and places the nodes there."""
    j = job(workdir)
    join_all(master(workdir, j))
    stores = Stores()
    m2 = master(workdir, j, stores=stores, restore=True)
    assert stores.reopened == [5000]
    w0, w1 = m2.poll(Poll(node_id=0)), m2.poll(Poll(node_id=1))
    assert (w0.state, w0.round, w0.store_port) == ("ready", 0, 5000)
    assert (w1.state, w1.node_rank) == ("ready", 1)
    assert m2.restarts == 0


def test_a_join_retried_after_it_formed_the_round_keeps_the_round(workdir):
    """The last join formed the round and the master died before answering it: the agent
    sends the join again to the successor, which must not queue it for a next round."""
    j = job(workdir)
    join_all(master(workdir, j))
    m2 = master(workdir, j, restore=True)
    assert m2.join(Join(node_id=1, nproc=1)) == Joined(action="none", round=0)
    assert m2.poll(Poll(node_id=1)).state == "ready" and m2.poll(Poll(node_id=0)).state == "ready"


def test_an_answer_lost_with_the_master_is_given_again(workdir):
    j = job(workdir)
    m = master(workdir, j)
    join_all(m)
    assert m.poll(Poll(node_id=0)).state == "ready"  # told; the master dies before node 1 asks
    m2 = master(workdir, j, restore=True)
    assert m2.nodes[0].state == "running" and m2.nodes[1].state == "waiting"
    again = m2.poll(Poll(node_id=0))  # node 0 never got its answer: it asks again
    assert (again.state, again.round, again.store_port) == ("ready", 0, 5000)
    assert m2.poll(Poll(node_id=1)).state == "ready"
    assert m2.heartbeat(Heartbeat(node_id=0, round=0)).action == "none"


def test_an_agent_in_a_round_the_journal_missed_is_restarted_past_it(workdir):
    """Should the journal miss a round (its write failed), agents running it are not left
    running alone: they restart into a round numbered past it."""
    j = job(workdir)
    m = master(workdir, j)
    join_all(m)
    m.poll(Poll(node_id=0)), m.poll(Poll(node_id=1))
    m2 = master(workdir, j, restore=True)  # knows round 0; the agents run round 3
    assert m2.heartbeat(Heartbeat(node_id=0, round=3)).action == "restart"
    assert m2.heartbeat(Heartbeat(node_id=1, round=3)).action == "restart" and m2.restarts == 0
    for n in (0, 1):
        m2.join(Join(node_id=n, nproc=1))
    assert m2.poll(Poll(node_id=0)).round == 4 and m2.poll(Poll(node_id=1)).round == 4


def test_a_round_whose_store_is_gone_is_replaced_not_counted(workdir):
    """The store's port was taken while the master was down: the nodes restart into a new
    round (a membership change, not a failure)."""
    j = job(workdir)
    m = master(workdir, j)
    join_all(m)
    m.poll(Poll(node_id=0))
    m2 = master(workdir, j, stores=Stores(taken=True), restore=True)
    assert m2.poll(Poll(node_id=1)).state == "rejoin"
    assert m2.required_round == 1 and m2.restarts == 0
    assert m2.heartbeat(Heartbeat(node_id=0, round=0)).action == "restart"
    for n in (0, 1):
        m2.join(Join(node_id=n, nproc=1))
    assert m2.poll(Poll(node_id=0)).round == 1


def test_successes_survive_a_restart(workdir):
    """A node that reported success never reports it again: the successor must know."""
    j = job(workdir)
    m = master(workdir, j)
    join_all(m)
    m.poll(Poll(node_id=0)), m.poll(Poll(node_id=1))
    m.write_journal()
    assert m.succeeded(Succeeded(node_id=0, round=0)).action == "none"
    m2 = master(workdir, j, restore=True)
    assert m2.state == JobState.RUNNING
    assert m2.succeeded(Succeeded(node_id=1, round=0)).action == "stop"
    assert m2.state == JobState.SUCCEEDED


def test_a_relaunch_is_journaled_before_it_is_issued_and_issued_again_if_lost(workdir):
    clock = Clock()
    seen: list[list[int]] = []
    j = job(workdir, heartbeat_timeout_s=3)
    m = master(workdir, j, clock=clock, relaunch=lambda request: seen.append(pending_relaunches(workdir)))
    join_all(m)
    m.poll(Poll(node_id=0)), m.poll(Poll(node_id=1))
    clock.t += 4
    m.heartbeat(Heartbeat(node_id=0, round=0))
    m.tick()  # node 1 is lost: relaunched
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [[1]]  # the journal held the order when the scheduler got it
    # the master dies; whether the relaunch happened is unknown to its successor
    issued: list[int] = []
    clock2 = Clock()
    m2 = master(workdir, j, clock=clock2, relaunch=lambda request: issued.append(request.node_id), restore=True)
    assert m2.nodes[1].relaunches == 1
    clock2.t += 2
    m2.tick()
    assert issued == []  # the new agent may still be starting
    clock2.t += 3 + 10  # a heartbeat timeout past the restore grace: never came
    m2.heartbeat(Heartbeat(node_id=0, round=0))
    m2.tick()
    deadline = time.monotonic() + 5
    while not issued and time.monotonic() < deadline:
        time.sleep(0.01)
    assert issued == [1] and m2.nodes[1].relaunches == 2
    m2.register(Register(node_id=1, host="h", pid=555))
    assert 1 not in m2.snapshot()["relaunching"]


def test_journal_keeps_the_newest_snapshot_and_skips_a_torn_line(workdir):
    journal = Journal(workdir / "master_journal.json", crash_at="")
    assert journal.write({"version": 2, "seq": 0, "x": "new"})
    assert not journal.write({"version": 1, "seq": 0, "x": "old"})  # a slower thread's older snapshot
    journal.append({"seq": 1, "node": {"node_id": 0}})
    with open(journal.log_path, "a") as f:
        f.write('{"seq": 2, "node": {"no')  # the master died mid-line
    snapshot, entries = Journal(workdir / "master_journal.json", crash_at="").load()
    assert snapshot["x"] == "new" and [e["seq"] for e in entries] == [1]
    assert not journal.write({"version": 3, "seq": 0, "x": "new"}, skip_unchanged=True)
    assert journal.write({"version": 4, "seq": 1, "x": "newer"})
    assert Journal(workdir / "master_journal.json", crash_at="").load()[1] == []  # the snapshot includes line 1


def test_crash_hook_names_its_format():
    with pytest.raises(DLRoverError, match="DLROVER_TEST_CRASH_AT='round_formed:x'.*round_formed:2"):
        Journal(Path("/nonexistent/j.json"), crash_at="round_formed:x")


# ----- slow: real jobs, a real SIGKILL, the master crashed at one journal point ------------------


def real_job(tmp: Path, *args: str, **failure) -> Job:
    """A 2-node job whose agents wait out a master restart (a few seconds here: a new
    process, its imports, the journal) instead of giving it up as lost."""
    return Job(
        name="journal", entrypoint=str(SCRIPTS / "tiny_train.py"), args=list(args), nodes=2, accelerator="cpu",
        checkpoint=Checkpoint(dir=str(tmp / "ck"), persist_every_steps=20),
        failure=Failure(**{"max_restarts": 3, "stop_grace_s": 2, "heartbeat_timeout_s": 15.0, **failure}),
        log_dir=str(tmp / "runs"),
    )


def handle_info(run) -> dict:
    return json.loads((Path(run.handle.log_dir) / "handle.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("crash_at, kill", [
    # one job crashes its master at two points, in turn (the restarted master counts afresh)
    ("restart_decided:1,node_succeeded:1", "worker"),  # the restart is ordered, no agent has heard it;
    # later one node finished, and will never say so again
    ("round_formed:2,step_committed:2", "worker"),  # the new round formed, nobody told yet (its store
    # reopened); later a checkpoint step committed
    ("node_placed:3", "worker"),  # one node told its place in the new round, the other not
    ("relaunch_issued:1", "agent"),  # a lost node's relaunch ordered, not issued
])
def test_master_crash_at_a_journal_point_of_a_recovery(tmp_path, monkeypatch, crash_at, kill):
    monkeypatch.setenv("DLROVER_TEST_CRASH_AT", crash_at)
    out = tmp_path / "final.sha256"  # rank 0 writes it after its last step
    # a killed agent's node is awaited for a heartbeat timeout (plus 10 s) by the restarted
    # master, which cannot know it is gone: short there
    failure = {"heartbeat_timeout_s": 3.0} if kill == "agent" else {}
    run = real_job(tmp_path, "--steps", "50", "--step-sleep", "0.05", "--out", str(out), **failure).submit()
    wait_for(lambda: run.status().step >= 8, 60, "step 8")
    if kill == "worker":
        pid = wait_for(lambda: run.status().worker_pids.get(1), 60, "rank 1")
    else:
        pid = handle_info(run)["agents"]["node-1"]
    os.kill(pid, signal.SIGKILL)
    result = run.wait(progress=False, timeout_s=120)
    assert result.state == JobState.SUCCEEDED, result.reason
    assert out.exists(), "training did not run to its last step"
    points = crash_at.split(",")
    for point_n in points:
        point, n = point_n.split(":")
        assert (Path(result.log_dir) / f"test_crash_{point}_{n}.fired").exists(), f"the master never crashed at {point_n}"
    assert handle_info(run)["master_restarts"] == len(points)
    kinds = [json.loads(line)["kind"] for line in (Path(result.log_dir) / "events.jsonl").read_text().splitlines()]
    assert kinds.count("master_recovered") == len(points)
    assert job_processes(result.job_id) == []


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_restarted_master_whose_port_is_taken_listens_elsewhere(tmp_path):
    """../shared/repro/master-port-taken: the master is SIGKILLed and another process holds
    its port (listening, never answering) for the rest of the job. The restarted master
    takes a free port; agents find it through the address file; the job ends with a result."""
    run = real_job(tmp_path, "--steps", "50", "--step-sleep", "0.05").submit()
    wait_for(lambda: run.status().step >= 10, 60, "step 10")
    info = handle_info(run)
    port = int(info["master_addr"].rsplit(":", 1)[1])
    os.kill(info["master_pid"], signal.SIGKILL)
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the dead master's connections linger
    wait_for(lambda: _try_bind(squatter, port), 10, "the port")
    squatter.listen()
    try:
        result = run.wait(progress=False, timeout_s=120)  # (wait() is what restarts the master)
    finally:
        squatter.close()
    assert result.state == JobState.SUCCEEDED, result.reason
    assert result.final_step == 49
    info = handle_info(run)
    assert info["master_restarts"] == 1
    assert int(info["master_addr"].rsplit(":", 1)[1]) != port
    assert "master_port_taken" in (Path(result.log_dir) / "master.log").read_text()
    # the agents found it at its new address: none gave the master up, no node was relaunched
    logs = "".join(p.read_text() for p in Path(result.log_dir).glob("node_*.log"))
    assert "master_lost" not in logs and "relaunched" not in info, logs[-3000:]
    assert job_processes(result.job_id) == []


def _try_bind(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


def test_a_restarted_master_gives_each_launcher_the_id_it_had(tmp_path):
    """``dlrover run``'s launchers: the ids handed out are logged before the answer (a line;
    the snapshot carries the table): after a master restart, host B's launcher (its agent
    died meanwhile: it asks again to report it) gets node 1 back, not a new id; a new host
    that stood in for a silent one keeps that id and the old host does not get it back; a
    new host finds the job full; an id whose agent never registered goes to the next host
    only after the restored master's grace and the heartbeat timeout."""
    from dlrover_core.protocol import AssignNode, Register

    j = Job(name="m", entrypoint="t.py", nodes=Nodes(min=2, max=3),
            failure=Failure(max_restarts=5, heartbeat_timeout_s=30))
    (tmp_path / "t.py").write_text("")
    clock = Clock()
    m = master(tmp_path, j, clock=clock, relaunch=lambda request: None)
    assert m.assign_node(AssignNode(key="hostA:1")).node_id == 0
    m.register(Register(node_id=0, host="a", pid=100))
    assert m.write_journal()  # the snapshot has host A; the lines after it, the others
    assert [m.assign_node(AssignNode(key=k)).node_id for k in ("hostB:2", "hostC:3")] == [1, 2]
    m.register(Register(node_id=1, host="b", pid=101))  # host C's launcher died before its agent registered
    assert [e["assigned"] for e in map(json.loads, (tmp_path / "journal" / "master_journal.log").read_text().splitlines())
            if "assigned" in e] == [["hostB:2", 1], ["hostC:3", 2]]
    m2 = master(tmp_path, j, clock=clock, relaunch=lambda request: None, restore=True)
    assert m2.assign_node(AssignNode(key="hostB:2")).node_id == 1
    assert m2.assign_node(AssignNode(key="hostA:1")).node_id == 0
    assert m2.assign_node(AssignNode(key="hostD:4")).node_id == -1  # node 2 is still awaited
    clock.t += 31
    assert m2.assign_node(AssignNode(key="hostD:4")).node_id == -1  # (the restore's grace)
    clock.t += 60
    assert m2.assign_node(AssignNode(key="hostD:4")).node_id == 2  # stands in for node 2
    m3 = master(tmp_path, j, clock=clock, relaunch=lambda request: None, restore=True)
    assert m3.assign_node(AssignNode(key="hostD:4")).node_id == 2
    assert m3.assign_node(AssignNode(key="hostC:3")).node_id == -1  # the old host, back: no place now
