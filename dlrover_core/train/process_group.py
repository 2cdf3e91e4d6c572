"""``init()``: join the job's process group through this round's store."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import gc
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import attrs

from dlrover_core import env
from dlrover_core.logging import get_logger
from dlrover_core.parallel.ddp import replicated_modules
from dlrover_core.plugins import get_host
from dlrover_core.protocol.client import MasterClient
from dlrover_core.protocol.messages import LiveAssignment, LiveReform
from dlrover_core.protocol.progress import LiveReadyRecord
from dlrover_core.train import reconfigurable, reform
from dlrover_core.train.checkpointer import held_memory_steps, prefault_restore
from dlrover_core.train.context import WorkerInfo, current_job, is_joiner, is_live, worker_info
from dlrover_core.train.progress import get_writer, install_excepthook

__all__ = ["init"]

log = get_logger()

_info: WorkerInfo | None = None
#: The client of the round's TCPStore (``None`` before ``init()``, or outside a launched job).
_store: Any = None
_store_addr: tuple[str, int] | None = None
_backend: str = "gloo"
#: The process group backends a sharded job's live world has been tested on (reconfigurable
#: groups wrap them: ``train.reconfigurable``); on another (NCCL, HCCL: no GPU run yet) a
#: sharded job's failures restart every worker.
VERIFIED_SHARDED_BACKENDS = ("gloo",)
#: Why this worker's sharded job cannot recover live here ("": it can, or it is not sharded).
_sharded_off = ""
_timeout_s: float = 300.0


def _watch_parent(pid: int) -> None:
    """Exit when the agent that started us is gone (belt and braces to PR_SET_PDEATHSIG)."""

    def loop() -> None:
        while True:
            if os.getppid() != pid:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=loop, name="dlrover-parent-watch", daemon=True).start()


def _register_stack_dump() -> None:
    """On SIGUSR1, write every thread's Python stack to ``DLROVER_STACK_FILE`` (the agent's
    fallback when py-spy is not installed)."""
    path = os.environ.get("DLROVER_STACK_FILE")
    if path:
        faulthandler.register(signal.SIGUSR1, file=open(path, "a"), all_threads=True)


def init(*, timeout_s: float | None = None) -> WorkerInfo:
    """Initialise ``torch.distributed`` for this worker and return its :class:`WorkerInfo`.

    Under a dlrover agent (or torchrun) it connects to the TCPStore of the current
    rendezvous round at ``MASTER_ADDR:MASTER_PORT`` — a fresh store per round, so a restarted
    worker never reads a dead round's keys — and creates the default process group with the
    accelerator's backend (gloo on cpu). Run directly (``python train.py``) it makes a
    one-process group. Idempotent.

    Args:
        timeout_s: collective timeout; default ``Job.failure.collective_timeout_s`` (300 s).

    Raises:
        torch.distributed.DistStoreError: the round's store cannot be reached in time.
    """
    global _info
    if _info is not None:
        return _info
    import torch  # heavy: imported when a worker joins its group, not by ``import dlrover_core.train``
    import torch.distributed as dist  # heavy: torch

    info = worker_info()
    job = current_job()
    if timeout_s is None:
        timeout_s = job.failure.collective_timeout_s if job is not None else 300.0
    timeout = datetime.timedelta(seconds=timeout_s)
    accelerator = get_host().create_accelerator(info.accelerator)
    info = attrs.evolve(info, accelerator=accelerator.name, device=accelerator.device_for(info.local_rank))
    if info.device.type != "cpu":
        getattr(torch, info.device.type).set_device(info.device)
    global _backend, _timeout_s, _sharded_off
    _backend, _timeout_s = accelerator.dist_backend, timeout_s
    sharded = is_live() and job is not None and job.live_sharded
    if sharded and accelerator.dist_backend not in VERIFIED_SHARDED_BACKENDS:
        _sharded_off = (f"live recovery of sharded state over {accelerator.dist_backend} is not verified yet (only "
                        f"{', '.join(VERIFIED_SHARDED_BACKENDS)}): this job's failures restart every worker")
        log.warning("live_sharded_unavailable", rank=info.rank, reason=_sharded_off)
        sharded = False
    if info.is_launched and not (is_live() and is_joiner() and not sharded):
        prefault_restore(info.rank)
    if is_live() and is_joiner() and not sharded:
        # a replacement joins the running world in train.steps(), once it is ready (its
        # model and optimizer built): its rank and world size come from that generation
        pass
    elif not dist.is_initialized():
        group_backend = accelerator.dist_backend
        if info.is_launched:
            store = round_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        else:
            store = dist.HashStore()
        if sharded:  # the mesh and FSDP keep these groups: each generation reconnects them in place
            at = _join_sharded(info).generation if is_joiner() else 0
            reconfigurable.register(accelerator.dist_backend, at_generation=at)
            group_backend = reconfigurable.BACKEND
        before = socket_inodes()
        dist.init_process_group(
            backend=group_backend, store=store, rank=info.rank,
            world_size=info.world_size, timeout=timeout,
        )
        note_group_sockets(before)
    _destroy_group_at_exit()
    _freeze_imports()
    watch = os.environ.get(env.WATCH_PID)
    if watch:
        _watch_parent(int(watch))
    if info.is_launched:
        install_excepthook()
        _register_stack_dump()
    get_writer().mark()
    log.debug("worker_initialised", rank=info.rank, world_size=info.world_size, backend=accelerator.dist_backend)
    _info = info
    return info


def _join_sharded(info: WorkerInfo) -> LiveAssignment:
    """A sharded job's replacement asks to join the running world in its dead
    predecessor's place (its rank, its shard) before the script builds its mesh; the
    answer's ``resume_step`` is the step its ``Checkpointer.load`` takes from memory.

    Raises:
        LiveRecoveryError: the master is unreachable, or placed it elsewhere.
        SystemExit: 0 when the others finished training meanwhile, 1 when every worker
            restarts instead (the agent stops this process anyway).
    """
    steps = held_memory_steps(info.rank, info.world_size)
    get_writer().write(LiveReadyRecord(rank=info.rank))  # the agent may replace it alone
    node_id = int(os.environ.get(env.NODE_ID, "0"))
    local_rank = int(os.environ.get(env.LOCAL_RANK, os.environ.get("LOCAL_RANK", "0")))
    log.info("live_join_waiting", node_id=node_id, local_rank=local_rank, rank=info.rank, memory_steps=steps)
    message = LiveReform(node_id=node_id, local_rank=local_rank, pid=os.getpid(), round=info.round, generation=-1,
                         step=-1, reason="join", replica=False, memory_steps=tuple(steps))
    client = MasterClient(os.environ[env.MASTER_ADDR])
    try:
        answer = reform.ask(client, message)
    finally:
        client.close()
    if answer.state == "finished":
        log.info("live_join_not_needed", node_id=node_id, local_rank=local_rank, reason=answer.reason)
        raise SystemExit(0)
    if answer.state != "ready":
        log.warning("live_recovery_ended", state=answer.state, reason=answer.reason, rank=info.rank)
        raise SystemExit(1)
    if (answer.rank, answer.world_size) != (info.rank, info.world_size):
        raise reform.LiveRecoveryError(f"a sharded world placed this replacement at rank {answer.rank} of "
                                       f"{answer.world_size}, not in its slot's place (rank {info.rank} of "
                                       f"{info.world_size})")
    reform.set_joined(answer)
    return answer


_exit_hook_installed = False


def _destroy_group_at_exit() -> None:
    """Destroy the default process group when the script returns normally, while the
    interpreter is still whole. A gloo group left to interpreter finalization can abort
    the process (``terminate called without an active exception``, exit code -6: torch
    issue 190489, pull request 179291), which would count as a failed worker at the very
    end of a job. Not after an uncaught exception: peers may still be in a collective
    with this process, and destroying an NCCL group then can block (torchtitan pull
    request 1342).

    A DDP reducer holds a reference to the group, so the group object outlives
    ``destroy_process_group`` while a DDP model does, and the abort can still happen when
    that model is freed during finalization (13 of 300 worker exits of a 3-rank gloo DDP
    script here; none of 150 once the models were released first). So the DDP wrappers
    of ``train.prepare``'s live models are dropped, and unreachable objects collected,
    first. A DDP model the script keeps in a module global is beyond reach: a worker that
    then aborts at exit after its last step is restarted with the others (the live world
    cannot replace it)."""
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    _exit_hook_installed = True

    def destroy() -> None:
        try:
            if getattr(sys, "last_type", None) is not None:  # the script died of an exception
                return
            import torch.distributed as dist  # heavy: torch

            if dist.is_available() and dist.is_initialized():
                for module in replicated_modules():
                    module.release()
                gc.collect()  # DDP models the script dropped, in reference cycles (hooks), go now
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
        finally:
            _freeze_for_exit()

    atexit.register(destroy)


def _freeze_imports() -> None:
    """Exempt the objects alive when the worker joins its group from the garbage collector's
    full passes (``gc.freeze``; Python's documentation of the :mod:`gc` module recommends it
    for objects that live as long as the process). By then they are mostly imported modules
    (torch, numpy, dlrover: about 190,000 objects here), which every full collection would
    otherwise walk again: the one at exit (:func:`_destroy_group_at_exit`: 0.15 s of CPU with
    them, 0.08 s without, on this kind of machine) and the automatic ones during training.
    What a frozen object loses is only its cyclic collection: a reference cycle made before
    ``init()`` and dropped later stays in memory (objects freed by reference counting are
    freed as always). Objects made after ``init()`` (the models, ``train.prepare``'s DDP
    wrappers, the optimizer) are collected as usual. ``DLROVER_GC_AT_EXIT=1`` turns it off."""
    if os.environ.get(env.GC_AT_EXIT) != "1":
        gc.freeze()


def _freeze_for_exit() -> None:
    """Exempt every object alive now from the garbage collector's last passes
    (``gc.freeze``: moved to the permanent generation, which no collection examines; Python's
    documentation of the :mod:`gc` module).

    Interpreter finalization runs full collections over every object still tracked; with
    torch imported that is the whole module graph (sympy, the dispatcher's tables), and a
    worker spent 0.7-1.2 s in ``gc_collect_main`` after its script returned (py-spy on a CPU
    worker here), each second of it a second before its agent sees the exit and the job
    finishes or the failure is reported. Objects still freed by reference counting (module
    globals when the modules are cleared, open files) are unaffected; what frozen objects
    lose is only a cyclic collection at exit, which Python never promises (``__del__`` of
    objects alive at exit: the language reference, "Data model"). The atexit callbacks
    registered before ``init()`` (torch's, the script's) still run after this one."""
    if os.environ.get(env.GC_AT_EXIT) != "1":
        gc.freeze()


#: The sockets the current process group opened (fd -> ``socket:[inode]``): its peer
#: connections, which :func:`sever_group` shuts down.
_group_sockets: dict[int, str] = {}


def socket_inodes() -> dict[int, str]:
    """This process's open sockets: fd -> ``socket:[inode]`` (Linux ``/proc``; empty elsewhere)."""
    out: dict[int, str] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(fd)] = target
    return out


def note_group_sockets(before: dict[int, str]) -> None:
    """Remember the sockets a process group just opened (those not open ``before`` its init)."""
    global _group_sockets
    _group_sockets = {fd: inode for fd, inode in socket_inodes().items() if before.get(fd) != inode}


def sever_group() -> int:
    """Shut down the current process group's peer connections (from any thread); returns
    how many. A collective blocked on a peer that went silent (its host cut off: no
    connection reset ever comes, and ``ProcessGroup.abort()`` does not wake gloo) then fails
    at once, so the live world re-forms without it; the peers of this worker see their
    connections close and fail too. Only the sockets the group opened are touched (the
    store's and the master's connections, and the script's own, stay)."""
    severed = 0
    now = socket_inodes()
    for fd, inode in _group_sockets.items():
        if now.get(fd) != inode:  # closed meanwhile (the fd number may be another socket now)
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue  # the group's listener: gloo aborts the process when its accept() fails
            sock.shutdown(socket.SHUT_RDWR)
            severed += 1
        except OSError:
            pass
        finally:
            sock.close()
    return severed


def round_store(host: str, port: int) -> Any:
    """The client of the round's TCPStore at ``host:port`` (one per process, reused by every
    generation of the live world)."""
    global _store, _store_addr
    import torch.distributed as dist  # heavy: torch

    if _store is None or _store_addr != (host, port):
        _store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=_timeout_s),
                               use_libuv=True)
        _store_addr = (host, port)
    return _store


def sharded_off() -> str:
    """Why this worker's sharded job cannot recover live on its backend ("": it can)."""
    return _sharded_off


def backend() -> str:
    """The process group backend ``init()`` chose (the accelerator's)."""
    return _backend


def collective_timeout_s() -> float:
    """The collective timeout ``init()`` used (seconds)."""
    return _timeout_s


def set_place(*, rank: int, world_size: int) -> None:
    """A new generation of the live world gave this worker another place."""
    global _info
    if _info is not None:
        _info = attrs.evolve(_info, rank=rank, world_size=world_size)
