"""``python -m dlrover_core.agent.standby``: a warm spare worker.

The agent keeps standby processes that have already imported what workers need (torch,
numpy, safetensors, ``dlrover_core.train``, the plugin host). When workers (re)start, a standby receives one
line of JSON on stdin — ``{"argv": [...], "env": {...}, "cwd": "..."}``, the exact command
and environment a cold worker would get — takes that environment and working directory, and
runs the entrypoint in-process as ``python`` would (``runpy``, ``__main__``, ``sys.argv``,
``sys.path[0]``). The replacement worker so skips starting Python and importing torch
(about a second on this kind of machine).

The warm-up runs at the lowest CPU priority (nice 19, for its thread and, where the kernel
groups processes by session, for the standby's session; see :func:`_preload_at_low_priority`):
on a node whose cores the workers keep busy, a standby waits for idle CPU instead of slowing
the training it stands by for. Then the priority is back to what the agent started it with,
for the worker it becomes. Where idle CPU is scarce the standby is ready later, and a
restart before that starts a fresh process, as without standbys.

Caveats: variables read when a library is imported (OpenMP's ``OMP_NUM_THREADS``) take the
standby's value, which the agent sets to the workers' one; the process title stays this
module's.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import threading

import dlrover_core.train  # noqa: F401  (what workers import, before they are needed)
from dlrover_core.accelerators.numa import parse_cpu_ranges
from dlrover_core.env import CPU_AFFINITY, STANDBY_READY_FD
from dlrover_core.plugins import get_host, reset_host
from dlrover_core.train.progress import install_excepthook

#: The variables the plugin host reads when it loads (``dlrover_core.plugins.PluginHost``).
_HOST_VARIABLES = ("DLROVER_PLUGINS", "DLROVER_DISABLE_PLUGINS")


def _preload() -> None:
    """Import the heavy modules workers need (the point of a standby: this runs while it waits)."""
    import numpy  # noqa: F401  (heavy)
    import safetensors.torch  # noqa: F401  (heavy)
    import torch  # noqa: F401  (heavy)
    import torch.distributed  # noqa: F401  (heavy)

    get_host()  # plugin discovery (entry points, plugin imports): about a second, done while waiting
    # what a worker's first step loads on first use (autograd, the optimizers' torch._dynamo
    # and sympy imports): about 3 s here, that a replacement would pay before it can join
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 2)).sum().backward()
    optimizer.step()


#: nice value of the warm-up thread: the lowest, as ``nice -n 19`` (``setpriority(2)``)
_PRELOAD_NICE = 19


_AUTOGROUP = "/proc/self/autogroup"


def _autogroup_nice() -> int | None:
    """The nice value of this process's autogroup (``sched(7)``, "The autogroup feature"),
    or None where it has none: not Linux, a kernel built without autogroups, or a session in
    the kernel's default group (the file is there but empty: a session begun while
    autogroups were off, e.g. in some containers). Inside a CPU cgroup, or with
    ``kernel.sched_autogroup_enabled=0``, the value may be there but the kernel does not use
    it; per-thread nice values rule then, and lowering it changes nothing."""
    try:
        with open(_AUTOGROUP) as f:
            return int(f.read().split()[-1])  # "/autogroup-25 nice 0"
    except (OSError, ValueError, IndexError):
        return None


def _set_autogroup_nice(nice: int) -> bool:
    try:
        with open(_AUTOGROUP, "w") as f:
            f.write(str(nice))
        return True
    except OSError:
        return False


def _preload_at_low_priority() -> None:
    """Run :func:`_preload` at the lowest CPU priority and wait for it.

    Two mechanisms, because Linux applies one or the other: the warm-up runs in a thread of
    nice :data:`_PRELOAD_NICE` (nice values are per thread, ``setpriority(2)``), and, where
    the kernel groups processes by session (autogroups, ``sched(7)``: there a thread's nice
    value only ranks it within its session, and the standby has a session of its own), the
    session's autogroup is set to the same nice value and set back after. Setting it back
    needs no privilege when the old value is 0 or more (only negative values do), so it is
    lowered only then.

    Raises:
        BaseException: whatever the warm-up raised, re-raised here.
    """
    failure: list[BaseException] = []

    # Threads the warm-up starts would keep nice 19 after it: its tensors stay tiny, so torch
    # starts no OpenMP pool (checked: only the main thread is left when the standby is
    # ready). A warm-up that fails (a plugin that installs a signal handler at import, which
    # only the main thread may) ends the standby, and restarts start fresh processes.
    def warm_up() -> None:
        with contextlib.suppress(OSError, AttributeError):  # not Linux: the thread keeps the priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _PRELOAD_NICE)
        try:
            _preload()
        except BaseException as exc:  # handed to the main thread
            failure.append(exc)

    group_nice = _autogroup_nice()
    lowered = group_nice is not None and group_nice >= 0 and _set_autogroup_nice(_PRELOAD_NICE)
    try:
        thread = threading.Thread(target=warm_up, name="dlrover-standby-warm-up", daemon=True)
        thread.start()
        thread.join()
    finally:
        if lowered and not _set_autogroup_nice(group_nice):
            raise RuntimeError(f"could not set the standby's autogroup nice value back to {group_nice}")
    if failure:
        raise failure[0]


def _run(argv: list[str]) -> None:
    args = argv[1:]  # drop the interpreter
    while args and args[0] == "-u":
        args = args[1:]
    if args and args[0] == "-m":
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, rest = args[0], args[1:]
        sys.argv = [script, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def _bind_cpus() -> None:
    """Bind every thread of this process to the CPUs in ``DLROVER_CPU_AFFINITY``
    (``--numa-binding``), as torch binds a worker that is a function
    (``torch.numa.binding._bind_all_threads_in_current_process_to_logical_cpus``): a fresh
    worker is bound before its program starts; a standby, already running, at activation."""
    value = os.environ.get(CPU_AFFINITY)
    if not value or not hasattr(os, "sched_setaffinity"):
        return
    cpus = parse_cpu_ranges(value)
    os.sched_setaffinity(0, cpus)
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError):  # a thread may have ended meanwhile
                os.sched_setaffinity(int(tid), cpus)


def _say_ready() -> None:
    """One byte on the agent's pipe: warm now (the agent prefers a fresh process before)."""
    fd = int(os.environ.pop(STANDBY_READY_FD, "-1"))
    if fd >= 0:
        try:
            os.write(fd, b"1")
        except OSError:
            pass
        finally:
            os.close(fd)


def main() -> None:
    _preload_at_low_priority()
    _say_ready()
    line = sys.stdin.readline()
    if not line:  # the agent closed the pipe without a job: not needed any more
        return
    spec = json.loads(line)
    if any(os.environ.get(k) != spec["env"].get(k) for k in _HOST_VARIABLES):
        reset_host()  # the worker selects other plugins than this standby loaded
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["cwd"])
    _bind_cpus()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        import torch  # heavy (imported by _preload already)

        torch.set_num_threads(int(threads))
    install_excepthook()  # an exception at import of the entrypoint is recorded for the master too
    _run(spec["argv"])


if __name__ == "__main__":
    main()
