"""``prepare(model)``: apply the job's parallel strategies, then build its optimizer."""

from __future__ import annotations

from typing import Any

from dlrover_core.train.context import current_job

__all__ = ["prepare"]


def prepare(model: Any, **optimizer_options: Any) -> tuple[Any, Any]:
    """Apply ``Job.parallel`` strategies to ``model`` in order, then build ``Job.optimizer``.

    ``init()`` must have been called. With ``Job.parallel`` unset, ``ddp`` is applied (a
    no-op on a one-process world). ``optimizer_options`` override the Job's optimizer options
    (e.g. ``lr=1e-3``). Outside dlrover the defaults are ``ddp`` and ``adamw``.

    Returns:
        ``(model, optimizer)``: the transformed model and a ``torch.optim.Optimizer`` over
        its parameters.

    Raises:
        RuntimeError: ``init()`` was not called.
        PluginNotFoundError: a strategy or optimizer name is not registered.
    """
    from dlrover_core.plugins import get_host
    from dlrover_core.spec import Optimizer
    from dlrover_core.train import process_group

    ctx = process_group._info
    if ctx is None:
        raise RuntimeError("call dlrover_core.train.init() before prepare()")
    job = current_job()
    strategies = job.parallel.strategies if job is not None and job.parallel is not None else (("ddp", {}),)
    optimizer = job.optimizer if job is not None else Optimizer("adamw")
    registries = get_host().registries
    for name, options in strategies:
        model = registries.parallel_strategy.get(name)(model, ctx, **options)
    factory = registries.optimizer.get(optimizer.name)
    return model, factory(model.parameters(), **{**optimizer.options, **optimizer_options})
