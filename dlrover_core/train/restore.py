"""Putting saved state back into the training script's objects (used by
:meth:`~dlrover_core.train.checkpointer.Checkpointer.load`).

* :func:`restore_tree` rebuilds the user's state from a snapshot or shard's tensors and its
  JSON tree, copying into the given targets in place (modules, optimizers, tensors,
  DTensors) or returning fresh values;
* :func:`reshard` loads a storage step saved at another world size through
  ``torch.distributed.checkpoint`` (DCP resharding of DTensor shards by their global
  offsets);
* :func:`shards_differ` says whether the saved shards cover the targets differently (so a
  resharding load is needed); :func:`without_rng` drops the RNG states from a tree.

torch is imported inside the functions: it is heavy, and only a training process needs it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from dlrover_core.checkpoint.copy import copy_all
from dlrover_core.checkpoint.state_format import flatten, unflatten, unwrap_module
from dlrover_core.errors import CheckpointError

__all__ = ["reshard", "restore_tree", "shards_differ", "without_rng"]


def without_rng(tree: Any) -> Any:
    """The tree minus its rank-local RNG states (another rank's RNG is not ours)."""
    return {"__dict__": [[k, v] for k, v in tree["__dict__"] if k != "rng"]}


def _dtensor_type() -> Any:
    """DTensor if this process uses it (its module is imported), else ``None``: importing
    ``torch.distributed.tensor`` costs most of a second, and a state without DTensors
    never needs it."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def shards_differ(views: dict[str, Any], state: dict[str, Any]) -> bool:
    """Whether a target DTensor's local shard has another shape than the saved one."""
    DTensor = _dtensor_type()
    if DTensor is None:
        return False
    _, targets = flatten({"state": state})
    return any(isinstance(t, DTensor) and k in views and tuple(t.to_local().shape) != tuple(views[k].shape)
               for k, t in targets.items())


def reshard(step_path: Path, views: dict[str, Any], state: dict[str, Any], *, storage: Any,
             sharded: list[str], files: list[str] | None = None) -> dict[str, Any]:
    """Fill the targets' tensors from every rank's file of the step with DCP (resharding).

    ``sharded`` names the saved keys that were DTensor shards: each needs a target tensor
    (a target that has not allocated it — an optimizer before its first step — cannot be
    resharded into)."""
    import torch  # heavy: torch
    import torch.distributed.checkpoint as dcp  # heavy: torch
    from torch.distributed.checkpoint import DefaultLoadPlanner, HuggingFaceStorageReader  # heavy: torch

    if not step_path.is_dir():
        raise CheckpointError(f"loading at another world size needs a local directory; {storage.url!r} is not one")
    _, targets = flatten({"state": state})
    wanted = {k: v for k, v in targets.items() if k in views and isinstance(v, torch.Tensor)}
    missing = [k for k in sharded if k not in wanted]
    if missing:
        raise CheckpointError(
            f"cannot reshard {len(missing)} saved shard(s) into targets that lack them (e.g. {missing[0]!r}); "
            "an optimizer has no state before its first step: pass train.ModelOptimizerState(model, optimizer), "
            "which allocates it (torch.distributed.checkpoint.state_dict)")
    # DCP's reader takes every *.safetensors file of a directory: give it only the commit's
    # files (a late write of a stale incarnation may lie beside them)
    with tempfile.TemporaryDirectory(prefix="dlrover-reshard-") as tmp:
        for name in files or [p.name for p in step_path.glob("*.safetensors")]:
            os.symlink((step_path / name).resolve(), Path(tmp) / name)  # absolute: a relative dir too
        dcp.load(wanted, storage_reader=HuggingFaceStorageReader(tmp),
                 planner=DefaultLoadPlanner(allow_partial_load=True))
    return {**views, **wanted}


def restore_tree(tree: Any, tensors: dict[str, Any], targets: dict[str, Any] | None, *, copy: bool) -> dict[str, Any]:
    """Rebuild the saved state from ``tree`` and ``tensors``; load it into ``targets``.

    With ``copy``, tensors that escape (returned, or given to objects that keep them, like
    optimizers) are copied first, since the views die with the buffer; ``nn.Module`` targets
    copy on their own in ``load_state_dict``.
    """
    import torch  # heavy: torch

    full = unflatten(tree, tensors)
    saved = full["state"]
    out = dict(saved)
    for key, target in (targets or {}).items():
        if key not in saved:
            raise CheckpointError(f"checkpoint has no entry {key!r} (it has: {', '.join(map(str, saved))})")
        value = saved[key]
        target = unwrap_module(target)
        if isinstance(target, torch.nn.Module):
            if not _copy_into_module(target, value):
                target.load_state_dict(_as_dtensors(value, target.state_dict()))
            out[key] = target.state_dict()
            continue
        value = _clone(value) if copy else value
        if hasattr(target, "load_state_dict"):
            target.load_state_dict(_as_dtensors(value, target.state_dict()))
        elif isinstance(target, torch.Tensor):
            with torch.no_grad():
                target.copy_(value)
        out[key] = value
    for key in saved:
        if key not in (targets or {}) and copy:
            out[key] = _clone(saved[key])
    full["state"] = out
    if copy and "rng" in full:
        full["rng"] = _clone(full["rng"])
    return full


def _copy_into_module(module: Any, value: dict[str, Any]) -> bool:
    """Copy a saved state dict into a module's own CPU tensors, in parallel; return False
    (nothing done) unless that is exactly what ``load_state_dict`` would do: same keys,
    shapes and dtypes, plain contiguous CPU tensors, no load hooks."""
    import torch  # heavy: torch

    if module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks or not isinstance(value, dict):
        return False
    if any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks for m in module.modules()):
        return False
    own = module.state_dict(keep_vars=True)
    if set(own) != set(value):
        return False
    pairs = []
    for key, target in own.items():
        src = value[key]
        if not isinstance(src, torch.Tensor) or type(target.data) is not torch.Tensor or type(src) is not torch.Tensor:
            return False
        dst = target.data
        if (dst.device.type != "cpu" or src.device.type != "cpu" or dst.shape != src.shape or dst.dtype != src.dtype
                or not dst.is_contiguous() or not src.is_contiguous()):
            return False
        if dst.numel():
            pairs.append((dst.view(-1).view(torch.uint8).numpy(), src.view(-1).view(torch.uint8).numpy()))
    with torch.no_grad():
        copy_all(pairs)
    return True


def _clone(value: Any) -> Any:
    import torch  # heavy: torch

    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _as_dtensors(value: Any, target: Any) -> Any:
    """Where ``target`` holds a DTensor and ``value`` a plain tensor (a saved local shard),
    wrap the value as a DTensor like the target (same mesh, placements, global shape)."""
    DTensor = _dtensor_type()
    if DTensor is None:
        return value
    import torch  # heavy: torch

    if isinstance(target, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        if value.shape != target.to_local().shape:
            return value  # a resharded value already filled the target itself
        return DTensor.from_local(value.to(target.device), target.device_mesh, target.placements,
                                  shape=target.shape, stride=target.stride(), run_check=False)
    if isinstance(value, dict) and isinstance(target, dict):
        return {k: _as_dtensors(v, target.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and isinstance(target, (list, tuple)) and len(value) == len(target):
        return type(value)(_as_dtensors(v, t) for v, t in zip(value, target, strict=True))
    return value
