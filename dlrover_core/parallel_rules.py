"""What can be checked about a list of strategies before any process starts (no torch here).

:class:`~dlrover_core.spec.Parallel` calls :func:`check_strategies` when it is built, so a
conflicting or malformed list fails at ``Job(...)`` with a
:class:`~dlrover_core.errors.JobSpecError` naming the strategy. Names are checked against the
registry by ``Job`` itself (a plugin may add strategies); only the built-in names have rules.

Mesh rank layout (ATorch's convention, ``atorch.distributed.create_parallel_group``): the
first-listed dimension varies fastest. For dimensions ``[(n_0, s_0), ..., (n_k, s_k)]`` rank
``r`` has coordinate ``c_i = (r // (s_0 * ... * s_{i-1})) % s_i`` along ``n_i``, i.e.
``r = c_0 + s_0 * (c_1 + s_1 * (c_2 + ...))``. For ``[("data", 2), ("tensor", 2)]``:
the data groups are ``[0, 1]`` and ``[2, 3]``, the tensor groups ``[0, 2]`` and ``[1, 3]``.
:func:`mesh_groups` computes these groups; the ``mesh`` strategy builds the same layout as a
torch ``DeviceMesh`` (whose own layout is row-major: last dimension fastest, so it is built
with the dimensions reversed).

Replicated state (whether a job's failures can be recovered live, docs/design.md §5a): a
live peer can give a replacement the training state only if every data-parallel rank holds
all of it. Each strategy declares whether it keeps the state so when it registers
(``register(fn, name="ddp", replicated=True)``; one that does not say is taken to shard
it). The spec is plain data and loads no plugin (docs/architecture.md), so the declaration
reaches it as data, in two ways: the built-ins' declarations are listed here as well
(:data:`REPLICATED_BUILTINS`; ``tests/test_parallel.py`` checks they match what the
built-ins register), which is all a spec that never met the plugin registry (built and
handed to a master in a test, or decoded from an older ``job.json``) can know; and
``Job.dryrun()``/``submit()``/``run()``, where the plugins are loaded, resolve every
strategy's declaration from the registry into ``Parallel.replicated``
(:func:`dlrover_core.validation.declare_replicated`), which then wins. From either,
:func:`first_unreplicated` gives the strategy that rules live recovery out, and
``JobSpec.live_blocker`` the reason, once, for the master, the agents and the workers.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from dlrover_core.errors import JobSpecError

__all__ = [
    "AUTO_DEFAULTS",
    "DATA_PARALLEL",
    "REPLICATED_BUILTINS",
    "auto_rule_text",
    "check_strategies",
    "describe",
    "first_unreplicated",
    "mesh_groups",
    "normalize_mesh_dims",
    "resolve_mesh_dims",
]

#: Strategies that replicate or shard the model over the data-parallel ranks; at most one.
DATA_PARALLEL = ("ddp", "fsdp", "auto")

#: The built-in strategies that keep the training state whole on every data-parallel rank
#: (each registers with ``replicated=True``); ``fsdp``, ``mesh`` and ``auto`` (which may
#: choose fsdp) do not.
REPLICATED_BUILTINS = frozenset({"ddp", "amp", "compile", "checkpoint"})

#: Thresholds of ``Parallel("auto")`` (fractions of one worker's device memory).
AUTO_DEFAULTS = {"shard_above": 0.5, "checkpoint_above": 0.5}

_DIM_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

#: Options each built-in strategy accepts (``None``: passed through to torch unchecked).
_OPTIONS: dict[str, frozenset[str] | None] = {
    "ddp": None,  # torch.nn.parallel.DistributedDataParallel keyword arguments
    "compile": None,  # torch.nn.Module.compile / torch.compile keyword arguments
    "fsdp": frozenset({"wrap_class", "reshard_after_forward", "param_dtype", "reduce_dtype"}),
    "amp": frozenset({"dtype", "output_dtype", "init_scale"}),
    "checkpoint": frozenset({"wrap_class"}),
    "mesh": frozenset({"dims"}),
    "auto": frozenset({"shard_above", "checkpoint_above", "wrap_class", "device_mb"}),
}

_AMP_DTYPES = ("bfloat16", "float16")
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def normalize_mesh_dims(dims: Any, field: str) -> list[list[Any]]:
    """``[("data", 2), ("tensor", -1)]`` -> ``[["data", 2], ["tensor", -1]]``, validated.

    A size is a positive int, or ``-1`` (at most once): the world size divided by the product
    of the others, resolved at ``prepare()``.
    """
    want = "a list of (name, size) pairs, e.g. [('data', 2), ('tensor', 2)]; size > 0 or -1 (the rest, once)"
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or not dims:
        raise JobSpecError(field, dims, want)
    out: list[list[Any]] = []
    for d in dims:
        if (not isinstance(d, Sequence) or isinstance(d, str) or len(d) != 2 or not isinstance(d[0], str)
                or not _DIM_NAME_RE.fullmatch(d[0]) or isinstance(d[1], bool) or not isinstance(d[1], int)
                or not (d[1] > 0 or d[1] == -1)):
            raise JobSpecError(field, dims, want)
        out.append([d[0], d[1]])
    names = [n for n, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise JobSpecError(field, dims, f"each dimension name once; {', '.join(map(repr, dup))} is repeated")
    if sum(1 for _, s in out if s == -1) > 1:
        raise JobSpecError(field, dims, "at most one size of -1 (the rest of the world)")
    return out


def resolve_mesh_dims(dims: Sequence[Sequence[Any]], world_size: int, field: str = "parallel.mesh") -> list[tuple[str, int]]:
    """Sizes with ``-1`` filled in; raises JobSpecError if their product is not ``world_size``."""
    known = math.prod(s for _, s in dims if s != -1)
    sizes = []
    for name, size in dims:
        if size == -1:
            if world_size % known:
                raise JobSpecError(field, [list(d) for d in dims],
                                   f"the other sizes (product {known}) to divide the world size {world_size}")
            size = world_size // known
        sizes.append((name, int(size)))
    product = math.prod(s for _, s in sizes)
    if product != world_size:
        shown = " × ".join(f"{n}={s}" for n, s in sizes)
        raise JobSpecError(field, [list(d) for d in dims],
                           f"sizes whose product ({shown} = {product}) equals the world size ({world_size})")
    return sizes


def mesh_groups(dims: Sequence[Sequence[Any]]) -> dict[str, list[list[int]]]:
    """The rank groups of each dimension, first-listed dimension fastest (ATorch's layout).

    ``mesh_groups([("data", 2), ("tensor", 2)])`` is
    ``{"data": [[0, 1], [2, 3]], "tensor": [[0, 2], [1, 3]]}``. Sizes must be resolved
    (no ``-1``). Groups are sorted by their first rank; ranks within a group by coordinate.
    """
    sizes = [int(s) for _, s in dims]
    world = math.prod(sizes)
    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]
    out: dict[str, list[list[int]]] = {}
    for i, (name, size) in enumerate(dims):
        groups = {}
        for r in range(world):
            base = r - ((r // strides[i]) % size) * strides[i]  # the rank with c_i = 0
            groups.setdefault(base, []).append(r)
        out[name] = [groups[b] for b in sorted(groups)]
    return out


def _wrap_class_ok(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    return isinstance(value, Sequence) and bool(value) and all(isinstance(v, str) and v for v in value)


def _check_options(name: str, options: dict[str, Any], field: str) -> None:
    allowed = _OPTIONS.get(name)
    if allowed is None:
        return
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise JobSpecError(field, options, f"options of {name!r}: {', '.join(sorted(allowed))}; "
                                           f"unknown: {', '.join(unknown)}")
    wrap = options.get("wrap_class")
    if "wrap_class" in options and wrap is not None and not _wrap_class_ok(wrap):
        raise JobSpecError(f"{field}.wrap_class", wrap, "a module class name ('Block'), a dotted path "
                                                        "('mypkg.model.Block') or a list of them")
    if name == "checkpoint" and not wrap:
        raise JobSpecError(f"{field}.wrap_class", wrap,
                           "the class of the modules to recompute, e.g. ('checkpoint', {'wrap_class': 'Block'})")
    if name == "amp" and options.get("dtype", "bfloat16") not in _AMP_DTYPES:
        raise JobSpecError(f"{field}.dtype", options.get("dtype"), "'bfloat16' or 'float16' (with a gradient scaler)")
    if name == "amp" and options.get("output_dtype", "float32") not in (*_FLOAT_DTYPES, None):
        raise JobSpecError(f"{field}.output_dtype", options.get("output_dtype"),
                           "'float32' (default), 'bfloat16', 'float16' or None (keep autocast's)")
    if name == "amp" and "init_scale" in options:
        v = options["init_scale"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise JobSpecError(f"{field}.init_scale", v, "a positive number (float16's first loss scale), e.g. 65536")
    if name == "fsdp":
        for key in ("param_dtype", "reduce_dtype"):
            if options.get(key) not in (*_FLOAT_DTYPES, None):
                raise JobSpecError(f"{field}.{key}", options[key], f"one of {', '.join(_FLOAT_DTYPES)} or None")
    if name == "auto":
        for key in ("shard_above", "checkpoint_above"):
            v = options.get(key, AUTO_DEFAULTS[key])
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise JobSpecError(f"{field}.{key}", v, "a fraction of device memory > 0, e.g. 0.5")
        mb = options.get("device_mb")
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb > 0):
            raise JobSpecError(f"{field}.device_mb", mb, "MiB per worker > 0, or None (ask the accelerator probe)")


def check_strategies(strategies: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
    """Raise :class:`JobSpecError` naming the first strategy that is malformed or conflicts.

    Rules (built-in names only; others are the registering plugin's business):
    each name at most once; one of ``ddp`` / ``fsdp`` / ``auto``; ``mesh`` first;
    ``checkpoint`` before ``ddp`` / ``fsdp`` (activation checkpointing wraps the model's own
    blocks, before they are replicated or sharded, as torch's FSDP2 examples do) and not with
    ``auto`` (which decides it); each built-in's options (see the strategy's docstring).
    """
    seen: dict[str, int] = {}
    for i, (name, options) in enumerate(strategies):
        field = f"parallel.strategies[{i}]"
        if name in seen:
            raise JobSpecError(field, name, f"each strategy at most once; {name!r} is already at [{seen[name]}]")
        for other, j in seen.items():
            if name in DATA_PARALLEL and other in DATA_PARALLEL:
                raise JobSpecError(field, name, f"one data-parallel strategy; {name!r} conflicts with {other!r} "
                                                f"at [{j}] (choose one of {', '.join(DATA_PARALLEL)})")
            if {name, other} == {"checkpoint", "auto"}:
                raise JobSpecError(field, name, f"{name!r} conflicts with {other!r} at [{j}]: 'auto' decides "
                                                "activation checkpointing (give it wrap_class instead)")
            if name == "checkpoint" and other in ("ddp", "fsdp"):
                raise JobSpecError(field, name, f"'checkpoint' listed before {other!r} (at [{j}]): activation "
                                                "checkpointing wraps the model's blocks before they are replicated or sharded")
        if name == "mesh" and i != 0:
            raise JobSpecError(field, name, "'mesh' listed first: the strategies after it use the mesh")
        _check_options(name, options, field)
        seen[name] = i


def first_unreplicated(names: Sequence[str], replicated: Collection[str] | None = None) -> str | None:
    """The first of ``names`` (a job's strategies, in order) that does not keep the training
    state replicated on every data-parallel rank; ``None`` when all do.

    Args:
        names: the strategies' names.
        replicated: the names whose registrations declared replicated state, resolved from
            the plugin registry (``Parallel.replicated``); ``None`` when not resolved: then
            the built-ins' declarations (:data:`REPLICATED_BUILTINS`) hold and any other
            name counts as sharding the state.
    """
    declared = REPLICATED_BUILTINS if replicated is None else frozenset(replicated)
    return next((name for name in names if name not in declared), None)


def auto_rule_text(options: Mapping[str, Any] | None = None) -> str:
    """The rule ``Parallel("auto")`` applies at ``prepare()``, in words, with its thresholds."""
    o = {**AUTO_DEFAULTS, **(options or {})}
    m = (f"M = {o['device_mb']} MiB (given)" if o.get("device_mb") else
         "M = the accelerator probe's DeviceReport.memory_mb × min(1, count / local_world_size) "
         "(cpu: host memory shared by the node's workers)")
    return (f"auto: at prepare(), S = parameter + gradient + optimizer-state bytes (AdamW/Adam: 2 fp32 tensors "
            f"per parameter, SGD with momentum 1, others 2), {m}, D = data-parallel size; "
            f"S <= {o['shard_above']:g}·M -> ddp; else S/D <= {o['checkpoint_above']:g}·M -> fsdp; "
            f"else fsdp + activation checkpointing (of wrap_class, or the repeated block class in a ModuleList); "
            f"the decision is logged as parallel_auto")


def describe(strategies: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """One line per strategy for ``Job.dryrun()``'s plan text."""
    lines = []
    for name, options in strategies:
        if name == "mesh":
            dims = options["dims"]
            shown = " × ".join(f"{n}={s}" for n, s in dims)
            lines.append(f"mesh: {shown} (first-listed dimension varies fastest; -1 = the rest of the world)")
        elif name == "auto":
            lines.append(auto_rule_text(options))
        else:
            lines.append(f"{name} {json.dumps(options, sort_keys=True)}" if options else name)
    return lines
