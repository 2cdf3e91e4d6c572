"""The built-in ``ddp`` strategy: torch's DistributedDataParallel."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

from dlrover_core.markers import hookimpl

__all__ = ["ddp", "replicate", "replicated_modules"]

#: Every :class:`ReplicatedModule` of this process (``train.steps()`` rebuilds them).
_replicated: weakref.WeakSet = weakref.WeakSet()


def replicated_modules() -> list[Any]:
    """The live :class:`ReplicatedModule` instances of this process."""
    return list(_replicated)


def _replicated_module_type() -> type:
    import torch  # torch: heavy, workers only

    class ReplicatedModule(torch.nn.Module):
        """A model replicated on every rank whose DDP wrapper is rebuilt on each new process
        group of the live world (docs/design.md §5a), so the object the training script holds stays
        valid when the world shrinks or grows.

        ``forward`` and ``no_sync()`` go to the current
        :class:`~torch.nn.parallel.DistributedDataParallel` (to the plain module while the
        world has one process). ``state_dict()`` keys are ``module.<name>``, as DDP's.
        """

        #: a checkpoint saves the module inside (``checkpoint.state_format.unwrap_module``)
        dlrover_wrapper = True

        def __init__(self, module: torch.nn.Module, options: dict[str, Any]) -> None:
            super().__init__()
            self.module = module
            first_sync = options.pop("init_sync", True)
            object.__setattr__(self, "_options", options)
            object.__setattr__(self, "_ddp", None)
            self.rebuild(init_sync=first_sync)
            _replicated.add(self)

        def rebuild(self, *, init_sync: bool = False) -> None:
            """Wrap the module in a new DDP on the current default process group (none while
            the world has one process). ``init_sync``: broadcast rank 0's parameters (the
            first wrap; a re-formed world has synced them already)."""
            import torch.distributed as dist  # torch: heavy, workers only

            object.__setattr__(self, "_ddp", None)  # the old reducer's hooks go with it
            if dist.is_initialized() and dist.get_world_size() > 1:
                ddp = torch.nn.parallel.DistributedDataParallel(self.module, init_sync=init_sync, **self._options)
                object.__setattr__(self, "_ddp", ddp)

        def release(self) -> None:
            """Drop the DDP wrapper (its reducer holds the process group): called at a
            normal exit, before the group is destroyed (see
            ``train.process_group._destroy_group_at_exit``)."""
            object.__setattr__(self, "_ddp", None)

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return (self._ddp or self.module)(*args, **kwargs)

        def no_sync(self) -> Any:
            """DDP's ``no_sync()``: accumulate gradients locally (a no-op on one process)."""
            return self._ddp.no_sync() if self._ddp is not None else contextlib.nullcontext()

    return ReplicatedModule


_TYPE: type | None = None


def replicate(module: Any, options: dict[str, Any] | None = None) -> Any:
    """``module`` in a ``ReplicatedModule``: DDP with ``options``, rebuilt in place on each
    new process group of the live world (the class is made on first use: torch is imported
    only when a worker builds one)."""
    global _TYPE
    if _TYPE is None:
        _TYPE = _replicated_module_type()
    return _TYPE(module, dict(options or {}))


def ddp(model: Any, ctx: Any, **options: Any) -> Any:
    """Wrap ``model`` in :class:`torch.nn.parallel.DistributedDataParallel`.

    ``options`` go to DDP (``find_unused_parameters``, ``bucket_cap_mb``, ...). On a
    one-process world the model is returned unchanged. On an accelerator the model is moved
    to the worker's device first and ``device_ids`` is set. With a ``mesh``, gradients are
    averaged over its ``data`` dimension (``process_group``), else over the whole world.

    In a job with live recovery (``Failure(live_recovery=True)``, the default, under a dlrover
    agent) the model is a ``ReplicatedModule`` instead (:func:`replicate`): the same DDP,
    rebuilt in place on each new process group when the world shrinks or grows, and on each
    reconnection of a sharded job's world (a fresh reducer, as the replacement's: DDP's
    first iterations run collectives of their own, bucket rebuilding, that every member
    must run together).
    """
    import torch  # torch: heavy, workers only
    import torch.distributed as dist  # torch: heavy, workers only

    mesh = getattr(ctx, "mesh", None)
    live = bool(getattr(ctx, "live", False))
    if not live and (not dist.is_initialized() or dist.get_world_size() == 1):
        return model
    device = ctx.device
    if device.type != "cpu":
        model = model.to(device)
        options.setdefault("device_ids", [device.index])
    if getattr(ctx, "joining", False):  # its peers run no first broadcast with it (see ParallelContext)
        options.setdefault("init_sync", False)
    if mesh is not None:
        options.setdefault("process_group", ctx.data_mesh().get_group())
    if live:
        return replicate(model, options)
    return torch.nn.parallel.DistributedDataParallel(model, **options)


@hookimpl
def dlrover_register_parallel_strategies(register):
    register(ddp, name="ddp", replicated=True)
