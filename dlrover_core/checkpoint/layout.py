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

What depends only on the tensors' keys, dtypes and shapes — the order, the offsets, the
tensor table of the header — is a :class:`LayoutPlan`. A training loop saves the same
tensors step after step, so :func:`build_layout` takes the previous save's plan and reuses
it when the tensors match (compared on every save); then only the tree of the rest is
encoded again. The bytes are those a fresh plan gives.
"""

from __future__ import annotations

import io
import json
import struct
import sys
import warnings
import zlib
from typing import Any

import attrs

from dlrover_core.checkpoint.copy import copy_all
from dlrover_core.checkpoint.state_format import flatten, unflatten
from dlrover_core.errors import CheckpointError

__all__ = ["FORMAT_VERSION", "CopyTargets", "Layout", "LayoutPlan", "build_layout", "parse_header", "tensor_views"]

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
class LayoutPlan:
    """Where a state's tensors go: what a :class:`Layout` takes from its tensors' keys,
    dtypes and shapes alone. Reused by the next save whose tensors have the same
    ``signature``; never mutated.

    Attributes:
        signature: per tensor, in the state's order: ``(key, dtype, shape, offsets)``
            (``offsets``: a DTensor's global offsets, else ``None``).
        order: indices of the state's tensors in data order.
        entries: the safetensors tensor table, in data order.
        data_len: bytes of the packed region.
        sharding, dtensors: the JSON of ``DCP_SHARDING_INFO`` and ``dlrover_dtensors``.
        header_prefix: the header's JSON before the metadata object:
            ``{<entries>,"__metadata__":``.
    """

    signature: tuple[tuple[Any, ...], ...]
    order: tuple[int, ...]
    entries: dict[str, dict[str, Any]]
    data_len: int
    sharding: str
    dtensors: str
    header_prefix: bytes


#: tensors with fewer elements than this are copied by one torch call for all of them (torch
#: copies such a tensor in the calling thread: its OpenMP threads start at 32768 elements,
#: ``at::internal::GRAIN_SIZE``, and wait for each other on shared cores); larger ones by
#: numpy (:mod:`.copy`)
_SMALL_NUMEL = 32768


@attrs.frozen(kw_only=True, eq=False)
class CopyTargets:
    """Where :meth:`Layout.copy_into` copies each source (indices into ``sources``), as
    views of one buffer.

    Attributes:
        small: sources under ``_SMALL_NUMEL`` elements, copied together by torch.
        small_views: torch views of their places, typed and shaped like them.
        large: ``(index, numpy view, torch view, as_bytes)`` of the others: the numpy view
            is typed and shaped like the source, or its bytes (``as_bytes``) where numpy has
            no such dtype.
    """

    small: tuple[int, ...]
    small_views: list[Any]
    large: tuple[tuple[int, Any, Any, bool], ...]


def _foreach_copy(dst: list[Any], src: list[Any]) -> None:
    """``dst[i].copy_(src[i])`` for every ``i``: in one call for CPU sources (where torch
    has ``_foreach_copy_``), else one by one (device to host)."""
    import torch  # heavy: torch

    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None and all(s.is_cpu for s in src):
        foreach(dst, src)
        return
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


@attrs.frozen(kw_only=True, eq=False)
class Layout:
    """A rank's state, planned: safetensors ``entries`` (in data order), ``metadata``, the
    region size, the source tensors to copy (local pieces, in data order), and the ``plan``
    they came from (``None`` for a layout made by hand)."""

    entries: dict[str, dict[str, Any]]
    metadata: dict[str, str]
    data_len: int
    sources: tuple[tuple[str, Any], ...]
    plan: LayoutPlan | None = None

    def header_bytes(self) -> bytes:
        """The safetensors header: 8-byte little-endian length, then JSON padded to 8 bytes."""
        if self.plan is not None:  # the tensor table is encoded once per plan: the same bytes
            text = self.plan.header_prefix + json.dumps(self.metadata, separators=(",", ":")).encode() + b"}"
        else:
            text = json.dumps({**self.entries, "__metadata__": self.metadata}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text

    def targets(self, buffer: Any, offset: int) -> CopyTargets:
        """Views of ``buffer`` at ``offset`` that :meth:`copy_into` copies the sources into.
        They depend only on the plan: a writer keeps them for its buffer and passes them to
        every save with the same :attr:`plan` (making them is a good part of a small
        state's save)."""
        import numpy as np  # heavy: numpy
        import torch  # heavy: torch

        region = np.frombuffer(buffer, dtype=np.uint8, count=self.data_len, offset=offset)
        region_t = torch.from_numpy(region)
        small, small_views, large = [], [], []
        for index, (key, src) in enumerate(self.sources):
            begin, end = self.entries[key]["data_offsets"]
            if end == begin:
                continue
            view = region_t[begin:end].view(src.dtype).view(src.shape)
            if src.numel() < _SMALL_NUMEL:
                small.append(index)
                small_views.append(view)
                continue
            dtype = _numpy_dtype(src.dtype)
            array = region[begin:end] if dtype is None else region[begin:end].view(dtype).reshape(tuple(src.shape))
            large.append((index, array, view, dtype is None))
        return CopyTargets(small=tuple(small), small_views=small_views, large=tuple(large))

    def copy_into(self, buffer: Any, offset: int, targets: CopyTargets | None = None) -> None:
        """Copy every tensor's bytes into ``buffer`` (a writable buffer) at ``offset``.

        CPU tensors under ``_SMALL_NUMEL`` elements are copied by one torch call for them
        all (``_foreach_copy_``), accelerator ones one by one; larger CPU tensors by
        :func:`~dlrover_core.checkpoint.copy.copy_all` (numpy, chunks across a few threads),
        larger accelerator tensors by torch. ``targets``: what :meth:`targets` gave for
        this buffer, offset and plan."""
        import torch  # heavy: torch

        if self.data_len == 0:
            return
        if targets is None:
            targets = self.targets(buffer, offset)
        sources = self.sources
        with torch.no_grad():
            if targets.small:
                _foreach_copy(targets.small_views, [sources[i][1] for i in targets.small])
            pairs = []
            for index, array, view, as_bytes in targets.large:
                src = sources[index][1]
                if not src.is_cpu:
                    view.copy_(src)  # device to host
                elif as_bytes:  # bfloat16, float8: numpy has no such dtype
                    pairs.append((array, src.reshape(-1).view(torch.uint8).numpy()))
                else:
                    pairs.append((array, src.numpy()))
            copy_all(pairs)

    def write_to(self, f: Any) -> None:
        """Write the whole file (header, then each tensor's bytes) to a binary stream."""
        import torch  # heavy: torch

        f.write(self.header_bytes())
        for _, src in self.sources:
            if src.numel():
                f.write(memoryview(src.reshape(-1).view(torch.uint8).cpu().numpy()))


_NUMPY_DTYPES: dict[Any, Any] = {}


def _numpy_dtype(dtype: Any) -> Any:
    """numpy's dtype for a torch dtype, or ``None`` where numpy has none (bfloat16, float8)."""
    try:
        return _NUMPY_DTYPES[dtype]
    except KeyError:
        import torch  # heavy: torch

        try:
            found = torch.empty(0, dtype=dtype).numpy().dtype
        except (TypeError, RuntimeError):
            found = None
        return _NUMPY_DTYPES.setdefault(dtype, found)


def build_layout(state: Any, *, step: int, rank: int, world_size: int, plan: LayoutPlan | None = None) -> Layout:
    """Plan ``state`` (nothing is copied). Raises CheckpointError for unsupported values.

    ``plan``: an earlier layout's :attr:`Layout.plan`; used when this state's tensors have
    the same keys, dtypes, shapes (and DTensor offsets) — checked here — else a new plan
    is made."""
    import numpy as np  # heavy: numpy
    import torch  # heavy: torch

    # a DTensor can only exist if its module was imported: do not pay for importing it
    DTensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)

    tree, leaves = flatten(state)
    locals_ = []
    signature = []
    for key, leaf in leaves.items():
        offsets = None
        if isinstance(leaf, np.ndarray):
            local = torch.from_numpy(np.ascontiguousarray(leaf))
        elif DTensor is not None and isinstance(leaf, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # heavy: torch

            local = leaf.to_local()
            _, global_offsets = compute_local_shape_and_global_offset(leaf.shape, leaf.device_mesh, leaf.placements)
            offsets = tuple(int(o) for o in global_offsets)
        else:
            local = leaf
        locals_.append(local)
        signature.append((key, local.dtype, local.shape, offsets))
    if plan is None or plan.signature != tuple(signature):
        plan = _plan(tuple(signature))
    metadata = {
        "format": FORMAT_VERSION,
        TREE_KEY: json.dumps(tree, separators=(",", ":")),
        "step": str(step), "rank": str(rank), "world_size": str(world_size),
        SHARDING_KEY: plan.sharding,
        DTENSORS_KEY: plan.dtensors,
    }
    sources = tuple((signature[i][0], locals_[i]) for i in plan.order)
    return Layout(entries=plan.entries, metadata=metadata, data_len=plan.data_len, sources=sources, plan=plan)


def _plan(signature: tuple[tuple[Any, ...], ...]) -> LayoutPlan:
    """The plan of tensors with this signature: ordered by element size, largest first
    (then in the state's order), packed."""
    names = _dtype_names()
    planned = []
    for index, (key, dtype, _, _) in enumerate(signature):
        if dtype not in names:
            raise CheckpointError(f"cannot checkpoint {key}: dtype {dtype} has no safetensors name")
        planned.append((-dtype.itemsize, index))
    planned.sort()
    entries: dict[str, dict[str, Any]] = {}
    sharding: dict[str, dict[str, list[int]]] = {}
    dtensor_keys = [key for key, _, _, offsets in signature if offsets is not None]
    pos = 0
    for neg_size, index in planned:
        key, dtype, shape, offsets = signature[index]
        nbytes = -neg_size
        for n in shape:
            nbytes *= n
        entries[key] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        sharding[key] = {"saved_offsets": list(offsets) if offsets is not None else [0] * len(shape)}
        pos += nbytes
    head = json.dumps(entries, separators=(",", ":"))
    prefix = (head[:-1] + ',"__metadata__":') if entries else '{"__metadata__":'
    return LayoutPlan(signature=signature, order=tuple(index for _, index in planned), entries=entries,
                      data_len=pos, sharding=json.dumps(sharding, separators=(",", ":")),
                      dtensors=json.dumps(dtensor_keys), header_prefix=prefix.encode())


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


def data_crc32(data: Any) -> int:
    """CRC32 (zlib) of the data region of dlrover safetensors bytes: what a commit records
    per shard (``checkpoint.json`` ``shards[rank].crc32``) and a reader checks.

    Raises CheckpointError when the bytes are not a complete dlrover state file."""
    entries, _, start = parse_header(data)
    data_len = max((e["data_offsets"][1] for e in entries.values()), default=0)
    return zlib.crc32(memoryview(data)[start : start + data_len])


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
