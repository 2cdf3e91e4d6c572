"""The built-in ``checkpoint`` strategy: activation checkpointing of the model's blocks.

``("checkpoint", {"wrap_class": "Block"})`` makes every outermost module of that class keep
only its inputs during forward and recompute its activations in backward
(:func:`torch.utils.checkpoint.checkpoint`, non-reentrant,
https://pytorch.org/docs/stable/checkpoint.html): activation memory drops from one block's
activations per block to one block's inputs per block, for about one extra forward.
The block's ``forward`` is replaced on the instance, so parameter names (and checkpoints)
are unchanged. List it before ``ddp`` / ``fsdp``, as torch's FSDP2 examples apply it.
"""

from __future__ import annotations

from typing import Any

from dlrover_core.logging import get_logger
from dlrover_core.markers import hookimpl
from dlrover_core.parallel.context import find_modules, replace_forward

__all__ = ["checkpoint"]

log = get_logger()


def _recompute(forward: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint as recompute  # torch: heavy, workers only

    return recompute(forward, *args, use_reentrant=False, **kwargs)


def checkpoint(model: Any, ctx: Any, *, wrap_class: str | list[str]) -> Any:
    """Recompute the activations of ``model``'s modules of ``wrap_class`` in backward.

    Args:
        wrap_class: class name(s) or dotted path(s), e.g. ``"Block"``; modules nested in a
            matched one are not wrapped again.

    Raises:
        JobSpecError: no module of the model has that class (the error lists the classes).
    """
    modules = find_modules(model, wrap_class, field=ctx.field("wrap_class"), outermost=True)
    for module in modules:
        replace_forward(module, _recompute)
    log.debug("activation_checkpoint_applied", wrap_class=wrap_class, modules=len(modules), rank=ctx.rank)
    return model


@hookimpl
def dlrover_register_parallel_strategies(register):
    register(checkpoint, name="checkpoint", replicated=True)
