"""The built-in ``auto`` strategy: pick ddp, fsdp, or fsdp + activation checkpointing.

The rule (its text is :func:`dlrover_core.parallel_rules.auto_rule_text`, which
``Job.dryrun()`` prints), with S the training state of one replica and M one worker's
device memory:

- S = parameter bytes + gradient bytes (trainable parameters, same dtype) + optimizer-state
  bytes, the last k fp32 tensors per trainable parameter: k = 2 for AdamW / Adam (``exp_avg``,
  ``exp_avg_sq``), 1 for SGD with momentum, 0 without, and 2 for any other optimizer (the
  cautious guess);
- M = ``DeviceReport.memory_mb`` of the worker's accelerator probe × min(1, count /
  local_world_size) — a GPU per worker gets its own memory, the cpu "device" (host memory)
  is shared by the node's workers — or the ``device_mb`` option;
- D = data-parallel size (the mesh's ``data`` size, or the world size).

S <= ``shard_above`` × M (0.5): ``ddp`` — a replica leaves half the memory to activations.
Else S / D <= ``checkpoint_above`` × M (0.5): ``fsdp`` — sharded state leaves half.
Else ``checkpoint`` + ``fsdp`` — activations must shrink too (logged as a warning when
even S / D > M: the state alone does not fit). Memory unknown: ``ddp``. fsdp and
checkpoint wrap ``wrap_class``, or else the repeated block class: among modules held in a
``torch.nn.ModuleList``, the class whose instances hold the most parameters (none:
fsdp wraps only the root and checkpointing is skipped, logged).

ATorch's ``auto_accelerate`` searches strategies by dry runs; this rule only needs sizes,
so every rank reaches the same decision without a collective.
"""

from __future__ import annotations

from typing import Any

import attrs

from dlrover_core.logging import get_logger
from dlrover_core.markers import hookimpl
from dlrover_core.parallel_rules import AUTO_DEFAULTS
from dlrover_core.plugins import get_host

__all__ = ["AutoDecision", "auto", "decide", "guess_block_class", "optimizer_state_tensors"]

log = get_logger()

_MB = 2**20


@attrs.frozen(kw_only=True)
class AutoDecision:
    """What ``auto`` chose, and from which numbers (MiB).

    Attributes:
        choice: strategies to apply, in order, e.g. ``("checkpoint", "fsdp")``.
        state_mb: S, one replica's parameters + gradients + optimizer state.
        sharded_mb: S / D.
        device_mb: M, or ``None`` when unknown.
        reason: the branch of the rule taken, in words.
    """

    choice: tuple[str, ...]
    state_mb: float
    sharded_mb: float
    device_mb: float | None
    reason: str


def optimizer_state_tensors(optimizer: Any) -> int:
    """k: fp32 state tensors per parameter of the spec ``optimizer`` (``None``: adamw)."""
    name = getattr(optimizer, "name", "adamw")
    options = getattr(optimizer, "options", {}) or {}
    if name in ("adamw", "adam"):
        return 2
    if name == "sgd":
        return 1 if options.get("momentum") else 0
    return 2


def decide(
    *,
    state_bytes: float,
    device_mb: float | None,
    data_parallel_size: int,
    shard_above: float = AUTO_DEFAULTS["shard_above"],
    checkpoint_above: float = AUTO_DEFAULTS["checkpoint_above"],
) -> AutoDecision:
    """Apply the rule of this module's docstring to S = ``state_bytes`` (pure)."""
    state_mb = state_bytes / _MB
    sharded_mb = state_mb / max(1, data_parallel_size)
    numbers = {"state_mb": state_mb, "sharded_mb": sharded_mb, "device_mb": device_mb}
    if device_mb is None:
        return AutoDecision(choice=("ddp",), reason="device memory unknown: ddp", **numbers)
    if state_mb <= shard_above * device_mb:
        return AutoDecision(choice=("ddp",), reason=f"S <= {shard_above:g}·M: ddp", **numbers)
    if sharded_mb <= checkpoint_above * device_mb:
        return AutoDecision(choice=("fsdp",), reason=f"S > {shard_above:g}·M, S/D <= {checkpoint_above:g}·M: fsdp",
                            **numbers)
    return AutoDecision(choice=("checkpoint", "fsdp"),
                        reason=f"S/D > {checkpoint_above:g}·M: fsdp + activation checkpointing", **numbers)


def guess_block_class(model: Any) -> str | None:
    """Dotted path of the class of the model's repeated blocks (see the module doc), or None."""
    import torch  # torch: heavy, workers only

    totals: dict[type, int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for child in module:
                n = sum(p.numel() for p in child.parameters())
                if n:
                    totals[type(child)] = totals.get(type(child), 0) + n
    if not totals:
        return None
    cls = max(totals, key=lambda c: totals[c])
    return f"{cls.__module__}.{cls.__qualname__}"


def _probe_device_mb(ctx: Any) -> float | None:
    report = get_host().create_accelerator(ctx.info.accelerator or "auto").probe()
    if report.memory_mb is None:
        return None
    return report.memory_mb * min(1.0, max(1, report.count) / max(1, ctx.info.local_world_size))


def auto(
    model: Any,
    ctx: Any,
    *,
    shard_above: float = AUTO_DEFAULTS["shard_above"],
    checkpoint_above: float = AUTO_DEFAULTS["checkpoint_above"],
    wrap_class: str | list[str] | None = None,
    device_mb: float | None = None,
) -> Any:
    """Measure ``model``, decide (module doc), log ``parallel_auto`` and apply the choice.

    Args:
        shard_above, checkpoint_above: the rule's thresholds, fractions of M.
        wrap_class: the block class for fsdp and checkpointing (default: guessed).
        device_mb: M in MiB, instead of asking the accelerator probe.
    """
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    optimizer_bytes = optimizer_state_tensors(ctx.optimizer) * sum(p.numel() for p in trainable) * 4
    mb = device_mb or ctx.device_mb or _probe_device_mb(ctx)
    d = decide(state_bytes=param_bytes + grad_bytes + optimizer_bytes, device_mb=mb,
               data_parallel_size=ctx.data_parallel_size, shard_above=shard_above, checkpoint_above=checkpoint_above)
    block = wrap_class or (guess_block_class(model) if "fsdp" in d.choice else None)
    log.info("parallel_auto", param_mb=round(param_bytes / _MB, 3), grad_mb=round(grad_bytes / _MB, 3),
             optimizer_mb=round(optimizer_bytes / _MB, 3), state_mb=round(d.state_mb, 3),
             sharded_mb=round(d.sharded_mb, 3), device_mb=None if mb is None else round(mb, 3),
             data_parallel_size=ctx.data_parallel_size, choice=list(d.choice), wrap_class=block, reason=d.reason,
             rank=ctx.rank)
    if mb is not None and d.sharded_mb > mb:
        log.warning("parallel_auto_does_not_fit", sharded_mb=round(d.sharded_mb, 3), device_mb=round(mb, 3))
    for name in d.choice:
        if name == "checkpoint":
            if block is None:
                log.warning("parallel_auto_no_blocks", reason="no repeated block class in a ModuleList; "
                            "pass ('auto', {'wrap_class': ...}) to checkpoint activations")
                continue
            model = ctx.apply("checkpoint", model, wrap_class=block)
        elif name == "fsdp":
            model = ctx.apply("fsdp", model, wrap_class=block)
        else:
            model = ctx.apply(name, model)
    return model


@hookimpl
def dlrover_register_parallel_strategies(register):
    register(auto, name="auto", replicated=False)
