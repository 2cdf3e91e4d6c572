"""Capture and restore the random number generators a training step draws from."""

from __future__ import annotations

import random
from typing import Any

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state() -> dict[str, Any]:
    """Python's ``random``, numpy's global and torch's CPU (and accelerator) generators."""
    import numpy as np  # heavy: numpy
    import torch  # heavy: torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` captured (after a round-trip through the state format)."""
    import numpy as np  # heavy: numpy
    import torch  # heavy: torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys, pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
