"""The standby the nodes of one host share (:mod:`dlrover_core.agent.zygote`).

Real processes: the agent's :class:`Standby` with a ``shared_log_file`` asks the host's
shared standby (starting it when none listens) to fork the node's standby; the process tree,
exit codes and who survives which kill are read from the outside (``/proc``, ``psutil``).
The stress test drives several "agents" (``Standby`` objects, and agent processes killed
with SIGKILL) through random schedules of forks, kills and closes and checks the invariants:
every standby a node asks for becomes ready (shared, or its own where the shared one is
gone), every worker's exit code is the one it exited with (``-9`` where it was killed or its
standby died), and nothing of the job is left once every agent closed its standby.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from helpers import job_processes, wait_for, writing_to

from dlrover_core.agent import forkserver
from dlrover_core.agent.forkserver import Standby, StandbyGone, shared_standby_digest, shared_standby_name

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="abstract Unix sockets and pidfds are Linux's")

_READY_S = 180.0  # a warm-up is a few CPU-seconds; a loaded 2-core machine may take long


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _standby(tmp: Path, job_id: str, node: int, **kw) -> Standby:
    node_dir = tmp / f"node_{node}"
    node_dir.mkdir(exist_ok=True)
    return Standby(env=kw.pop("env", None) or _env(), cwd=str(tmp), log_file=node_dir / "standby.log",
                   job_id=job_id, shared_log_file=tmp / "shared_standby.log", **kw)


def _shared(tmp: Path) -> list[psutil.Process]:
    """The shared standbys writing to ``tmp``'s ``shared_standby.log`` (the standbys they fork
    keep their command line, but write to their node's log)."""
    return writing_to(tmp / "shared_standby.log")


def _fork(standby: Standby, tmp: Path, code: str):
    return standby.fork(argv=[sys.executable, "-c", code], env=_env(), cwd=str(tmp))


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _job_id(name: str) -> str:
    return f"{name}-{os.getpid()}-{time.monotonic_ns() % 10**9}"


# ----- the name: who shares -----------------------------------------------------------------------


def test_only_standbys_that_would_be_identical_share_a_name():
    env = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "DLROVER_WATCH_PID": "11", "DLROVER_STANDBY_FD": "5"}
    same = {**env, "DLROVER_WATCH_PID": "12", "DLROVER_STANDBY_FD": "9"}  # what names the agent only
    assert shared_standby_name("j", env, "/w") == shared_standby_name("j", same, "/w")
    for other in ({**env, "OMP_NUM_THREADS": "1"}, {**env, "EXTRA": "1"}, {k: v for k, v in env.items() if k != "PATH"}):
        assert shared_standby_name("j", other, "/w") != shared_standby_name("j", env, "/w"), other
    assert shared_standby_name("j", env, "/x") != shared_standby_name("j", env, "/w")
    assert shared_standby_name("k", env, "/w") != shared_standby_name("j", env, "/w")
    assert f"-{os.getuid()}-j-" in shared_standby_name("j", env, "/w")


def test_the_shared_standby_refuses_a_request_whose_environment_differs():
    from dlrover_core.agent import zygote

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # (SO_PEERCRED: this user)
    with ours, theirs:
        digest = shared_standby_digest({"A": "1"}, "/w")
        assert zygote._refusal(ours, {"env": {"A": "1", "DLROVER_WATCH_PID": "3"}, "cwd": "/w"}, digest) is None
        assert "differs" in zygote._refusal(ours, {"env": {"A": "2"}, "cwd": "/w"}, digest)
        assert "differs" in zygote._refusal(ours, {"env": {"A": "1"}, "cwd": "/v"}, digest)


# ----- sharing ------------------------------------------------------------------------------------


def test_the_nodes_of_a_host_share_one_warm_process_that_forks_their_standbys(tmp_path):
    job_id = _job_id("share")
    standbys = [_standby(tmp_path, job_id, node) for node in range(3)]
    try:
        for s in standbys:
            assert s.wait_ready(_READY_S), (tmp_path / "shared_standby.log").read_text(errors="replace")
        assert all(s.shared and s.popen is None for s in standbys)
        (shared,) = _shared(tmp_path)
        assert sorted(p.pid for p in shared.children()) == sorted(s.pid for s in standbys)
        assert shared.ppid() != os.getpid()  # it left the tree of the agent that started it
        for node, s in enumerate(standbys):
            proc = _fork(s, tmp_path, f"import os, sys; print(os.getppid(), flush=True); sys.exit({node + 3})")
            out = proc.stdout.read().decode()
            assert proc.wait(timeout=30) == node + 3, out
            assert out.split() == [str(s.pid)]  # the node's standby forked it
            assert psutil.Process(s.pid).cwd() == str(tmp_path)
    finally:
        for s in standbys:
            s.close()
    assert all(_gone(s.pid) for s in standbys)  # close() returns once its standby is gone
    # the last of its standbys gone, the shared one exits too: nothing of the job is left
    wait_for(lambda: job_processes(job_id) == [], 15, "the shared standby to exit")


_AGENT = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from dlrover_core.agent.forkserver import Standby
    tmp, job_id, env = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    (tmp / "node_9").mkdir(exist_ok=True)
    s = Standby(env=env, cwd=str(tmp), log_file=tmp / "node_9" / "standby.log", job_id=job_id,
                shared_log_file=tmp / "shared_standby.log")
    assert s.wait_ready(180) and s.shared
    w = s.fork(argv=[sys.executable, "-c", "import time; time.sleep(600)"], env=env, cwd=str(tmp))
    print(json.dumps({"standby": s.pid, "worker": w.pid}), flush=True)
    time.sleep(600)
""")


def test_an_agent_that_dies_takes_its_standby_and_workers_with_it_and_no_other(tmp_path):
    job_id = _job_id("agentdies")
    mine = _standby(tmp_path, job_id, 0)
    agent = subprocess.Popen([sys.executable, "-c", _AGENT, str(tmp_path), job_id, json.dumps(_env())],
                             stdout=subprocess.PIPE, cwd=str(tmp_path))
    try:
        assert mine.wait_ready(_READY_S)
        theirs = json.loads(agent.stdout.readline())
        my_worker = _fork(mine, tmp_path, "import time; time.sleep(600)")
        agent.kill()  # SIGKILL: nothing of the agent runs to clean up
        agent.wait()
        wait_for(lambda: _gone(theirs["standby"]) and _gone(theirs["worker"]), 15,
                 "the dead agent's standby and worker to exit")
        assert mine.ready() and my_worker.poll() is None  # the other node's are untouched
        proc = _fork(mine, tmp_path, "print('still forking', flush=True)")
        assert proc.stdout.read() == b"still forking\n" and proc.wait(timeout=30) == 0
        assert len(_shared(tmp_path)) == 1
        os.kill(my_worker.pid, signal.SIGKILL)
        assert my_worker.wait(timeout=30) == -9
    finally:
        if agent.poll() is None:
            agent.kill()
        mine.close()
    wait_for(lambda: job_processes(job_id) == [], 15, "the job's processes to exit")


def test_a_killed_shared_standby_leaves_the_nodes_standbys_working_and_another_starts_on_demand(tmp_path):
    job_id = _job_id("sharedkilled")
    first = _standby(tmp_path, job_id, 0)
    second = None
    try:
        assert first.wait_ready(_READY_S)
        (shared,) = _shared(tmp_path)
        shared.kill()
        shared.wait(timeout=10)
        proc = _fork(first, tmp_path, "print('forked', flush=True)")
        assert proc.stdout.read() == b"forked\n" and proc.wait(timeout=30) == 0
        second = _standby(tmp_path, job_id, 1)
        assert second.wait_ready(_READY_S) and second.shared
        (again,) = _shared(tmp_path)
        assert again.pid != shared.pid
    finally:
        first.close()
        if second is not None:
            second.close()
    wait_for(lambda: job_processes(job_id) == [], 15, "the job's processes to exit")


def test_a_refused_request_falls_back_to_a_standby_of_its_own(tmp_path, monkeypatch):
    job_id = _job_id("refused")
    # two environments under one name: the shared standby sees the second one's differ
    monkeypatch.setattr(forkserver, "shared_standby_name", lambda job_id, env, cwd: f"dlrover-standby-test-{job_id}")
    first = _standby(tmp_path, job_id, 0)
    second = _standby(tmp_path, job_id, 1, env={**_env(), "OMP_NUM_THREADS": "2"})
    try:
        assert first.wait_ready(_READY_S) and first.shared
        assert second.wait_ready(_READY_S), (tmp_path / "node_1" / "standby.log").read_text(errors="replace")
        assert not second.shared and second.popen is not None  # its own process, warmed up itself
        proc = _fork(second, tmp_path, "import os; print(os.environ['OMP_NUM_THREADS'], flush=True)")
        assert proc.stdout.read() == b"1\n" and proc.wait(timeout=30) == 0  # (the worker's env is the request's)
    finally:
        first.close()
        second.close()
    wait_for(lambda: job_processes(job_id) == [], 15, "the job's processes to exit")


def test_a_standby_closed_before_it_is_ready_leaves_nothing_behind(tmp_path):
    """The only node that asked closes its standby while the shared one still warms up: the
    shared one sees nobody waits for it and exits at once, not after its warm-up."""
    job_id = _job_id("earlyclose")
    s = _standby(tmp_path, job_id, 0, low_priority=True)  # (a warm-up at nice 19 takes long)
    wait_for(lambda: _shared(tmp_path), 30, "the shared standby to start")
    s.close()
    wait_for(lambda: job_processes(job_id) == [], 30, "the shared standby to exit")
    assert "Traceback" not in (tmp_path / "shared_standby.log").read_text(errors="replace")
    other = _standby(tmp_path, job_id, 1)  # the next node's request starts a new one
    try:
        assert other.wait_ready(_READY_S) and other.shared
    finally:
        other.close()
    wait_for(lambda: job_processes(job_id) == [], 30, "the job's processes to exit")


def test_a_shared_standby_nobody_asks_exits_after_its_idle_time(tmp_path):
    """The agent that started the shared standby died before it asked: with no request in
    ``--idle-exit-s`` (60 s by default) it exits (code 0), here while it still warms up;
    once warm, its serving loop does the same (the second half)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"\0dlrover-test-idle-{os.getpid()}-{time.monotonic_ns()}")
    listener.listen()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "dlrover_core.agent.zygote", "--listen-fd", str(listener.fileno()),
                             "--idle-exit-s", "0.5"], pass_fds=[listener.fileno()],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in out, out
    assert time.monotonic() - t0 >= 0.5
    serve = ("import socket, sys, time; from dlrover_core.agent import zygote\n"
             "listener = socket.socket(fileno=int(sys.argv[1])); t0 = time.monotonic()\n"
             "print(zygote._serve(listener, 'digest', [], idle_exit_s=1.0), round(time.monotonic() - t0, 1))")
    out = subprocess.run([sys.executable, "-c", serve, str(listener.fileno())], pass_fds=[listener.fileno()],
                         capture_output=True, text=True, timeout=60)
    listener.close()
    returned, waited_s = out.stdout.split()
    assert returned == "None" and 1.0 <= float(waited_s) < 30, out


# ----- stress -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [11, 12])
def test_random_forks_kills_and_closes_keep_every_standby_answering(tmp_path, seed):
    rng = random.Random(seed)
    job_id = _job_id(f"stress{seed}")
    standbys: dict[int, Standby] = {}
    workers: list[tuple[object, set[int], int]] = []  # (process, the exit codes it may end with, its node)
    next_node = 0
    shared_kills = 0

    def add() -> None:
        nonlocal next_node
        standbys[next_node] = _standby(tmp_path, job_id, next_node)
        next_node += 1

    def end_node(node: int, kill: bool) -> None:
        s = standbys.pop(node)
        if kill and s.pid is not None:
            os.kill(s.pid, signal.SIGKILL)
            wait_for(lambda: not s.alive(), 15, "the killed standby to be seen gone")
        s.close()
        assert s.pid is None or _gone(s.pid)
        for i, (proc, codes, n) in enumerate(workers):
            if n == node:
                workers[i] = (proc, codes | {-9}, n)  # it dies with its standby, unless it ended first

    add()
    try:
        for _ in range(24):
            action = rng.choice(["add", "fork", "fork", "fork", "kill_worker", "kill_standby", "close",
                                 "kill_shared"])
            if action == "add" or not standbys:
                add()
                continue
            node = rng.choice(sorted(standbys))
            s = standbys[node]
            if action == "fork":
                assert s.wait_ready(_READY_S), f"node {node}'s standby never became ready"
                code = rng.randrange(0, 4)
                sleep_s = rng.choice([0.0, 0.05, 0.5, 30.0])
                try:
                    proc = _fork(s, tmp_path, f"import sys, time; time.sleep({sleep_s}); sys.exit({code})")
                except StandbyGone as exc:  # only where its standby died (never in this schedule)
                    pytest.fail(f"a ready standby did not fork: {exc}")
                workers.append((proc, {code}, node))
            elif action == "kill_worker":
                running = [(i, w) for i, w in enumerate(workers) if w[0].poll() is None]
                if running:
                    i, (proc, codes, n) = rng.choice(running)
                    os.kill(proc.pid, signal.SIGKILL)
                    workers[i] = (proc, codes | {-9}, n)
            elif action in ("kill_standby", "close"):
                assert s.wait_ready(_READY_S)
                end_node(node, kill=action == "kill_standby")
            elif action == "kill_shared" and shared_kills < 2:
                shared_kills += 1
                for p in _shared(tmp_path):
                    p.kill()
                # the nodes' standbys go on: each still forks
                for n, other in standbys.items():
                    if other.ready():
                        proc = _fork(other, tmp_path, "pass")
                        assert proc.wait(timeout=30) == 0, f"node {n}'s standby stopped forking"
            time.sleep(rng.choice([0.0, 0.01, 0.1]))
        for node in sorted(standbys):
            assert standbys[node].wait_ready(_READY_S), f"node {node}'s standby never became ready"
        # the long sleepers are killed by the closes below
    finally:
        for node in sorted(standbys):
            end_node(node, kill=False)
    for proc, codes, node in workers:
        assert proc.wait(timeout=30) in codes, (node, proc.pid, proc.returncode, codes)
    wait_for(lambda: job_processes(job_id) == [], 30, "the job's processes to exit")
