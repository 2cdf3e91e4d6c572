"""``prepare(model)``: apply the job's parallel strategies, then build its optimizer."""

from __future__ import annotations

from typing import Any

from dlrover_core.parallel.context import ParallelContext, apply_strategies
from dlrover_core.plugins import get_host
from dlrover_core.spec import Optimizer, Parallel
from dlrover_core.train import process_group
from dlrover_core.train.context import current_job, is_live
from dlrover_core.train.reform import joined

__all__ = ["prepare"]


def prepare(model: Any, *, parallel: Any = None, optimizer: Any = None, **optimizer_options: Any) -> tuple[Any, Any]:
    """Apply ``Job.parallel`` strategies to ``model`` in order, then build ``Job.optimizer``.

    ``init()`` must have been called. With ``Job.parallel`` unset, ``ddp`` is applied (a
    no-op on a one-process world). Each strategy is ``fn(model, ctx, **options) -> model``
    with a :class:`~dlrover_core.parallel.ParallelContext`; after the last one the optimizer
    is built over the model's parameters and the strategies' optimizer hooks run (e.g. the
    float16 ``amp`` gradient scaler). ``optimizer_options`` override the Job's optimizer
    options (e.g. ``lr=1e-3``). Outside dlrover the defaults are ``ddp`` and ``adamw``.

    Args:
        parallel: a :class:`~dlrover_core.spec.Parallel` (or its list of strategies) instead
            of the Job's, e.g. for a script run outside dlrover.
        optimizer: a :class:`~dlrover_core.spec.Optimizer` instead of the Job's.

    Returns:
        ``(model, optimizer)``: the transformed model and a ``torch.optim.Optimizer`` over
        its parameters.

    Raises:
        RuntimeError: ``init()`` was not called.
        PluginNotFoundError: a strategy or optimizer name is not registered.
        JobSpecError: a strategy cannot apply to this model or world (a mesh whose sizes'
            product is not the world size, a ``wrap_class`` no module has, ...).
    """
    info = process_group._info
    if info is None:
        raise RuntimeError("call dlrover_core.train.init() before prepare()")
    job = current_job()
    if parallel is None:
        parallel = job.parallel if job is not None and job.parallel is not None else Parallel(["ddp"])
    elif not isinstance(parallel, Parallel):
        parallel = Parallel(parallel)
    if optimizer is None:
        optimizer = job.optimizer if job is not None else Optimizer("adamw")
    registries = get_host().registries
    for name, _ in parallel.strategies:
        registries.parallel_strategy.entry(name)  # unknown names fail before any strategy runs
    factory = registries.optimizer.get(optimizer.name)
    try:  # what the optimizer will be, for strategies that size its state (auto)
        spec = Optimizer(optimizer.name, **{**optimizer.options, **optimizer_options})
    except ValueError:
        spec = optimizer
    ctx = ParallelContext(info=info, optimizer=spec, live=is_live(), joining=joined() is not None)
    model = apply_strategies(model, parallel.strategies, ctx)
    built = factory(model.parameters(), **{**optimizer.options, **optimizer_options})
    ctx.finish(built)
    return model, built
