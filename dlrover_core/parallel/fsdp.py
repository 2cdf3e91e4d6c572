"""The built-in ``fsdp`` strategy: FSDP2, ``torch.distributed.fsdp.fully_shard``.

FSDP2 shards every parameter on dim 0 across the data-parallel ranks as a ``DTensor``,
all-gathers a module's parameters before its forward and backward and reduce-scatters its
gradients (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html). Wrapping the
repeated blocks (``wrap_class``) separately lets one block's communication overlap another's
compute and frees each block's unsharded parameters after use; the root is wrapped last, as
the docs prescribe (bottom-up).
"""

from __future__ import annotations

from typing import Any

from dlrover_core.logging import get_logger
from dlrover_core.markers import hookimpl
from dlrover_core.parallel.context import find_modules

__all__ = ["fsdp"]

log = get_logger()


def fsdp(
    model: Any,
    ctx: Any,
    *,
    wrap_class: str | list[str] | None = None,
    reshard_after_forward: bool | None = None,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
) -> Any:
    """Shard ``model`` with ``fully_shard`` over the data-parallel ranks (``mesh["data"]``, or
    the whole world). Where the mesh also has a ``replicate`` dimension, the model is
    sharded over ``data`` and replicated over ``replicate`` (HSDP: ``fully_shard`` on the
    2-D mesh ``mesh["replicate", "data"]``, torch's "hybrid sharding",
    https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html: "if mesh is 2D, then
    parameters are replicated across the 0th dim and sharded across the 1st"), e.g.
    ``Parallel([("mesh", [("data", 2), ("replicate", 2)]), "fsdp"])``: 4 ranks, the shard
    groups ``[0, 1]``, ``[2, 3]``, the replica groups ``[0, 2]``, ``[1, 3]``.

    Args:
        wrap_class: class name(s) (``"Block"``) or dotted path(s) (``"mypkg.model.Block"``) of
            the modules to shard as their own unit, innermost first; the root always is one.
            A name that matches no module raises JobSpecError listing the model's classes.
        reshard_after_forward: free the unsharded parameters after forward (torch's default
            ``True``; ``False`` keeps them for backward, like ZeRO-2).
        param_dtype, reduce_dtype: ``MixedPrecisionPolicy`` dtypes (``"bfloat16"``, ...):
            the dtype of the all-gathered parameters in compute and of gradient reduction.

    Returns the same module object, its parameters now ``DTensor`` shards on the mesh's
    device. Without a process group the model is returned unchanged (logged).
    """
    import torch  # torch: heavy, workers only
    import torch.distributed as dist  # torch: heavy, workers only
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # torch: heavy, workers only

    if not dist.is_initialized():
        log.warning("fsdp_skipped", reason="torch.distributed is not initialised; call train.init() first")
        return model
    kwargs: dict[str, Any] = {"mesh": ctx.data_mesh()}
    if ctx.mesh is not None and "replicate" in (ctx.mesh.mesh_dim_names or ()):
        kwargs["mesh"] = ctx.mesh["replicate", "data"]  # HSDP
    if reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = reshard_after_forward
    if param_dtype or reduce_dtype:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=getattr(torch, param_dtype) if param_dtype else None,
            reduce_dtype=getattr(torch, reduce_dtype) if reduce_dtype else None,
        )
    units = 1
    if wrap_class:
        for module in reversed(find_modules(model, wrap_class, field=ctx.field("wrap_class"))):
            if module is not model:
                fully_shard(module, **kwargs)
                units += 1
    fully_shard(model, **kwargs)
    ctx.sharded = True
    log.debug("fsdp_applied", units=units, data_parallel_size=ctx.data_parallel_size, rank=ctx.rank)
    return model


@hookimpl
def dlrover_register_parallel_strategies(register):
    register(fsdp, name="fsdp", replicated=False)
