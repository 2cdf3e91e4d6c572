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

#: values a tree keeps as they are, without a walk (exact types: a subclass, e.g. an IntEnum,
#: or numpy's float64, is walked)
_PLAIN = frozenset({int, float, str, bool, type(None)})


def flatten(state: Any) -> tuple[Any, dict[str, Any]]:
    """``(json_tree, {key: leaf})``; leaves are the caller's tensors (or numpy arrays)."""
    walker = _Walker()
    return walker.walk(state, ""), walker.leaves


class _Walker:
    """One :func:`flatten`. (A class, not nested functions: a recursive closure is a
    reference cycle, which kept ``leaves``, a tensor object per leaf, alive until the next
    garbage collection.)"""

    def __init__(self) -> None:
        import numpy as np  # heavy: numpy
        import torch  # heavy: torch

        self.leaves: dict[str, Any] = {}
        self._tensor, self._ndarray, self._generic = torch.Tensor, np.ndarray, np.generic

    def key_for(self, path: str) -> str:
        key, n = path or "_", 1
        while key in self.leaves:
            n += 1
            key = f"{path}~{n}"
        return key

    def walk(self, obj: Any, path: str) -> Any:
        if isinstance(obj, self._tensor):
            key = self.key_for(path)
            # (a tensor that does not require grad has no autograd history to cut off: it
            # is its own detached alias, without a new tensor object per leaf and save)
            self.leaves[key] = obj.detach() if obj.requires_grad else obj
            return {"__tensor__": key}
        if isinstance(obj, self._ndarray):
            key = self.key_for(path)
            self.leaves[key] = obj
            return {"__ndarray__": key}
        if isinstance(obj, self._generic):
            return obj.item()
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        walk = self.walk
        if isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                if not (k is None or isinstance(k, (str, int, float, bool))):
                    raise CheckpointError(f"state key {k!r} at {path or '/'} has type {type(k).__name__}; use str or int keys")
                # a plain value is its own tree: no walk (nor its path) for each of them
                items.append([k, v if type(v) in _PLAIN else walk(v, f"{path}/{k}" if path else str(k))])
            return {"__dict__": items}
        if isinstance(obj, (tuple, list)):  # (Python's RNG state: 625 ints)
            items = [v if type(v) in _PLAIN else walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
            return {"__tuple__": items} if isinstance(obj, tuple) else items
        if hasattr(obj, "state_dict") and callable(obj.state_dict):
            return walk(unwrap_module(obj).state_dict(), path)
        raise CheckpointError(
            f"cannot checkpoint {path or 'state'}: type {type(obj).__module__}.{type(obj).__qualname__} "
            "is not a tensor, array, number, string, None, dict, list, tuple or object with state_dict()"
        )


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
