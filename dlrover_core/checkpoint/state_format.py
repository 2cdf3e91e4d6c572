"""A state dict as a JSON tree plus tensor leaves, without pickle.

``flatten`` splits a state (nested dicts, lists, tuples, tensors, DTensors, numpy arrays,
numbers, strings, None, objects with ``state_dict()``) into a JSON-safe tree, in which each
tensor is replaced by ``{"__tensor__": key}``, and a ``{key: tensor}`` map of references
(nothing is copied). ``unflatten`` is the inverse. Keys are ``/``-joined paths.

Tree encoding (so any key type and container round-trips exactly):
    dict  → {"__dict__": [[key, value], ...]}    (keys: str, int, float, bool or None)
    tuple → {"__tuple__": [...]}
    list  → [...]
    numpy array → {"__ndarray__": key}            (stored as a tensor)
Anything else raises CheckpointError naming its path and type. Loading never executes code.
"""

from __future__ import annotations

import sys
from typing import Any

from dlrover_core.errors import CheckpointError

__all__ = ["flatten", "unflatten"]


def flatten(state: Any) -> tuple[Any, dict[str, Any]]:
    """``(json_tree, {key: leaf})``; leaves are the caller's tensors (or numpy arrays)."""
    import numpy as np  # heavy: numpy
    import torch  # heavy: torch

    leaves: dict[str, Any] = {}

    def key_for(path: str) -> str:
        key, n = path or "_", 1
        while key in leaves:
            n += 1
            key = f"{path}~{n}"
        return key

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            key = key_for(path)
            leaves[key] = obj.detach()
            return {"__tensor__": key}
        if isinstance(obj, np.ndarray):
            key = key_for(path)
            leaves[key] = obj
            return {"__ndarray__": key}
        if isinstance(obj, np.generic):
            return obj.item()
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                if not (k is None or isinstance(k, (str, int, float, bool))):
                    raise CheckpointError(f"state key {k!r} at {path or '/'} has type {type(k).__name__}; use str or int keys")
                items.append([k, walk(v, f"{path}/{k}" if path else str(k))])
            return {"__dict__": items}
        if isinstance(obj, tuple):
            return {"__tuple__": [walk(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if hasattr(obj, "state_dict") and callable(obj.state_dict):
            return walk(unwrap_module(obj).state_dict(), path)
        raise CheckpointError(
            f"cannot checkpoint {path or 'state'}: type {type(obj).__module__}.{type(obj).__qualname__} "
            "is not a tensor, array, number, string, None, dict, list, tuple or object with state_dict()"
        )

    return walk(state, ""), leaves


def unwrap_module(obj: Any) -> Any:
    """The module inside a ``DistributedDataParallel`` wrapper, or a wrapper class that says
    ``dlrover_wrapper = True`` (the live world's ``ReplicatedModule``), else ``obj`` itself, so
    that a checkpoint's keys do not depend on whether the world that saved it had one
    process (no wrapper) or many (keys prefixed ``module.``)."""
    ddp = _ddp_type()
    wrapped = (ddp is not None and isinstance(obj, ddp)) or getattr(type(obj), "dlrover_wrapper", False)
    return obj.module if wrapped else obj


def _ddp_type() -> Any:
    parallel = sys.modules.get("torch.nn.parallel")  # only loaded torch can have wrapped a model
    return getattr(parallel, "DistributedDataParallel", None) if parallel is not None else None


def unflatten(tree: Any, tensors: dict[str, Any]) -> Any:
    """Inverse of :func:`flatten`: ``tensors`` maps keys to tensors (numpy leaves are
    converted back with ``.numpy()``)."""
    if isinstance(tree, list):
        return [unflatten(v, tensors) for v in tree]
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            return tensors[tree["__tensor__"]]
        if "__ndarray__" in tree:
            return tensors[tree["__ndarray__"]].numpy()
        if "__tuple__" in tree:
            return tuple(unflatten(v, tensors) for v in tree["__tuple__"])
        if "__dict__" in tree:
            return {k: unflatten(v, tensors) for k, v in tree["__dict__"]}
        raise CheckpointError(f"malformed state tree node: {sorted(tree)}")
    return tree


def tensor_keys(tree: Any) -> list[str]:
    """Keys of every tensor or array leaf in ``tree``."""
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if "__tensor__" in node or "__ndarray__" in node:
                out.append(node.get("__tensor__") or node["__ndarray__"])
            elif "__tuple__" in node:
                walk(node["__tuple__"])
            elif "__dict__" in node:
                for _, v in node["__dict__"]:
                    walk(v)

    walk(tree)
    return out
