"""``python -m dlrover_core.agent.standby``: a node's warm standby, a fork server for its workers.

The agent starts one per node when it starts (:class:`dlrover_core.agent.forkserver.Standby`,
where the wire is described). It imports what workers need (torch, numpy, safetensors,
``dlrover_core.train``, the plugin host, what a first optimizer step loads), says it is
ready, and then forks a worker for each request: the child takes the request's environment
and working directory, its own session, the output pipe the agent sent, and runs the
entrypoint in-process as ``python`` would (``runpy``, ``__main__``, ``sys.argv``,
``sys.path[0]``). A worker so skips starting Python and importing torch, and a node pays
for the imports once, not once per worker and per restart. The standby reaps its children
and reports each exit code to the agent.

Every standby imports all of it before it says it is ready (:func:`_preload`): torch,
numpy, safetensors, the plugins (:func:`_import_heavy`) and what a first optimizer step
loads (:func:`_first_step`: ``torch._dynamo`` and sympy, which ``DistributedDataParallel``
and ``fully_shard`` import at construction, about 2 CPU-s). The first one does it at the
agent's priority while the agent registers and rendezvouses, so each forked worker, the
first ones included, skips those imports: a node pays for them once, not once per worker
plus once in the standby. The first training step comes no later for it
(``benchmarks/launch.py``); a script that never wraps a model waits for it all the same. A standby started while workers train on the node (the first
one died) warms up at the lowest CPU priority (``--low-priority``: nice 19, for its thread
and, where the kernel groups processes by session, for the standby's session; see
:func:`_preload_at_low_priority`), so it waits for idle CPU instead of slowing the training.

Caveats: variables read when a library is imported (OpenMP's ``OMP_NUM_THREADS``) take the
standby's value, which the agent sets to the workers' one; a worker's process title and
``/proc/<pid>/environ`` stay the standby's (its ``os.environ`` is the worker's). Nothing here
touches an accelerator: a forked CUDA context would be unusable in the child.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.machinery
import os
import runpy
import select
import signal
import socket
import sys
import threading
import types
import zipfile
from collections.abc import Callable
from typing import Any

import dlrover_core.train  # noqa: F401  (what workers import, before they are needed)
from dlrover_core.accelerators.numa import parse_cpu_ranges
from dlrover_core.agent.forkserver import ChildExits, recv_request, send_event
from dlrover_core.env import CPU_AFFINITY, STANDBY_FD
from dlrover_core.plugins import get_host, reset_host
from dlrover_core.train.progress import install_excepthook

#: The variables the plugin host reads when it loads (``dlrover_core.plugins.PluginHost``).
_HOST_VARIABLES = ("DLROVER_PLUGINS", "DLROVER_DISABLE_PLUGINS")


def _import_heavy() -> None:
    """What a worker imports before its first line of training: torch, numpy, safetensors,
    the plugins (entry points, plugin imports). The first standby does this before it forks
    the first workers (about 3 CPU-s here), as a cold worker would before its first collective."""
    import numpy  # noqa: F401  (heavy)
    import safetensors.torch  # noqa: F401  (heavy)
    import torch  # noqa: F401  (heavy)
    import torch.distributed  # noqa: F401  (heavy)

    get_host()


def _first_step() -> None:
    """What a worker's first step loads on first use (autograd, the optimizers'
    ``torch._dynamo`` and sympy imports, which DDP and FSDP2 also import when they wrap a
    model): about 2 CPU-s here, that every forked worker would pay before its first step.
    Tiny tensors: torch starts no OpenMP pool, so forking stays safe."""
    import torch  # heavy (imported by _import_heavy already)

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 2)).sum().backward()
    optimizer.step()


def _preload() -> None:
    """The whole warm-up: :func:`_import_heavy`, then :func:`_first_step`."""
    _import_heavy()
    _first_step()


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


class _LowPriority:
    """``work`` run in a thread at the lowest CPU priority, started now.

    Two mechanisms, because Linux applies one or the other: the thread runs at nice
    :data:`_PRELOAD_NICE` (nice values are per thread, ``setpriority(2)``), and, where the
    kernel groups processes by session (autogroups, ``sched(7)``: there a thread's nice value
    only ranks it within its session, and the standby has a session of its own), the
    session's autogroup is set to the same nice value until :meth:`join` sets it back.
    Setting it back needs no privilege when the old value is 0 or more (only negative values
    do), so it is lowered only then. Forked workers take sessions of their own: the lowered
    group is never theirs.
    """

    def __init__(self, work: Callable[[], None]) -> None:
        self._failure: list[BaseException] = []

        # Threads the work starts would keep nice 19 after it: its tensors stay tiny, so
        # torch starts no OpenMP pool (checked: only the main thread is left when the
        # standby is ready). A warm-up that fails (a plugin that installs a signal handler
        # at import, which only the main thread may) ends the standby, and restarts start
        # fresh processes.
        def run() -> None:
            with contextlib.suppress(OSError, AttributeError):  # not Linux: the thread keeps the priority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _PRELOAD_NICE)
            try:
                work()
            except BaseException as exc:  # handed to the main thread
                self._failure.append(exc)

        self._group_nice = _autogroup_nice()
        self._lowered = (self._group_nice is not None and self._group_nice >= 0
                         and _set_autogroup_nice(_PRELOAD_NICE))
        self._thread = threading.Thread(target=run, name="dlrover-standby-warm-up", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` (forever when None); whether the work ended (then the
        autogroup's nice value is back).

        Raises:
            BaseException: whatever the work raised, re-raised here.
        """
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        if self._lowered:
            self._lowered = False
            if not _set_autogroup_nice(self._group_nice):  # type: ignore[arg-type]
                raise RuntimeError(f"could not set the standby's autogroup nice value back to {self._group_nice}")
        if self._failure:
            raise self._failure[0]
        return True


def _preload_at_low_priority() -> None:
    """Run :func:`_preload` at the lowest CPU priority (:class:`_LowPriority`) and wait for it.

    Raises:
        BaseException: whatever the warm-up raised, re-raised here.
    """
    _LowPriority(_preload).join()


def _new_main() -> types.ModuleType:
    """A fresh ``__main__`` module in ``sys.modules``, as ``python`` makes for what it runs."""
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    return main


def _run(argv: list[str]) -> None:
    """Run ``python [-u] script|-m module|-c code [args]`` in this process, as ``python`` would.

    The code runs in a real ``__main__`` module that stays in ``sys.modules`` (``runpy``'s
    ``run_path`` and ``run_module`` use a temporary one, dropped at return): what a script
    leaves in its globals is freed when the interpreter exits, as under ``python``, not when
    the script returns. Freeing it then, with torch's threads still running, can deadlock: a
    ``DistributedDataParallel`` left in a global frees its gloo process group, whose
    destructor joins the group's thread while holding the GIL, and that thread may be waiting
    for the GIL to drop its last work (``benchmarks/job_cpu.py``'s script hung so at its end).
    At the interpreter's exit such threads cannot take the GIL and end instead.
    """
    args = argv[1:]  # drop the interpreter
    while args and args[0] == "-u":
        args = args[1:]
    if args and args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        main = _new_main()
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    elif args and args[0] == "-m":
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest]
        sys.path[0] = os.getcwd()
        _new_main()
        # what ``python -m`` itself calls: it runs the module in ``sys.modules["__main__"]``
        # and sets ``sys.argv[0]`` to the module's file
        runpy._run_module_as_main(module, alter_argv=True)  # type: ignore[attr-defined]
    else:
        script, rest = args[0], args[1:]
        sys.argv = [script, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        if os.path.isfile(script) and not zipfile.is_zipfile(script):
            main = _new_main()
            main.__file__ = script
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
            main.__cached__ = None
            with open(script, "rb") as f:  # (bytes: compile reads a coding declaration)
                code = compile(f.read(), script, "exec")
            exec(code, main.__dict__)
        else:  # a directory or a zip file with a __main__.py, as ``python`` runs them
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


def _serve(sock: socket.socket, *, watch_parent: bool = True) -> tuple[dict[str, Any], int] | None:
    """Fork a worker for each request on ``sock`` and report its pid, reap the workers and
    report their exit codes, until the agent closes the socket or dies (its end closes with
    it; ``watch_parent``: also when this process's parent, the agent, is gone; not for a
    standby the host's shared standby forked, whose parent is that one).

    Returns:
        In a forked worker, its request and output fd; in the standby, None (time to exit).
    """
    agent = os.getppid() if watch_parent else None
    exits = ChildExits()  # SIGCHLD wakes the select
    try:
        while True:
            readable, _, _ = select.select([sock, exits.fd], [], [], 1.0)
            if agent is not None and os.getppid() != agent:
                return None  # (its workers die with it: PR_SET_PDEATHSIG)
            if exits.fd in readable:
                exits.drain()
            _reap(sock)
            if sock not in readable:
                continue
            request = recv_request(sock)
            if request is None:
                return None
            spec, out_fd = request
            try:
                pid = os.fork()
            except OSError as exc:
                os.close(out_fd)
                send_event(sock, event="started", id=spec.get("id"), pid=None, error=str(exc))
                continue
            if pid == 0:  # the worker: nothing of the server stays open in it
                exits.close_in_child()
                sock.close()
                return spec, out_fd
            os.close(out_fd)
            send_event(sock, event="started", id=spec.get("id"), pid=pid)
    except (OSError, ValueError) as exc:  # the agent is gone, or a request this wire does not know
        print(f"dlrover standby: stopping: {exc!r}", file=sys.stderr, flush=True)
        return None


def _reap(sock: socket.socket) -> None:
    """Reap every exited worker and report its exit code (``-N``: killed by signal N)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send_event(sock, event="exited", pid=pid, returncode=os.waitstatus_to_exitcode(status))


def _detach(out_fd: int, standby: int) -> None:
    """In a just-forked worker: its own session (so its tree can be signalled), death with
    the standby (``PR_SET_PDEATHSIG``, then exit if the standby is already gone), stdin from
    ``/dev/null``, stdout and stderr to the agent's pipe."""
    os.setsid()
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != standby:
            os._exit(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)


def _become_worker(spec: dict[str, Any]) -> None:
    """Take the worker's environment, directory, CPUs and threads; run its entrypoint."""
    if any(os.environ.get(k) != spec["env"].get(k) for k in _HOST_VARIABLES):
        reset_host()  # the worker selects other plugins than this standby loaded
    paths = spec["env"].get("PYTHONPATH", "")
    if paths != os.environ.get("PYTHONPATH", ""):  # where python puts them at start: after sys.path[0]
        sys.path[1:1] = [p for p in paths.split(os.pathsep) if p and p not in sys.path]
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["cwd"])
    _bind_cpus()
    import numpy  # heavy (imported by _preload already)
    import torch  # heavy (imported by _preload already)

    # the random generators a fresh interpreter seeds from the OS's entropy at start: each
    # worker its own, not the standby's (``random`` reseeds itself at fork)
    torch.seed()
    numpy.random.seed()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    install_excepthook()  # an exception at import of the entrypoint is recorded for the master too
    _run(spec["argv"])


def serve_agent(sock: socket.socket, *, watch_parent: bool = True) -> None:
    """Be the node's standby from here on, warm: say so to the agent on ``sock``, then fork
    its workers (:func:`_serve`); in each forked worker, run it (returns only in the
    standby, when the agent is gone)."""
    standby = os.getpid()
    try:
        send_event(sock, event="ready", pid=standby)
    except OSError:  # the agent gave up on it meanwhile (it closed its end)
        return
    forked = _serve(sock, watch_parent=watch_parent)
    if forked is None:
        return
    spec, out_fd = forked
    _detach(out_fd, standby)
    _become_worker(spec)


def warm_up(*, low_priority: bool) -> None:
    """Import what workers need (:func:`_preload`; ``low_priority``: at the lowest CPU
    priority, :func:`_preload_at_low_priority`, for a standby started while workers train),
    then keep what is alive now out of the collector's way: it stays alive in every worker,
    and the collector's passes would touch, and so copy, every page of it (at exit they cost
    a forked worker 1.2 s of CPU here, 0.5 s frozen). The fork-server use ``gc.freeze`` was
    made for (its docs).

    Raises:
        BaseException: whatever the imports raised.
    """
    if low_priority:
        _preload_at_low_priority()
    else:
        _preload()
    gc.freeze()


def main() -> None:
    sock = socket.socket(fileno=int(os.environ.pop(STANDBY_FD)))
    # --low-priority: workers train on this node already: all of it on idle CPU, then ready;
    # else the first workers wait for it (the agent rendezvouses meanwhile)
    warm_up(low_priority="--low-priority" in sys.argv[1:])
    serve_agent(sock)


if __name__ == "__main__":
    main()
