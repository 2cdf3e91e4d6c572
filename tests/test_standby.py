"""A node's warm standby: a fork server whose workers behave as cold ``python`` processes.

Real processes: the agent's :class:`Standby` starts ``python -m dlrover_core.agent.standby``
and asks it for workers over its socket; exit codes, output, sessions and seeds are checked
from the outside (``/proc``, signals), as the agent sees them.

A standby started while workers train (``low_priority``) warms up at the lowest CPU
priority: nice 19 for the warm-up thread and, where the kernel has autogroups, for the
standby's session (without the second, a 2-core machine's training steps ran 2x slower while
two standbys warmed up, whatever the thread's nice value); the priorities are read from
``/proc`` (each thread's nice value, field 19 of its ``stat``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from dlrover_core.agent import standby as standby_module
from dlrover_core.agent.forkserver import Standby

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")


def _autogroup_nice(pid: int | str = "self") -> int | None:
    """The nice value of ``pid``'s autogroup; None where the file is missing, or empty (the
    session is in the kernel's default group, as in CI's containers: ``sched(7)``)."""
    try:
        fields = Path(f"/proc/{pid}/autogroup").read_text().split()  # "/autogroup-25 nice 0"
    except OSError:
        return None
    return int(fields[-1]) if fields else None


def _thread_nices(pid: int) -> dict[int, int]:
    """Thread id -> nice value of every thread of ``pid`` (``proc(5)``, ``/proc/pid/task/tid/stat``)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        out[int(task.name)] = int(fields[16])  # field 19 of stat: nice
    return out


def test_a_low_priority_standby_warms_up_at_nice_19_and_its_worker_runs_at_the_agents_priority(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, threading\n"
        "print('worker_nice', os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), flush=True)\n"
        "fields = open('/proc/self/autogroup').read().split() if os.path.exists('/proc/self/autogroup') else []\n"
        "if fields:\n"
        "    print('autogroup_nice', fields[-1], flush=True)\n"
    )
    group_nice = _autogroup_nice()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    standby = Standby(env=env, cwd=str(tmp_path), low_priority=True)
    try:
        seen_low = False
        seen_low_group = group_nice is None or group_nice < 0  # lowered only where it can be set back
        deadline = time.monotonic() + 120
        while not standby.ready():
            assert standby.alive(), "the standby exited while warming up"
            assert time.monotonic() < deadline, "the standby was not ready within 120 s"
            nices = _thread_nices(standby.popen.pid)
            assert nices.get(standby.popen.pid) == os.getpriority(os.PRIO_PROCESS, 0), nices  # main thread
            seen_low = seen_low or 19 in nices.values()
            if not seen_low_group:
                seen_low_group = _autogroup_nice(standby.popen.pid) == 19
            time.sleep(0.02)
        assert seen_low, "no thread of the standby warmed up at nice 19"
        assert seen_low_group, "the standby's autogroup did not warm up at nice 19"
        left = _thread_nices(standby.popen.pid)  # no thread the warm-up started keeps nice 19
        assert set(left.values()) == {os.getpriority(os.PRIO_PROCESS, 0)}, left
        proc = standby.fork(argv=[sys.executable, "-u", str(script)], env=env, cwd=str(tmp_path))
        out = proc.stdout.read()
        proc.wait(timeout=60)
    finally:
        standby.close()
    assert proc.returncode == 0, out
    assert f"worker_nice {os.getpriority(os.PRIO_PROCESS, 0)}" in out.decode(), out
    if group_nice is not None:
        assert f"autogroup_nice {group_nice}" in out.decode(), out


@pytest.mark.parametrize(("text", "expected"), [("/autogroup-25 nice 0\n", 0), ("/autogroup-7 nice 5\n", 5),
                                                ("", None), (None, None)])
def test_autogroup_nice_reads_the_kernels_line_and_none_where_the_session_has_no_group(
        tmp_path, monkeypatch, text, expected):
    # the kernel writes nothing for a session in its default group (CI's containers), and
    # kernels without autogroups have no file at all
    path = tmp_path / "autogroup"
    if text is not None:
        path.write_text(text)
    monkeypatch.setattr(standby_module, "_AUTOGROUP", str(path))
    assert standby_module._autogroup_nice() == expected


# ----- the fork server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def standby(tmp_path_factory):
    """One warm standby for the tests below (warming up costs seconds of CPU)."""
    cwd = tmp_path_factory.mktemp("standby")
    s = Standby(env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=str(cwd), log_file=cwd / "standby.log",
                job_id="standby-test")
    assert s.wait_ready(180), (cwd / "standby.log").read_text()
    yield s
    s.close()


def _fork(standby, tmp_path, code: str, *args: str, env: dict[str, str] | None = None):
    script = tmp_path / f"w{time.monotonic_ns()}.py"
    script.write_text(code)
    return standby.fork(argv=[sys.executable, "-u", str(script), *args], env={**os.environ, **(env or {})},
                cwd=str(tmp_path))


def test_a_forked_worker_runs_its_script_as_python_would(standby, tmp_path):
    # argv, __main__, sys.path[0], the environment, the directory, stdin, its own session
    (tmp_path / "helper_mod.py").write_text("VALUE = 42\n")
    proc = _fork(standby, tmp_path, (
        "import os, sys, helper_mod\n"
        "print('argv', sys.argv[1:], __name__, os.environ['ONLY_HERE'], os.getcwd() == sys.argv[1])\n"
        "print('value', helper_mod.VALUE, 'stdin', repr(sys.stdin.read()))\n"
        "print('session', os.getsid(0) == os.getpid(), 'parent', os.getppid())\n"
        "print('to stderr', file=sys.stderr)\n"
    ), str(tmp_path), "b", env={"ONLY_HERE": "yes"})
    out = proc.stdout.read().decode()
    assert proc.wait(timeout=30) == 0, out
    assert f"argv ['{tmp_path}', 'b'] __main__ yes True" in out, out
    assert "value 42 stdin ''" in out and "to stderr" in out, out
    assert f"session True parent {standby.pid}" in out, out
    assert "ONLY_HERE" not in os.environ


@pytest.mark.parametrize(("code", "expected"), [
    ("import sys; sys.exit(3)", 3),
    ("raise RuntimeError('boom')", 1),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -15),
    ("import os; os._exit(7)", 7),
    ("pass", 0),
])
def test_a_forked_workers_exit_code_is_the_one_popen_would_give(standby, tmp_path, code, expected):
    proc = _fork(standby, tmp_path, code)
    out = proc.stdout.read().decode()
    assert proc.wait(timeout=30) == expected, out
    assert proc.poll() == expected
    if expected == 1:
        assert "RuntimeError: boom" in out, out


def test_forked_workers_draw_their_own_random_numbers_as_cold_processes_do(standby, tmp_path):
    code = "import random, numpy, torch\nprint(torch.rand(1).item(), numpy.random.rand(), random.random())\n"
    outs = []
    for _ in range(3):
        proc = _fork(standby, tmp_path, code)
        outs.append(proc.stdout.read().decode().split())
        assert proc.wait(timeout=30) == 0, outs[-1]
    for column in range(3):
        assert len({o[column] for o in outs}) == 3, outs


def test_what_a_script_leaves_in_its_globals_lives_until_the_interpreter_exits_as_with_python(standby, tmp_path):
    """Freed at the interpreter's exit, as ``python script.py`` frees it, not when the script
    returns: freeing a DistributedDataParallel's gloo group while torch's threads still run
    can deadlock (a benchmark's script hung at its end); at exit those threads end instead."""
    import subprocess

    # (the class lives in another module: a function of the script itself would tie its
    # globals into a reference cycle, which only the collector frees, at exit either way)
    (tmp_path / "left_helper.py").write_text("import sys\n"
                                             "class Left:\n"
                                             "    def __del__(self):\n"
                                             "        print('freed at exit', sys.is_finalizing(), flush=True)\n")
    (tmp_path / "left_mod.py").write_text("import left_helper\nleft = left_helper.Left()\n")
    cold = subprocess.run([sys.executable, "-u", str(tmp_path / "left_mod.py")], capture_output=True, text=True,
                          timeout=60).stdout
    assert cold == "freed at exit True\n", cold
    for argv in ([sys.executable, "-u", str(tmp_path / "left_mod.py")], [sys.executable, "-u", "-m", "left_mod"]):
        proc = standby.fork(argv=argv, env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=str(tmp_path))
        out = proc.stdout.read().decode()
        assert proc.wait(timeout=30) == 0 and out == cold, (argv, out)


def test_a_module_and_a_command_run_as_with_python_m_and_c(standby, tmp_path):
    # as ``python -m``: sys.argv[0] is the module's file
    (tmp_path / "pkg_mod_x.py").write_text("import os, sys\nprint('module', __name__, os.path.basename(sys.argv[0]), sys.argv[1:])\n")
    proc = standby.fork(argv=[sys.executable, "-u", "-m", "pkg_mod_x", "a"], env={**os.environ, "PYTHONPATH": str(tmp_path)},
                        cwd=str(tmp_path))
    out = proc.stdout.read().decode()
    assert proc.wait(timeout=30) == 0 and "module __main__ pkg_mod_x.py ['a']" in out, out
    proc = standby.fork(argv=[sys.executable, "-c", "import sys; print('command', __name__, sys.argv)", "z"],
                        env=dict(os.environ), cwd=str(tmp_path))
    out = proc.stdout.read().decode()
    assert proc.wait(timeout=30) == 0 and "command __main__ ['-c', 'z']" in out, out


def test_a_fork_answered_after_its_request_gave_up_is_killed_not_adopted(standby, tmp_path, monkeypatch):
    from dlrover_core.agent import forkserver
    from dlrover_core.agent.forkserver import StandbyGone

    monkeypatch.setattr(forkserver, "_FORK_TIMEOUT_S", 0.0)  # the answer always comes too late
    with pytest.raises(StandbyGone, match="did not fork"):
        _fork(standby, tmp_path, "import time; time.sleep(300)")
    monkeypatch.undo()
    proc = _fork(standby, tmp_path, "print('mine', flush=True)")  # the next request gets its own worker
    assert proc.stdout.read() == b"mine\n" and proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 30
    while children := Path(f"/proc/{standby.pid}/task/{standby.pid}/children").read_text().split():
        assert time.monotonic() < deadline, f"the late worker still runs: {children}"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_standby_that_dies_takes_its_workers_with_it_and_they_read_minus_9(tmp_path):
    s = Standby(env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=str(tmp_path))
    try:
        assert s.wait_ready(180)
        procs = [_fork(s, tmp_path, "import time; print('up', flush=True); time.sleep(300)") for _ in range(2)]
        for p in procs:
            assert p.stdout.readline() == b"up\n"
        os.kill(s.pid, 9)
        for p in procs:
            assert p.wait(timeout=10) == -9
            assert not Path(f"/proc/{p.pid}").exists() or "Z" in Path(f"/proc/{p.pid}/stat").read_text().split(")")[1][:3]
        assert not s.alive()
    finally:
        s.close()


def test_closing_a_standby_ends_it_and_what_it_forked(tmp_path):
    s = Standby(env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=str(tmp_path))
    s.close()  # while it warms up: killed
    assert s.popen.returncode is not None
    s = Standby(env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=str(tmp_path))
    assert s.wait_ready(180)
    proc = _fork(s, tmp_path, "import time; print('up', flush=True); time.sleep(300)")
    assert proc.stdout.readline() == b"up\n"
    s.close()  # warm: it reads the closed socket and exits, its worker with it
    assert s.popen.returncode == 0
    assert proc.wait(timeout=10) == -9


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_stress_random_forks_exits_and_kills_from_two_threads_give_each_worker_its_own_exit_code(
        standby, tmp_path, seed):
    """Two agent threads fork workers while a third kills random ones; every worker's
    reported exit code is its own (its exit code, or minus the signal that killed it), its
    output is whole, and none is left running or unreaped."""
    import random
    import threading

    rng = random.Random(seed)
    plans = [(rng.randrange(0, 5), rng.uniform(0, 0.3), rng.random() < 0.3) for _ in range(16)]
    script = tmp_path / "w.py"
    script.write_text("import sys, time\ntime.sleep(float(sys.argv[2]))\nprint('done', sys.argv[1], flush=True)\n"
                      "sys.exit(int(sys.argv[1]))\n")
    results: dict[int, tuple] = {}
    lock = threading.Lock()

    def forker(part: list[int]) -> None:
        for i in part:
            code, sleep_s, kill = plans[i]
            proc = standby.fork(argv=[sys.executable, "-u", str(script), str(code), str(sleep_s if not kill else 30)],
                                env=dict(os.environ), cwd=str(tmp_path))
            with lock:
                results[i] = (proc, kill)
            time.sleep(rng.uniform(0, 0.05))

    threads = [threading.Thread(target=forker, args=(list(range(k, len(plans), 2)),)) for k in range(2)]
    for t in threads:
        t.start()
    killed = set()
    while any(t.is_alive() for t in threads) or len(killed) < sum(k for _, _, k in plans):
        with lock:
            targets = [(i, p) for i, (p, kill) in results.items() if kill and i not in killed]
        for i, p in targets:
            os.kill(p.pid, rng.choice([9, 15]))
            killed.add(i)
        time.sleep(0.01)
    for t in threads:
        t.join()
    for i, (proc, kill) in results.items():
        code = proc.wait(timeout=60)
        out = proc.stdout.read().decode()
        if kill:
            assert code in (-9, -15), (i, code, out)
        else:
            assert code == plans[i][0] and out == f"done {plans[i][0]}\n", (i, code, out)
    children = Path(f"/proc/{standby.pid}/task/{standby.pid}/children").read_text().split()
    assert children == [], children  # every worker reaped


# ----- in a job -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_whose_standby_is_killed_goes_on_and_its_node_gets_a_new_standby(tmp_path):
    """The standby of a running 1-node job is SIGKILLed: its workers die with it (they are its
    children), the agent reports the failure and restarts them — cold, as no standby is warm
    — and starts a new standby at nice 19; the job ends SUCCEEDED within its restart budget
    and leaves no process behind."""
    import signal

    from helpers import SCRIPTS, job_processes, node_standbys, wait_for

    from dlrover_core import Checkpoint, Failure, Job, JobState, Nodes

    job = Job(name="standby-killed", entrypoint=str(SCRIPTS / "tiny_train.py"),
              args=["--steps", "60", "--step-sleep", "0.1"], nodes=Nodes(min=1, max=1, nproc_per_node=2),
              accelerator="cpu", log_dir=str(tmp_path / "runs"),
              checkpoint=Checkpoint(dir=str(tmp_path / "ck"), persist_every_steps=10),
              failure=Failure(max_restarts=1, stop_grace_s=5))
    run = job.submit()
    try:
        wait_for(lambda: run.status().step >= 10, 150, "step 10")
        (standby,) = node_standbys(run.handle.log_dir, 0)
        os.kill(standby.pid, signal.SIGKILL)
    finally:
        result = run.wait(progress=False, timeout_s=200)
    assert result.state == JobState.SUCCEEDED, result.reason
    assert result.restarts == 1 and result.final_step == 59
    node_log = next(Path(result.log_dir).glob("node_0*.log")).read_text()
    assert "standby_exited" in node_log, node_log[-3000:]
    assert "warm=[False, False]" in node_log or "warm=False" in node_log, node_log[-3000:]
    assert job_processes(result.job_id) == []


def test_a_failed_warm_up_is_raised_in_the_standbys_main_thread_which_ends_it():
    """A warm-up at low priority runs on its own thread: its failure is re-raised where the
    standby waits for it (its main thread), so the standby ends before it says it is ready
    and the agent starts its workers cold, as from no standby at all."""
    def broken() -> None:
        raise ImportError("a plugin's module is missing")

    with pytest.raises(ImportError, match="a plugin's module is missing"):
        standby_module._LowPriority(broken).join(30.0)
    assert standby_module._LowPriority(lambda: None).join(30.0) is True
