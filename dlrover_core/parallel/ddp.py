"""The built-in ``ddp`` strategy: torch's DistributedDataParallel."""

from __future__ import annotations

from typing import Any

from dlrover_core.plugins import hookimpl

__all__ = ["ddp"]


def ddp(model: Any, ctx: Any, **options: Any) -> Any:
    """Wrap ``model`` in :class:`torch.nn.parallel.DistributedDataParallel`.

    ``options`` go to DDP (``find_unused_parameters``, ``bucket_cap_mb``, ...). On a
    one-process world the model is returned unchanged. On an accelerator the model is moved
    to the worker's device first and ``device_ids`` is set.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    device = ctx.device
    if device.type != "cpu":
        model = model.to(device)
        options.setdefault("device_ids", [device.index])
    return torch.nn.parallel.DistributedDataParallel(model, **options)


@hookimpl
def dlrover_register_parallel_strategies(register):
    register(ddp, name="ddp")
