"""The hook that registers AGD as the optimizer ``agd``.

The factory imports torch (and the optimizer) only when called, so loading plugins
(``dlrover plugins list``) stays fast.
"""

from __future__ import annotations

from typing import Any

from dlrover_core import hookimpl

__all__ = ["agd", "dlrover_register_optimizers"]


def agd(params: Any, **kwargs: Any) -> Any:
    """:class:`~dlrover_plugin_optim_agd.AGD` over ``params`` with ``kwargs`` as its options
    (``Job(optimizer=Optimizer("agd", lr=3e-4))``; JSON lists are accepted for ``betas``)."""
    from dlrover_plugin_optim_agd._agd import AGD  # subclasses torch.optim.Optimizer: torch is heavy

    return AGD(params, **kwargs)


@hookimpl
def dlrover_register_optimizers(register: Any) -> None:
    register(agd, name="agd")
