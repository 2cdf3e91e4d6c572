"""Turning a state dict into tensors plus JSON and back, without pickle.

A state (nested dicts, lists, tuples, tensors, numpy arrays, numbers, strings, None) is
split into a flat ``{key: tensor}`` map and a JSON tree in which each tensor is replaced by
``{"__tensor__": key}``. The tensors are stored with safetensors and the JSON tree in the
safetensors header's ``__metadata__`` (a ``str → str`` map), so one file per rank holds
everything and opens with ``safetensors.safe_open`` anywhere.

JSON tree encoding (chosen so any key type and container round-trips exactly):
    dict  → {"__dict__": [[key, value], ...]}    (keys: str, int, float, bool or None)
    tuple → {"__tuple__": [...]}
    list  → [...]
    numpy array → {"__ndarray__": key}            (stored as a tensor)
    objects with ``state_dict()`` are saved as their state dict.
Anything else raises CheckpointError naming its path and type. Loading never executes code.

Format reference: https://huggingface.co/docs/safetensors (header: 8-byte little-endian
length, then a JSON header with an optional ``__metadata__`` entry).
"""

from __future__ import annotations

import json
import struct
from typing import Any

from dlrover_core.errors import CheckpointError

__all__ = ["FORMAT_VERSION", "decode", "encode", "flatten", "unflatten"]

FORMAT_VERSION = "dlrover-state/1"
_META_KEY = "dlrover_state"


def flatten(state: Any) -> tuple[Any, dict[str, Any]]:
    """Split ``state`` into ``(json_tree, {key: tensor})``; tensors are detached CPU tensors."""
    import numpy as np
    import torch

    tensors: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()

    def key_for(path: str) -> str:
        key, n = path or "_", 1
        while key in tensors:
            n += 1
            key = f"{path}~{n}"
        return key

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            key = key_for(path)
            t = obj.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            # safetensors refuses tensors that share memory; give each its own storage.
            ptr = t.untyped_storage().data_ptr()
            if t.numel() and ptr in seen_storage:
                t = t.clone()
            elif t.numel():
                seen_storage.add(ptr)
            tensors[key] = t
            return {"__tensor__": key}
        if isinstance(obj, np.ndarray):
            key = key_for(path)
            tensors[key] = torch.from_numpy(np.ascontiguousarray(obj)).clone()
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
            return walk(obj.state_dict(), path)
        raise CheckpointError(
            f"cannot checkpoint {path or 'state'}: type {type(obj).__module__}.{type(obj).__qualname__} "
            "is not a tensor, array, number, string, None, dict, list, tuple or object with state_dict()"
        )

    return walk(state, ""), tensors


def unflatten(tree: Any, tensors: dict[str, Any]) -> Any:
    """Inverse of :func:`flatten`."""
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


def encode(state: Any, extra_metadata: dict[str, str] | None = None) -> bytes:
    """``state`` as safetensors bytes (JSON tree in the header metadata)."""
    from safetensors.torch import save

    tree, tensors = flatten(state)
    metadata = {"format": FORMAT_VERSION, _META_KEY: json.dumps(tree, separators=(",", ":"))}
    metadata.update(extra_metadata or {})
    return save(tensors, metadata=metadata)


def read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` map of safetensors bytes (only the header is parsed)."""
    if len(data) < 8:
        raise CheckpointError("not a safetensors file: shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CheckpointError("not a safetensors file: header length exceeds the file size (torn file?)")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as exc:
        raise CheckpointError(f"not a safetensors file: header is not JSON ({exc})") from None
    return header.get("__metadata__") or {}


def decode(data: bytes) -> tuple[Any, dict[str, str]]:
    """Inverse of :func:`encode`: ``(state, metadata)``."""
    from safetensors.torch import load

    metadata = read_metadata(data)
    if metadata.get("format") != FORMAT_VERSION or _META_KEY not in metadata:
        raise CheckpointError(f"not a dlrover state file (format {metadata.get('format')!r}, want {FORMAT_VERSION!r})")
    try:
        tensors = load(data)
    except Exception as exc:
        raise CheckpointError(f"corrupt safetensors data: {exc}") from None
    return unflatten(json.loads(metadata[_META_KEY]), tensors), metadata
