"""torch's own optimizers, registered as ``adamw``, ``adam`` and ``sgd``.

The factories import torch when called, so loading plugins (``dlrover plugins list``) stays
fast.
"""

from __future__ import annotations

from typing import Any

from dlrover_core.markers import hookimpl

__all__ = ["adam", "adamw", "sgd"]


def adamw(params: Any, **kwargs: Any) -> Any:
    """:class:`torch.optim.AdamW` (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019)."""
    import torch  # torch: heavy, workers only

    return torch.optim.AdamW(params, **kwargs)


def adam(params: Any, **kwargs: Any) -> Any:
    """:class:`torch.optim.Adam` (Kingma & Ba, "Adam", ICLR 2015)."""
    import torch  # torch: heavy, workers only

    return torch.optim.Adam(params, **kwargs)


def sgd(params: Any, **kwargs: Any) -> Any:
    """:class:`torch.optim.SGD`, with optional momentum and Nesterov."""
    import torch  # torch: heavy, workers only

    return torch.optim.SGD(params, **kwargs)


@hookimpl
def dlrover_register_optimizers(register):
    register(adamw, name="adamw")
    register(adam, name="adam")
    register(sgd, name="sgd")
