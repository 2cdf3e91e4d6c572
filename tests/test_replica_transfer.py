"""Replicas moved between agents (dlrover_core/agent/replicas.py) over real HTTP and real
shared memory: a buddy pulls a node's snapshots, keeps the newest whole one through damaged
and cut-off transfers, and serves it to the lost node's replacement, whose worker then
holds its rank's snapshot in its own slot."""

from __future__ import annotations

import http.server
import re
import socket
import threading
import time
import uuid

import pytest

from dlrover_core.agent.replicas import ReplicaPuller, ReplicaServer, ReplicaStore, fetch_replica, replica_budget
from dlrover_core.checkpoint.layout import build_layout
from dlrover_core.checkpoint.memory import MemorySnapshots
from dlrover_core.checkpoint.replica import take_frame
from dlrover_core.checkpoint.shm import SHM_DIR, SnapshotSlot, node_prefix, remove_segments, segment_name


def state_at(step: int, n: int = 1000):
    import torch

    return {"w": torch.full((n,), float(step)), "step": step}


@pytest.fixture
def job_id():
    job = f"repl-{uuid.uuid4().hex[:8]}"
    yield job
    remove_segments(f"dlrover-{job}-")


def save(mem: MemorySnapshots, step: int, world_size: int = 2, n: int = 1000) -> None:
    assert mem.save(build_layout(state_at(step, n), step=step, rank=mem.rank, world_size=world_size), step=step,
                    world_size=world_size, persist=False)


def test_a_buddy_pulls_each_rank_and_serves_a_lost_nodes_replacement(job_id):
    """Node 1 pulls node 0's ranks 0 and 1 (always the newest step); node 0 dies with its
    memory; its replacement (node 0 again, a new agent) fetches both ranks from node 1 into
    its own slots and reads them as its own snapshots, of the same step and lineage."""
    ranks = [MemorySnapshots(job_id=job_id, node_id=0, rank=r, agent=1, round_index=3) for r in (0, 1)]
    for mem in ranks:
        save(mem, 1)
    store0 = ReplicaStore(job_id=job_id, node_id=0, agent=1)
    server0 = ReplicaServer(job_id=job_id, node_id=0, agent=1, store=store0)
    store1 = ReplicaStore(job_id=job_id, node_id=1, agent=2)
    server1 = ReplicaServer(job_id=job_id, node_id=1, agent=2, store=store1)
    puller = ReplicaPuller(store1, source_node=0, source_address=server0.address, ranks=[0, 1])
    try:
        assert puller.pull_once() == 2
        assert store1.held() == [(0, 0, 1, 3), (0, 1, 1, 3)]
        assert puller.pull_once() == 0  # nothing newer
        for step in (2, 3):
            for mem in ranks:
                save(mem, step)
        assert puller.pull_once() == 2
        assert store1.held() == [(0, 0, 3, 3), (0, 1, 3, 3)]

        # node 0 dies with its memory
        server0.close()
        for mem in ranks:
            for slot in mem.slots:
                slot.close()
        remove_segments(node_prefix(job_id, 0))
        assert not [n for n in SHM_DIR.iterdir() if n.name.startswith(node_prefix(job_id, 0))]
        assert puller.pull_once() == 0  # the source is gone: the replicas stay
        assert store1.held() == [(0, 0, 3, 3), (0, 1, 3, 3)]

        # its replacement (agent token 4) fetches each rank into its own slot 0
        for rank in (0, 1):
            into = SnapshotSlot.open(segment_name(job_id, 0, rank, 0, 4), create=True)
            h = fetch_replica(server1.address, 0, rank, into=into)
            assert (h.rank, h.step, h.round) == (rank, 3, 3)
            into.close()
            mem = MemorySnapshots(job_id=job_id, node_id=0, rank=rank, agent=4, round_index=4)
            assert mem.held(2) == [(3, 3)]
            with mem.read(3, 2, round_index=3) as (tensors, _):
                assert tensors["w"].eq(3.0).all()
        assert fetch_replica(server1.address, 5, 0, into=SnapshotSlot.open(
            segment_name(job_id, 0, 0, 1, 4), create=True)) is None  # no replica of node 5
    finally:
        puller.stop()
        server1.close()
        store1.close()
        store0.close()


class _BadSource:
    """A source agent that answers with a damaged frame (a flipped data byte) or a cut-off
    one (the connection closed half-way), as a faulty link or a dying host would."""

    def __init__(self, frame: bytes, how: str) -> None:
        self.frame, self.how = frame, how
        source = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                if self.path.startswith("/v1/steps"):  # (a pass begins: the newest step of each rank)
                    body = b'{"0": [5]}'
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                data = bytearray(source.frame)
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if source.how == "flipped":
                    data[-10] ^= 0x40
                    self.wfile.write(data)
                else:
                    self.wfile.write(data[: len(data) // 2])
                    self.close_connection = True

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return "%s:%d" % self.httpd.server_address[:2]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("how", ["flipped", "cut_off"])
def test_a_damaged_or_cut_off_pull_keeps_the_replica_held(job_id, how):
    mem = MemorySnapshots(job_id=job_id, node_id=0, rank=0, agent=1)
    store = ReplicaStore(job_id=job_id, node_id=1, agent=2)
    save(mem, 4, world_size=1)
    store.put(0, take_frame(next(s for s in mem.slots if s.header() is not None), rank=0))
    save(mem, 5, world_size=1)
    newer = next(f for s in mem.slots if (f := take_frame(s, rank=0, newer_than=4)) is not None)
    source = _BadSource(bytes(newer), how)
    puller = ReplicaPuller(store, source_node=0, source_address=source.address, ranks=[0], timeout_s=5)
    try:
        assert puller.pull_once() == 0
        assert puller.refused == (1 if how == "flipped" else 0)
        assert store.held() == [(0, 0, 4, 0)]
    finally:
        puller.stop()
        source.close()
        store.close()


def test_pulls_keep_to_the_bandwidth_budget_and_run_in_the_background(job_id):
    """A 4 MiB snapshot pulled at 8 MiB/s takes at least half a second; the background
    puller then follows every new step without being asked."""
    mem = MemorySnapshots(job_id=job_id, node_id=0, rank=0, agent=1)
    save(mem, 1, world_size=1, n=2**20)  # 4 MiB of float32
    server = ReplicaServer(job_id=job_id, node_id=0, agent=1, store=ReplicaStore(job_id=job_id, node_id=0, agent=1))
    store = ReplicaStore(job_id=job_id, node_id=1, agent=2)
    puller = ReplicaPuller(store, source_node=0, source_address=server.address, ranks=[0], interval_s=0.05,
                           max_bytes_per_s=8 * 2**20)
    try:
        t0 = time.monotonic()
        assert puller.pull_once() == 1
        assert time.monotonic() - t0 >= 0.45
        puller.max_bytes_per_s = None
        puller.start()
        for step in (2, 3):
            save(mem, step, world_size=1, n=2**20)
            deadline = time.monotonic() + 20
            while store.held() != [(0, 0, step, 0)]:
                assert time.monotonic() < deadline, store.held()
                time.sleep(0.02)
    finally:
        puller.stop()
        server.close()
        store.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lost_node_restores_from_its_buddys_memory_not_from_storage(tmp_path):
    """A 2-node job (restart-all: the script does not loop with train.steps()); node 1 dies
    as a machine does: its agent and worker SIGKILLed, its /dev/shm segments removed. The
    relaunched node fetches its rank's replicas from node 0 before its worker starts, and
    every rank restores from memory (no storage read) at a step newer than the last commit;
    the job ends with the parameters of a run without the failure, bit for bit."""
    import json
    import random
    from pathlib import Path

    from helpers import SCRIPTS, job_processes, kill_node, shm_entries, wait_for

    from dlrover_core import Checkpoint, Failure, Job, JobState

    def job(name: str, out: Path, step_sleep_s: float) -> Job:
        return Job(name=name, entrypoint=str(SCRIPTS / "tiny_train.py"),
                   args=["--steps", "30", "--step-sleep", str(step_sleep_s), "--out", str(out)], nodes=2,
                   accelerator="cpu",
                   checkpoint=Checkpoint(dir=str(tmp_path / name / "ck"), persist_every_steps=10),
                   failure=Failure(max_restarts=2, stop_grace_s=2, heartbeat_timeout_s=3.0),
                   log_dir=str(tmp_path / "runs"))

    shm_before = shm_entries()
    run = job("lost", tmp_path / "lost.sha256", 0.2).submit()
    wait_for(lambda: run.status().step >= 14, 90, "step 14")
    # the machine dies at a random moment: the replica pins keep a step every rank can restore
    time.sleep(random.Random(14).uniform(0.0, 0.8))
    kill_node(run, 1)  # the machine's memory is gone with it
    result = run.wait(progress=False, timeout_s=180)
    assert result.state == JobState.SUCCEEDED, result.reason
    (failure,) = result.failures  # (the survivor's broken collective or the lost node: whichever came first)
    assert failure.recovery == "restart_all" and failure.restored_from == "memory", failure
    assert failure.restored_step > 10, failure  # newer than the last commit (10)
    events = [json.loads(line) for line in (Path(result.log_dir) / "events.jsonl").read_text().splitlines()]
    restores = [e for e in events if e["kind"] == "restore_decided" and e["round"] >= 1]
    assert [e["source"] for e in restores] == ["memory"], restores
    assert "replicas_fetched" in (Path(result.log_dir) / "node_1.log").read_text()
    # both nodes on one host: the puller's link is loopback, with no budget
    assert re.search(r"replica_source .*budget=loopback", (Path(result.log_dir) / "node_0.log").read_text())

    clean = job("clean", tmp_path / "clean.sha256", 0.0).run(progress=False)  # (the sleep changes no parameter)
    assert clean.state == JobState.SUCCEEDED
    assert (tmp_path / "lost.sha256").read_text() == (tmp_path / "clean.sha256").read_text()
    assert job_processes(result.job_id) == []
    assert {e for e in shm_entries() - shm_before if result.job_id in e} == set()


def test_a_new_lineage_replaces_the_abandoned_replicas_at_once(job_id):
    """The job went back (round 1 restored step 3 from storage) after the buddy pulled steps
    5 and 6 of round 0: the next pull takes round 1's step 3 although its step is lower, and
    it is the newest replica held from then on (the abandoned lineage's are never preferred)."""
    mem = MemorySnapshots(job_id=job_id, node_id=0, rank=0, agent=1, round_index=0)
    server = ReplicaServer(job_id=job_id, node_id=0, agent=1, store=ReplicaStore(job_id=job_id, node_id=0, agent=1))
    store = ReplicaStore(job_id=job_id, node_id=1, agent=2)
    puller = ReplicaPuller(store, source_node=0, source_address=server.address, ranks=[0])
    try:
        for step in (5, 6):
            save(mem, step, world_size=1)
            assert puller.pull_once() == 1
        assert store.held() == [(0, 0, 6, 0)]
        restored = MemorySnapshots(job_id=job_id, node_id=0, rank=0, agent=1, round_index=1)
        save(restored, 3, world_size=1)
        assert puller.pull_once() == 1
        assert store.held() == [(0, 0, 3, 1)]
        assert puller.pull_once() == 0
        save(restored, 4, world_size=1)
        assert puller.pull_once() == 1 and store.held() == [(0, 0, 4, 1)]
    finally:
        puller.stop()
        server.close()
        store.close()


# ----- the bandwidth budget ----------------------------------------------------------------------


def test_the_replica_budget_is_the_users_or_a_share_of_the_link():
    """``Checkpoint.replica_mb_per_s`` wins; a source on this host (loopback) has no budget;
    towards another address, a quarter of the interface's reported speed, or 1,000 MB/s
    where it reports none (psutil's reading of ``/sys/class/net/<if>/speed``)."""
    assert replica_budget("127.0.0.1:5000", 50) == (50e6, "checkpoint.replica_mb_per_s")
    assert replica_budget("127.0.0.1:5000") == (None, "loopback")
    psutil = pytest.importorskip("psutil")
    stats = psutil.net_if_stats()
    outward = [(name, a.address) for name, addrs in psutil.net_if_addrs().items() for a in addrs
               if a.family == socket.AF_INET and not a.address.startswith("127.")
               and name in stats and stats[name].isup and "loopback" not in stats[name].flags]
    if not outward:
        pytest.skip("no network interface but loopback here")
    name, address = outward[0]
    # (the route to this host's own address goes over lo, but from that address: its interface is named)
    budget, why = replica_budget(f"{address}:5000")
    speed = stats[name].speed
    assert budget == (speed * 1e6 / 8 / 4 if speed else 1e9), (budget, why)


def test_a_bad_replica_budget_names_the_field():
    from dlrover_core import Checkpoint, JobSpecError

    for bad in (0, -1, "fast"):
        with pytest.raises(JobSpecError, match=r"checkpoint.replica_mb_per_s.*MB per second"):
            Checkpoint(replica_mb_per_s=bad)
    assert Checkpoint(replica_mb_per_s=250).replica_mb_per_s == 250


def test_the_puller_keeps_to_its_share_of_a_core(job_id):
    """``Checkpoint.replica_cpu_share`` (default 0.1): a pass that took 0.2 s of the puller's
    CPU is followed by 2 s of waiting at 0.1, by ``interval_s`` at 1.0; bad shares are refused
    naming the field."""
    from dlrover_core import Checkpoint, JobSpecError

    store = ReplicaStore(job_id=job_id, node_id=1, agent=2)
    try:
        tenth = ReplicaPuller(store, source_node=0, source_address="127.0.0.1:9", ranks=[0], interval_s=0.1,
                              cpu_share=Checkpoint().replica_cpu_share)
        whole = ReplicaPuller(store, source_node=0, source_address="127.0.0.1:9", ranks=[0], interval_s=0.1,
                              cpu_share=1.0)
        assert tenth.wait_after(0.2) == pytest.approx(2.0) and tenth.wait_after(0.001) == 0.1
        assert whole.wait_after(0.2) == pytest.approx(0.2) and whole.wait_after(0.0) == 0.1
    finally:
        store.close()
    for bad in (0, -0.5, 1.5, True, "0.1"):
        with pytest.raises(JobSpecError, match=r"checkpoint.replica_cpu_share.*share of one CPU core"):
            Checkpoint(replica_cpu_share=bad)
    assert Checkpoint(replica_cpu_share=1).replica_cpu_share == 1


def test_a_puller_whose_source_went_silent_stops_at_once(job_id):
    """A source whose host is gone answers nothing (no reset): stopping the puller (an
    agent exiting) breaks off the read in flight instead of waiting out its timeout."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    store = ReplicaStore(job_id=job_id, node_id=1, agent=2)
    puller = ReplicaPuller(store, source_node=0, source_address="127.0.0.1:%d" % sock.getsockname()[1], ranks=[0],
                           timeout_s=60).start()
    try:
        sock.settimeout(10)
        conn, _ = sock.accept()  # the puller's request is in flight, never answered
        time.sleep(0.2)
        t0 = time.monotonic()
        puller.stop(timeout_s=30)
        assert not puller._thread.is_alive()
        assert time.monotonic() - t0 < 5.0  # (not the read's 60 s, nor the join's 30 s)
        conn.close()
    finally:
        puller.stop()
        sock.close()
        store.close()


@pytest.mark.timeout(240)
def test_a_lagging_buddy_makes_the_ranks_skip_snapshots_not_wait(tmp_path):
    """Replication at 2 KB/s cannot follow 10 ms steps: in ``train.steps`` the ranks agree
    at each step's start and skip the step's snapshot together while a buddy lacks a rank's
    newest one, instead of every save waiting for the replicas. The job runs its 80 steps,
    takes fewer snapshots than steps, every rank the same ones, and says so."""
    import json
    import re
    from pathlib import Path

    from helpers import SCRIPTS

    from dlrover_core import Checkpoint, Failure, Job, JobState, Nodes

    job = Job(name="lag", entrypoint=str(SCRIPTS / "live_train.py"),
              args=["--steps", "80", "--samples", "96", "--batch", "4", "--step-sleep", "0.01",
                    "--out", str(tmp_path / "out")],
              nodes=Nodes(min=2, max=2), accelerator="cpu",
              checkpoint=Checkpoint(dir=str(tmp_path / "ck"), persist_every_steps=0, replica_mb_per_s=0.002),
              failure=Failure(stop_grace_s=2), log_dir=str(tmp_path / "runs"))
    result = job.run(progress=False)
    assert result.state == JobState.SUCCEEDED, result.reason
    taken: dict[str, list[int]] = {}
    for path in Path(result.log_dir).glob("node_*/round_*/progress_rank*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        taken[str(path)] = [r["step"] for r in records if r.get("type") == "checkpoint"]
    assert len(taken) == 2 and len({tuple(steps) for steps in taken.values()}) == 1, taken  # the same steps
    (steps,) = {tuple(steps) for steps in taken.values()}
    assert 79 in steps and len(steps) < 40, steps  # the last step forced; most others skipped
    logs = "".join(p.read_text() for p in Path(result.log_dir).glob("node_*.log"))
    assert re.search(r"snapshots_skipped .*skipped=\d+", logs), logs[-2000:]
