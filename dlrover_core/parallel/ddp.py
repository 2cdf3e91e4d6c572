"""The built-in ``ddp`` strategy: torch's DistributedDataParallel."""

from __future__ import annotations

from typing import Any

from dlrover_core.markers import hookimpl

__all__ = ["ddp"]


def ddp(model: Any, ctx: Any, **options: Any) -> Any:
    """Wrap ``model`` in :class:`torch.nn.parallel.DistributedDataParallel`.

    ``options`` go to DDP (``find_unused_parameters``, ``bucket_cap_mb``, ...). On a
    one-process world the model is returned unchanged. On an accelerator the model is moved
    to the worker's device first and ``device_ids`` is set. With a ``mesh``, gradients are
    averaged over its ``data`` dimension (``process_group``), else over the whole world.
    """
    import torch  # torch: heavy, workers only
    import torch.distributed as dist  # torch: heavy, workers only

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    device = ctx.device
    if device.type != "cpu":
        model = model.to(device)
        options.setdefault("device_ids", [device.index])
    if getattr(ctx, "mesh", None) is not None:
        options.setdefault("process_group", ctx.data_mesh().get_group())
    return torch.nn.parallel.DistributedDataParallel(model, **options)


@hookimpl
def dlrover_register_parallel_strategies(register):
    register(ddp, name="ddp")
