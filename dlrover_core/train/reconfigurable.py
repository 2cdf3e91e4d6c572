"""Process groups whose connections are replaced under them: a sharded job's live world.

FSDP2, ``DeviceMesh`` and DTensor keep a reference to the process group they were built
on, so a world whose state is sharded cannot swap its group for a new one as the
replicated world does (docs/design.md §5a). Instead every group of such a worker is a
:class:`ReconfigurableGroup`: a ``torch.distributed.ProcessGroup`` that forwards each
collective to an inner backend (gloo, or the accelerator's) and, when a generation of the
live world forms, gets a new inner backend on the generation's store keys (same rank, same
size) — the mesh, FSDP and the DTensors keep the object they hold. TorchFT's
``ProcessGroupWrapper`` / ``ManagedProcessGroup`` showed the approach (a Python
``ProcessGroup`` registered as a c10d backend, github.com/meta-pytorch/torchft,
``torchft/process_group.py``); this one swaps whole worlds of fixed size.

The groups are made by ``torch.distributed`` itself (``init_process_group(backend=BACKEND)``,
``new_group``), through the backend registered here, so a mesh's sub-groups are
reconfigurable too; :func:`reconfigure` moves every group of the process to a generation.

torch is imported inside the functions: only a worker needs it.
"""

from __future__ import annotations

import contextlib
import datetime
import weakref
from typing import Any

from dlrover_core.logging import get_logger

__all__ = ["BACKEND", "abort", "generation", "groups", "reconfigure", "register"]

log = get_logger()

#: The c10d backend name of reconfigurable groups (``init_process_group(backend=BACKEND)``).
BACKEND = "dlrover_live"

#: How long connecting a re-formed generation's group may wait for its members (seconds):
#: they all were placed a moment ago, so one that does not come died meanwhile (the next
#: re-form leaves it out); the collectives then get the group's own timeout. (The live
#: world's replicated path waits as long: ``train.live._JOIN_TIMEOUT_S``.) Generation 0,
#: the round's start, waits the group's whole timeout, as ``init_process_group`` does: its
#: members are processes still starting, a relaunched node's cold one seconds after a
#: survivor's forked one.
CONNECT_TIMEOUT_S = 5.0

_inner_backend = "gloo"
_generation = 0
_groups: list[weakref.ref[Any]] = []
_registered = False
_cls: Any = None


def generation() -> int:
    """The live world's generation the groups are connected for."""
    return _generation


def groups() -> list[Any]:
    """This process's reconfigurable groups still alive, oldest first."""
    return [g for g in (r() for r in _groups) if g is not None]


def register(inner_backend: str, *, at_generation: int = 0) -> None:
    """Register :data:`BACKEND` with ``torch.distributed`` (once per process): groups made
    with it connect through ``inner_backend`` (``"gloo"``, ``"nccl"``, ...), first for
    ``at_generation`` (a replacement joins the running generation)."""
    global _registered, _inner_backend, _generation, _cls
    import torch.distributed as dist  # heavy: torch

    _inner_backend, _generation = inner_backend, at_generation
    if _registered:
        return
    _cls = _group_class(dist)
    devices = ["cpu", "cuda"] if inner_backend == "nccl" else ["cpu"]
    dist.Backend.register_backend(BACKEND, _create, devices=devices)
    _registered = True


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    group = _cls(store, rank, size, timeout)
    _groups.append(weakref.ref(group))
    return group


def abort() -> None:
    """Close every group's connections now (peers blocked on this worker fail at once);
    the groups themselves stay for :func:`reconfigure`."""
    for group in groups():
        group.drop()


def reconfigure(new_generation: int) -> None:
    """Connect every group for ``new_generation``: a new inner backend on the generation's
    keys of the group's store. Blocks until every member of each group connected (the
    members all do this, in the same order: the groups' creation order).

    Raises:
        RuntimeError: a member did not connect within the group's timeout (gloo's error).
    """
    global _generation
    _generation = new_generation
    for group in groups():
        group.connect(new_generation)


def _inner(store: Any, rank: int, size: int, timeout: datetime.timedelta, gen: int) -> Any:
    import torch.distributed as dist  # heavy: torch

    prefixed = dist.PrefixStore(f"gen{gen}/", store)
    if _inner_backend == "nccl":  # (connects lazily, at the first collective)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    connect = timeout if gen == 0 else min(timeout, datetime.timedelta(seconds=CONNECT_TIMEOUT_S))
    group = dist.ProcessGroupGloo(prefixed, rank, size, connect)  # connects every pair now
    group._set_default_timeout(timeout)
    return group


def _group_class(dist: Any) -> Any:
    """The ``ProcessGroup`` subclass (made on first use: it needs torch)."""

    def forward(name: str, to: str | None = None) -> Any:
        target = to or name

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self._backend(), target)(*args, **kwargs)

        method.__name__ = name
        return method

    def coalesced(to: str) -> Any:
        def method(self: Any, outputs: Any, inputs: Any, *args: Any) -> Any:
            backend = self._backend()
            works = [getattr(backend, to)(o, i, *args) for o, i in zip(outputs, inputs, strict=True)]
            for work in works[:-1]:
                work.wait()
            return works[-1]

        return method

    class ReconfigurableGroup(dist.ProcessGroup):
        """A process group of fixed rank and size whose inner backend is replaced for each
        generation of the live world (see the module's docstring)."""

        def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
            super().__init__(rank, size)
            self._store, self._timeout = store, timeout
            self._connected: Any = None
            self._gen = -1
            self.connect(_generation)

        def connect(self, gen: int) -> None:
            self.drop()
            self._connected = _inner(self._store, self.rank(), self.size(), self._timeout, gen)
            self._gen = gen

        def drop(self) -> None:
            inner, self._connected = self._connected, None
            if inner is not None:
                with contextlib.suppress(Exception):
                    inner.abort()

        def _backend(self) -> Any:
            if self._connected is None:
                raise RuntimeError(f"process group aborted: generation {self._gen} of the live world ended")
            return self._connected

        @property
        def group_name(self) -> str:
            return dist.distributed_c10d._world.pg_names[self]

        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return BACKEND

        def _get_backend_name(self) -> str:
            return BACKEND

        abort = drop

        allreduce = forward("allreduce")
        allreduce_coalesced = forward("allreduce_coalesced")
        allgather = forward("allgather")
        allgather_coalesced = forward("allgather_coalesced")
        _allgather_base = forward("_allgather_base")
        all_gather_single = forward("all_gather_single", "_allgather_base")
        _reduce_scatter_base = forward("_reduce_scatter_base")
        reduce_scatter_single = forward("reduce_scatter_single", "_reduce_scatter_base")
        allgather_into_tensor_coalesced = coalesced("_allgather_base")
        all_gather_single_coalesced = coalesced("_allgather_base")
        reduce_scatter_tensor_coalesced = coalesced("_reduce_scatter_base")
        reduce_scatter_single_coalesced = coalesced("_reduce_scatter_base")
        reduce_scatter = forward("reduce_scatter")
        broadcast = forward("broadcast")
        barrier = forward("barrier")
        reduce = forward("reduce")
        gather = forward("gather")
        scatter = forward("scatter")
        alltoall = forward("alltoall")
        alltoall_base = forward("alltoall_base")
        send = forward("send")
        recv = forward("recv")
        recv_anysource = forward("recv_anysource")
        monitored_barrier = forward("monitored_barrier")

    return ReconfigurableGroup
