"""``dlrover run`` on three hosts: network namespaces joined by a bridge (tests/netns.py).

Each host runs the same ``dlrover run --nnodes 3 --rdzv-backend c10d --rdzv-endpoint
<host 0>:29400`` in its own namespace, with its own address (``--local-addr``) and its own
log directory; the checkpoint directory is shared (a shared filesystem), and so is
/dev/shm (not on real hosts: each test checks only the segments of the hosts it expects to
be clean). The tests skip with the reason where namespaces cannot be made (not root, no
``ip``); ``.ci/run`` installs iproute2 and checks them first.

* a plain torch.distributed script across the three hosts;
* the char LM: one host's cable is pulled mid-training, the other two go on (live), the
  cable is plugged back and the host rejoins; every host exits 0;
* a sharded (FSDP2) job on two hosts loses one; a third host's waiting ``dlrover run`` stands
  in for it, with its shard from the survivor's memory over the network;
* the host running the job master dies: the others exit 1 within twice the heartbeat timeout,
  naming the unreachable master, leaving no process and no shared memory behind.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import netns
import pytest
from helpers import SCRIPTS, check_committed_steps, shm_entries

pytestmark = pytest.mark.slow

PORT = 29400
#: --rdzv-conf giving Failure.heartbeat_timeout_s = 20 x 0.5 = 10 s
FAST_HEARTBEAT = "keep_alive_interval=0.5,keep_alive_max_attempt=20"
HEARTBEAT_TIMEOUT_S = 10.0


@pytest.fixture
def hosts():
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    h = netns.Hosts(3)
    try:
        yield h
    finally:
        h.close()


class Job:
    """``dlrover run`` started on every host, with what the checks need."""

    def __init__(self, hosts: netns.Hosts, tmp: Path, name: str, script: Path, args: list[str], *,
                 rdzv_conf: str = "", env: dict[str, str] | None = None, nnodes: int | None = None,
                 flags: tuple[str, ...] = (), started: int | None = None) -> None:
        self.hosts, self.tmp = hosts, tmp
        self.job_id = f"{name}-{secrets.token_hex(3)}"
        self.endpoint = f"{hosts.addrs[0]}:{PORT}"
        self.ck = tmp / "ck"
        self.procs: list[subprocess.Popen] = []
        self.exit_codes: dict[int, int] = {}
        self._argv_tail = ["--nnodes", str(nnodes or len(hosts.names)), *flags,
                           *(["--rdzv-conf", rdzv_conf] if rdzv_conf else []), str(script), *args]
        self._env = {**os.environ, **(env or {})}
        for _ in range(len(hosts.names) if started is None else started):
            self.start_next()

    def start_next(self) -> None:
        """Start ``dlrover run`` on the next host (every host at once unless ``started``)."""
        i = len(self.procs)
        argv = [sys.executable, "-m", "dlrover_core.cli", "run",
                "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint,
                "--rdzv-id", self.job_id, "--local-addr", self.hosts.addrs[i], "--accelerator", "cpu",
                "--log-dir", str(self.log_root(i)), "--checkpoint-dir", str(self.ck), *self._argv_tail]
        self.procs.append(self.hosts.popen(i, argv, output=self.out_file(i), cwd=str(self.tmp), env=self._env))

    # ----- where things are -----------------------------------------------------------------

    def log_root(self, i: int) -> Path:
        return self.tmp / f"logs-h{i}"

    def run_dir(self, i: int) -> Path:
        return self.log_root(i) / self.job_id

    def out_file(self, i: int) -> Path:
        return self.tmp / f"h{i}.out"

    def output(self, i: int) -> str:
        try:
            return self.out_file(i).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def events(self) -> list[dict]:
        path = self.run_dir(0) / "events.jsonl"
        if not path.exists():
            return []
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:  # a line being written
                pass
        return records

    def node_id(self, i: int) -> int:
        """Host ``i``'s node id (the master assigns them in the order the hosts ask)."""
        found = re.findall(r"agent_started .*?node_id=(\d+)", self.output(i))
        assert found, f"host {i} has no agent yet:\n{self.output(i)[-2000:]}"
        return int(found[0])

    def steps(self, i: int) -> dict[str, list[int]]:
        """Host ``i``'s workers' applied steps, per progress file (one file per worker process)."""
        out: dict[str, list[int]] = {}
        for path in sorted(glob.glob(str(self.run_dir(i) / "node_*" / "round_*" / "progress_rank*.jsonl"))):
            steps = []
            with open(path) as f:
                for line in f:
                    try:
                        r = json.loads(line)
                    except ValueError:
                        continue
                    if r.get("type") == "step":
                        steps.append(int(r["step"]))
            out[path] = steps
        return out

    def why_replaced(self, i: int) -> str:
        """Host ``i``'s progress files and what its output says of workers that exited or
        were replaced (the lines that tell why)."""
        files = {Path(path).name: len(steps) for path, steps in self.steps(i).items()}
        marks = ("worker_exited", "worker_replaced", "live_worker_stuck", "live_collective_failed",
                 "live_recovery_ended", "Traceback", "Error")
        lines = [line for line in self.output(i).splitlines() if any(m in line for m in marks)]
        return f"progress files (steps each) {files}; lines:\n" + "\n".join(line[:400] for line in lines[-40:])

    def last_step(self, i: int) -> int:
        return max((s[-1] for s in self.steps(i).values() if s), default=-1)

    def segments(self, node_ids: set[int] | None = None) -> set[str]:
        """This job's shared-memory segments (of ``node_ids`` only, if given)."""
        prefix = f"dlrover-{self.job_id}-"
        names = {n for n in shm_entries() if n.startswith(prefix)}
        if node_ids is not None:
            names = {n for n in names if any(n.startswith(f"{prefix}n{k}-") for k in node_ids)}
        return names

    # ----- waiting ---------------------------------------------------------------------------

    def diagnose(self) -> str:
        parts = []
        for i in range(len(self.procs)):
            parts.append(f"--- host {i} (exit {self.procs[i].poll()}):\n{self.output(i)[-2500:]}")
        parts.append("--- events:\n" + "\n".join(json.dumps(e)[:300] for e in self.events()[-25:]))
        master_log = self.run_dir(0) / "master.log"
        if master_log.exists():
            parts.append(f"--- master.log:\n{master_log.read_text(errors='replace')[-2500:]}")
        return "\n".join(parts)

    def wait_for(self, predicate: Callable[[], object], timeout_s: float, what: str, *,
                 running: tuple[int, ...] = (0, 1, 2)) -> None:
        """Wait until ``predicate()``; fail (with every host's output) on the timeout or when a
        host in ``running`` exits meanwhile."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            for i in running:
                if self.procs[i].poll() is not None:
                    raise AssertionError(f"waiting for {what}: host {i}'s dlrover run exited "
                                         f"{self.procs[i].returncode}\n{self.diagnose()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}\n{self.diagnose()}")
            time.sleep(0.1)

    def wait_exit(self, i: int, timeout_s: float) -> int:
        try:
            code = self.procs[i].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"host {i}'s dlrover run still runs (waited {timeout_s:.1f} s more)\n{self.diagnose()}") from None
        self.exit_codes[i] = code
        return code


@pytest.fixture
def jobs(hosts, tmp_path):
    """Start jobs on ``hosts``; afterwards (pass or fail) remove their shared memory (the
    processes go with the namespaces)."""
    started: list[Job] = []

    def start(*args, **kwargs) -> Job:
        job = Job(hosts, tmp_path, *args, **kwargs)
        started.append(job)
        return job

    yield start
    hosts.close()  # every process first: none can make a segment afterwards
    for job in started:
        for name in job.segments():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")


def write_gate(path: Path, **gate) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(gate))
    os.replace(tmp, path)  # the workers never read half a file


# ----- a. torch.distributed on three hosts ----------------------------------------------------


@pytest.mark.timeout(120)
def test_plain_torch_distributed_script_on_three_hosts(hosts, jobs, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    job = jobs("mh-plain", SCRIPTS / "torchrun_style.py", [str(results)])
    codes = [job.wait_exit(i, 90) for i in range(3)]
    assert codes == [0, 0, 0], job.diagnose()

    records = [json.loads(p.read_text()) for p in sorted(results.glob("rank_*_attempt_0.json"))]
    assert len(records) == 3, job.diagnose()
    envs = [r["env"] for r in records]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["GROUP_WORLD_SIZE"] for e in envs} == {"3"}
    assert sorted(e["GROUP_RANK"] for e in envs) == ["0", "1", "2"]
    assert sorted(e["RANK"] for e in envs) == ["0", "1", "2"]
    assert {e["MASTER_ADDR"] for e in envs} == {hosts.addrs[0]}, "workers rendezvous at the endpoint's host"
    assert {e["TORCHELASTIC_RUN_ID"] for e in envs} == {job.job_id}
    assert all(r["sum"] == 1 + 2 + 3 for r in records)
    # one worker on each host, each host's output and logs in its own place
    for i in range(3):
        assert len(glob.glob(str(job.run_dir(i) / "node_*" / "rank_*.log"))) == 1, job.diagnose()
    assert "SUCCEEDED" in job.output(0) and job.job_id in job.output(0)
    for i in (1, 2):
        assert f"job {job.job_id}: SUCCEEDED" in job.output(i), job.output(i)
    assert not any(hosts.pids(i) for i in range(3)), "processes left on a host"
    assert job.segments() == set()


# ----- b. the char LM: a host cut off and back ------------------------------------------------


@pytest.mark.timeout(300)
def test_charlm_host_cut_off_others_go_on_and_it_rejoins(hosts, jobs, tmp_path):
    gate = tmp_path / "gate.json"
    hold = 3
    write_gate(gate, hold_at=hold)
    job = jobs("mh-charlm", SCRIPTS / "charlm_gated.py",
               ["--steps", "1000", "--batch-size", "4", "--block-size", "32", "--max-bytes", "200000",
                "--eval-every", "100000", "--eval-batches", "2", "--log-every", "5", "--warmup-steps", "5"],
               rdzv_conf=FAST_HEARTBEAT, env={"CHARLM_GATE": str(gate)})
    cut = 2  # not the master's host
    job.wait_for(lambda: all(job.last_step(i) >= hold for i in range(3)), 150, f"every host at step {hold}")
    survivors = (0, 1)
    started = {i: re.findall(r"workers_started .*", job.output(i)) for i in survivors}
    lost_node = job.node_id(cut)

    hosts.cut(cut)
    t_cut = time.monotonic()
    write_gate(gate, sleep_s=0.2)  # go on, slowly enough for the host to come back before the end

    def reformed(world_size: int, after: int = 0) -> list[dict]:
        return [e for e in job.events()[after:] if e["kind"] == "live_reformed" and e["world_size"] == world_size]

    job.wait_for(lambda: reformed(2), 60, "the other two hosts re-forming without the cut one")
    detected_s = time.monotonic() - t_cut
    events = job.events()
    assert any(e["kind"] == "node_lost" and e["node_id"] == lost_node for e in events), job.diagnose()
    at_reform = max(job.last_step(i) for i in survivors)
    job.wait_for(lambda: min(job.last_step(i) for i in survivors) >= at_reform + 3, 60,
                 "the other two training on without the cut host")
    assert job.last_step(cut) <= hold + 1, "the cut host cannot have trained on"

    n_events = len(job.events())
    hosts.heal(cut)
    t_heal = time.monotonic()
    job.wait_for(lambda: reformed(3, n_events), 90, "the healed host rejoining (world size 3 again)")
    rejoined_s = time.monotonic() - t_heal
    at_rejoin = max(job.last_step(i) for i in range(3))
    job.wait_for(lambda: job.last_step(cut) > at_rejoin, 60, "the healed host training again")

    end_at = max(job.last_step(i) for i in range(3)) + 3
    write_gate(gate, end_at=end_at)
    codes = [job.wait_exit(i, 90) for i in range(3)]
    assert codes == [0, 0, 0], job.diagnose()
    assert "SUCCEEDED" in job.output(0)
    for i in (1, 2):
        assert f"job {job.job_id}: SUCCEEDED" in job.output(i), job.output(i)

    events = job.events()
    # live all along: no round after the first, no restart of every worker
    assert not any(e["kind"] == "rendezvous_completed" and e["round"] > 0 for e in events), job.diagnose()
    assert not any(e["kind"] == "workers_restarted" for e in events), job.diagnose()
    sizes = [e["world_size"] for e in events if e["kind"] == "live_reformed"]
    assert 2 in sizes and sizes[-1] == 3, sizes
    # the survivors' workers never restarted: one worker process each, every step applied once
    for i in survivors:
        assert re.findall(r"workers_started .*", job.output(i)) == started[i], job.output(i)
        per_process = job.steps(i)
        assert len(per_process) == 1, f"host {i}'s worker was replaced: {job.why_replaced(i)}\n{job.diagnose()}"
        (steps,) = per_process.values()
        assert steps == list(range(end_at + 1)), f"host {i}'s worker skipped or repeated a step: {steps}"
    check_committed_steps(job.ck)
    assert not any(hosts.pids(i) for i in range(3)), "processes left on a host"
    assert job.segments() == set()
    print(f"cut → re-formed without it in {detected_s:.1f} s; healed → world 3 again in {rejoined_s:.1f} s")


# ----- c. a sharded job loses a host; a spare host stands in ----------------------------------


@pytest.mark.timeout(240)
def test_a_sharded_job_loses_a_host_and_a_waiting_spare_stands_in_live(hosts, jobs, tmp_path):
    """``dlrover run --parallel fsdp --nnodes 2`` on hosts 0 and 1; host 2 runs the same
    command and, finding the job full, waits. Host 1 dies (every process SIGKILLed, its cable
    cut, its shared memory gone). Host 0's worker keeps its process and its shard; host 2
    stands in for host 1's node: its agent fetches that node's rank's replica from host 0's
    memory over the network, its worker joins the running world in that rank and loads that
    shard (no byte from storage). Both hosts end the job; every rank trained each step of its lineage once."""
    out = tmp_path / "out"
    job = jobs("mh-shard", SCRIPTS / "sharded_live_train.py",
               ["--steps", "60", "--step-sleep", "0.1", "--out", str(out)],
               rdzv_conf="keep_alive_interval=0.5,keep_alive_max_attempt=8", nnodes=2,
               flags=("--parallel", "fsdp"), started=2)

    def records() -> list[dict]:
        return [json.loads(line) for p in out.glob("steps_*.jsonl") for line in p.read_text().splitlines()]

    job.wait_for(lambda: len({r["rank"] for r in records()}) == 2 and len(records()) >= 12, 120,
                 "both hosts training", running=(0, 1))
    job.start_next()  # the spare
    job.wait_for(lambda: "node_place_awaited" in job.output(2), 60, "the spare waiting for a place")
    lost = job.node_id(1)
    lost_rank = int(re.search(r"workers_started .*?ranks=\[(\d+)\]", job.output(1)).group(1))
    survivor = next(r["pid"] for r in records() if r["rank"] != lost_rank)  # (node ids go in the order hosts ask)
    hosts.crash(1)
    for name in job.segments({lost}):  # the machine's memory dies with it
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")
    codes = {i: job.wait_exit(i, 150) for i in (0, 2)}
    assert codes == {0: 0, 2: 0}, job.diagnose()
    assert job.node_id(2) == lost, job.output(2)[-2000:]
    events = job.events()
    assert not any(e["kind"] == "workers_restarted" for e in events), job.diagnose()
    assert any(e["kind"] == "live_reformed" for e in events) or "live_reformed" in job.output(0), job.diagnose()
    spare = job.output(2)
    assert re.search(rf"replicas_fetched .*'rank': {lost_rank}", spare), spare[-3000:]
    restores = re.findall(r"checkpoint_restored .*?source=(\w+) .*?storage_bytes=(\d+)", spare)
    assert restores and all(src == "memory" and int(n) == 0 for src, n in restores), restores
    by_pid: dict[int, list[int]] = {}
    for r in records():
        by_pid.setdefault(r["pid"], []).append(r["step"])
    mine = by_pid[survivor]
    assert mine[0] == 0 and mine[-1] == 59, "host 0's worker trained to the end"
    jumps = [(a, b) for a, b in zip(mine, mine[1:], strict=False) if b != a + 1]
    assert len(jumps) <= 1 and all(b <= a for a, b in jumps), jumps  # at most one go-back, to a common step
    for rank in (0, 1):
        assert {r["step"] for r in records() if r["rank"] == rank} == set(range(60)), f"rank {rank} missed a step"
    finals = [json.loads(p.read_text()) for p in out.glob("final_*.json")]
    assert sorted(f["rank"] for f in finals) == [0, 1] and survivor in {f["pid"] for f in finals}
    assert not any(hosts.pids(i) for i in (0, 2)), "processes left on a host"


# ----- d. the master's host dies --------------------------------------------------------------


# The master's host is gone: the other hosts' agents give up after the heartbeat timeout and
# their launchers after as long again (a host only cut off for a while rejoins within that
# window, which test b needs): the job fails cleanly on every other host, with the reason.
@pytest.mark.timeout(180)
def test_master_host_dies_the_others_fail_cleanly(hosts, jobs, tmp_path):
    job = jobs("mh-crash", SCRIPTS / "live_train.py",
               ["--steps", "100000", "--step-sleep", "0.1", "--out", str(tmp_path / "out")],
               rdzv_conf=FAST_HEARTBEAT)
    job.wait_for(lambda: all(job.last_step(i) >= 3 for i in range(3)), 120, "every host training")
    others = (1, 2)
    nodes = {job.node_id(i) for i in others}
    job.wait_for(lambda: all(job.segments({job.node_id(i)}) for i in others), 30,
                 "the other hosts' checkpoint snapshots in shared memory")

    killed = hosts.crash(0)
    t_crash = time.monotonic()
    assert killed, "no process on the master's host"
    # the agents give up after the heartbeat timeout (a beat in flight may add a few
    # seconds), their launchers wait as long for the master to answer again, then exit 1
    deadline = t_crash + 2 * HEARTBEAT_TIMEOUT_S + 20.0
    codes = {i: job.wait_exit(i, max(0.0, deadline - time.monotonic())) for i in others}
    took_s = time.monotonic() - t_crash
    assert codes == {1: 1, 2: 1}, job.diagnose()
    for i in others:
        out = job.output(i)
        assert "job_master_unreachable" in out and job.endpoint in out, out[-3000:]
    # nothing of theirs is left: no process on their hosts, no segment of their nodes
    deadline = time.monotonic() + 5
    while any(hosts.pids(i) for i in others) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(hosts.pids(i) for i in others), {i: hosts.pids(i) for i in others}
    assert job.segments(nodes) == set()
    print(f"master's host killed → the others exited 1 after {took_s:.1f} s")


def test_namespaces_are_removed(tmp_path):
    """The helper leaves no namespace and no process behind, even when a command still runs."""
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    h = netns.Hosts(2)
    names = [*h.names, h.switch]
    proc = h.popen(1, ["sleep", "60"], output=tmp_path / "sleep.out")
    assert h.ping(0, 1)
    h.cut(1)
    assert not h.ping(0, 1)
    h.heal(1)
    assert h.ping(0, 1, timeout_s=10)
    assert proc.pid in h.pids(1)
    h.close()
    assert proc.wait(timeout=5) == -signal.SIGKILL
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
