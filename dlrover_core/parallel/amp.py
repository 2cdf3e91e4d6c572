"""The built-in ``amp`` strategy: automatic mixed precision with ``torch.autocast``.

``("amp", {"dtype": "bfloat16"})`` runs the model's forward inside
``torch.autocast(device_type, dtype)`` (https://pytorch.org/docs/stable/amp.html#torch.autocast,
which recommends autocasting the forward only, not backward): matmuls and convolutions run
in the low precision, reductions and losses in float32. The model's floating outputs are
cast back to ``output_dtype`` (float32 by default, as HF Accelerate's
``convert_outputs_to_fp32`` does) so the loss the script computes outside is float32. The
parameters, their names and the optimizer stay float32; the forward is replaced on the
instance by :func:`~dlrover_core.parallel.context.replace_forward`.

``"float16"`` has a narrower exponent, so small gradients underflow: it also gets a dynamic
gradient scaler (https://pytorch.org/docs/stable/amp.html#gradient-scaling).
:class:`torch.amp.GradScaler` (or FSDP's ``ShardedGradScaler`` when the model is sharded,
which agrees on overflow across ranks) scales the gradient flowing into the model's outputs
by the current scale S (a tensor hook on each output, so ``loss.backward()`` is unchanged),
and the optimizer's ``step`` is replaced in place by one that unscales, skips the step when a
gradient is inf/NaN and updates S. Limits: gradients that do not flow through the model's
outputs are not scaled (and would be divided by S), and S is not checkpointed (it starts at
``init_scale`` again after a restart and settles within a few steps).
"""

from __future__ import annotations

import types
from typing import Any

from dlrover_core.errors import JobSpecError
from dlrover_core.logging import get_logger
from dlrover_core.markers import hookimpl
from dlrover_core.parallel.context import replace_forward

__all__ = ["amp"]

log = get_logger()


class _LossScale:
    """Holds the gradient scaler of one model; the scaler is made once the optimizer is."""

    def __init__(self, device_type: str, init_scale: float) -> None:
        self.device_type = device_type
        self.init_scale = init_scale
        self.scaler: Any = None
        self.scaled = False  # a backward went through the outputs since the last step

    def scale(self, grad: Any) -> Any:
        if self.scaler is None:
            return grad
        self.scaled = True
        return self.scaler.scale(grad)

    def attach(self, optimizer: Any, *, sharded: bool) -> None:
        import torch  # torch: heavy, workers only

        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # torch: heavy, workers only

            self.scaler = ShardedGradScaler(device=self.device_type, init_scale=self.init_scale)
        else:
            self.scaler = torch.amp.GradScaler(self.device_type, init_scale=self.init_scale)
        optimizer._dlrover_loss_scale = self
        optimizer._dlrover_unscaled_step = optimizer.step
        optimizer._dlrover_in_scaler = False
        # A bound method, so wrappers such as LRScheduler's (which use step.__func__) still work.
        optimizer.step = types.MethodType(_scaled_step, optimizer)


def _scaled_step(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``optimizer.step`` under a float16 ``amp``: unscale, skip on inf/NaN, update the scale."""
    box = self._dlrover_loss_scale
    if self._dlrover_in_scaler or not box.scaled:  # GradScaler calling back, or nothing was scaled
        return self._dlrover_unscaled_step(*args, **kwargs)
    self._dlrover_in_scaler = True
    try:
        result = box.scaler.step(self, *args, **kwargs)
        box.scaler.update()
    finally:
        self._dlrover_in_scaler = False
        box.scaled = False
    return result


def amp(
    model: Any, ctx: Any, *, dtype: str = "bfloat16", output_dtype: str | None = "float32", init_scale: float = 2.0**16
) -> Any:
    """Run ``model``'s forward under ``torch.autocast(ctx.device.type, dtype)``.

    Args:
        dtype: ``"bfloat16"`` or ``"float16"`` (adds a gradient scaler, see the module doc).
        output_dtype: dtype the forward's floating outputs are cast to (``None``: leave them).
        init_scale: float16 only: the scaler's first scale S (torch's default 2**16; the
            first steps are skipped while S backs off to a value without overflow).

    The same module object is returned, its ``forward`` replaced on the instance (parameter
    names, and so checkpoints, are unchanged). Works before or after ddp / fsdp.

    Raises:
        JobSpecError: the worker's device type has no autocast.
    """
    import torch  # torch: heavy, workers only
    from torch.utils._pytree import tree_map_only  # torch: heavy, workers only

    device_type = ctx.device.type
    if not torch.amp.is_autocast_available(device_type):
        raise JobSpecError(ctx.field("dtype"), dtype, f"a device type with torch.autocast; {device_type!r} has none")
    low = getattr(torch, dtype)
    out = getattr(torch, output_dtype) if output_dtype else None
    box = _LossScale(device_type, init_scale) if dtype == "float16" else None

    def convert(t: Any) -> Any:
        if out is not None and t.is_floating_point() and t.dtype != out and t.dtype in (torch.bfloat16, torch.float16):
            t = t.to(out)
        if box is not None and t.requires_grad and torch.is_grad_enabled():
            t.register_hook(box.scale)
        return t

    def autocast(forward: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device_type, dtype=low):
            outputs = forward(*args, **kwargs)
        return tree_map_only(torch.Tensor, convert, outputs)

    replace_forward(model, autocast)
    if box is not None:
        ctx.on_optimizer(lambda optimizer: box.attach(optimizer, sharded=ctx.sharded))
    log.debug("amp_applied", dtype=dtype, device_type=device_type, scaler=box is not None)
    return model


@hookimpl
def dlrover_register_parallel_strategies(register):
    register(amp, name="amp", replicated=True)
