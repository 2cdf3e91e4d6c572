"""Checkpoints without dlrover: list a checkpoint directory's committed steps, describe one,
and export it to files that plain torch, safetensors or ``torch.distributed.checkpoint`` read.

The layout these functions read is documented in ``docs/checkpoint-format.md``; in short, a
step ``S`` is committed when ``step_<S>/checkpoint.json`` exists and ``S`` is at or below the
step in the ``latest`` marker (:mod:`.commit`), and each rank's shard is a safetensors file
(:mod:`.layout`) whose JSON tree holds ``{"state": <what the script passed to save()>,
"rng": <that rank's RNG states>}``.

* :func:`list_steps` — every committed step with its shards, each checked (header, size,
  CRC32 against the commit);
* :func:`read_step` — the saved state of one step (rank 0's shard for a replicated / DDP
  state; DTensor / FSDP2 shards of every rank assembled into full tensors);
* :func:`describe` — what :func:`read_step` found, as JSON-ready data;
* :func:`export_step` — that state as ``torch`` (``.pt``), ``safetensors`` or ``dcp`` files.

Every error is a :class:`~dlrover_core.errors.CheckpointError` saying what to do. torch and
safetensors are imported inside the functions: the CLI imports this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from dlrover_core.checkpoint.commit import committed_steps
from dlrover_core.checkpoint.layout import DTENSORS_KEY, SHARDING_KEY, TREE_KEY, data_crc32, parse_header, tensor_views
from dlrover_core.checkpoint.saver import shard_path, step_dir
from dlrover_core.checkpoint.state_format import unflatten
from dlrover_core.errors import CheckpointError
from dlrover_core.logging import get_logger
from dlrover_core.storage.base import LATEST_MARKER, CheckpointStorage
from dlrover_core.storage.posix import PosixStorage

__all__ = [
    "FORMATS",
    "SavedStep",
    "ShardStatus",
    "StepStatus",
    "describe",
    "export_step",
    "list_steps",
    "read_step",
    "resolve_step",
]

log = get_logger()

#: what :func:`export_step` writes
FORMATS = ("torch", "safetensors", "dcp")

#: ``__metadata__["format"]`` of an exported ``optimizer.safetensors``
OPTIMIZER_FORMAT = "dlrover-export-optimizer/1"


# ----- committed steps and their shards ----------------------------------------------------


@attrs.frozen(kw_only=True)
class ShardStatus:
    """One rank's shard of a committed step, checked.

    Attributes:
        rank: the global rank that wrote it.
        file: its path in the storage (``step_<S>/rank_<r>-round<R>.safetensors``).
        bytes: the file's size in bytes (``-1`` when it cannot be read); listed without
            verifying, the data bytes the commit recorded.
        crc32: the CRC32 of its data region recorded by the commit, or ``None`` where the
            commit recorded none (a job without a master commits without CRCs).
        ok: the file is readable, a complete dlrover state file, and its CRC32 matches.
        error: why not (names the file), else ``""``.
    """

    rank: int
    file: str
    bytes: int
    crc32: int | None
    ok: bool
    error: str = ""


@attrs.frozen(kw_only=True)
class StepStatus:
    """A committed step (``step_<S>/checkpoint.json``).

    Attributes:
        step: the training step it was saved at.
        world_size: how many ranks saved it (one shard each).
        round: the incarnation (rendezvous round) that wrote it.
        time: when it was committed, seconds since the epoch (``None`` if not recorded).
        latest: it is the step the ``latest`` marker names.
        shards: one per rank, by rank.
    """

    step: int
    world_size: int
    round: int | None
    time: float | None
    latest: bool
    shards: tuple[ShardStatus, ...]

    @property
    def valid(self) -> bool:
        """Every rank's shard is present and intact."""
        return len(self.shards) == self.world_size and all(s.ok for s in self.shards)

    @property
    def bytes(self) -> int:
        """The shards' files together, in bytes."""
        return sum(max(s.bytes, 0) for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the attributes plus ``valid`` and ``bytes``."""
        return {"step": self.step, "world_size": self.world_size, "round": self.round, "time": self.time,
                "latest": self.latest, "valid": self.valid, "bytes": self.bytes,
                "shards": [attrs.asdict(s) for s in self.shards]}


def _latest(storage: CheckpointStorage) -> int | None:
    try:
        return storage.latest_step()
    except ValueError as exc:
        raise CheckpointError(f"the {LATEST_MARKER!r} marker in {storage.url!r} is not a step number ({exc}); "
                              "it names the last committed step: rewrite it or remove the directory") from None


def _commit(storage: CheckpointStorage, step: int) -> dict[str, Any]:
    """``step_<S>/checkpoint.json``. Raises CheckpointError when it is missing or not JSON."""
    path = f"{step_dir(step)}/checkpoint.json"
    try:
        meta = json.loads(storage.read(path))
        int(meta["world_size"])
    except FileNotFoundError:
        raise CheckpointError(f"step {step} has no commit record {path!r} in {storage.url!r}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"commit record {path!r} in {storage.url!r} is unreadable: "
                              f"{type(exc).__name__}: {exc}") from None
    return meta


def _shard_file(step: int, rank: int, meta: dict[str, Any]) -> tuple[str, int | None]:
    """(path of rank's shard, committed CRC32 or ``None``)."""
    entry = (meta.get("shards") or {}).get(str(rank), {})
    name = entry.get("file")
    return (f"{step_dir(step)}/{name}" if name else shard_path(step, rank)), entry.get("crc32")


def _read_shard(storage: CheckpointStorage, step: int, rank: int, meta: dict[str, Any]) -> tuple[bytes, ShardStatus]:
    """Read and check one shard: ``(bytes, status)``; ``bytes`` is empty when not ``ok``."""
    path, crc = _shard_file(step, rank, meta)
    try:
        data = storage.read(path)
    except OSError as exc:
        return b"", ShardStatus(rank=rank, file=path, bytes=-1, crc32=crc, ok=False,
                                error=f"{path}: cannot be read ({type(exc).__name__}: {exc})")
    try:
        actual = data_crc32(data)
    except CheckpointError as exc:
        return b"", ShardStatus(rank=rank, file=path, bytes=len(data), crc32=crc, ok=False, error=f"{path}: {exc}")
    if crc is not None:
        if actual != crc:
            return b"", ShardStatus(rank=rank, file=path, bytes=len(data), crc32=crc, ok=False, error=(
                f"{path}: CRC32 of its data {actual:#010x} does not match the committed {crc:#010x} "
                "(the file is corrupt or torn)"))
    return data, ShardStatus(rank=rank, file=path, bytes=len(data), crc32=crc, ok=True)


def _steps(storage: CheckpointStorage) -> tuple[list[int], int | None]:
    latest = _latest(storage)
    return committed_steps(storage, latest), latest


def list_steps(storage: CheckpointStorage, *, verify: bool = True) -> list[StepStatus]:
    """Every committed step in ``storage``, oldest first, each shard checked.

    Args:
        verify: read every shard and check its header and CRC32 (reads the whole
            checkpoint); without it only the files' presence is checked and ``bytes`` is
            what the commit recorded.

    Raises:
        CheckpointError: the ``latest`` marker is not a number.
    """
    steps, latest = _steps(storage)
    out = []
    for step in steps:
        try:
            meta = _commit(storage, step)
        except CheckpointError as exc:
            out.append(StepStatus(step=step, world_size=0, round=None, time=None, latest=step == latest,
                                  shards=(ShardStatus(rank=0, file=f"{step_dir(step)}/checkpoint.json", bytes=-1,
                                                      crc32=None, ok=False, error=str(exc)),)))
            continue
        world = int(meta["world_size"])
        shards = []
        for rank in range(world):
            if verify:
                shards.append(_read_shard(storage, step, rank, meta)[1])
                continue
            path, crc = _shard_file(step, rank, meta)
            present = storage.exists(path)
            recorded = (meta.get("shards") or {}).get(str(rank), {}).get("bytes", -1)
            shards.append(ShardStatus(rank=rank, file=path, bytes=recorded if present else -1, crc32=crc, ok=present,
                                      error="" if present else f"{path}: missing"))
        out.append(StepStatus(step=step, world_size=world, round=meta.get("round"), time=meta.get("time"),
                              latest=step == latest, shards=tuple(shards)))
    return out


def resolve_step(storage: CheckpointStorage, step: int | None = None) -> int:
    """``step`` if it is committed, or the newest committed step when ``None``.

    Raises:
        CheckpointError: nothing was ever committed in ``storage``; or ``step`` is not a
            committed step (the message lists those that are).
    """
    steps, latest = _steps(storage)
    if not steps:
        why = (f"no {LATEST_MARKER!r} marker: no step was ever committed" if latest is None
               else f"the {LATEST_MARKER!r} marker names step {latest} but its step directory has no checkpoint.json")
        raise CheckpointError(f"no committed step in {storage.url!r} ({why}); a step counts once "
                              f"step_<S>/checkpoint.json and the {LATEST_MARKER!r} marker are written")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CheckpointError(f"step {step} is not committed in {storage.url!r}; committed steps: "
                              f"{', '.join(map(str, steps))} (pass one of them with --step, or none for the newest)")
    return step


# ----- one step's state ----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SavedStep:
    """A committed step's saved state, read back.

    Attributes:
        step: the step.
        world_size: ranks that saved it.
        rank: whose shard the state came from.
        state: the dict the script passed to ``Checkpointer.save(step, state)``, objects
            replaced by their ``state_dict()`` (a model: ``{name: tensor}``; an optimizer:
            ``{"state": {...}, "param_groups": [...]}``); CPU tensors owned by the caller,
            DTensor shards assembled into full tensors.
        rng: that rank's RNG states (``python``, ``numpy``, ``torch``, maybe ``cuda``).
        metadata: the shard's safetensors ``__metadata__`` (strings).
        commit: the step's ``checkpoint.json``.
        assembled: keys (``state/...``) that were DTensor shards, now full tensors.
    """

    step: int
    world_size: int
    rank: int
    state: dict[Any, Any]
    rng: dict[str, Any] | None
    metadata: dict[str, str]
    commit: dict[str, Any]
    assembled: tuple[str, ...] = ()


def read_step(storage: CheckpointStorage, step: int | None = None, *, rank: int = 0) -> SavedStep:
    """The state saved at ``step`` (default: the newest committed step), from ``rank``'s shard.

    A replicated (DDP) state is the same on every rank: rank 0's shard has it all. Keys that
    were DTensor (FSDP2, tensor parallel) shards are assembled into full tensors from every
    rank's shard of the step by ``torch.distributed.checkpoint`` (each piece placed at the
    global offsets recorded in ``DCP_SHARDING_INFO``, as when a job loads them at another
    world size); each shard read is checked first.

    Args:
        rank: whose shard (entries that differ between ranks, e.g. a data position, are
            that rank's); must be below the step's world size.

    Raises:
        CheckpointError: no such committed step (lists the committed ones); ``rank`` out of
            range; a shard is missing, not a dlrover state file, or its CRC32 does not match
            the committed one (names the file).
    """
    step = resolve_step(storage, step)
    meta = _commit(storage, step)
    world = int(meta["world_size"])
    if not 0 <= rank < world:
        raise CheckpointError(f"rank {rank} is out of range: step {step} was saved by ranks 0..{world - 1} (--rank)")
    data, status = _read_shard(storage, step, rank, meta)
    if not status.ok:
        raise CheckpointError(f"step {step} rank {rank}: {status.error}; choose another committed step with --step")
    entries, metadata, start = parse_header(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: cloned at once
        tensors = {k: v.clone() for k, v in tensor_views(data, start, entries).items()}
    del data
    sharded = tuple(json.loads(metadata.get(DTENSORS_KEY) or "[]"))
    if sharded:
        tensors.update(_assemble(storage, step, meta, {k: tensors[k] for k in sharded}))
    full = unflatten(json.loads(metadata[TREE_KEY]), tensors)
    state = full.get("state") if isinstance(full, dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(f"step {step} rank {rank}: the shard's tree has no 'state' dict "
                              "(not written by Checkpointer.save)")
    return SavedStep(step=step, world_size=world, rank=rank, state=state, rng=full.get("rng"), metadata=metadata,
                     commit=meta, assembled=sharded)


def _assemble(storage: CheckpointStorage, step: int, meta: dict[str, Any], local: dict[str, Any]) -> dict[str, Any]:
    """Full tensors of the DTensor keys of ``local`` (one rank's pieces) from every rank's
    shard of ``step``, by ``torch.distributed.checkpoint``'s safetensors reader."""
    import torch  # heavy: torch
    import torch.distributed.checkpoint as dcp  # heavy: torch
    from torch.distributed.checkpoint import DefaultLoadPlanner, HuggingFaceStorageReader  # heavy: torch

    world = int(meta["world_size"])
    shapes: dict[str, list[int]] = {k: [0] * v.dim() for k, v in local.items()}
    with tempfile.TemporaryDirectory(prefix="dlrover-export-") as tmp:
        for r in range(world):  # check every shard, and give DCP's reader only the commit's files
            data, status = _read_shard(storage, step, r, meta)
            if not status.ok:
                raise CheckpointError(f"step {step} rank {r}: {status.error}; the step's DTensor shards need every "
                                      "rank's file; choose another committed step with --step")
            r_entries, r_meta, _ = parse_header(data, with_data=False)
            offsets = json.loads(r_meta.get(SHARDING_KEY) or "{}")
            for k in local:
                if k not in r_entries:
                    raise CheckpointError(f"step {step}: {status.file} lacks the DTensor shard {k!r}")
                for d, (n, o) in enumerate(zip(r_entries[k]["shape"], offsets[k]["saved_offsets"], strict=True)):
                    shapes[k][d] = max(shapes[k][d], n + o)
            target = Path(tmp) / Path(status.file).name
            if isinstance(storage, PosixStorage):
                os.symlink(storage.root.resolve() / status.file, target)
            else:
                target.write_bytes(data)
            del data
        full = {k: torch.zeros(shapes[k], dtype=v.dtype) for k, v in local.items()}
        with _quiet_dcp():
            dcp.load(full, storage_reader=HuggingFaceStorageReader(tmp),
                     planner=DefaultLoadPlanner(allow_partial_load=True))
    log.info("checkpoint_shards_assembled", step=step, world_size=world, keys=len(full))
    return full


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP without a process group warns that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        yield


# ----- what the state holds ------------------------------------------------------------------


def _is_tensor(value: Any) -> bool:
    import torch  # heavy: torch

    return isinstance(value, torch.Tensor)


def _is_model(value: Any) -> bool:
    """A module's ``state_dict()``: a non-empty ``{str: tensor}``."""
    return isinstance(value, dict) and bool(value) and all(
        isinstance(k, str) and _is_tensor(v) for k, v in value.items())


def _is_optimizer(value: Any) -> bool:
    """An optimizer's ``state_dict()``: ``{"state": {...}, "param_groups": [{"params": [...]}, ...]}``."""
    return (isinstance(value, dict) and set(value) == {"state", "param_groups"} and isinstance(value["state"], dict)
            and isinstance(value["param_groups"], list)
            and all(isinstance(g, dict) and "params" in g for g in value["param_groups"]))


def _file_name(key: Any) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", str(key)).strip("._") or "entry"
    return name


@attrs.frozen(kw_only=True)
class _Entry:
    """One exported thing: ``name`` (the file's stem), ``kind`` (``model``, ``optimizer``,
    ``other``), the value, and for an optimizer the model it belongs to (its name)."""

    name: str
    kind: str
    value: Any
    source: str
    model: str | None = None


def _entries(state: dict[Any, Any]) -> list[_Entry]:
    """The state's entries as they are exported. ``train.ModelOptimizerState`` (an entry
    ``{"model": ..., "optimizer": ...}``) becomes two, ``model`` and ``optimizer`` (or
    ``<key>.model`` and ``<key>.optimizer`` when those names are taken)."""
    pairs = [k for k, v in state.items() if isinstance(v, dict) and set(v) == {"model", "optimizer"}
             and _is_model(v["model"]) and _is_optimizer(v["optimizer"])]
    taken = {_file_name(k) for k in state if k not in pairs}
    out: list[_Entry] = []
    for key, value in state.items():
        if key in pairs:
            plain = len(pairs) == 1 and not taken & {"model", "optimizer"}
            model, optim = ("model", "optimizer") if plain else (f"{_file_name(key)}.model", f"{_file_name(key)}.optimizer")
            out.append(_Entry(name=model, kind="model", value=value["model"], source=f"{key}/model"))
            out.append(_Entry(name=optim, kind="optimizer", value=value["optimizer"], source=f"{key}/optimizer",
                              model=model))
            continue
        kind = "model" if _is_model(value) else "optimizer" if _is_optimizer(value) else "other"
        out.append(_Entry(name=_file_name(key), kind=kind, value=value, source=str(key)))
    models = [e.name for e in out if e.kind == "model"]
    for i, e in enumerate(out):  # an optimizer saved beside one model (or beside "model") steps that model
        if e.kind == "optimizer" and e.model is None:
            model = models[0] if len(models) == 1 else "model" if "model" in models else None
            out[i] = attrs.evolve(e, model=model)
    names = [e.name for e in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise CheckpointError(f"state entries {dup} map to the same file name; export cannot tell them apart")
    return out


def _param_ids(groups: list[dict[str, Any]]) -> list[Any]:
    return [p for g in groups for p in g["params"]]


def _plain_optimizer(osd: dict[str, Any]) -> dict[str, Any]:
    """``osd`` keyed like ``optimizer.state_dict()``: parameters numbered ``0..N-1`` in
    ``param_groups`` order (a ``ModelOptimizerState`` keys them by name)."""
    ids = _param_ids(osd["param_groups"])
    if all(isinstance(p, int) for p in ids):
        return osd
    index = {p: i for i, p in enumerate(ids)}
    return {"state": {index[p]: s for p, s in osd["state"].items()},
            "param_groups": [{**g, "params": [index[p] for p in g["params"]]} for g in osd["param_groups"]]}


def _named_optimizer(osd: dict[str, Any], model: dict[str, Any] | None, *, name: str) -> dict[str, Any]:
    """``osd`` keyed by parameter name, as ``torch.distributed.checkpoint.state_dict.get_state_dict``
    gives it (what a DCP load fills). Numbered parameters are named after the model's
    floating-point entries in order, when their count and the state's shapes agree."""
    ids = _param_ids(osd["param_groups"])
    if all(isinstance(p, str) for p in ids):
        return osd
    why = "it is not saved beside exactly one model"
    if model is not None:
        names = [k for k, v in model.items() if v.is_floating_point()]
        why = (f"it has {len(ids)} parameters and the model {len(names)} floating-point entries "
               "(buffers or tied weights)")
        if len(names) == len(ids):
            by_id = dict(zip(ids, names, strict=True))
            bad = [by_id[p] for p, s in osd["state"].items() if isinstance(s, dict) and not _shapes_agree(s, model[by_id[p]])]
            if not bad:
                return {"state": {by_id[p]: s for p, s in osd["state"].items()},
                        "param_groups": [{**g, "params": [by_id[p] for p in g["params"]]} for g in osd["param_groups"]]}
            why = f"its state does not have the shape of {bad[0]!r}"
    raise CheckpointError(
        f"cannot name the parameters of optimizer {name!r} for DCP, which keys them by name: {why}. Save "
        "train.ModelOptimizerState(model, optimizer), which keys them by name, or export --to torch or "
        "safetensors, whose optimizer file is keyed like optimizer.state_dict()")


def _shapes_agree(state: dict[str, Any], param: Any) -> bool:
    """Some tensor of a parameter's optimizer state has its shape (or none has dimensions)."""
    shaped = [v for v in state.values() if _is_tensor(v) and v.dim() > 0]
    return not shaped or any(tuple(v.shape) == tuple(param.shape) for v in shaped)


def _summary(value: Any) -> Any:
    """A JSON-ready picture of a value: tensors as ``{"shape", "dtype", "bytes"}``."""
    if _is_tensor(value):
        return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                "bytes": value.numel() * value.element_size()}
    if isinstance(value, dict):
        return {str(k): _summary(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_summary(v) for v in value]
    if hasattr(value, "dtype") and hasattr(value, "shape"):  # a numpy array
        return {"shape": list(value.shape), "dtype": str(value.dtype), "bytes": int(value.nbytes)}
    return value


def _tensor_bytes(value: Any) -> int:
    if _is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def describe(saved: SavedStep) -> dict[str, Any]:
    """What a step holds, JSON-ready: ``step``, ``world_size``, ``rank``, ``metadata``
    (format, commit time and round, the shards' files, assembled DTensor keys, the saved
    RNG states) and ``entries``: per entry of the state its ``key``, ``kind``
    (``model`` / ``optimizer`` / ``other``), ``export_as`` (the file stem), ``bytes`` of
    tensors, and for a model ``tensors`` (``{name: {"shape", "dtype", "bytes"}}``), for an
    optimizer ``params`` (count), ``param_groups`` (hyperparameters, ``params`` as a
    count), ``state_keys`` (per-parameter state names) and ``keyed_by`` (``index`` or
    ``name``), else ``value`` (the value with tensors summarised)."""
    entries = []
    for e in _entries(saved.state):
        item: dict[str, Any] = {"key": e.source, "kind": e.kind, "export_as": e.name, "bytes": _tensor_bytes(e.value)}
        if e.kind == "model":
            item["tensors"] = _summary(e.value)
        elif e.kind == "optimizer":
            ids = _param_ids(e.value["param_groups"])
            names = sorted({n for s in e.value["state"].values() if isinstance(s, dict) for n in s})
            item.update(params=len(ids), keyed_by="index" if all(isinstance(p, int) for p in ids) else "name",
                        state_keys=names, param_groups=[
                            {**{k: _summary(v) for k, v in g.items() if k != "params"}, "params": len(g["params"])}
                            for g in e.value["param_groups"]])
        else:
            item["value"] = _summary(e.value)
        entries.append(item)
    commit = saved.commit
    return {
        "step": saved.step, "world_size": saved.world_size, "rank": saved.rank,
        "metadata": {
            "format": saved.metadata.get("format"), "round": commit.get("round"), "time": commit.get("time"),
            "files": {r: s.get("file") for r, s in sorted((commit.get("shards") or {}).items(), key=lambda i: int(i[0]))},
            "dtensors": list(saved.assembled), "rng": sorted(saved.rng or {}),
        },
        "entries": entries,
    }


# ----- export --------------------------------------------------------------------------------


def export_step(storage: CheckpointStorage, out: str | os.PathLike[str], *, to: str, step: int | None = None,
                rank: int = 0) -> dict[str, Any]:
    """Write ``step`` (default: the newest committed step) as files plain torch reads.

    ``to``:

    * ``torch``: ``OUT/<name>.pt`` per entry (``torch.save``): a model's ``state_dict()``
      (``model.load_state_dict(torch.load(...))``), an optimizer's ``state_dict()`` keyed by
      parameter index (``optimizer.load_state_dict``), any other entry as saved.
    * ``safetensors``: a model as ``OUT/<name>.safetensors`` (``safetensors.torch.load_file``);
      an optimizer as ``OUT/<name>.safetensors`` with tensors ``state/<index>/<name>`` and,
      in its ``__metadata__``, ``param_groups`` (JSON) and ``state_values`` (JSON: the
      non-tensor per-parameter state); another entry holding only tensors (a tensor or a
      ``{str: tensor}`` dict) as ``<name>.safetensors``, holding none as ``<name>.json``,
      mixing both: skipped (listed under ``skipped``; use ``torch`` or ``dcp``).
    * ``dcp``: one ``torch.distributed.checkpoint`` directory ``OUT`` (``dcp.save`` in one
      process) holding every entry under its name, an optimizer keyed by parameter name as
      ``get_state_dict(model, optimizer)`` gives it; ``dcp.load`` fills such dicts.

    Entry names (file stems) are the state's keys; a ``train.ModelOptimizerState`` entry is
    written as ``model`` and ``optimizer``. The RNG states are not exported.

    Args:
        out: a new or empty directory (created).
        rank: whose shard (see :func:`read_step`).

    Returns:
        ``{"step", "format", "out", "files": [paths written, relative to out], "skipped":
        {name: why}}``.

    Raises:
        CheckpointError: an unknown format; ``out`` is not empty; what :func:`read_step`
            raises; for ``dcp``, an optimizer keyed by index whose parameters cannot be named.
    """
    if to not in FORMATS:
        raise CheckpointError(f"unknown export format {to!r}; choose one of {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"export target {str(out)!r} exists and is not an empty directory; "
                              "choose a new or empty directory")
    saved = read_step(storage, step, rank=rank)
    entries = _entries(saved.state)
    if to == "dcp":  # (named before anything is written: it may refuse)
        entries = _named_optimizers(entries)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    skipped: dict[str, str] = {}
    try:
        if to == "torch":
            files = _write_torch(out, entries)
        elif to == "safetensors":
            files = _write_safetensors(out, entries, saved, skipped)
        else:
            files = _write_dcp(out, entries)
    except BaseException:
        if created:  # leave no half export behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    for name, why in skipped.items():
        log.warning("checkpoint_export_skipped", entry=name, reason=why)
    log.debug("checkpoint_exported", step=saved.step, format=to, out=str(out), files=files)
    return {"step": saved.step, "format": to, "out": str(out), "files": files, "skipped": skipped}


def _write_torch(out: Path, entries: list[_Entry]) -> list[str]:
    import torch  # heavy: torch

    files = []
    for e in entries:
        value = _plain_optimizer(e.value) if e.kind == "optimizer" else e.value
        torch.save(value, out / f"{e.name}.pt")
        files.append(f"{e.name}.pt")
    return files


def _write_safetensors(out: Path, entries: list[_Entry], saved: SavedStep, skipped: dict[str, str]) -> list[str]:
    from safetensors.torch import save_file  # heavy: pulls torch in

    base = {"source": f"dlrover step {saved.step}"}
    files = []
    for e in entries:
        if e.kind == "model":
            save_file({k: v.contiguous() for k, v in e.value.items()}, str(out / f"{e.name}.safetensors"),
                      metadata={**base, "format": "pt"})
        elif e.kind == "optimizer":
            osd = _plain_optimizer(e.value)
            tensors, values = {}, {}
            for pid, s in osd["state"].items():
                for n, v in (s.items() if isinstance(s, dict) else ()):
                    if _is_tensor(v):
                        tensors[f"state/{pid}/{n}"] = v.contiguous()
                    else:
                        values.setdefault(str(pid), {})[n] = v
            try:
                meta = {**base, "format": OPTIMIZER_FORMAT, "param_groups": json.dumps(osd["param_groups"]),
                        "state_values": json.dumps(values)}
            except TypeError as exc:
                skipped[e.name] = f"its param_groups are not JSON ({exc}); use --to torch or dcp"
                continue
            save_file(tensors, str(out / f"{e.name}.safetensors"), metadata=meta)
        elif _is_tensor(e.value):
            save_file({e.name: e.value.contiguous()}, str(out / f"{e.name}.safetensors"), metadata=base)
        elif not _has_tensor(e.value):
            try:
                text = json.dumps(e.value, indent=1)
            except (TypeError, ValueError) as exc:
                skipped[e.name] = f"not JSON ({exc}); use --to torch or dcp"
                continue
            (out / f"{e.name}.json").write_text(text + "\n")
            files.append(f"{e.name}.json")
            continue
        else:
            skipped[e.name] = "holds tensors and other values, which safetensors cannot; use --to torch or dcp"
            continue
        files.append(f"{e.name}.safetensors")
    return files


def _has_tensor(value: Any) -> bool:
    if _is_tensor(value) or (hasattr(value, "dtype") and hasattr(value, "shape")):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


def _named_optimizers(entries: list[_Entry]) -> list[_Entry]:
    """The entries with every optimizer keyed by parameter name (see :func:`_named_optimizer`)."""
    models = {e.name: e.value for e in entries if e.kind == "model"}
    return [attrs.evolve(e, value=_named_optimizer(e.value, models.get(e.model) if e.model else None, name=e.name))
            if e.kind == "optimizer" else e for e in entries]


def _write_dcp(out: Path, entries: list[_Entry]) -> list[str]:
    import torch.distributed.checkpoint as dcp  # heavy: torch

    with _quiet_dcp():
        dcp.save({e.name: e.value for e in entries}, checkpoint_id=str(out))
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
