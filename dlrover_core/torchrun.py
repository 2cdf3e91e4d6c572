"""torchrun's command line translated: from the arguments ``dlrover run`` takes (torchrun's
flags, with torchrun's meanings and defaults, docs/torchrun.md) to the :class:`~dlrover_core.Job`
they describe, where this host's agent finds the job master
(:class:`~dlrover_core.hostrun.HostPlan`) and the environment the agent reads its console and
worker settings from.

Functions of their arguments only (what they read of the machine, the environment, a network
interface or a free port, is a parameter with the machine's as default), without click:
``dlrover run``'s command (:mod:`dlrover_core.run_command`) parses the flags into a
:class:`TorchrunArgs` and calls them in torchrun's order, and a refused argument is a
:class:`TorchrunArgumentError` naming the flag, which the command shows as click's usage error.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import psutil

from dlrover_core import env
from dlrover_core.errors import DLRoverError
from dlrover_core.hostrun import HostPlan, parse_endpoint
from dlrover_core.job import Job
from dlrover_core.signals import DEFAULT_STOP_SIGNALS, SIGNALS_ENV, parse_signals
from dlrover_core.spec import Checkpoint, Failure, Nodes, Parallel, auto_heartbeat

__all__ = [
    "RDZV_CONF_KEYS",
    "REJECTED_FLAGS",
    "TorchrunArgs",
    "TorchrunArgumentError",
    "agent_environment",
    "check_supported",
    "failure_policy",
    "free_port",
    "host_plan",
    "interface_of",
    "job_name",
    "local_path",
    "nproc_per_node",
    "parse_parallel",
    "parse_rdzv_conf",
    "stop_signals",
    "to_job",
]

#: torchrun flags (``torch.distributed.run``) that ``dlrover run`` does not take, each with why
#: and what to do instead. Every other torchrun flag is accepted with torchrun's meaning
#: (differences: ``docs/torchrun.md``).
REJECTED_FLAGS = {
    "--logs-specs": "dlrover writes each rank's output to <log-dir>/<job id>/node_<n>/rank_<r>.log itself; "
                    "torchrun LogsSpecs plugins are not loaded",
    "--duplicate-stdout-filters": "not supported: every rank's output is already in its rank_<r>.log",
    "--duplicate-stderr-filters": "not supported: every rank's output is already in its rank_<r>.log",
}

#: The keys ``--rdzv-conf`` takes (torchrun passes any other on to its backend; dlrover refuses it).
RDZV_CONF_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "timeout", "read_timeout", "is_host",
                  "keep_alive_interval", "keep_alive_max_attempt", "heartbeat")


class TorchrunArgumentError(DLRoverError, ValueError):
    """An argument ``dlrover run`` refuses, as click's usage errors say it.

    Attributes:
        message: what is wrong and the fix, in one line.
        flag: the flag (or ``ENTRYPOINT``) whose value is invalid, shown as click's
            ``Invalid value for '<flag>'``; ``None``: a usage error of the command line as a
            whole (flags that do not go together, a flag not supported).
    """

    def __init__(self, message: str, flag: str | None = None) -> None:
        self.message = message
        self.flag = flag
        super().__init__(message if flag is None else f"{flag}: {message}")


@attrs.frozen(kw_only=True)
class TorchrunArgs:
    """The arguments of ``dlrover run``: every torchrun flag (its option's name, with
    ``dlrover run``'s defaults, which are torchrun's but where docs/torchrun.md says why not),
    then dlrover's own (``simulate_nodes``, ``accelerator``, ``checkpoint_dir``, ``node_unit``,
    ``run_id``, ``parallel``). Values are as given on the command line (text where torchrun takes text);
    the functions of this module check them.
    """

    entrypoint: str
    args: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    nnodes: str = "1:1"
    nproc_per_node: str = "1"
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: str = ""
    standalone: bool = False
    max_restarts: int = 3
    monitor_interval: float | None = None
    start_method: str = "spawn"
    event_log_handler: str = "null"
    role: str = "default"
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    log_dir: str = "dlrover-runs"
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: str = ""
    node_rank: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    local_addr: str | None = None
    signals_to_handle: str = DEFAULT_STOP_SIGNALS
    shutdown_timeout: float | None = None
    logs_specs: str | None = None
    numa_binding: str | None = None
    virtual_local_rank: bool = False
    duplicate_stdout_filters: str | None = None
    duplicate_stderr_filters: str | None = None
    simulate_nodes: str | None = None
    accelerator: str = "auto"
    checkpoint_dir: str = "checkpoints"
    node_unit: int = 1
    run_id: str | None = None
    parallel: str | None = None


def check_supported(args: TorchrunArgs) -> dict[str, str]:
    """Refuse what ``dlrover run`` does not take (a flag of :data:`REJECTED_FLAGS` given, an
    event log handler but ``null``, a rendezvous backend but static or c10d, ``--module``
    with ``--no-python``); return ``--rdzv-conf`` as a dict (:func:`parse_rdzv_conf`).

    Raises:
        TorchrunArgumentError: names the flag and why.
    """
    given = {"--logs-specs": args.logs_specs, "--duplicate-stdout-filters": args.duplicate_stdout_filters,
             "--duplicate-stderr-filters": args.duplicate_stderr_filters}
    for flag, value in given.items():
        if value:
            raise TorchrunArgumentError(f"{flag} is not supported: {REJECTED_FLAGS[flag]}")
    if args.event_log_handler != "null":
        raise TorchrunArgumentError(f"--event-log-handler {args.event_log_handler!r} is not supported: dlrover "
                                    "writes its events to <log-dir>/<job id>/events.jsonl (only 'null' is accepted)")
    if args.rdzv_backend not in ("static", "c10d", "dlrover"):
        raise TorchrunArgumentError(f"--rdzv-backend {args.rdzv_backend!r} is not supported: the job master serves "
                                    "the rendezvous; use c10d (with --rdzv-endpoint) or static")
    if args.module and args.no_python:
        raise TorchrunArgumentError("--module and --no-python cannot be used together (as in torchrun)")
    return parse_rdzv_conf(args.rdzv_conf)


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``--rdzv-conf``: ``KEY=VALUE,...`` → ``{KEY: VALUE}`` (blanks around each stripped).

    Raises:
        TorchrunArgumentError: a part without ``=``, or a key not in :data:`RDZV_CONF_KEYS`.
    """
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise TorchrunArgumentError(f"{part!r} is not KEY=VALUE", "--rdzv-conf")
        out[key.strip()] = value.strip()
    unknown = sorted(set(out) - set(RDZV_CONF_KEYS))
    if unknown:
        raise TorchrunArgumentError(f"unknown keys {unknown}; known: {', '.join(RDZV_CONF_KEYS)}", "--rdzv-conf")
    return out


def parse_parallel(text: str | None) -> Parallel:
    """``--parallel``: the strategies ``train.prepare()`` applies (:class:`~dlrover_core.spec.Parallel`),
    as names joined by commas (``fsdp``, ``ddp,amp``) or as the JSON list ``Parallel`` takes
    (``[["mesh", [["data", 2], ["replicate", 2]]], "fsdp"]``: HSDP). It also tells the job
    whether the training state is sharded, which decides how a failure recovers live
    (docs/design.md §5a). ``None`` or empty: ``Parallel()`` (ddp).

    Raises:
        TorchrunArgumentError: malformed JSON, or a list ``Parallel`` refuses (its message
            names the entry and the fix).
    """
    if not text or not text.strip():
        return Parallel()
    text = text.strip()
    if text.startswith("["):
        try:
            strategies = json.loads(text)
        except ValueError as exc:
            raise TorchrunArgumentError(f"not valid JSON ({exc}); e.g. '[[\"mesh\", [[\"data\", 2], "
                                        f"[\"replicate\", 2]]], \"fsdp\"]' or names: fsdp", "--parallel") from None
    else:
        strategies = [name.strip() for name in text.split(",")]
    try:
        return Parallel(strategies)
    except DLRoverError as exc:
        raise TorchrunArgumentError(str(exc), "--parallel") from None


def job_name(text: str) -> str:
    """The job's name from ``--run-id``, ``--rdzv-id`` or the entrypoint (a script's stem, a
    module's last part): lower case letters, digits and dashes, at most 40; ``job`` if none."""
    stem = Path(text).stem if text.endswith(".py") else text.split(":")[0].rsplit(".", 1)[-1]
    name = re.sub(r"[^a-z0-9-]+", "-", stem.lower()).strip("-")[:40].strip("-")
    return name or "job"


def local_path(path: str) -> str:
    """``path`` made absolute against this directory (a URL such as ``s3://...`` stays): the
    master, the agent and the workers resolve it alike whatever their working directory."""
    return path if "://" in path else str(Path(path).resolve())


def nproc_per_node(value: str) -> int | str:
    """torchrun's ``--nproc-per-node``: an integer, ``cpu`` (the cores this process may run
    on, as torchrun counts them: taskset, cpusets), ``gpu``/``xpu``/``auto`` → ``"auto"``
    (one per device; on cpu, dlrover's default: half the cores).

    Raises:
        TorchrunArgumentError: not one of those, or below 1.
    """
    if value == "cpu":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if value in ("auto", "gpu", "xpu"):
        return "auto"
    try:
        n = int(value)
    except ValueError:
        raise TorchrunArgumentError(f"{value!r}: an integer, auto, cpu, gpu or xpu", "--nproc-per-node") from None
    if n < 1:
        raise TorchrunArgumentError("at least 1", "--nproc-per-node")
    return n


def failure_policy(max_restarts: int, monitor_interval: float | None, conf: Mapping[str, str],
                   shutdown_timeout: float | None, *, nodes: int,
                   environ: Mapping[str, str] = os.environ) -> Failure:
    """The job's :class:`~dlrover_core.spec.Failure` from ``--max-restarts``,
    ``--monitor-interval`` (seconds), ``--rdzv-conf``'s ``keep_alive_interval`` (or
    ``heartbeat``, seconds) and ``keep_alive_max_attempt`` (missed heartbeats of the interval
    in effect, that of ``nodes`` nodes when none is given), ``--shutdown-timeout`` (seconds;
    unset: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` in ``environ``, as torchrun reads it).

    Raises:
        TorchrunArgumentError: ``max_restarts`` below 0, or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``
            not a number.
        JobSpecError: a value :class:`~dlrover_core.spec.Failure` refuses.
        ValueError: a ``--rdzv-conf`` value that is not a number.
    """
    if max_restarts < 0:
        raise TorchrunArgumentError("at least 0", "--max-restarts")
    fields: dict[str, Any] = {"max_restarts": max_restarts}
    interval = conf.get("keep_alive_interval", conf.get("heartbeat"))
    interval_s = float(interval) if interval is not None else monitor_interval
    if interval_s is not None:
        fields["heartbeat_interval_s"] = interval_s
    attempts = conf.get("keep_alive_max_attempt")
    if attempts is not None:
        # missed heartbeats of the interval in effect (the automatic one for the job's size)
        base = interval_s if interval_s is not None else auto_heartbeat(nodes)[0]
        fields["heartbeat_timeout_s"] = float(attempts) * float(base)
    elif interval_s is not None:
        fields["heartbeat_timeout_s"] = max(30.0, 10 * interval_s)
    if shutdown_timeout is None and environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        try:
            shutdown_timeout = float(environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
        except ValueError:
            raise TorchrunArgumentError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={environ['TORCH_ELASTIC_SHUTDOWN_TIMEOUT']!r}"
                                        " is not a number of seconds", "--shutdown-timeout") from None
    if shutdown_timeout is not None:
        fields["stop_grace_s"] = shutdown_timeout
    return Failure(**fields)


def to_job(args: TorchrunArgs, conf: Mapping[str, str], *, workdir: str | None = None,
           environ: Mapping[str, str] = os.environ) -> Job:
    """The :class:`~dlrover_core.Job` ``args`` describe (``conf``: ``--rdzv-conf`` from
    :func:`check_supported`): the entrypoint and its arguments; the nodes (``--nnodes``, or
    ``--simulate-nodes``; ``--nproc-per-node``, ``--node-unit``, ``last_call_timeout`` and
    ``join_timeout`` of ``conf`` in seconds, ``--numa-binding``, ``--virtual-local-rank``); the
    failure policy (:func:`failure_policy`); the strategies (``--parallel``,
    :func:`parse_parallel`); ``ROLE_NAME`` when ``--role`` is not ``default``;
    the checkpoint and log directories made absolute (:func:`local_path`); named by
    ``--run-id``, ``--rdzv-id`` or the entrypoint (:func:`job_name`); run in ``workdir``
    (default: this directory).

    Raises:
        TorchrunArgumentError: ``-m`` with a ``.py`` file; ``--simulate-nodes`` with
            ``--nnodes``, ``--rdzv-endpoint`` or ``--node-rank``; an invalid
            ``--nproc-per-node``, ``--parallel`` or failure flag.
        JobSpecError: a value a field of the Job refuses (``--nnodes 0``).
        ValueError: a ``--rdzv-conf`` timeout that is not a number.
    """
    if args.module and args.entrypoint.endswith(".py"):
        raise TorchrunArgumentError("with -m give a module name, not a file", "ENTRYPOINT")
    if args.simulate_nodes is not None:
        if args.nnodes not in ("1", "1:1") or args.rdzv_endpoint or args.node_rank is not None:
            raise TorchrunArgumentError("--simulate-nodes runs every node on this machine: leave out --nnodes, "
                                        "--rdzv-endpoint and --node-rank")
        nodes = Nodes.parse(args.simulate_nodes)
    else:
        nodes = Nodes.parse(args.nnodes)
    nproc = nproc_per_node(args.nproc_per_node)
    nodes = Nodes(min=nodes.min, max=nodes.max, node_unit=args.node_unit, nproc_per_node=nproc,
                  last_call_s=float(conf.get("last_call_timeout", nodes.last_call_s)),
                  join_timeout_s=float(conf.get("join_timeout", nodes.join_timeout_s)),
                  numa_binding=args.numa_binding, virtual_local_rank=args.virtual_local_rank)
    failure = failure_policy(args.max_restarts, args.monitor_interval, conf, args.shutdown_timeout, nodes=nodes.max,
                             environ=environ)
    job_env = {} if args.role == "default" else {"ROLE_NAME": args.role}
    name = job_name(args.run_id or (args.rdzv_id if args.rdzv_id != "none" else args.entrypoint))
    return Job(name=name, entrypoint=args.entrypoint, args=list(args.args), nodes=nodes, accelerator=args.accelerator,
               parallel=parse_parallel(args.parallel),
               checkpoint=Checkpoint(dir=local_path(args.checkpoint_dir)), failure=failure,
               log_dir=local_path(args.log_dir), env=job_env, workdir=workdir if workdir is not None else os.getcwd())


def stop_signals(text: str) -> tuple[int, ...]:
    """``--signals-to-handle``: the signals' numbers, in order, without repeats.

    Raises:
        TorchrunArgumentError: an unknown signal, or one no process can handle (SIGKILL).
    """
    try:
        return parse_signals(text)
    except ValueError as exc:
        raise TorchrunArgumentError(str(exc), "--signals-to-handle") from None


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_plan(job: Job, args: TorchrunArgs, conf: Mapping[str, str], *,
              port: Callable[[], int] = free_port) -> HostPlan:
    """Where this host's agent finds the job master, following torchrun's rules: standalone
    (``--standalone``, or one node without ``--rdzv-endpoint`` and ``--master-port``: the
    master on 127.0.0.1 and a port from ``port``); static (``--master-addr:--master-port``,
    29500 by default, with ``--node-rank``); else c10d (``--rdzv-endpoint``, the master
    assigns the node rank).

    Raises:
        TorchrunArgumentError: ``--standalone`` with more than one node; static with
            ``MIN:MAX`` nodes or without ``--node-rank`` on several nodes; no
            ``--rdzv-endpoint`` with several nodes; ``is_host=false`` in ``conf``.
        JobSpecError: a malformed endpoint.
    """
    rdzv_id = "" if args.rdzv_id == "none" else args.rdzv_id
    nodes = job.nodes
    if args.standalone or (nodes.max == 1 and not args.rdzv_endpoint and args.master_port is None):
        if nodes.max > 1:
            raise TorchrunArgumentError("--standalone runs one host: give --nnodes 1 (or leave it out)")
        return HostPlan(job=job, endpoint=f"127.0.0.1:{port()}", rdzv_id=rdzv_id, node_rank=0, standalone=True,
                        log_dir=job.log_dir)
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        if nodes.min != nodes.max:
            raise TorchrunArgumentError("--rdzv-backend static needs a fixed --nnodes N; use --rdzv-backend c10d "
                                        "with --rdzv-endpoint for MIN:MAX")
        if args.node_rank is None and nodes.max > 1:
            raise TorchrunArgumentError("--rdzv-backend static needs --node-rank on every host (0 on the one given "
                                        "by --master-addr); or use --rdzv-backend c10d --rdzv-endpoint HOST:PORT")
        endpoint = f"{args.master_addr}:{args.master_port or 29500}"
        rank: int | None = args.node_rank or 0
    else:
        if not args.rdzv_endpoint:
            raise TorchrunArgumentError("--rdzv-endpoint HOST[:PORT] is required with more than one node: the host "
                                        "where the job master runs")
        endpoint = args.rdzv_endpoint
        rank = args.node_rank if args.rdzv_backend == "static" else None
    is_host = conf.get("is_host")
    if is_host is not None and is_host.lower() in ("0", "false", "no"):
        raise TorchrunArgumentError("--rdzv-conf is_host=false is not supported: the first dlrover run on the "
                                    "endpoint's host starts the job master")
    parse_endpoint(endpoint)  # a clear error for a malformed one, now
    return HostPlan(job=job, endpoint=endpoint, rdzv_id=rdzv_id, node_rank=rank, log_dir=job.log_dir)


def _std_ranks(value: str, flag: str) -> dict[int, int] | int:
    """torchrun's ``Std`` syntax for -r/-t: ``N`` (every local rank) or ``RANK:N,...``."""
    try:
        if ":" not in value:
            return int(value)
        return {int(k): int(v) for k, v in (part.split(":") for part in value.split(","))}
    except ValueError:
        raise TorchrunArgumentError(f"{value!r}: give 0-3 or LOCAL_RANK:0-3,... (as torchrun)", flag) from None


def _console_ranks(nproc: int, redirects: str, local_ranks_filter: str) -> str | None:
    """The local ranks whose output the agent shows (``DLROVER_CONSOLE_LOCAL_RANKS``), or None: all."""
    shown = set(range(nproc))
    std = _std_ranks(redirects, "--redirects")
    if isinstance(std, int):
        if std:
            shown = set()
    else:
        shown -= {rank for rank, v in std.items() if v}
    if local_ranks_filter:
        try:
            shown &= {int(r) for r in local_ranks_filter.split(",")}
        except ValueError:
            raise TorchrunArgumentError("a comma-separated list of integers, e.g. 0,1,2",
                                        "--local-ranks-filter") from None
    return None if shown == set(range(nproc)) else ",".join(str(r) for r in sorted(shown))


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that has ``address``, or None."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def agent_environment(args: TorchrunArgs, nproc: int | str, *, environ: Mapping[str, str] = os.environ,
                      interface: Callable[[str], str | None] = interface_of) -> dict[str, str]:
    """The variables to set in this process's environment, which the agent inherits: the
    local ranks whose output the console shows (``DLROVER_CONSOLE_LOCAL_RANKS``, from
    ``--redirects`` and ``--local-ranks-filter``; unset: all), ``DLROVER_WORKER_EXEC=1`` with
    ``--no-python``, ``GLOO_SOCKET_IFNAME`` (the interface of ``--local-addr``, unless
    ``environ`` sets it), and ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (``--signals-to-handle``, as
    torchrun's workers see it). ``nproc``: the workers per node (``"auto"``: not known yet).

    Raises:
        TorchrunArgumentError: ``--tee`` or ``--redirects`` not torchrun's syntax; a
            ``--local-ranks-filter`` that is not integers; either with ``nproc`` ``"auto"``;
            ``--local-addr`` not an address of this host.
    """
    out: dict[str, str] = {}
    _std_ranks(args.tee, "--tee")
    if nproc != "auto":
        ranks = _console_ranks(int(nproc), args.redirects, args.local_ranks_filter)
        if ranks is not None:
            out[env.CONSOLE_LOCAL_RANKS] = ranks
    elif args.redirects != "0" or args.local_ranks_filter:
        raise TorchrunArgumentError("--redirects and --local-ranks-filter need a number for --nproc-per-node")
    if args.no_python:
        out[env.WORKER_EXEC] = "1"
    if args.local_addr and "GLOO_SOCKET_IFNAME" not in environ:
        name = interface(args.local_addr)
        if name is None:
            raise TorchrunArgumentError(f"{args.local_addr} is not an address of this host", "--local-addr")
        out["GLOO_SOCKET_IFNAME"] = name
    out[SIGNALS_ENV] = args.signals_to_handle
    return out
