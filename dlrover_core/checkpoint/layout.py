"""Snapshot layout: where each tensor's bytes go — and, at the same time, a safetensors header.

A rank's state is laid out as one packed byte region, tensors ordered by element size
(largest first, so every tensor is aligned to its element size) and described by a header in
the safetensors format (https://huggingface.co/docs/safetensors, "Format"): per tensor its
dtype, shape and ``data_offsets``; under ``__metadata__``:

* ``format``: ``dlrover-state/1``;
* ``dlrover_state``: the JSON tree of the state (see :mod:`.state_format`);
* ``step``, ``rank``, ``world_size``;
* ``DCP_SHARDING_INFO``: per tensor the global offsets of this rank's piece, the convention
  of torch's ``HuggingFaceStorageReader``, so ``torch.distributed.checkpoint`` can load a
  step's files at another world size (resharding DTensor / FSDP2 states);
* ``dlrover_dtensors``: keys whose tensor was a DTensor (a shard, not the whole tensor).

The same layout serves the shared-memory snapshot (the region is copied into the slot) and
the file persisted from it (header + the region, verbatim), so persisting is one write.
"""

from __future__ import annotations

import io
import json
import struct
import sys
import warnings
from typing import Any

import attrs

from dlrover_core.checkpoint.copy import copy_all
from dlrover_core.checkpoint.state_format import flatten, unflatten
from dlrover_core.errors import CheckpointError

__all__ = ["FORMAT_VERSION", "Layout", "build_layout", "parse_header", "tensor_views"]

FORMAT_VERSION = "dlrover-state/1"
TREE_KEY = "dlrover_state"
SHARDING_KEY = "DCP_SHARDING_INFO"
DTENSORS_KEY = "dlrover_dtensors"


def _dtype_names() -> dict[Any, str]:
    import torch  # heavy: torch

    names = {
        torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
        torch.bool: "BOOL", torch.complex64: "C64",
    }
    for attr, name in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                       ("uint32", "U32"), ("uint64", "U64")):
        if hasattr(torch, attr):
            names[getattr(torch, attr)] = name
    return names


@attrs.frozen(kw_only=True, eq=False)
class Layout:
    """A rank's state, planned: safetensors ``entries`` (in data order), ``metadata``, the
    region size, and the source tensors to copy (local pieces, in data order)."""

    entries: dict[str, dict[str, Any]]
    metadata: dict[str, str]
    data_len: int
    sources: tuple[tuple[str, Any], ...]

    def header_bytes(self) -> bytes:
        """The safetensors header: 8-byte little-endian length, then JSON padded to 8 bytes."""
        text = json.dumps({**self.entries, "__metadata__": self.metadata}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text

    def copy_into(self, buffer: Any, offset: int) -> None:
        """Copy every tensor's bytes into ``buffer`` (a writable buffer) at ``offset``.

        CPU tensors are copied by :func:`~dlrover_core.checkpoint.copy.copy_all` (numpy,
        chunks across a few threads); accelerator tensors by torch (device to host)."""
        import numpy as np  # heavy: numpy
        import torch  # heavy: torch


        if self.data_len == 0:
            return
        region = np.frombuffer(buffer, dtype=np.uint8, count=self.data_len, offset=offset)
        region_t = None
        pairs = []
        for key, src in self.sources:
            begin, end = self.entries[key]["data_offsets"]
            if end == begin:
                continue
            flat = src.reshape(-1).view(torch.uint8)
            if flat.device.type == "cpu":
                pairs.append((region[begin:end], flat.numpy()))
            else:
                if region_t is None:
                    region_t = torch.from_numpy(region)
                region_t[begin:end].copy_(flat)
        copy_all(pairs)

    def write_to(self, f: Any) -> None:
        """Write the whole file (header, then each tensor's bytes) to a binary stream."""
        import torch  # heavy: torch

        f.write(self.header_bytes())
        for _, src in self.sources:
            if src.numel():
                f.write(memoryview(src.reshape(-1).view(torch.uint8).cpu().numpy()))


def build_layout(state: Any, *, step: int, rank: int, world_size: int) -> Layout:
    """Plan ``state`` (nothing is copied). Raises CheckpointError for unsupported values."""
    import numpy as np  # heavy: numpy
    import torch  # heavy: torch

    names = _dtype_names()
    # a DTensor can only exist if its module was imported: do not pay for importing it
    DTensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)

    tree, leaves = flatten(state)
    planned = []
    dtensor_keys = []
    for index, (key, leaf) in enumerate(leaves.items()):
        if isinstance(leaf, np.ndarray):
            local = torch.from_numpy(np.ascontiguousarray(leaf))
            offsets = [0] * local.dim()
        elif DTensor is not None and isinstance(leaf, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # heavy: torch

            local = leaf.to_local()
            _, offsets = compute_local_shape_and_global_offset(leaf.shape, leaf.device_mesh, leaf.placements)
            offsets = list(offsets)
            dtensor_keys.append(key)
        else:
            local = leaf
            offsets = [0] * local.dim()
        if local.dtype not in names:
            raise CheckpointError(f"cannot checkpoint {key}: dtype {local.dtype} has no safetensors name")
        planned.append((-local.element_size(), index, key, local, offsets))
    planned.sort(key=lambda p: (p[0], p[1]))
    entries: dict[str, dict[str, Any]] = {}
    sharding: dict[str, dict[str, list[int]]] = {}
    sources = []
    pos = 0
    for _, _, key, local, offsets in planned:
        nbytes = local.numel() * local.element_size()
        entries[key] = {"dtype": names[local.dtype], "shape": list(local.shape), "data_offsets": [pos, pos + nbytes]}
        sharding[key] = {"saved_offsets": [int(o) for o in offsets]}
        sources.append((key, local))
        pos += nbytes
    metadata = {
        "format": FORMAT_VERSION,
        TREE_KEY: json.dumps(tree, separators=(",", ":")),
        "step": str(step), "rank": str(rank), "world_size": str(world_size),
        SHARDING_KEY: json.dumps(sharding, separators=(",", ":")),
        DTENSORS_KEY: json.dumps(dtensor_keys),
    }
    return Layout(entries=entries, metadata=metadata, data_len=pos, sources=tuple(sources))


def parse_header(buffer: Any, *, with_data: bool = True) -> tuple[dict[str, dict[str, Any]], dict[str, str], int]:
    """``(entries, metadata, data_start)`` of safetensors bytes (any buffer).

    With ``with_data`` the buffer must also hold all the data the header describes.

    Raises CheckpointError when the bytes are not a complete dlrover state header.
    """
    view = memoryview(buffer)
    if len(view) < 8:
        raise CheckpointError("not a safetensors file: shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", view[:8])
    if n > len(view) - 8:
        raise CheckpointError("not a safetensors file: header longer than the file (torn file?)")
    try:
        header = json.loads(bytes(view[8 : 8 + n]))
    except ValueError as exc:
        raise CheckpointError(f"not a safetensors file: header is not JSON ({exc})") from None
    metadata = header.pop("__metadata__", None) or {}
    if metadata.get("format") != FORMAT_VERSION or TREE_KEY not in metadata:
        raise CheckpointError(f"not a dlrover state file (format {metadata.get('format')!r}, want {FORMAT_VERSION!r})")
    data_len = max((e["data_offsets"][1] for e in header.values()), default=0)
    if with_data and 8 + n + data_len > len(view):
        raise CheckpointError("dlrover state file is shorter than its header says (torn file?)")
    return header, metadata, 8 + n


def tensor_views(buffer: Any, data_start: int, entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Tensors viewing ``buffer`` (no copy) for every entry; empty tensors are fresh."""
    import torch  # heavy: torch

    back = {v: k for k, v in _dtype_names().items()}
    data_len = max((e["data_offsets"][1] for e in entries.values()), default=0)
    region = torch.frombuffer(buffer, dtype=torch.uint8, count=data_len, offset=data_start) if data_len else None
    out = {}
    for key, e in entries.items():
        dtype = back[e["dtype"]]
        begin, end = e["data_offsets"]
        if end == begin:
            out[key] = torch.empty(e["shape"], dtype=dtype)
        else:
            out[key] = region[begin:end].view(dtype).view(e["shape"])
    return out


def encode(state: Any, *, step: int = 0, rank: int = 0, world_size: int = 1) -> bytes:
    """``state`` as the bytes of one dlrover safetensors file."""
    buf = io.BytesIO()
    build_layout(state, step=step, rank=rank, world_size=world_size).write_to(buf)
    return buf.getvalue()


def decode(data: Any) -> tuple[Any, dict[str, str]]:
    """Inverse of :func:`encode`: ``(state, metadata)``; tensors are copies.

    Raises CheckpointError for anything but a complete dlrover state file.
    """
    entries, metadata, start = parse_header(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: cloned below
        views = tensor_views(data, start, entries)
    tensors = {k: v.clone() for k, v in views.items()}
    return unflatten(json.loads(metadata[TREE_KEY]), tensors), metadata
