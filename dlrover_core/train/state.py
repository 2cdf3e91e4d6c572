"""``ModelOptimizerState``: a model and its optimizer as one checkpointable object."""

from __future__ import annotations

from typing import Any

__all__ = ["ModelOptimizerState"]


class ModelOptimizerState:
    """Pairs a model with its optimizer for checkpoints that can be resharded.

    ``state_dict()`` is torch's ``get_state_dict(model, optimizer)``
    (``torch.distributed.checkpoint.state_dict``): optimizer state keyed by parameter name,
    allocated even before the first step, DTensors for FSDP2 models. ``load_state_dict()`` is
    ``set_state_dict``. Use it when an FSDP2 / DTensor job may be restored at another world
    size::

        ckpt.save(step, {"train": ModelOptimizerState(model, optimizer), "data": sampler})
    """

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict  # heavy: torch

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict  # heavy: torch

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
