"""The built-in ``compile`` strategy: ``torch.compile`` of the model, in place."""

from __future__ import annotations

from typing import Any

from dlrover_core.markers import hookimpl

__all__ = ["compile_model"]


def compile_model(model: Any, ctx: Any, **options: Any) -> Any:
    """Compile ``model`` with :meth:`torch.nn.Module.compile` (``options``: ``mode``,
    ``fullgraph``, ``dynamic``, ``backend``, ``options``; see
    https://pytorch.org/docs/stable/generated/torch.compile.html).

    In place, unlike ``torch.compile(model)``, whose wrapper would prefix every parameter
    name with ``_orig_mod.`` and so change the checkpoint's keys. Compilation happens at the
    first forward (slow: seconds to minutes; on cpu it needs a C++ compiler).
    """
    model.compile(**options)
    return model


@hookimpl
def dlrover_register_parallel_strategies(register):
    register(compile_model, name="compile", replicated=True)
