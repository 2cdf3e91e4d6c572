"""The ``srun`` task of a node: runs the node's elastic agent, then cleans up after it there.

``python -m dlrover_plugin_slurm.node_task --job-id J --node-id N --master-addr H:P --log-dir D``
is what the batch script's ``srun`` and :meth:`SlurmScheduler.relaunch_node` start on a compute
node. It starts ``python -m dlrover_core.agent`` with the same arguments and waits for it.

An agent removes its node's shared-memory segments (``/dev/shm/dlrover-<job>-n<node>-*``) when
it exits, but a SIGKILLed agent (or one the OOM killer took) cannot. The segments are on that
compute node only, where nothing else of the job may ever run again: the master relaunches the
node elsewhere when it excludes it (under a new node id), an elastic job may go on without it,
and ``cancel`` runs on the submitting machine. So this task, which outlives its agent on the
same node, removes them once the agent is gone — an epilog of the task:

1. it is the child subreaper of the agent's processes (``PR_SET_CHILD_SUBREAPER``), so the
   agent's workers and standbys, which die with the agent (``PR_SET_PDEATHSIG``), are
   reparented to it and not to init;
2. once the agent has exited, any such process still alive is killed and every one reaped, so
   none of them can write to a segment afterwards;
3. if a signal ended the agent (an agent that exits by itself has removed its segments), the
   node's segments are removed, except any that a live process still has open or mapped (a
   replacement agent of the same node on the same machine), with the event
   ``slurm_node_segments_removed`` in the node's log; the task exits with the agent's code
   (``128 + N`` for signal N).

SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 received by the task are passed on to the agent
(Slurm usually signals every process of the step anyway; the agent acts on the first and
ignores the repeat). Only a SIGKILL of the task itself (Slurm's after ``KillWait``) skips the
cleanup; the agent has had ``KillWait`` seconds to clean up on its own by then.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from dlrover_core.backend import SHM_DIR, get_logger
from dlrover_plugin_slurm._script import agent_argv

__all__ = ["main", "remove_node_segments", "run_agent"]

#: prctl(2) option that makes this process the reaper of its orphaned descendants.
PR_SET_CHILD_SUBREAPER = 36
#: Signals passed on to the agent.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
#: After the agent exited, how long the killed leftovers of its process tree may take to be
#: reaped before the segments are removed anyway (seconds).
REAP_TIMEOUT_S = 10.0


def _become_subreaper() -> bool:
    """Make orphaned descendants children of this process (Linux); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _exit_code(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128 + the signal number."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _wait_for(pid: int) -> int:
    """Wait for ``pid``, reaping any other (orphaned) child that ends meanwhile; its wait status."""
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:  # pragma: no cover - pid was ours: cannot happen
            return 0
        if done == pid:
            return status


def _kill_and_reap_leftovers(timeout_s: float) -> list[int]:
    """SIGKILL every process still below this one (the dead agent's tree) and reap them;
    return their pids. Gives up reaping after ``timeout_s``."""
    try:
        leftovers = psutil.Process().children(recursive=True)
    except psutil.Error:
        leftovers = []
    for proc in leftovers:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if done == 0:
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
    return [p.pid for p in leftovers]


def _in_use(shm_dir: Path, prefix: str) -> set[str]:
    """Names of segments ``prefix*`` in ``shm_dir`` that a live process has open or mapped
    (from ``/proc/<pid>/fd`` and ``/proc/<pid>/maps``; processes we may not inspect are
    skipped: they are not this job's)."""
    base = f"{shm_dir}/{prefix}"
    used: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{entry}/fd/{fd}")
                    if target.startswith(base):
                        used.add(target[len(str(shm_dir)) + 1:].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError), open(f"/proc/{entry}/maps") as maps:
            for line in maps:
                if base in line:
                    path = line.split(maxsplit=5)[-1].strip().removesuffix(" (deleted)")
                    used.add(path[len(str(shm_dir)) + 1:])
    return used


def remove_node_segments(job_id: str, node_id: str) -> tuple[list[str], list[str]]:
    """Remove the segments of node ``node_id`` of job ``job_id`` on this machine that no live
    process holds; return ``(removed, kept because in use)``."""
    prefix = f"dlrover-{job_id}-n{node_id}-"
    try:
        names = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return [], []
    if not names:
        return [], []
    used = _in_use(SHM_DIR, prefix)
    removed = []
    for name in names:
        if name in used:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / name)
            removed.append(name)
    return removed, sorted(used & set(names))


def run_agent(argv: Sequence[str], *, job_id: str, node_id: str) -> int:
    """Run ``argv`` (the agent) and wait for it; kill and reap what is left of its process
    tree; if a signal ended it, remove the segments ``dlrover-<job_id>-n<node_id>-*`` it left
    on this machine (see the module docstring). Return the agent's exit code (``128 + N`` if
    signal N ended it)."""
    subreaper = _become_subreaper()
    agent: dict[str, int | None] = {"pid": None}  # the live agent's pid, for the signal handler

    def forward(signum: int, _frame: object) -> None:
        pid = agent["pid"]
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for sig in FORWARDED_SIGNALS:  # before the spawn: the agent starts with default handlers
        signal.signal(sig, forward)
    pid = agent["pid"] = os.posix_spawn(argv[0], list(argv), os.environ)
    status = _wait_for(pid)
    agent["pid"] = None
    code = _exit_code(status)
    leftovers = _kill_and_reap_leftovers(REAP_TIMEOUT_S)
    if not os.WIFSIGNALED(status):
        return code  # the agent ended by itself and removed its segments (its own incarnation's only)

    removed, in_use = remove_node_segments(job_id, node_id)
    get_logger().warning(
        "slurm_node_segments_removed", job_id=job_id, node_id=int(node_id),
        agent_signal=_signal_name(os.WTERMSIG(status)), segments=removed, kept_in_use=in_use,
        killed_leftovers=leftovers, subreaper=subreaper,
    )
    return code


def main(args: Sequence[str] | None = None) -> int:
    """Parse the agent's arguments, run it with :func:`run_agent`; return the exit code."""
    parser = argparse.ArgumentParser(prog="python -m dlrover_plugin_slurm.node_task",
                                     description="Run a node's dlrover agent under srun and clean up after it.")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--node-id", required=True, type=int)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--log-dir", required=True)
    ns = parser.parse_args(args)
    argv = agent_argv(sys.executable, ns.job_id, str(ns.node_id), ns.master_addr, ns.log_dir)
    try:
        return run_agent(argv, job_id=ns.job_id, node_id=str(ns.node_id))
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EACCES):
            print(f"dlrover: cannot start the agent {argv[0]!r}: {exc.strerror}", file=sys.stderr)
            return 127
        raise


if __name__ == "__main__":
    sys.exit(main())
