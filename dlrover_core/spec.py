"""The job spec: plain, frozen data describing what to run and how to keep it running.

Every class is frozen and keyword-only (change a value with :func:`attrs.evolve`); every
invalid field raises :class:`~dlrover_core.errors.JobSpecError` naming the field, the value
and what is allowed. A :class:`JobSpec` crosses process and container boundaries as a dict
(:meth:`JobSpec.to_dict` / :meth:`JobSpec.from_dict`, via cattrs).

Plain data: constructing or decoding a spec loads no plugin and touches no file, so the
master, every agent and every worker decode it for free. What needs the installed plugins or
the filesystem (backend names, the workdir, the entrypoint) is checked by
:func:`dlrover_core.validation.validate_job`, which ``Job.validate()``, ``dryrun``, ``run``,
``submit`` and the ``dlrover`` commands run. The user-facing :class:`dlrover_core.Job` adds
those actions to this class.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import cattrs

from dlrover_core.errors import JobSpecError
from dlrover_core.parallel_rules import (
    check_strategies,
    describe,
    first_unreplicated,
    mesh_groups,
    normalize_mesh_dims,
    resolve_mesh_dims,
)

__all__ = ["Checkpoint", "Failure", "JobSpec", "Nodes", "Optimizer", "Parallel", "NAME_PATTERN", "MODULE_PATTERN",
           "HEARTBEAT_RATE_PER_S", "NUMA_MODES", "auto_heartbeat"]


#: The modes of ``Nodes.numa_binding`` (``dlrover run --numa-binding``): torch's ``AffinityMode``
#: values (``torch/numa/binding.py``); :mod:`dlrover_core.accelerators.numa` applies them.
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")


# ----- small validators --------------------------------------------------------------------


def _int_at_least(field: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise JobSpecError(field, value, f"an integer >= {low}")


def _positive_number(field: str, value: Any, *, allow_none: bool = False, unit: str = "seconds") -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise JobSpecError(field, value, f"a number of {unit} > 0" + (" or None" if allow_none else ""))


def _args_tuple(value: Any) -> tuple[Any, ...]:
    """``Job.args`` as a tuple. A single string is refused: ``tuple("--lr 1e-3")`` would be its
    characters, and splitting it like a shell would guess at quoting the user may not mean."""
    if isinstance(value, (str, bytes)):
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        try:
            example = f"args={shlex.split(text)!r}"
        except ValueError:  # unbalanced quotes: no split to suggest
            example = "e.g. args=['--lr', '1e-3']"
        raise JobSpecError("args", value, f"a list of strings, one per argument, not one string: {example} "
                                          "(shlex.split(...) splits a command line the way a shell does)")
    if isinstance(value, (Mapping, set, frozenset)) or not isinstance(value, Iterable):
        raise JobSpecError("args", value, "a list of strings, one per argument, e.g. ['--lr', '1e-3']")
    return tuple(value)


def _env_dict(value: Any) -> dict[Any, Any]:
    """``Job.env`` as a dict (from a mapping or ``(name, value)`` pairs)."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise JobSpecError("env", value, "a dict of variable names to string values, e.g. {'OMP_NUM_THREADS': '1'}")
    try:
        return dict(value)
    except (TypeError, ValueError):
        raise JobSpecError("env", value, "a dict of variable names to string values, e.g. "
                                         "{'OMP_NUM_THREADS': '1'}") from None


# ----- parts ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Nodes:
    """How many nodes (agents) the job runs on, and processes per node.

    Attributes:
        min: fewest nodes the job may train with (>= 1).
        max: most nodes (>= min); defaults to ``min``.
        nproc_per_node: worker processes per node, or ``"auto"`` (the accelerator's device
            count; on cpu half the cores).
        node_unit: the node count of a round is a multiple of this (DLRover's
            ``--node-unit``), e.g. to keep a tensor-parallel group whole.
        last_call_s: once ``min`` nodes wait, how long a round waits for more before it
            starts without them (torch elastic's ``last_call_timeout``).
        join_timeout_s: how long an agent waits for a round to complete before giving up.
        numa_binding: bind each worker (its process and every thread) to CPUs near the device
            it uses, the one whose index is its local rank (torchrun's ``--numa-binding``, the
            modes of torch's ``AffinityMode``): ``"node"`` the CPUs of the device's NUMA node;
            ``"socket"`` those of every NUMA node of the device's socket; ``"exclusive"`` an equal
            share of the node's physical cores per device on that node; ``"core-complex"`` one
            group of cores sharing a last-level cache per device. Only the CPUs the agent may
            use count (:mod:`dlrover_core.accelerators.numa` gives the rules). ``None`` (the
            default, as torchrun's): no binding. Needs an accelerator whose devices have a NUMA
            node (cuda); elsewhere the workers cannot start and the job is refused, naming it.
        virtual_local_rank: every worker sees ``LOCAL_RANK=0`` and only its own device: the
            accelerator's visibility variable (``CUDA_VISIBLE_DEVICES``) narrowed to the entry at
            its local rank, as torchrun's ``--virtual-local-rank``; on cpu, which has none, only
            ``LOCAL_RANK`` changes. ``DLROVER_LOCAL_RANK`` keeps the worker's place on its node
            (live recovery tells a node's workers apart by it).
    """

    min: int = 1
    max: int = attrs.field()
    nproc_per_node: int | str = 1
    node_unit: int = 1
    last_call_s: float = 3.0
    join_timeout_s: float = 600.0
    numa_binding: str | None = None
    virtual_local_rank: bool = False

    @max.default
    def _max_default(self) -> int:
        return self.min

    def __attrs_post_init__(self) -> None:
        _int_at_least("nodes.min", self.min, 1)
        _int_at_least("nodes.max", self.max, 1)
        if self.max < self.min:
            raise JobSpecError("nodes.max", self.max, f"an integer >= nodes.min ({self.min})")
        if self.nproc_per_node != "auto":
            _int_at_least("nodes.nproc_per_node", self.nproc_per_node, 1)
        _int_at_least("nodes.node_unit", self.node_unit, 1)
        if self.node_unit > self.max or self.max // self.node_unit * self.node_unit < self.min:
            raise JobSpecError(
                "nodes.node_unit", self.node_unit,
                f"a unit such that some multiple of it lies in [{self.min}, {self.max}]",
            )
        if isinstance(self.last_call_s, bool) or not isinstance(self.last_call_s, (int, float)) or self.last_call_s < 0:
            raise JobSpecError("nodes.last_call_s", self.last_call_s, "a number of seconds >= 0")
        _positive_number("nodes.join_timeout_s", self.join_timeout_s)
        if self.numa_binding is not None and self.numa_binding not in NUMA_MODES:
            raise JobSpecError("nodes.numa_binding", self.numa_binding,
                               f"None (no binding) or one of {', '.join(map(repr, NUMA_MODES))} (torchrun's "
                               "--numa-binding modes); 'node' if in doubt")
        if not isinstance(self.virtual_local_rank, bool):
            raise JobSpecError("nodes.virtual_local_rank", self.virtual_local_rank, "True or False")

    @classmethod
    def parse(cls, value: Nodes | int | str | Mapping[str, Any]) -> Nodes:
        """``2`` → ``Nodes(min=2, max=2)``; ``"1:2"`` → ``Nodes(min=1, max=2)``; a dict → fields."""
        if isinstance(value, Nodes):
            return value
        if isinstance(value, bool):
            raise JobSpecError("nodes", value, "an int, 'MIN:MAX', or Nodes(...)")
        if isinstance(value, int):
            return cls(min=value, max=value)
        if isinstance(value, str):
            m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", value)
            if not m:
                raise JobSpecError("nodes", value, "an int, 'MIN:MAX' (e.g. '1:4'), or Nodes(...)")
            low = int(m.group(1))
            return cls(min=low, max=int(m.group(2)) if m.group(2) else low)
        if isinstance(value, Mapping):
            return cls(**value)
        raise JobSpecError("nodes", value, "an int, 'MIN:MAX', or Nodes(...)")


@attrs.frozen(kw_only=True)
class Checkpoint:
    """Where and how often the :class:`~dlrover_core.train.Checkpointer` saves.

    Attributes:
        dir: storage location (a directory for ``posix``; a URL for other storages).
        storage: name of a registered checkpoint storage.
        memory_every_steps: snapshot to memory every N steps (0 = never; Flash Checkpoint).
        persist_every_steps: persist to storage every N steps (0 = only when forced).
        keep_last: committed steps to keep in storage (older ones are deleted).
        persist_timeout_s: a shard write to storage that has not returned after this many
            seconds (a hung mount, a stuck upload) ends the job FAILED, naming the storage
            and the step; it also bounds the final flush and how long a save waits for a
            slot while the storage falls behind.
        replicas: copies of every memory snapshot kept in the shared memory of another node
            (its *buddy*, on another host where there is one), so a lost node's ranks restore
            from memory, not from storage: ``0`` or ``1``; ``None`` (the default): ``1`` when
            the job can have more than one node, else ``0`` (:meth:`replicas_for`). The
            agents copy them in the background, at the lowest CPU priority (issue 28;
            ``dlrover_core.agent.replicas``).
        replica_mb_per_s: the most a node reads from its buddy's source each second to
            keep the replicas, in MB (10^6 bytes), so that copies never crowd out the
            training's own traffic on the link. ``None`` (the default): a quarter of the
            speed of the network interface towards the source (Linux reports it in
            ``/sys/class/net/<interface>/speed``), 1,000 MB/s where the interface does
            not say, and no limit between two nodes of one host (loopback)
            (:func:`dlrover_core.agent.replicas.replica_budget`).
        replica_cpu_share: the most of one CPU core a node's replica puller uses on average
            (its thread's CPU time; ``0 < share <= 1``): after a pass that took ``c``
            CPU-seconds it waits ``c / share`` at least, so where the training keeps every
            core busy a large snapshot is replicated every few steps rather than slowing
            each one (a lost node then recomputes those few steps). Default ``0.1``; ``1.0``
            refreshes the replicas as fast as the bandwidth budget allows.
    """

    dir: str = "checkpoints"
    storage: str = "posix"
    memory_every_steps: int = 1
    persist_every_steps: int = 50
    keep_last: int = 3
    persist_timeout_s: float = 600.0
    replicas: int | None = None
    replica_mb_per_s: float | None = None
    replica_cpu_share: float = 0.1

    def __attrs_post_init__(self) -> None:
        _positive_number("checkpoint.replica_mb_per_s", self.replica_mb_per_s, allow_none=True,
                         unit="MB per second")
        if isinstance(self.replica_cpu_share, bool) or not isinstance(self.replica_cpu_share, (int, float)) or not (
                0 < self.replica_cpu_share <= 1):
            raise JobSpecError("checkpoint.replica_cpu_share", self.replica_cpu_share,
                               "a share of one CPU core, > 0 and <= 1 (1.0: no limit)")
        if self.replicas is not None and (isinstance(self.replicas, bool) or self.replicas not in (0, 1)):
            raise JobSpecError("checkpoint.replicas", self.replicas, "0, 1 or None (1 where there is more than one node)")
        if not isinstance(self.dir, str) or not self.dir:
            raise JobSpecError("checkpoint.dir", self.dir, "a non-empty path or URL")
        _int_at_least("checkpoint.memory_every_steps", self.memory_every_steps, 0)
        _int_at_least("checkpoint.persist_every_steps", self.persist_every_steps, 0)
        _int_at_least("checkpoint.keep_last", self.keep_last, 1)
        _positive_number("checkpoint.persist_timeout_s", self.persist_timeout_s)

    def replicas_for(self, max_nodes: int) -> int:
        """The replicas in effect for a job of at most ``max_nodes`` nodes."""
        if self.replicas is None:
            return 1 if max_nodes > 1 else 0
        return self.replicas if max_nodes > 1 else 0


@attrs.frozen(kw_only=True)
class Failure:
    """How the job reacts to failures.

    Attributes:
        max_restarts: job-wide budget of restarts (all nodes together, not per node).
        hang_timeout_s: no ``report()`` progress for this long counts as a hang (``None``:
            derived from the observed step time).
        node_check: run the accelerator's node check (matmul, all-reduce; in pairs, twice)
            before training and after failures; a node failing it is excluded and replaced.
        exclude_stragglers: also exclude nodes the check finds slower than twice the median.
        heartbeat_interval_s: how often agents report to the master; ``None`` (the default):
            automatic, growing with the job so that one master gets at most
            :data:`HEARTBEAT_RATE_PER_S` heartbeats a second — ``max(0.5, nodes.max / 2000)``
            (:func:`auto_heartbeat`; ``JobSpec.heartbeat_interval_s`` is the value in effect).
        heartbeat_timeout_s: an agent silent this long is declared lost (and relaunched);
            ``None`` (the default): automatic, ``max(30, 6 * interval)`` — six missed
            heartbeats, at least 30 s (``JobSpec.heartbeat_timeout_s``).
        max_node_failures: a node whose workers failed first (or that was lost) this many
            times within ``node_failure_window_s`` is excluded from the job and replaced.
        node_failure_window_s: the window of ``max_node_failures`` (seconds): failures
            older than this are forgiven, so a healthy node is not excluded for failures
            spread over a long job (a node failing this often is likely broken).
        stop_grace_s: after SIGTERM, how long workers get before SIGKILL.
        collective_timeout_s: timeout of the worker process group's collectives.
        warm_restart: each node's agent starts one standby process that imports torch and
            the plugins once and forks every worker of the node from that state (the first
            ones, replacements, restarts: ``dlrover_core/agent/standby.py``), so a worker
            skips starting Python and importing torch (3-5 CPU-s here); ``False`` starts
            each worker as a plain process.
        live_recovery: when a worker or node fails (a script that loops with
            ``train.steps()``), the surviving workers keep their processes: with replicated
            state (``ddp``) they train on in a smaller process group and the replacement
            rejoins with their live state; with sharded state (``fsdp``, ``mesh``) they wait
            for a replacement that takes the dead rank's place and loads its shard from
            memory (docs/design.md §5a); with ``False``, every worker restarts from a
            checkpoint. Which path ran, and why, is in the log and the ``JobResult``; whether
            a job can recover live at all is :attr:`JobSpec.live_blocker`.
    """

    max_restarts: int = 3
    hang_timeout_s: float | None = None
    node_check: bool = False
    exclude_stragglers: bool = False
    heartbeat_interval_s: float | None = None
    heartbeat_timeout_s: float | None = None
    max_node_failures: int = 3
    node_failure_window_s: float = 300.0
    stop_grace_s: float = 10.0
    collective_timeout_s: float = 300.0
    warm_restart: bool = True
    live_recovery: bool = True

    def __attrs_post_init__(self) -> None:
        _int_at_least("failure.max_restarts", self.max_restarts, 0)
        _positive_number("failure.hang_timeout_s", self.hang_timeout_s, allow_none=True)
        for name in ("node_check", "exclude_stragglers"):
            if not isinstance(getattr(self, name), bool):
                raise JobSpecError(f"failure.{name}", getattr(self, name), "True or False")
        _positive_number("failure.heartbeat_interval_s", self.heartbeat_interval_s, allow_none=True)
        _positive_number("failure.heartbeat_timeout_s", self.heartbeat_timeout_s, allow_none=True)
        if (self.heartbeat_interval_s is not None and self.heartbeat_timeout_s is not None
                and self.heartbeat_timeout_s <= self.heartbeat_interval_s):
            raise JobSpecError(
                "failure.heartbeat_timeout_s", self.heartbeat_timeout_s,
                f"more than failure.heartbeat_interval_s ({self.heartbeat_interval_s})",
            )
        _int_at_least("failure.max_node_failures", self.max_node_failures, 1)
        _positive_number("failure.node_failure_window_s", self.node_failure_window_s)
        _positive_number("failure.stop_grace_s", self.stop_grace_s)
        _positive_number("failure.collective_timeout_s", self.collective_timeout_s)
        for name in ("warm_restart", "live_recovery"):
            if not isinstance(getattr(self, name), bool):
                raise JobSpecError(f"failure.{name}", getattr(self, name), "True or False")


#: Heartbeats a second that the automatic heartbeat interval holds one master to: with
#: more nodes than this times 0.5 s, each node beats less often (:func:`auto_heartbeat`).
#: What the master serves on 2 cores with room to spare (``benchmarks/master_scale.py``,
#: ``docs/scale.md``).
HEARTBEAT_RATE_PER_S = 2000
#: The automatic heartbeat interval of a small job (seconds), and its smallest timeout.
_MIN_HEARTBEAT_INTERVAL_S, _MIN_HEARTBEAT_TIMEOUT_S = 0.5, 30.0
#: Heartbeats an agent may miss before the automatic timeout declares its node lost.
_MISSED_HEARTBEATS = 6


def auto_heartbeat(nodes: int) -> tuple[float, float]:
    """The automatic ``(heartbeat_interval_s, heartbeat_timeout_s)`` of a job of at most
    ``nodes`` nodes (``Failure`` fields left ``None``)::

        interval_s = max(0.5, nodes / HEARTBEAT_RATE_PER_S)    # 2000: 0.5 s up to 1,000 nodes, 5 s at 10,000
        timeout_s  = max(30, 6 * interval_s)                    # 30 s up to 10,000 nodes, 300 s at 100,000

    so the master gets at most ``HEARTBEAT_RATE_PER_S`` heartbeats a second however large
    the job, and a node is declared lost after six missed heartbeats (at least 30 s). A
    failed worker or an exited agent is reported at once and does not wait for either.
    """
    interval_s = max(_MIN_HEARTBEAT_INTERVAL_S, nodes / HEARTBEAT_RATE_PER_S)
    return interval_s, max(_MIN_HEARTBEAT_TIMEOUT_S, _MISSED_HEARTBEATS * interval_s)


@attrs.frozen(init=False)
class Optimizer:
    """An optimizer by registered name, with its keyword options: ``Optimizer("adamw", lr=3e-4)``."""

    name: str
    options: dict[str, Any]

    def __init__(self, name: str = "adamw", /, **options: Any) -> None:
        if not isinstance(name, str) or not name:
            raise JobSpecError("optimizer.name", name, "a registered optimizer name, e.g. 'adamw'")
        try:
            json.dumps(options)
        except TypeError as exc:
            raise JobSpecError("optimizer.options", options, f"JSON-safe values (numbers, strings, lists): {exc}") from None
        self.__attrs_init__(name=name, options=dict(options))


def _normalize_strategy(item: Any, index: int) -> tuple[str, dict[str, Any]]:
    field = f"parallel.strategies[{index}]"
    if isinstance(item, str):
        return (item, {})
    if isinstance(item, (list, tuple)) and len(item) == 2 and item[0] == "mesh":
        if isinstance(item[1], Mapping):  # the JSON form, {"dims": [...]}
            return ("mesh", {**item[1], "dims": normalize_mesh_dims(item[1].get("dims"), f"{field}.dims")})
        return ("mesh", {"dims": normalize_mesh_dims(item[1], field)})
    if isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], Mapping):
        return (item[0], dict(item[1]))
    raise JobSpecError(field, item, "a name or a (name, {options}) pair")


@attrs.frozen(init=False)
class Parallel:
    """Parallel strategies applied in order by ``train.prepare()`` (ATorch style)::

        Parallel(["ddp", ("amp", {"dtype": "bfloat16"})])
        Parallel([("mesh", [("data", 2), ("tensor", 2)]), ("fsdp", {"wrap_class": "Block"})])
        Parallel("auto")

    Built-in strategies (see :mod:`dlrover_core.parallel`): ``ddp``; ``fsdp`` (FSDP2,
    options ``wrap_class``, ``reshard_after_forward``, ``param_dtype``, ``reduce_dtype``);
    ``amp`` (``dtype``: ``"bfloat16"`` or ``"float16"`` with a gradient scaler;
    ``output_dtype``, ``init_scale``); ``checkpoint`` (activation checkpointing,
    ``wrap_class``); ``compile`` (``torch.compile`` options); ``mesh`` (a ``DeviceMesh``; its
    list of ``(name, size)`` dimensions, first-listed varies fastest, one size may be -1 for
    the rest; must come first; fsdp shards over its ``data`` dimension and, where it has a
    ``replicate`` dimension too, replicates over that: HSDP); ``auto`` (picks ddp, fsdp or checkpoint + fsdp from the
    model's size and the device memory, options ``shard_above``, ``checkpoint_above``,
    ``wrap_class``, ``device_mb``; see :func:`dlrover_core.parallel_rules.auto_rule_text`).
    Plugins add more names.

    A malformed or conflicting list (a name twice; two of ddp / fsdp / auto; mesh not first;
    checkpoint after ddp / fsdp or with auto; a built-in's unknown option) raises
    :class:`~dlrover_core.errors.JobSpecError` here; unknown names at ``Job.validate()``; a mesh
    whose size product is not the world size at ``prepare()``.

    Attributes:
        strategies: ``(name, options)`` pairs, in the order they are applied; options are
            JSON values (tuples become lists), ``("mesh", dims)`` becomes
            ``("mesh", {"dims": [[name, size], ...]})``.
        replicated: which of these strategies keep the training state replicated on every
            data-parallel rank, as their plugins declared it when they registered
            (``register(fn, name=..., replicated=True)``). Filled in from the plugin registry
            by ``Job.dryrun()``, ``submit()`` and ``run()`` (leave it out); ``None``: not
            resolved, the built-ins' declarations hold
            (:data:`~dlrover_core.parallel_rules.REPLICATED_BUILTINS`) and any other strategy
            counts as sharding the state. It decides :attr:`JobSpec.live_blocker`.
    """

    strategies: tuple[tuple[str, dict[str, Any]], ...]
    replicated: tuple[str, ...] | None

    def __init__(self, strategies: Sequence[Any] = ("ddp",), *, replicated: Iterable[str] | None = None) -> None:
        if isinstance(strategies, str):
            strategies = [strategies]
        if not isinstance(strategies, Sequence):
            raise JobSpecError("parallel.strategies", strategies, "a list of names or (name, {options}) pairs")
        normalized = [_normalize_strategy(s, i) for i, s in enumerate(strategies)]
        for i, (name, _) in enumerate(normalized):
            if not name:
                raise JobSpecError(f"parallel.strategies[{i}]", name, "a registered strategy name, e.g. 'ddp'")
        try:
            normalized = json.loads(json.dumps(normalized))  # JSON values only: equal after to_dict/from_dict
        except (TypeError, ValueError) as exc:
            raise JobSpecError("parallel.strategies", strategies, f"JSON-safe options: {exc}") from None
        pairs = tuple((name, options) for name, options in normalized)
        check_strategies(pairs)
        self.__attrs_init__(strategies=pairs, replicated=_replicated_names(replicated, [n for n, _ in pairs]))

    def describe(self) -> list[str]:
        """One line per strategy, as ``Job.dryrun()``'s plan shows them (``auto``: its rule)."""
        return describe(self.strategies)

    def first_unreplicated(self) -> str | None:
        """The first strategy that does not keep the training state replicated on every
        data-parallel rank (``None``: all do); see :attr:`replicated`."""
        return first_unreplicated([name for name, _ in self.strategies], self.replicated)


def _replicated_names(value: Iterable[str] | None, names: Sequence[str]) -> tuple[str, ...] | None:
    if value is None:
        return None
    want = ("the names of this Parallel's strategies whose plugins declared replicated state; leave it out: "
            "Job.dryrun(), submit() and run() fill it in from the installed plugins")
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise JobSpecError("parallel.replicated", value, want)
    out = tuple(value)
    if any(not isinstance(n, str) or n not in names for n in out):
        raise JobSpecError("parallel.replicated", list(out), want)
    return tuple(n for n in names if n in out)  # in the strategies' order, each once


# ----- the job ----------------------------------------------------------------------------

#: A job name: a DNS label of at most 40 characters.
NAME_PATTERN = re.compile(r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?")
#: An entrypoint that is a module (``pkg.mod``) or a function in one (``pkg.mod:function``).
MODULE_PATTERN = re.compile(r"[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?")


@attrs.frozen(kw_only=True)
class JobSpec:
    """A distributed training job, as plain data (the user-facing :class:`dlrover_core.Job`
    adds ``validate``, ``dryrun``, ``submit`` and ``run``).

    Attributes:
        name: DNS-label style name (lowercase letters, digits, '-'; at most 40 characters).
        entrypoint: a Python script path (relative to ``workdir``), a module ``"pkg.mod"``
            run like ``python -m``, or ``"pkg.mod:function"`` called with no arguments.
        args: arguments given to the entrypoint (``sys.argv[1:]``): a list of strings, one per
            argument. A single string (``"--lr 1e-3"``) is refused with the split to use
            (``shlex.split("--lr 1e-3")`` gives ``["--lr", "1e-3"]``).
        nodes: :class:`Nodes`, or an int (``min == max``), or ``"MIN:MAX"``.
        accelerator: a registered accelerator name or ``"auto"``.
        scheduler: a registered scheduler name (``"local"`` runs on this machine).
        scheduler_options: the scheduler backend's own options by name (JSON values), e.g.
            ``{"image": "ghcr.io/org/train:1"}`` for k8s; each backend declares its options
            (name, type, default, help: ``dlrover plugins list`` shows them) and
            ``Job.validate()`` refuses an unknown one or a value of the wrong type.
        checkpoint: :class:`Checkpoint` settings for ``train.Checkpointer``.
        failure: :class:`Failure` settings (restart budget, timeouts).
        optimizer: what ``train.prepare()`` builds.
        parallel: strategies ``train.prepare()`` applies; ``None``: ``ddp`` when the world
            has more than one process.
        env: extra environment variables for every worker (string names and values).
        workdir: working directory of the workers.
        log_dir: where runs keep logs, events and results (one sub-directory per run).
    """

    name: str
    entrypoint: str
    args: tuple[str, ...] = attrs.field(default=(), converter=_args_tuple)
    nodes: Nodes = attrs.field(default=Nodes(), converter=Nodes.parse)
    accelerator: str = "auto"
    scheduler: str = "local"
    scheduler_options: dict[str, Any] = attrs.field(factory=dict, converter=dict)
    checkpoint: Checkpoint = Checkpoint()
    failure: Failure = Failure()
    optimizer: Optimizer = Optimizer("adamw")
    parallel: Parallel | None = None
    env: dict[str, str] = attrs.field(factory=dict, converter=_env_dict)
    workdir: str = "."
    log_dir: str = "dlrover-runs"

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_PATTERN.fullmatch(self.name):
            raise JobSpecError("name", self.name, "lowercase letters, digits and '-', 1-40 characters, e.g. 'charlm'")
        for i, a in enumerate(self.args):
            if not isinstance(a, str):
                raise JobSpecError(f"args[{i}]", a, "a string (convert numbers with str())")
        for k, v in self.env.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise JobSpecError(f"env[{k!r}]", v, "string keys and string values")
        for field, value, want in (
            ("nodes", self.nodes, Nodes), ("checkpoint", self.checkpoint, Checkpoint),
            ("failure", self.failure, Failure), ("optimizer", self.optimizer, Optimizer),
        ):
            if not isinstance(value, want):
                raise JobSpecError(field, value, f"a {want.__name__}(...)")
        if self.parallel is not None and not isinstance(self.parallel, Parallel):
            raise JobSpecError("parallel", self.parallel, "None or a Parallel(...)")
        if not isinstance(self.entrypoint, str) or not self.entrypoint:
            raise JobSpecError("entrypoint", self.entrypoint, "a script path, 'pkg.module' or 'pkg.module:function'")
        looks_like_script = self.entrypoint.endswith(".py") or "/" in self.entrypoint
        if not looks_like_script and not MODULE_PATTERN.fullmatch(self.entrypoint):
            raise JobSpecError("entrypoint", self.entrypoint, "a script path, 'pkg.module' or 'pkg.module:function'")
        for key, value in self.scheduler_options.items():
            if not isinstance(key, str) or not key:
                raise JobSpecError("scheduler_options", key, "option names as strings, e.g. {'image': '...'}")
            try:
                json.dumps(value)
            except (TypeError, ValueError) as exc:
                raise JobSpecError(f"scheduler_options[{key!r}]", value, f"a JSON value (string, number, list, dict): {exc}") from None
        for field in ("accelerator", "scheduler", "workdir", "log_dir"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise JobSpecError(field, value, "a non-empty string")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:  # one of them automatic
            raise JobSpecError(
                "failure.heartbeat_timeout_s", self.heartbeat_timeout_s,
                f"more than the heartbeat interval ({self.heartbeat_interval_s:g} s, automatic for "
                f"nodes.max={self.nodes.max}: max(0.5, nodes / {HEARTBEAT_RATE_PER_S})); "
                "set failure.heartbeat_interval_s too, or a longer timeout",
            )

    # ----- heartbeats ------------------------------------------------------------------

    @property
    def heartbeat_interval_s(self) -> float:
        """Seconds between an agent's heartbeats: ``failure.heartbeat_interval_s``, or the
        automatic one for ``nodes.max`` (:func:`auto_heartbeat`). Read it here, not from
        ``failure``."""
        if self.failure.heartbeat_interval_s is not None:
            return float(self.failure.heartbeat_interval_s)
        return auto_heartbeat(self.nodes.max)[0]

    @property
    def heartbeat_timeout_s(self) -> float:
        """Seconds of silence after which a node is lost: ``failure.heartbeat_timeout_s``,
        or ``max(30, 6 * heartbeat_interval_s)`` (:func:`auto_heartbeat`)."""
        if self.failure.heartbeat_timeout_s is not None:
            return float(self.failure.heartbeat_timeout_s)
        return max(_MIN_HEARTBEAT_TIMEOUT_S, _MISSED_HEARTBEATS * self.heartbeat_interval_s)

    # ----- recovery without stopping -----------------------------------------------------

    @property
    def live_blocker(self) -> str:
        """Why this job's failures restart every worker instead of being recovered live
        (docs/design.md §5a); ``""``: the survivors go on and a replacement rejoins. The one
        place this is decided: the master, the agents and the workers read it here. It is
        ``"failure.live_recovery=False"``, or, for a job whose state is sharded
        (:attr:`live_sharded`), that memory snapshots are off: a replacement takes its
        shard from its node's shared memory, never from a peer."""
        if not self.failure.live_recovery:
            return "failure.live_recovery=False"
        if self.live_sharded and self.checkpoint.memory_every_steps == 0:
            name = self.parallel.first_unreplicated() if self.parallel is not None else None
            return (f"parallel strategy {name!r} shards the training state and checkpoint.memory_every_steps=0: "
                    "a replacement's shard comes from its memory snapshot, so every worker restarts from storage")
        return ""

    @property
    def live_sharded(self) -> bool:
        """Whether the live world of this job keeps its size: a parallel strategy shards the
        training state (:meth:`Parallel.first_unreplicated`), so no peer holds a dead rank's
        part. The survivors keep their processes and wait for a replacement that takes the
        dead rank's place (rank and shard) and loads its shard from memory; every member
        resumes after the newest step each of them can restore. ``False``: the state is
        replicated, the survivors train on in a smaller world and a replacement catches up
        from a peer."""
        return self.parallel is not None and self.parallel.first_unreplicated() is not None

    def replica_groups(self, world_size: int) -> list[list[int]]:
        """Groups of ranks that hold the same shard of a sharded state: the groups of the
        ``mesh`` strategy's ``replicate`` dimension (HSDP: ``fsdp`` shards over ``data`` and
        replicates over ``replicate``), ranks laid out as the mesh lays them (first-listed
        dimension fastest: :func:`~dlrover_core.parallel_rules.mesh_groups`). A sharded
        world's replacement whose own memory lacks the step its peers resume after takes
        its shard from a live member of its group. ``[]`` without such a dimension, or for
        a world size the mesh does not fit (the workers then fail on the mesh themselves).
        Pure: ``world_size`` ranks, no plugin loaded."""
        if self.parallel is None:
            return []
        for name, options in self.parallel.strategies:
            if name != "mesh" or not isinstance(options, Mapping):
                continue
            try:
                dims = resolve_mesh_dims(options.get("dims") or (), world_size)
            except JobSpecError:
                return []
            return [g for g in mesh_groups(dims).get("replicate", []) if len(g) > 1]
        return []

    # ----- serialization ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict; :meth:`from_dict` turns it back into an equal spec."""
        return _converter.unstructure(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        """Build one of ``cls`` from :meth:`to_dict` output (raises JobSpecError on invalid
        fields). Pure: loads no plugin and reads no file."""
        try:
            return _converter.structure(dict(data), cls)
        except cattrs.BaseValidationError as exc:
            inner = exc.exceptions[0] if getattr(exc, "exceptions", None) else exc
            if isinstance(inner, JobSpecError):
                raise inner from None
            raise JobSpecError("job", dict(data), f"a dict from Job.to_dict(): {inner}") from None


_converter = cattrs.Converter(forbid_extra_keys=True)
_converter.register_unstructure_hook(Optimizer, lambda o: {"name": o.name, "options": dict(o.options)})
_converter.register_structure_hook(Optimizer, lambda d, _: Optimizer(d["name"], **d.get("options", {})))
_converter.register_unstructure_hook(Parallel, lambda p: {"strategies": [[n, dict(o)] for n, o in p.strategies],
                                                            **({} if p.replicated is None else
                                                               {"replicated": list(p.replicated)})})
_converter.register_structure_hook(Parallel, lambda d, _: Parallel([tuple(s) for s in d["strategies"]],
                                                                   replicated=d.get("replicated")))
_converter.register_structure_hook(Nodes, lambda d, _: Nodes.parse(d))
_converter.register_structure_hook(int | str, lambda v, _: v)
# Job's own converters check these (cattrs would turn the string "--lr 1e-3" into its characters)
_converter.register_structure_hook_func(lambda t: t in (tuple[str, ...], dict[str, str]), lambda v, _: v)
