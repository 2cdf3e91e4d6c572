"""A warm standby warms up at the lowest CPU priority, and the worker it becomes does not.

Nice 19 for the warm-up thread and, where the kernel has autogroups, for the standby's
session: without the second, a 2-core machine's training steps ran 2x slower while two
standbys warmed up, whatever the thread's nice value.

Real processes: the agent's :class:`Standby` starts ``python -m dlrover_core.agent.standby``;
the priorities are read from ``/proc`` (each thread's nice value, field 19 of its ``stat``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from dlrover_core.agent import standby as standby_module
from dlrover_core.agent.workers import Standby

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


def test_standby_warms_up_at_nice_19_and_its_worker_runs_at_the_agents_priority(tmp_path):
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
    standby = Standby(env=env, cwd=str(tmp_path))
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
        proc = standby.activate(argv=[sys.executable, "-u", str(script)], env=env, cwd=str(tmp_path))
        out = proc.stdout.read()  # its stdin is closed already: not communicate()
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
