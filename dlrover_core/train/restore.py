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
from dlrover_core.train.state import ModelOptimizerState

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
        if copy and isinstance(target, ModelOptimizerState):
            loaded = _load_fresh_optimizer(target, value)
            if loaded is not None:
                out[key] = loaded
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


def _load_fresh_optimizer(target: ModelOptimizerState, value: Any) -> dict[str, Any] | None:
    """Load a saved ``ModelOptimizerState`` value (this rank's local shards, as its own
    snapshot or shard holds them) into a model and an optimizer that has no state yet (a
    process that just started: a replacement, a restarted worker), without torch's
    initialization of the optimizer state: ``set_state_dict`` (and ``get_state_dict``, which
    :func:`_as_dtensors` needs for the DTensor layout) first runs one optimizer step with
    zero gradients to allocate it (``torch.distributed.checkpoint.state_dict``'s
    ``_init_optim_state``): 0.41 s of a replacement's 0.51 s load of 257 MiB per rank here,
    on the live world's critical path. Here the model is loaded by ``load_state_dict`` (a
    copy into its parameters) and the optimizer gets a copy of each saved state tensor
    through ``Optimizer.load_state_dict``, laid out as its parameter (a DTensor of the same
    mesh and placements where the parameter is one).

    Returns the loaded value (the model's state_dict; the optimizer's state as saved, of
    the copies), or ``None`` with nothing loaded where this does not apply: the optimizer
    holds state, or the saved names, groups or shapes are not this model's and optimizer's
    (the caller then takes ``set_state_dict``'s way)."""
    model, optimizer = unwrap_module(target.model), target.optimizer
    if optimizer.state or not isinstance(value, dict) or set(value) != {"model", "optimizer"}:
        return None
    saved, model_sd = value["optimizer"], value["model"]
    if (not isinstance(saved, dict) or set(saved) != {"state", "param_groups"} or not isinstance(model_sd, dict)
            or len(optimizer.param_groups) != len(saved["param_groups"])):
        return None
    template = model.state_dict()
    if set(model_sd) != set(template) or any(not _same_local_shape(model_sd[k], t) for k, t in template.items()):
        return None
    names = {id(p): name for name, p in model.named_parameters()}
    groups: list[dict[str, Any]] = []
    entries: list[tuple[int, str, Any, dict[str, Any]]] = []  # (index, name, parameter, saved state)
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        fqns = [names.get(id(p)) for p in group["params"]]
        if None in fqns or list(saved_group.get("params", ())) != fqns:
            return None
        first = sum(len(g["params"]) for g in groups)
        groups.append({**saved_group, "params": list(range(first, first + len(fqns)))})
        for i, (param, fqn) in enumerate(zip(group["params"], fqns, strict=True)):
            entry = saved["state"].get(fqn)
            if entry is None:
                continue
            if not isinstance(entry, dict) or any(not _fits(v, param) for v in entry.values()):
                return None
            entries.append((first + i, fqn, param, entry))
    copies = _copies([v for *_, entry in entries for v in entry.values()])
    state: dict[int, dict[str, Any]] = {}
    loaded: dict[str, dict[str, Any]] = {}
    for index, fqn, param, entry in entries:
        state[index] = {k: _shard_like(copies.get(id(v), v), param) for k, v in entry.items()}
        loaded[fqn] = state[index]
    model.load_state_dict(_as_dtensors(model_sd, template))
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return {"model": model.state_dict(), "optimizer": {"state": loaded, "param_groups": saved["param_groups"]}}


def _local_shape(t: Any) -> tuple[int, ...]:
    DTensor = _dtensor_type()
    return tuple((t.to_local() if DTensor is not None and isinstance(t, DTensor) else t).shape)


def _same_local_shape(value: Any, target: Any) -> bool:
    import torch  # heavy: torch

    if not isinstance(target, torch.Tensor):
        return not isinstance(value, torch.Tensor)
    return isinstance(value, torch.Tensor) and tuple(value.shape) == _local_shape(target)


def _fits(value: Any, param: Any) -> bool:
    """Whether a saved optimizer state value can be laid out as ``param``'s: a non-tensor,
    a scalar, or a tensor of the parameter's local shape (a DTensor parameter's other
    shapes, e.g. factored second moments, have a layout only torch's way knows)."""
    import torch  # heavy: torch

    DTensor = _dtensor_type()
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return True
    if DTensor is not None and isinstance(value, DTensor):
        return False  # (a snapshot holds local shards)
    if DTensor is not None and isinstance(param, DTensor):
        return tuple(value.shape) == _local_shape(param)
    return True


def _shard_like(value: Any, param: Any) -> Any:
    """``value`` (a copy) as ``param`` lays out its state: a DTensor like ``param`` for a
    tensor of its local shape, else as it is."""
    DTensor = _dtensor_type()
    if DTensor is None or not isinstance(param, DTensor) or getattr(value, "dim", lambda: 0)() == 0:
        return value
    return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride(), run_check=False)


def _copies(values: list[Any]) -> dict[int, Any]:
    """A copy of each tensor of ``values`` (by ``id``), the large contiguous CPU ones made
    by :func:`~dlrover_core.checkpoint.copy.copy_all`'s threads."""
    import torch  # heavy: torch

    out: dict[int, Any] = {}
    pairs = []
    for v in values:
        if not isinstance(v, torch.Tensor) or id(v) in out:
            continue
        src = v.detach()
        if src.device.type == "cpu" and src.is_contiguous() and type(src) is torch.Tensor and src.numel():
            dst = torch.empty_like(src)
            pairs.append((dst.view(-1).view(torch.uint8).numpy(), src.view(-1).view(torch.uint8).numpy()))
            out[id(v)] = dst
        else:
            out[id(v)] = src.clone()
    copy_all(pairs)
    return out


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
