"""Parallel strategies, applied in order by ``train.prepare()`` (ATorch style).

A Job lists them as :class:`~dlrover_core.spec.Parallel`; each name is looked up in the
``parallel_strategy`` registry, filled through the ``dlrover_register_parallel_strategies``
hook, and called as ``fn(model, ctx, **options) -> model`` with a :class:`ParallelContext`.
The optimizer is built after every strategy ran; strategies that must act on it register
``ctx.on_optimizer(hook)``.

Each registers with ``replicated=`` (whether every data-parallel rank keeps the whole
training state, which live recovery needs; ``True`` for ``ddp``, ``amp``, ``checkpoint``,
``compile``; see :mod:`dlrover_core.parallel_rules`). Built-ins, each a plugin module
registered like any other:

==============  ======================================================================
``mesh``        ``("mesh", [("data", 2), ("tensor", 2)])``: a ``DeviceMesh``, first-listed
                dimension fastest (:mod:`.mesh`, :mod:`dlrover_core.parallel_rules`); must come first
``ddp``         ``DistributedDataParallel`` over the ``data`` ranks (:mod:`.ddp`)
``fsdp``        FSDP2 ``fully_shard`` of ``wrap_class`` modules, then the root (:mod:`.fsdp`)
``amp``         ``torch.autocast`` forward, ``dtype`` bfloat16 / float16 + scaler (:mod:`.amp`)
``checkpoint``  activation checkpointing of ``wrap_class`` modules (:mod:`.activation_checkpoint`)
``compile``     ``torch.compile`` in place (:mod:`.compile`)
``auto``        ddp, fsdp or checkpoint + fsdp from model and device memory (:mod:`.auto`)
==============  ======================================================================

Importing this package does not import torch.
"""

from dlrover_core.parallel.context import (
    ParallelContext,
    apply_strategies,
    current_mesh,
    find_modules,
    replace_forward,
)
from dlrover_core.parallel_rules import auto_rule_text, check_strategies, mesh_groups

__all__ = [
    "ParallelContext",
    "apply_strategies",
    "auto_rule_text",
    "check_strategies",
    "current_mesh",
    "find_modules",
    "mesh_groups",
    "replace_forward",
]
