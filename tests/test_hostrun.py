"""``dlrover run`` on each host (``dlrover_core.hostrun``): one agent per host, the job master
where the rendezvous endpoint is, evidence of a dead agent from its host's launcher.

Two "hosts" here are two ``dlrover run`` processes on this machine sharing one loopback
endpoint (``tests/test_multihost.py`` runs them in separate network namespaces). Every
process is real; agents are killed with real signals.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from helpers import SCRIPTS, job_processes, left_behind, shm_entries, wait_for

from dlrover_core import JobState
from dlrover_core.cli import main
from dlrover_core.errors import JobSpecError
from dlrover_core.hostrun import claim_endpoint, is_local_address, parse_endpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----- the endpoint ------------------------------------------------------------------------


def test_endpoints_parse_as_torchrun_reads_them():
    assert parse_endpoint("node0:29500") == ("node0", 29500)
    assert parse_endpoint("node0") == ("node0", 29400)
    assert parse_endpoint("[::1]:1234") == ("::1", 1234)
    for bad in (":29400", "node0:http", "node0:70000", ""):
        with pytest.raises(JobSpecError, match="--rdzv-endpoint"):
            parse_endpoint(bad)


def test_local_addresses_are_told_from_remote_ones():
    assert is_local_address("127.0.0.1") and is_local_address("localhost")
    assert not is_local_address("203.0.113.7")  # TEST-NET-3: never an address of this machine
    assert not is_local_address("no-such-host.invalid")


def test_only_one_launcher_claims_an_endpoint():
    port = _free_port()
    first = claim_endpoint("127.0.0.1", port)
    try:
        assert first is not None
        assert claim_endpoint("127.0.0.1", port) is None  # taken: the second one's agent connects
    finally:
        first.close()
    assert claim_endpoint("203.0.113.7", port) is None  # not this machine: never hosts


# ----- flags -------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2", "--rdzv-backend", "static"], "needs --node-rank"),
    (["--nnodes", "1:2", "--rdzv-backend", "static", "--node-rank", "0"], "needs a fixed --nnodes"),
    (["--nnodes", "2", "--rdzv-backend", "c10d"], "--rdzv-endpoint HOST[:PORT] is required"),
    (["--standalone", "--nnodes", "2"], "--standalone runs one host"),
    (["--rdzv-backend", "etcd-v2"], "--rdzv-backend 'etcd-v2' is not supported"),
    (["--simulate-nodes", "2", "--nnodes", "2"], "--simulate-nodes runs every node on this machine"),
    (["--rdzv-conf", "colour=red"], "unknown keys ['colour']"),
])
def test_inconsistent_flags_are_one_line_naming_the_flag(tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("print('trained')\n")
    result = CliRunner().invoke(main, ["run", *argv, "train.py"])
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    assert not (tmp_path / "dlrover-runs").exists()


# ----- two hosts on loopback ---------------------------------------------------------------


def _launch(tmp: Path, host: int, port: int, rdzv_id: str, *script: str, nnodes: str = "2") -> subprocess.Popen:
    log = open(tmp / f"host{host}.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "dlrover_core.cli", "run", "--nnodes", nnodes, "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
         "--accelerator", "cpu", "--log-dir", str(tmp / "runs"), "--checkpoint-dir", str(tmp / "ck"),
         "--max-restarts", "5", *script],
        cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _agent_of(launcher: subprocess.Popen) -> psutil.Process:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher.pid).children():
            if child.name() == "dlrover-agent":
                return child
        time.sleep(0.05)
    raise AssertionError("no agent process under the launcher")


def _events(tmp: Path, job_id: str) -> list[dict]:
    path = tmp / "runs" / job_id / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _finish(procs: list[subprocess.Popen], tmp: Path, timeout_s: float = 120) -> list[int]:
    codes = []
    for i, proc in enumerate(procs):
        try:
            codes.append(proc.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"host {i} did not finish:\n" + (tmp / f"host{i}.log").read_text()[-3000:]) from None
    return codes


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_agent_is_reported_by_its_launcher_and_rejoins_live(tmp_path):
    """Two hosts train with ``train.steps``; SIGKILL the agent of the host without the master:
    its launcher tells the master within 0.5 s (no heartbeat timeout), the other host's worker
    goes on (live), the restarted agent's worker joins with live state, and both hosts end
    SUCCEEDED with equal parameters."""
    port = _free_port()
    out = tmp_path / "out"
    script = [str(SCRIPTS / "live_train.py"), "--steps", "120", "--samples", "96", "--batch", "4",
              "--step-sleep", "0.1", "--out", str(out)]
    before_shm = shm_entries()
    master_host = _launch(tmp_path, 0, port, "twohosts", *script)
    time.sleep(0.5)  # the first launcher binds the endpoint (either order works; this one makes it known)
    other_host = _launch(tmp_path, 1, port, "twohosts", *script)
    procs = [master_host, other_host]
    try:
        def steps_done() -> int:
            return sum(len(p.read_text().splitlines()) for p in out.glob("steps_*.jsonl")) if out.exists() else 0

        deadline = time.monotonic() + 90
        while steps_done() < 40:
            assert time.monotonic() < deadline, (tmp_path / "host1.log").read_text()[-3000:]
            assert all(p.poll() is None for p in procs), (tmp_path / "host0.log").read_text()[-3000:]
            time.sleep(0.1)
        agent = _agent_of(other_host)
        killed_at = time.time()
        agent.send_signal(signal.SIGKILL)
        codes = _finish(procs, tmp_path)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    logs = [(tmp_path / f"host{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    events = _events(tmp_path, "twohosts")
    lost = [e for e in events if e["kind"] == "node_lost"]
    assert lost, [e["kind"] for e in events]
    assert f"pid {agent.pid}" in lost[0]["reason"]
    assert "launcher" in lost[0]["reason"]
    assert lost[0]["unix_time_s"] - killed_at <= 0.5, lost[0]["unix_time_s"] - killed_at
    assert any(e["kind"] == "live_reformed" for e in events), [e["kind"] for e in events]
    assert "agent_restarting" in logs[1]
    result = json.loads((tmp_path / "runs" / "twohosts" / "result.json").read_text())
    assert result["state"] == JobState.SUCCEEDED.value
    finals = {json.loads(p.read_text())["params"] for p in out.glob("final_*.json")}
    assert len(finals) == 1, finals
    assert job_processes("twohosts") == []
    assert {e for e in shm_entries() - before_shm if "twohosts" in e} == set()


@pytest.mark.timeout(120)
def test_a_host_with_another_rdzv_id_is_refused_with_both_ids(tmp_path):
    port = _free_port()
    (tmp_path / "wait.py").write_text("import time\ntime.sleep(60)\n")
    first = _launch(tmp_path, 0, port, "job-a", "wait.py")
    try:
        time.sleep(0.5)
        second = _launch(tmp_path, 1, port, "job-b", "wait.py")
        assert second.wait(timeout=60) != 0
        log = (tmp_path / "host1.log").read_text()
        assert "runs job 'job-a', not 'job-b'" in log, log[-2000:]
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=60)
    assert job_processes("job-a") == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGQUIT])
def test_a_hangup_or_quit_cancels_the_job_like_sigterm(tmp_path, signum):
    """SIGHUP (a closed terminal, a dropped SSH session) and SIGQUIT are among the signals
    the launcher forwards (torchrun's ``--signals-to-handle`` default). The master and the
    agent handle them as SIGTERM: the job ends CANCELLED with its result written, and no
    process or shared memory is left (they used to die at once, leaving neither)."""
    port = _free_port()
    before_shm = shm_entries()
    first = _launch(tmp_path, 0, port, "hup", str(SCRIPTS / "tiny_train.py"), "--steps", "100000",
                    "--step-sleep", "0.05", nnodes="1")
    try:
        wait_for(lambda: any(e["kind"] == "checkpoint_committed" for e in _events(tmp_path, "hup")), 60,
                 "a first commit")
        os.killpg(first.pid, signum)
        code = first.wait(timeout=60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(timeout=60)
    result = json.loads((tmp_path / "runs" / "hup" / "result.json").read_text())
    name = signal.Signals(signum).name
    assert result["state"] == JobState.CANCELLED.value and name in result["reason"], result
    assert code == 128 + signum
    assert left_behind("hup") == []
    assert {e for e in shm_entries() - before_shm if "hup" in e} == set()


def test_a_master_draining_after_sigterm_does_not_spin(tmp_path):
    """SIGTERM cancels the master, which then drains while an agent has not gone (here one
    is stopped). Its loop must pace itself while it drains (it used to wait on an event the
    signal had set, and so spun a whole core until the drain time ran out)."""
    port = _free_port()
    (tmp_path / "wait.py").write_text("import time\ntime.sleep(60)\n")
    first = _launch(tmp_path, 0, port, "spin", "wait.py")
    agent = master = None
    try:
        agent = _agent_of(first)
        master = wait_for(lambda: next((p for p in psutil.Process(first.pid).children()
                                        if p.name() == "dlrover-master"), None), 30, "the master")
        time.sleep(1.0)  # (its signal handlers are set up)

        def busy_share(window_s: float) -> float:
            t0 = sum(master.cpu_times()[:2])
            time.sleep(window_s)
            return (sum(master.cpu_times()[:2]) - t0) / window_s

        # its start-up work done first (it imports torch on a thread: seconds on a slow machine)
        wait_for(lambda: busy_share(0.5) < 0.2, 90, "the master idle before the SIGTERM")
        agent.send_signal(signal.SIGSTOP)  # an agent that does not say goodbye
        master.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        share = busy_share(2.0)
        assert share < 0.5, f"the draining master used {share:.0%} of a core"
    finally:
        for proc in (agent, master):  # (each leads a process group of its own)
            if proc is not None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_frozen_host_is_left_out_and_rejoins_live_when_it_thaws(tmp_path):
    """SIGSTOP every process of one host (its launcher, agent and worker: a host cut off, no
    connection reset ever comes). After the heartbeat timeout the master drops it and makes
    the survivor shut down its group's connections, so the survivor goes on alone at once
    (not after gloo's collective timeout); after SIGCONT the host's worker rejoins with the
    survivor's state: the same process when its collective fails, a replacement when gloo
    left it blocked (it exits after ``live._STUCK_MIN_S``). Every step is applied once with
    one update; both end equal."""
    port = _free_port()
    out = tmp_path / "out"
    pace = tmp_path / "pace"  # --pace-file: only the sleep between steps changes, never a step
    script = [str(SCRIPTS / "live_train.py"), "--steps", "150", "--samples", "96", "--batch", "4",
              "--step-sleep", "0.1", "--pace-file", str(pace), "--out", str(out)]
    conf = ["--rdzv-conf", "keep_alive_interval=0.5,keep_alive_max_attempt=8"]  # lost after 4 s of silence
    procs = [_launch(tmp_path, 0, port, "frozen", *conf, *script)]
    time.sleep(0.5)
    procs.append(_launch(tmp_path, 1, port, "frozen", *conf, *script))

    def records() -> list[dict]:
        return [json.loads(line) for p in out.glob("steps_*.jsonl") for line in p.read_text().splitlines()]

    try:
        deadline = time.monotonic() + 90
        while len(records()) < 40:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                (tmp_path / "host0.log").read_text()[-3000:]
            time.sleep(0.1)
        frozen = _tree(procs[1].pid)
        worker_pids = {r["pid"] for r in records()}
        # freeze just after the host's worker recorded a step (between steps, where a cut
        # usually finds a training loop)
        mine = next(p.pid for p in frozen if p.pid in worker_pids)
        seen = sum(1 for r in records() if r["pid"] == mine)
        while sum(1 for r in records() if r["pid"] == mine) == seen:
            time.sleep(0.005)
        for p in frozen:
            p.suspend()
        stopped_at = time.time()
        deadline = time.monotonic() + 30
        while not any(e["kind"] == "live_reformed" and e["world_size"] == 1 for e in _events(tmp_path, "frozen")):
            assert time.monotonic() < deadline, [e["kind"] for e in _events(tmp_path, "frozen")]
            time.sleep(0.1)
        alone_at = time.time()
        time.sleep(6)  # the survivor trains alone meanwhile
        # until the thawed host is back in the world, slow steps: on a slow or loaded machine
        # a replacement's cold start must not find the survivor done with every step
        pace.write_text("0.3")
        for p in frozen:
            p.resume()
        deadline = time.monotonic() + 120
        while not any(e["kind"] == "live_reformed" and e["world_size"] == 2
                      for e in _events(tmp_path, "frozen")):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                break  # the asserts below say what went wrong
            time.sleep(0.1)
        pace.write_text("0.01")  # nothing is left to watch but that both end well
        codes = _finish(procs, tmp_path)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
    logs = [(tmp_path / f"host{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert alone_at - stopped_at < 4 + 6, "the survivor waited for more than the heartbeat timeout"
    assert "live_group_severed" in logs[0]
    events = _events(tmp_path, "frozen")
    reforms = [e["world_size"] for e in events if e["kind"] == "live_reformed"]
    assert reforms[:1] == [1] and 2 in reforms[1:], reforms  # alone, then both again
    assert not any(e["kind"] == "workers_restarted" for e in events)
    by_step: dict[int, set[str]] = {}
    for r in records():
        by_step.setdefault(r["step"], set()).add(r["params"])
    assert sorted(by_step) == list(range(150)) and all(len(v) == 1 for v in by_step.values())
    pids = {r["pid"] for r in records()}
    assert mine in pids
    survivor = (worker_pids - {mine}).pop()
    assert survivor in pids  # the survivor's process throughout
    replaced = pids - worker_pids
    if replaced:  # the thawed worker was left blocked by gloo: it exited and a replacement joined
        assert len(replaced) == 1 and "live_worker_stuck" in logs[1], logs[1][-3000:]
    else:
        assert "live_worker_stuck" not in logs[1]
    finals = {json.loads(p.read_text())["params"] for p in out.glob("final_*.json")}
    assert len(finals) == 1, finals
    assert job_processes("frozen") == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lost_host_of_a_sharded_job_comes_back_live_from_its_buddys_replica(tmp_path):
    """``dlrover run --parallel fsdp`` on two hosts, and a third host's ``dlrover run`` (a
    spare) that finds the job full and waits. Host 1 dies as a machine does: its launcher,
    agent and worker SIGKILLed, its shared memory gone. The survivor on host 0 keeps its
    process; the spare stands in for host 1's node: it gets that node's rank's shard from
    host 0's memory (the buddy replica), never from storage, and its worker joins the running
    world in that rank's place. The result is bit-identical to the same job without the
    failure (``--simulate-nodes 2``, the same flags). (Node ids go in the order the hosts'
    agents ask, so host 1's node and rank are read from its output.)"""
    from dlrover_core.checkpoint.shm import node_prefix, remove_segments

    port = _free_port()
    out = tmp_path / "out"
    script = [str(SCRIPTS / "sharded_live_train.py"), "--steps", "40", "--step-sleep", "0.1", "--out", str(out)]
    flags = ["--parallel", "fsdp", "--rdzv-conf", "keep_alive_interval=0.5,keep_alive_max_attempt=6"]
    procs = [_launch(tmp_path, 0, port, "shardhost", *flags, *script)]
    time.sleep(0.5)
    procs.append(_launch(tmp_path, 1, port, "shardhost", *flags, *script))

    def records() -> list[dict]:
        return [json.loads(line) for p in out.glob("steps_*.jsonl") for line in p.read_text().splitlines()]

    def both_training() -> bool:
        assert all(p.poll() is None for p in procs), (tmp_path / "host0.log").read_text()[-3000:]
        return len({r["pid"] for r in records()}) == 2 and len(records()) >= 16

    spare = None
    try:
        wait_for(both_training, 120, "step 8 on both hosts")
        host1 = (tmp_path / "host1.log").read_text()
        lost = int(re.search(r"agent_started .*?node_id=(\d+)", host1).group(1))
        lost_rank = int(re.search(r"workers_started .*?ranks=\[(\d+)\]", host1).group(1))
        survivor = next(r["pid"] for r in records() if r["rank"] != lost_rank)
        spare = _launch(tmp_path, 2, port, "shardhost", *flags, *script)
        # (a new `dlrover run` starts in seconds; on a loaded 2-core machine it has taken over a minute)
        try:
            wait_for(lambda: "node_place_awaited" in (tmp_path / "host2.log").read_text(), 150, "the spare waiting")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the spare printed:\n{(tmp_path / 'host2.log').read_text()[-3000:]}") from None
        victims = _tree(procs[1].pid)
        for p in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(victims, timeout=10)
        remove_segments(node_prefix("shardhost", lost))  # the machine's memory dies with it
        codes = [procs[0].wait(timeout=180), spare.wait(timeout=60)]
    finally:
        for p in [*procs, *([spare] if spare else [])]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    logs = {i: (tmp_path / f"host{i}.log").read_text() for i in (0, 2)}
    assert codes == [0, 0], logs[0][-3000:] + logs[2][-3000:]
    events = _events(tmp_path, "shardhost")
    assert not any(e["kind"] == "workers_restarted" for e in events), [e["kind"] for e in events]
    finals = {json.loads(p.read_text())["pid"]: json.loads(p.read_text()) for p in out.glob("final_*.json")}
    assert survivor in finals and finals[survivor]["start"] == 0, "the survivor trained from step 0 to the end"
    assert "node_place_awaited" in logs[2]
    assert f"stands_in_for={lost}" in (tmp_path / "runs" / "shardhost" / "master.log").read_text()
    assert re.search(rf"replicas_fetched node_id={lost} replicas=\[\{{'rank': {lost_rank},", logs[2]), logs[2][-3000:]
    text = logs[0] + logs[2]  # (each host's agent and workers log to its dlrover run's output)
    restores = re.findall(r"checkpoint_restored .*?source=(\w+) .*?storage_bytes=(\d+)", text)
    assert restores and all(src == "memory" and int(n) == 0 for src, n in restores), restores
    clean = subprocess.run(
        [sys.executable, "-m", "dlrover_core.cli", "run", "--simulate-nodes", "2", "--nproc-per-node", "1",
         "--accelerator", "cpu", "--parallel", "fsdp", "--log-dir", str(tmp_path / "clean_runs"),
         "--checkpoint-dir", str(tmp_path / "clean_ck"), str(SCRIPTS / "sharded_live_train.py"),
         "--steps", "40", "--step-sleep", "0", "--out", str(tmp_path / "clean")],
        cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    assert json.loads((out / "final.json").read_text()) == json.loads((tmp_path / "clean" / "final.json").read_text())
    assert job_processes("shardhost") == []
