"""The built-in ``mesh`` strategy: a named ``DeviceMesh`` with ATorch's rank layout.

``Parallel([("mesh", [("data", 2), ("tensor", 2)]), ...])``: the first-listed dimension
varies fastest, so ranks 0 and 1 differ in their ``data`` index and share their ``tensor``
index (data groups ``[0, 1]``, ``[2, 3]``; tensor groups ``[0, 2]``, ``[1, 3]``; exact
mapping in :mod:`dlrover_core.parallel_rules`). ddp and fsdp replicate / shard over the
``data`` dimension; other dimensions are for the user's (or a plugin's) tensor or pipeline
parallelism, through :func:`dlrover_core.parallel.current_mesh`.

torch's ``init_device_mesh`` lays ranks out row-major (last dimension fastest;
https://pytorch.org/docs/stable/distributed.html#torch.distributed.device_mesh.init_device_mesh),
so the mesh is built with the listed dimensions reversed: ``mesh.mesh_dim_names`` is
``("tensor", "data")`` for the example, and ``mesh["data"]`` is the data group of this rank.
"""

from __future__ import annotations

from typing import Any

from dlrover_core.logging import get_logger
from dlrover_core.markers import hookimpl
from dlrover_core.parallel_rules import resolve_mesh_dims

__all__ = ["mesh"]

log = get_logger()


def mesh(model: Any, ctx: Any, *, dims: list[list[Any]]) -> Any:
    """Build the ``DeviceMesh`` of ``dims`` (``[[name, size], ...]``, one size may be ``-1``)
    into ``ctx.mesh``; ``model`` is returned unchanged.

    Raises:
        JobSpecError: the sizes' product is not the world size (every rank raises the same,
            before any collective).
    """
    sizes = resolve_mesh_dims(dims, ctx.world_size, field=ctx.field("dims"))
    from torch.distributed.device_mesh import init_device_mesh  # torch: heavy, workers only

    names = tuple(n for n, _ in reversed(sizes))
    ctx.mesh = init_device_mesh(ctx.device.type, tuple(s for _, s in reversed(sizes)), mesh_dim_names=names)
    ctx.mesh_dims = tuple(sizes)
    log.debug("parallel_mesh", dims=[list(d) for d in sizes], rank=ctx.rank)
    return model


@hookimpl
def dlrover_register_parallel_strategies(register):
    register(mesh, name="mesh", replicated=False)
