"""The ``dlrover`` command line: ``dlrover run`` (torchrun-compatible), ``dlrover submit``,
``status``, ``logs``, ``cancel``, ``plot``, ``dlrover checkpoint ls|inspect|export``,
``dlrover plugins`` and ``dlrover doctor``."""

from __future__ import annotations

import json
import os
import re
import runpy
import socket
import sys
from pathlib import Path
from time import gmtime, strftime
from typing import Any

import attrs
import click
import psutil
from rich.console import Console
from rich.table import Table

from dlrover_core import env, jobplot, plugin_docs
from dlrover_core.checkpoint import export as checkpoint_export
from dlrover_core.doctor import diagnose
from dlrover_core.errors import DLRoverError
from dlrover_core.hostrun import HostPlan, parse_endpoint, run_host
from dlrover_core.job import Job
from dlrover_core.logging import json_mode, write_record
from dlrover_core.plugins import get_host
from dlrover_core.protocol.result import NO_STEPS_NOTE, format_exit_codes
from dlrover_core.protocol.state import JobState
from dlrover_core.runner import (
    check_checkpoint_storage,
    check_worker_placement,
    exit_code,
    find_job,
    log_record,
    progress_fields,
    progress_line,
)
from dlrover_core.signals import DEFAULT_STOP_SIGNALS, SIGNALS_ENV, parse_signals
from dlrover_core.spec import NUMA_MODES, Checkpoint, Failure, Nodes, auto_heartbeat
from dlrover_core.stoplatch import StopLatch, process_latch
from dlrover_core.validation import validate_job

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dlrover-core", prog_name="dlrover")
def main() -> None:
    """Self-healing distributed PyTorch training."""


# ----- dlrover run -----------------------------------------------------------------------


def _job_name(script: str) -> str:
    stem = Path(script).stem if script.endswith(".py") else script.split(":")[0].rsplit(".", 1)[-1]
    name = re.sub(r"[^a-z0-9-]+", "-", stem.lower()).strip("-")[:40].strip("-")
    return name or "job"


#: ``dlrover run`` refuses, without ``--force``, to start more cpu workers on this machine
#: than this many per CPU core: past it each worker gets a sliver of a core, steps crawl and
#: gloo's collectives time out, which reads as a hang rather than as the typo it usually is.
MAX_CPU_WORKERS_PER_CORE = 4


def _ensure_log_dir(log_dir: str, flag: str) -> None:
    """Create ``log_dir`` (the run's logs go below it), or stop with one line naming ``flag``."""
    try:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = exc.strerror or str(exc)
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != log_dir else ""
        raise click.ClickException(f"cannot create the log directory {log_dir!r}{where}: {why}; "
                                   f"pass {flag} with a directory you can write to") from None


def _check_worker_count(nodes: Any, accelerator: str, scheduler: str, force: bool) -> None:
    """Refuse (unless ``force``) far more cpu workers than this machine has cores.

    Only the local scheduler puts every node's workers on this machine, so only it is
    checked: ``nproc_per_node * nodes.max`` workers against ``MAX_CPU_WORKERS_PER_CORE``
    times ``os.cpu_count()``. Other accelerators are bounded by their device count.
    """
    nproc = nodes.nproc_per_node
    cores = os.cpu_count() or 1
    if force or scheduler != "local" or nproc == "auto" or nproc * nodes.max <= MAX_CPU_WORKERS_PER_CORE * cores:
        return
    if accelerator != "cpu":  # probe only when the count is suspicious: "auto" may be a GPU here
        if get_host().create_accelerator(accelerator).name != "cpu":
            return
    total = nproc * nodes.max
    limit = MAX_CPU_WORKERS_PER_CORE * cores
    on_nodes = f" ({nproc} per node x {nodes.max} nodes, all on this machine)" if nodes.max > 1 else ""
    raise click.UsageError(
        f"--nproc-per-node {nproc} starts {total} cpu workers{on_nodes}, more than {MAX_CPU_WORKERS_PER_CORE} per "
        f"core of this machine's {cores} cores ({limit}): each would get a sliver of a core and the collectives "
        f"time out. Use --nproc-per-node {max(1, limit // nodes.max)} or fewer ('auto': half the cores), or pass "
        "--force to start them anyway."
    )


def _rdzv_conf(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise click.BadParameter(f"{part!r} is not KEY=VALUE", param_hint="--rdzv-conf")
        out[key.strip()] = value.strip()
    return out


#: torchrun flags (``torch.distributed.run``) that ``dlrover run`` does not take, each with why
#: and what to do instead. Every other torchrun flag is accepted with torchrun's meaning
#: (differences: ``docs/torchrun.md``).
_REJECTED = {
    "--logs-specs": "dlrover writes each rank's output to <log-dir>/<job id>/node_<n>/rank_<r>.log itself; "
                    "torchrun LogsSpecs plugins are not loaded",
    "--duplicate-stdout-filters": "not supported: every rank's output is already in its rank_<r>.log",
    "--duplicate-stderr-filters": "not supported: every rank's output is already in its rank_<r>.log",
}

_RDZV_CONF_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "timeout", "read_timeout", "is_host",
                   "keep_alive_interval", "keep_alive_max_attempt", "heartbeat")


def _std_ranks(value: str, flag: str) -> dict[int, int] | int:
    """torchrun's ``Std`` syntax for -r/-t: ``N`` (every local rank) or ``RANK:N,...``."""
    try:
        if ":" not in value:
            return int(value)
        return {int(k): int(v) for k, v in (part.split(":") for part in value.split(","))}
    except ValueError:
        raise click.BadParameter(f"{value!r}: give 0-3 or LOCAL_RANK:0-3,... (as torchrun)", param_hint=flag) from None


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
            raise click.BadParameter("a comma-separated list of integers, e.g. 0,1,2",
                                     param_hint="--local-ranks-filter") from None
    return None if shown == set(range(nproc)) else ",".join(str(r) for r in sorted(shown))


def _nproc(value: str, accelerator: str) -> int | str:
    """torchrun's ``--nproc-per-node``: an integer, ``cpu`` (this machine's cores), ``gpu``
    (one per device) or ``auto`` (one per device; on cpu, dlrover's default)."""
    if value == "cpu":  # the cores this process may run on, as torchrun counts them (taskset, cpusets)
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if value in ("auto", "gpu", "xpu"):
        return "auto"
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r}: an integer, auto, cpu, gpu or xpu", param_hint="--nproc-per-node") from None
    if n < 1:
        raise click.BadParameter("at least 1", param_hint="--nproc-per-node")
    return n


def _interface_of(address: str) -> str | None:
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    short_help="Run a training script on this host, like torchrun (one agent per host).",
)
@click.option("--nnodes", default="1:1", show_default=True, envvar="PET_NNODES",
              help="Hosts (nodes) of the job as N or MIN:MAX (elastic); run dlrover run on each.")
@click.option("--nproc-per-node", "--nproc_per_node", "nproc_per_node", default="1", show_default=True,
              envvar="PET_NPROC_PER_NODE", help="Workers on this host: N, auto (one per device; cpu: half the "
                                                "cores), cpu (one per core) or gpu.")
@click.option("--rdzv-backend", "--rdzv_backend", "rdzv_backend", default="static", show_default=True,
              envvar="PET_RDZV_BACKEND", help="static (--master-addr/--master-port, --node-rank) or c10d "
                                              "(--rdzv-endpoint); both are served by the job master.")
@click.option("--rdzv-endpoint", "--rdzv_endpoint", "rdzv_endpoint", default="", envvar="PET_RDZV_ENDPOINT",
              help="HOST[:PORT] (port 29400) where the job master runs; the first dlrover run on that host starts it.")
@click.option("--rdzv-id", "--rdzv_id", "rdzv_id", default="none", show_default=True, envvar="PET_RDZV_ID",
              help="The job's id, the same on every host.")
@click.option("--rdzv-conf", "--rdzv_conf", "rdzv_conf", default="", envvar="PET_RDZV_CONF",
              help="KEY=VALUE,...: join_timeout, last_call_timeout, keep_alive_interval, keep_alive_max_attempt, "
                   "is_host (and torch's close_timeout, timeout, read_timeout, accepted).")
@click.option("--standalone", is_flag=True, envvar="PET_STANDALONE",
              help="One host: the job master on a free local port (ignores --rdzv-* flags).")
@click.option("--max-restarts", "--max_restarts", "max_restarts", type=int, default=3, show_default=True,
              envvar="PET_MAX_RESTARTS", help="Job-wide budget of recoveries (all hosts together).")
@click.option("--monitor-interval", "--monitor_interval", "monitor_interval", type=float, default=None,
              envvar="PET_MONITOR_INTERVAL", help="Seconds between the agent's heartbeats (default: the product's).")
@click.option("--start-method", "--start_method", "start_method", default="spawn", show_default=True,
              type=click.Choice(["spawn", "fork", "forkserver"]), envvar="PET_START_METHOD",
              help="Accepted: a script always starts in a fresh interpreter (as torchrun's scripts do).")
@click.option("--event-log-handler", "--event_log_handler", "event_log_handler", default="null", show_default=True,
              envvar="PET_EVENT_LOG_HANDLER", help="Only 'null': dlrover's events go to <run dir>/events.jsonl.")
@click.option("--role", default="default", show_default=True, envvar="PET_ROLE", help="The workers' ROLE_NAME.")
@click.option("-m", "--module", "module", is_flag=True, envvar="PET_MODULE",
              help="Run the entrypoint as a module (python -m).")
@click.option("--no-python", "--no_python", "no_python", is_flag=True, envvar="PET_NO_PYTHON",
              help="Run the entrypoint as an executable, without python.")
@click.option("--run-path", "--run_path", "run_path", is_flag=True, envvar="PET_RUN_PATH",
              help="Accepted: the script runs as __main__ (in a fresh interpreter per worker).")
@click.option("--log-dir", "--log_dir", "log_dir", default="dlrover-runs", show_default=True, envvar="PET_LOG_DIR",
              help="Base directory of the run's logs: <log-dir>/<job id>/.")
@click.option("-r", "--redirects", default="0", show_default=True, envvar="PET_REDIRECTS",
              help="Keep these local ranks' output off the console (N or RANK:N,...; it is in rank_<r>.log).")
@click.option("-t", "--tee", default="0", show_default=True, envvar="PET_TEE",
              help="Accepted: every rank's output is always written to rank_<r>.log and shown.")
@click.option("--local-ranks-filter", "--local_ranks_filter", "local_ranks_filter", default="",
              envvar="PET_LOCAL_RANKS_FILTER", help="Only show these local ranks' output on the console (e.g. 0,1).")
@click.option("--node-rank", "--node_rank", "node_rank", type=int, default=None, envvar="PET_NODE_RANK",
              help="This host's node rank (static backend; c10d assigns one).")
@click.option("--master-addr", "--master_addr", "master_addr", default="127.0.0.1", show_default=True,
              envvar="PET_MASTER_ADDR", help="Static backend: the host that runs the job master (rank 0's).")
@click.option("--master-port", "--master_port", "master_port", type=int, default=None, envvar="PET_MASTER_PORT",
              help="Static backend: the job master's port (29500; a free one with one node).")
@click.option("--local-addr", "--local_addr", "local_addr", default=None, envvar="PET_LOCAL_ADDR",
              help="This host's address: workers' collectives use its interface (GLOO_SOCKET_IFNAME).")
@click.option("--signals-to-handle", "--signals_to_handle", "signals_to_handle", default=DEFAULT_STOP_SIGNALS,
              show_default=True, envvar="PET_SIGNALS_TO_HANDLE",
              help="Signals forwarded to the agent, which stops the workers gracefully.")
@click.option("--shutdown-timeout", "--shutdown_timeout", "shutdown_timeout", type=float, default=None,
              envvar="PET_SHUTDOWN_TIMEOUT", help="Seconds workers get to exit after SIGTERM (Failure.stop_grace_s; "
                                                  "unset: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 10).")
@click.option("--logs-specs", "--logs_specs", "logs_specs", default=None, hidden=True)
@click.option("--numa-binding", "--numa_binding", "numa_binding", default=None, type=click.Choice(NUMA_MODES),
              help="Bind each worker to the CPUs near its device (the one of its local rank): node, socket, "
                   "exclusive or core-complex (torch's modes). Needs devices with a NUMA node (cuda).")
@click.option("--virtual-local-rank", "--virtual_local_rank", "virtual_local_rank", is_flag=True,
              envvar="PET_VIRTUAL_LOCAL_RANK",
              help="Every worker sees LOCAL_RANK=0 and only its own device (CUDA_VISIBLE_DEVICES narrowed).")
@click.option("--duplicate-stdout-filters", "--duplicate_stdout_filters", "duplicate_stdout_filters", default=None,
              hidden=True, envvar="PET_DUPLICATE_STDOUT_FILTERS")
@click.option("--duplicate-stderr-filters", "--duplicate_stderr_filters", "duplicate_stderr_filters", default=None,
              hidden=True, envvar="PET_DUPLICATE_STDERR_FILTERS")
@click.option("--simulate-nodes", default=None, metavar="N|MIN:MAX",
              help="dlrover's own: run N simulated nodes, each an agent with --nproc-per-node workers, all on this "
                   "machine (the local scheduler).")
@click.option("--accelerator", default="auto", show_default=True, help="cpu, cuda, ascend, ppu or auto.")
@click.option("--checkpoint-dir", default="checkpoints", show_default=True,
              help="Where train.Checkpointer saves (shared by every host).")
@click.option("--node-unit", "--node_unit", "node_unit", type=int, default=1, show_default=True,
              help="Node count of a round is a multiple of this.")
@click.option("--run-id", "--run_id", "run_id", default=None, hidden=True)
@click.option("--dryrun", is_flag=True, help="With --simulate-nodes: print the plan and exit.")
@click.option("--progress/--no-progress", "progress", default=None,
              help="dlrover's own: the job's progress line on the job master's host. Default: live on a terminal "
                   "only; --progress: also plain progress lines (JSON records with DLROVER_LOG_FORMAT=json) "
                   "when stdout is not a terminal.")
@click.option("--force", is_flag=True,
              help=f"Start more than {MAX_CPU_WORKERS_PER_CORE} cpu workers per core of this machine anyway.")
@click.argument("entrypoint")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(nnodes, nproc_per_node, rdzv_backend, rdzv_endpoint, rdzv_id, rdzv_conf, standalone, max_restarts,
        monitor_interval, start_method, event_log_handler, role, module, no_python, run_path, log_dir, redirects, tee,
        local_ranks_filter, node_rank, master_addr, master_port, local_addr, signals_to_handle, shutdown_timeout,
        logs_specs, numa_binding, virtual_local_rank, duplicate_stdout_filters, duplicate_stderr_filters,
        simulate_nodes, accelerator, checkpoint_dir, node_unit, run_id, dryrun, progress, force, entrypoint, args):
    """Run ENTRYPOINT (a script, or a module with -m) with ARGS: one agent on this host.

    \b
    One host:    dlrover run --nproc-per-node 2 train.py --lr 1e-3
    Each host:   dlrover run --nnodes 2:3 --nproc-per-node 2 --rdzv-backend c10d \\
                   --rdzv-endpoint node0:29400 --rdzv-id job1 train.py
    Static:      dlrover run --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 train.py

    torchrun's flags mean what they mean there (docs/torchrun.md lists the differences);
    --simulate-nodes runs several agents on this machine instead.
    """
    given = {"--logs-specs": logs_specs, "--duplicate-stdout-filters": duplicate_stdout_filters,
             "--duplicate-stderr-filters": duplicate_stderr_filters}
    for flag, value in given.items():
        if value:
            raise click.UsageError(f"{flag} is not supported: {_REJECTED[flag]}")
    if event_log_handler != "null":
        raise click.UsageError(f"--event-log-handler {event_log_handler!r} is not supported: dlrover writes its "
                               "events to <log-dir>/<job id>/events.jsonl (only 'null' is accepted)")
    if rdzv_backend not in ("static", "c10d", "dlrover"):
        raise click.UsageError(f"--rdzv-backend {rdzv_backend!r} is not supported: the job master serves the "
                               "rendezvous; use c10d (with --rdzv-endpoint) or static")
    if module and no_python:
        raise click.UsageError("--module and --no-python cannot be used together (as in torchrun)")
    conf = _rdzv_conf(rdzv_conf)
    unknown = sorted(set(conf) - set(_RDZV_CONF_KEYS))
    if unknown:
        raise click.BadParameter(f"unknown keys {unknown}; known: {', '.join(_RDZV_CONF_KEYS)}", param_hint="--rdzv-conf")
    try:
        if module and entrypoint.endswith(".py"):
            raise click.BadParameter("with -m give a module name, not a file", param_hint="ENTRYPOINT")
        if simulate_nodes is not None:
            if nnodes not in ("1", "1:1") or rdzv_endpoint or node_rank is not None:
                raise click.UsageError("--simulate-nodes runs every node on this machine: leave out --nnodes, "
                                       "--rdzv-endpoint and --node-rank")
            nodes = Nodes.parse(simulate_nodes)
        else:
            nodes = Nodes.parse(nnodes)
        nproc = _nproc(nproc_per_node, accelerator)
        nodes = Nodes(min=nodes.min, max=nodes.max, node_unit=node_unit, nproc_per_node=nproc,
                      last_call_s=float(conf.get("last_call_timeout", nodes.last_call_s)),
                      join_timeout_s=float(conf.get("join_timeout", nodes.join_timeout_s)),
                      numa_binding=numa_binding, virtual_local_rank=virtual_local_rank)
        failure = _failure(max_restarts, monitor_interval, conf, shutdown_timeout, nodes=nodes.max)
        job_env = {} if role == "default" else {"ROLE_NAME": role}
        job = Job(name=_job_name(run_id or (rdzv_id if rdzv_id != "none" else entrypoint)), entrypoint=entrypoint,
                  args=list(args), nodes=nodes, accelerator=accelerator, checkpoint=Checkpoint(dir=_local_path(checkpoint_dir)),
                  failure=failure, log_dir=_local_path(log_dir), env=job_env, workdir=os.getcwd())
        latch = process_latch()  # armed at this process's first instruction (dlrover_core.stoplatch)
        if latch is not None:
            latch.handle_only(_signals(signals_to_handle))
        if simulate_nodes is not None:
            _check_worker_count(nodes, accelerator, "local", force)
            _agent_environment(nproc, redirects, tee, local_ranks_filter, no_python, local_addr)
            os.environ[SIGNALS_ENV] = signals_to_handle
            if dryrun:
                click.echo(str(job.dryrun()))
                _exit_if_stopped(latch)
                return
            _ensure_log_dir(log_dir, "--log-dir")
            job_run = job.submit()  # Job.run(): submit, then wait (which cancels the job on a stop signal)
            result = job_run.wait()
            sys.exit(exit_code(result, job_run.stop_signal))
        _check_worker_count(attrs.evolve(nodes, min=1, max=1), accelerator, "local", force)
        plan = _host_plan(job, nodes=nodes, standalone=standalone, rdzv_backend=rdzv_backend,
                          rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, node_rank=node_rank, master_addr=master_addr,
                          master_port=master_port, is_host=conf.get("is_host"))
        _agent_environment(nproc, redirects, tee, local_ranks_filter, no_python, local_addr)
        signals = _signals(signals_to_handle)
        os.environ[SIGNALS_ENV] = signals_to_handle  # as torchrun: its workers inherit it
        if dryrun:
            node = "assigned by the job master" if plan.node_rank is None else str(plan.node_rank)
            click.echo(f"# this host: one agent, node {node}; the job master at {plan.endpoint} "
                       f"({'started here' if plan.standalone else 'started by the first dlrover run on that host'})")
            click.echo(str(attrs.evolve(job, nodes=attrs.evolve(nodes, min=1, max=1)).dryrun()))
            _exit_if_stopped(latch)
            return
        _ensure_log_dir(log_dir, "--log-dir")
        code = run_host(plan, signals=signals, latch=latch, progress=progress,
                        preflight=lambda: (validate_job(job), check_checkpoint_storage(job), check_worker_placement(job)))
    except (DLRoverError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(code)


def _exit_if_stopped(latch: StopLatch | None) -> None:
    """Exit 128+N when a stop signal N came during a dry run (nothing was started)."""
    if latch is not None and latch.signum is not None:
        sys.exit(128 + latch.signum)


def _local_path(path: str) -> str:
    """``path`` made absolute against this directory (a URL such as ``s3://...`` stays): the
    master, the agent and the workers resolve it alike whatever their working directory."""
    return path if "://" in path else str(Path(path).resolve())


def _failure(max_restarts: int, monitor_interval: float | None, conf: dict[str, str],
             shutdown_timeout: float | None, *, nodes: int) -> Failure:
    if max_restarts < 0:
        raise click.BadParameter("at least 0", param_hint="--max-restarts")
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
    if shutdown_timeout is None and os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):  # as torchrun reads it
        try:
            shutdown_timeout = float(os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
        except ValueError:
            raise click.BadParameter(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={os.environ['TORCH_ELASTIC_SHUTDOWN_TIMEOUT']!r}"
                                     " is not a number of seconds", param_hint="--shutdown-timeout") from None
    if shutdown_timeout is not None:
        fields["stop_grace_s"] = shutdown_timeout
    return Failure(**fields)


def _host_plan(job: Any, *, nodes: Any, standalone: bool, rdzv_backend: str, rdzv_endpoint: str, rdzv_id: str,
               node_rank: int | None, master_addr: str, master_port: int | None, is_host: str | None) -> HostPlan:
    """Where this host's agent finds the job master, following torchrun's rules."""
    rdzv_id = "" if rdzv_id == "none" else rdzv_id
    if standalone or (nodes.max == 1 and not rdzv_endpoint and master_port is None):
        if nodes.max > 1:
            raise click.UsageError("--standalone runs one host: give --nnodes 1 (or leave it out)")
        port = _free_port()
        return HostPlan(job=job, endpoint=f"127.0.0.1:{port}", rdzv_id=rdzv_id, node_rank=0, standalone=True,
                        log_dir=job.log_dir)
    if rdzv_backend == "static" and not rdzv_endpoint:
        if nodes.min != nodes.max:
            raise click.UsageError("--rdzv-backend static needs a fixed --nnodes N; use --rdzv-backend c10d with "
                                   "--rdzv-endpoint for MIN:MAX")
        if node_rank is None and nodes.max > 1:
            raise click.UsageError("--rdzv-backend static needs --node-rank on every host (0 on the one given by "
                                   "--master-addr); or use --rdzv-backend c10d --rdzv-endpoint HOST:PORT")
        endpoint = f"{master_addr}:{master_port or 29500}"
        rank = node_rank or 0
    else:
        if not rdzv_endpoint:
            raise click.UsageError("--rdzv-endpoint HOST[:PORT] is required with more than one node: the host "
                                   "where the job master runs")
        endpoint = rdzv_endpoint
        rank = node_rank if rdzv_backend == "static" else None
    if is_host is not None and is_host.lower() in ("0", "false", "no"):
        raise click.UsageError("--rdzv-conf is_host=false is not supported: the first dlrover run on the "
                               "endpoint's host starts the job master")
    parse_endpoint(endpoint)  # a clear error for a malformed one, now
    return HostPlan(job=job, endpoint=endpoint, rdzv_id=rdzv_id, node_rank=rank, log_dir=job.log_dir)


def _agent_environment(nproc: int | str, redirects: str, tee: str, local_ranks_filter: str, no_python: bool,
                       local_addr: str | None) -> None:
    """Settings the agent reads from its environment (this process's, which it inherits)."""
    _std_ranks(tee, "--tee")
    if nproc != "auto":
        ranks = _console_ranks(int(nproc), redirects, local_ranks_filter)
        if ranks is not None:
            os.environ[env.CONSOLE_LOCAL_RANKS] = ranks
    elif redirects != "0" or local_ranks_filter:
        raise click.UsageError("--redirects and --local-ranks-filter need a number for --nproc-per-node")
    if no_python:
        os.environ[env.WORKER_EXEC] = "1"
    if local_addr and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = _interface_of(local_addr)
        if interface is None:
            raise click.BadParameter(f"{local_addr} is not an address of this host", param_hint="--local-addr")
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def _signals(text: str) -> tuple[int, ...]:
    try:
        return parse_signals(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--signals-to-handle") from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----- dlrover status ------------------------------------------------------------------------


def _load_job(path: str) -> Any:
    """The ``Job`` a Python file defines: its ``job`` variable, or its only ``Job`` object."""
    try:
        namespace = runpy.run_path(path, run_name="__dlrover_submit__")
    except FileNotFoundError:
        raise click.ClickException(f"no such file: {path}") from None
    if isinstance(namespace.get("job"), Job):
        return namespace["job"]
    jobs = [v for k, v in namespace.items() if isinstance(v, Job) and not k.startswith("_")]
    if len(jobs) != 1:
        raise click.ClickException(f"{path} must define `job = Job(...)` (found {len(jobs)} Job objects)")
    return jobs[0]


@main.command()
@click.argument("job_file", metavar="JOB_FILE")
@click.option("--scheduler", default=None, help="Run on this scheduler backend instead of the Job's.")
@click.option("--wait/--detach", default=False, show_default=True, help="Wait for the job, showing its logs.")
@click.option("--dryrun", is_flag=True, help="Print the native request (processes, sbatch script, manifests) and exit.")
def submit(job_file: str, scheduler: str | None, wait: bool, dryrun: bool) -> None:
    """Submit the Job that JOB_FILE defines (`job = Job(...)`) to its scheduler backend."""
    job = _load_job(job_file)
    try:
        if scheduler is not None:
            job = attrs.evolve(job, scheduler=scheduler)  # validated like any field
        if dryrun:
            click.echo(str(job.dryrun()))
            return
        _ensure_log_dir(job.log_dir, f"a Job(log_dir=...) in {job_file}")
        run = job.submit(detach=not wait)
    except DLRoverError as exc:
        raise click.ClickException(str(exc)) from exc
    log_root = str(Path(run.handle.log_dir).parent)
    click.echo(f"submitted {run.handle} (logs in {run.handle.log_dir})")
    click.echo(f"  dlrover status {run.job_id} --log-dir {log_root}")
    click.echo(f"  dlrover logs {run.job_id} --log-dir {log_root} --follow")
    click.echo(f"  dlrover cancel {run.job_id} --log-dir {log_root}")
    if wait:
        result = run.wait()  # prints the summary
        sys.exit(exit_code(result, run.stop_signal))  # 0, 1, or 128+N after Ctrl-C (130) / SIGTERM (143)


def _find(job_id: str, log_dir: str) -> Any:
    """The job ``job_id`` under ``log_dir``; ``job_id`` may also be the run directory itself
    (``dlrover-runs/<job id>``, as ``dlrover run`` prints it)."""
    run_dir = Path(job_id)
    if ("/" in job_id or job_id in (".", "..")) and (run_dir / "job.json").is_file():
        run_dir = run_dir.resolve()
        job_id, log_dir = run_dir.name, str(run_dir.parent)
    try:
        return find_job(job_id, log_dir)
    except DLRoverError as exc:
        raise click.ClickException(str(exc)) from exc


@main.command()
@click.argument("job_id")
@click.option("--log-dir", default="dlrover-runs", show_default=True, help="The Job's log_dir.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(job_id: str, log_dir: str, as_json: bool) -> None:
    """Show a job (JOB_ID, or its run directory <log-dir>/<job id>) on any scheduler: the
    progress line (step/total, ETA, samples/s, loss,
    goodput, nodes, restarts), metrics and the goodput timeline; for a job whose script never
    called ``train.report``: what is known (wall time, restarts, worker exit codes) and that
    step and goodput need it. ``--json``: the status's fields, ``progress`` (the line's numbers),
    ``result`` once the job ended, and ``note`` when no step was reported."""
    run = _find(job_id, log_dir)
    st = run.status()
    goodput = st.goodput
    run_dir = Path(run.handle.log_dir)
    if not goodput and (run_dir / "goodput.json").exists():
        goodput = json.loads((run_dir / "goodput.json").read_text())
    result = run.backend.result(run.handle) if st.state.is_terminal else None
    if result is not None:  # an ended job's status (read from its result) lacks what only the result has
        st = attrs.evolve(st, total_steps=st.total_steps if st.total_steps is not None else result.total_steps,
                          elapsed_s=st.elapsed_s if st.elapsed_s is not None else result.wall_time_s,
                          goodput=st.goodput or goodput or {"goodput": result.goodput})
    reported = st.step >= 0 or (result is not None and result.steps_reported)
    if as_json:
        data = {**attrs.asdict(st), "state": st.state.value, "scheduler": run.handle.scheduler,
                "native_id": run.handle.native_id, "goodput": goodput, "progress": progress_fields(st)}
        if result is not None:
            data["result"] = result.to_dict()
        if not reported:
            data["note"] = NO_STEPS_NOTE
        click.echo(json.dumps(data, indent=2, default=str))
        return
    console = Console(highlight=False)
    console.print(f"job {run.job_id} ({run.handle}): [b]{st.state.value}[/b]" + (f" — {st.message}" if st.message else ""))
    round_text = f" | round {st.round}" if st.round >= 0 else ""
    console.print(f"  {progress_line(st)}{round_text}", markup=False, soft_wrap=True)
    if st.metrics:
        console.print("  metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(st.metrics.items())), markup=False)
    root = st.root_cause or (result.root_cause if result is not None else None)
    if root is not None:
        console.print("  root cause of the " + ("failure" if st.state == JobState.FAILED else "newest failure")
                      + " (first observed failure):", markup=False)
        for line in root.root_cause_lines(traceback_lines=15):
            console.print(f"    {line}", markup=False, soft_wrap=True)
    if not reported:
        if result is not None and result.worker_exit_codes:
            console.print(f"  worker exit codes: {format_exit_codes(result.worker_exit_codes)}", markup=False)
        note = NO_STEPS_NOTE if st.state.is_terminal else "no step reported yet: " + NO_STEPS_NOTE.split(": ", 1)[1]
        console.print(f"  {note}", markup=False, soft_wrap=True)
    if goodput:
        table = Table(title="goodput timeline (seconds)", title_justify="left")
        table.add_column("phase")
        table.add_column("s", justify="right")
        for key, value in goodput.items():
            if not reported and key in ("goodput", "productive_s"):
                continue  # not measured: no step was reported
            table.add_row(key.removesuffix("_s"), f"{value:.3f}" if key != "goodput" else f"{value:.1%}")
        console.print(table)


@main.command()
@click.argument("job_id")
@click.option("--log-dir", default="dlrover-runs", show_default=True, help="The Job's log_dir.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job ends.")
def logs(job_id: str, log_dir: str, follow: bool) -> None:
    """Print a job's logs (each line prefixed by its node and rank; with
    DLROVER_LOG_FORMAT=json, one JSON object a line with ``node``/``rank`` fields)."""
    run = _find(job_id, log_dir)
    as_json = json_mode()
    try:
        for line in run.logs(follow=follow):
            if as_json:
                write_record(log_record(line))
            else:
                click.echo(line)
    except KeyboardInterrupt:
        pass


@main.command()
@click.argument("job_id")
@click.option("--log-dir", default="dlrover-runs", show_default=True, help="The Job's log_dir.")
def cancel(job_id: str, log_dir: str) -> None:
    """Stop a job and remove everything it started (idempotent)."""
    run = _find(job_id, log_dir)
    run.cancel()
    click.echo(f"cancelled {run.handle}: {run.status().state.value}")


# ----- dlrover plugins -----------------------------------------------------------------------


@main.group()
def plugins() -> None:
    """Installed plugins and what they register."""


@plugins.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plugins_list(as_json: bool) -> None:
    """List plugins: name, distribution, version, hooks, backends registered, errors; and
    each scheduler's options (name, type, default, environment fallback, help)."""
    host = get_host()
    schedulers = host.registries.scheduler
    infos = [i.to_dict() for i in host.plugins.values()]
    for info in infos:
        info["scheduler_options"] = {name: [o.describe() for o in schedulers.get(name).options]
                                     for name in info["backends"].get("scheduler", [])}
    if as_json:
        click.echo(json.dumps(infos, indent=2))
        return
    table = Table(title="dlrover plugins")
    for col in ("name", "distribution", "version", "hooks", "backends", "errors"):
        table.add_column(col, overflow="fold")
    for i in infos:
        backends = "; ".join(f"{k}: {', '.join(v)}" for k, v in i["backends"].items())
        hooks = ", ".join(h.removeprefix("dlrover_") for h in i["hooks"])
        table.add_row(i["name"], i["distribution"] or "", i["version"] or "", hooks, backends,
                      "\n".join(i["errors"]), style="red" if i["errors"] else None)
    console = Console(width=max(Console().width, 120))
    console.print(table)
    options = Table(title="scheduler options: Job(scheduler_options={name: value}); the variable is the fallback")
    for col in ("scheduler", "option", "type", "default", "variable", "help"):
        options.add_column(col, overflow="fold")
    for name in schedulers.names():
        declared = schedulers.get(name).options
        if not declared:
            options.add_row(name, "(none)", "", "", "", "", style="dim")
        for o in declared:
            d = o.describe()
            options.add_row(name, d["name"], d["type"], json.dumps(d["default"]), d["env"] or "", d["help"])
    console.print(options)


@plugins.command("hooks")
@click.option("--update", "update", metavar="FILE", default=None,
              help="Rewrite the generated part of FILE (between its hooks:begin/hooks:end markers) instead of printing.")
def plugins_hooks(update: str | None) -> None:
    """Print the hook reference for plugin authors as Markdown (from the hook specs' docstrings)."""
    if update is None:
        click.echo(plugin_docs.hook_reference(), nl=False)
        return
    try:
        changed = plugin_docs.update_file(update)
    except (OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{update}: {'updated' if changed else 'already up to date'}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def doctor(as_json: bool) -> None:
    """Probe every installed accelerator: what was found, what was not and why, and which
    one accelerator="auto" picks."""
    diagnosis = diagnose()
    if as_json:
        click.echo(json.dumps(diagnosis.to_dict(), indent=2))
        return
    table = Table(title="dlrover doctor: accelerators (highest priority first)")
    for col in ("accelerator", "package", "devices", "model, memory, versions", "health", "why not available"):
        table.add_column(col, overflow="fold")
    for p in diagnosis.probes:
        r = p.report
        if r.present:
            detail = ", ".join(x for x in (r.model, f"{r.memory_mb} MiB" if r.memory_mb else None,
                                           f"driver {r.driver_version}" if r.driver_version else None,
                                           f"runtime {r.runtime_version}" if r.runtime_version else None) if x)
            health = " ".join("ok" if h else "UNHEALTHY" for h in r.healthy)
            table.add_row(p.name, p.distribution or "built in", str(r.count), detail, health, "")
        else:
            table.add_row(p.name, p.distribution or "built in", "0", "", "", r.reason or "", style="dim")
    for name, package in sorted(diagnosis.not_installed.items()):
        table.add_row(name, "", "", "", "", f"not installed: pip install {package}", style="dim")
    console = Console(width=max(Console().width, 120))
    console.print(table)
    console.print(diagnosis.summary())


# ----- dlrover plot --------------------------------------------------------------------------


@main.command()
@click.argument("job_id")
@click.option("-o", "--output", default=None, metavar="PATH",
              help="The image to write (PNG)  [default: <log-dir>/<JOB_ID>/job.png]")
@click.option("--log-dir", default="dlrover-runs", show_default=True, help="The Job's log_dir.")
@click.option("--metric", default="loss", show_default=True, help="Which metric of rank 0's report() to draw.")
def plot(job_id: str, output: str | None, log_dir: str, metric: str) -> None:
    """Draw a job from the files it left: rank 0's step over wall time with each failure,
    detection, recovery and checkpoint commit marked, the world size, the metric (loss), the
    lost time shaded, and where the wall time went (goodput). Needs matplotlib:
    pip install 'dlrover-core[plot]'."""
    try:
        run_dir = jobplot.find_job_dir(job_id, log_dir)
        summary = jobplot.render(jobplot.read_job(run_dir, metric=metric), output or run_dir / "job.png")
    except jobplot.JobPlotError as exc:
        raise click.ClickException(str(exc)) from None
    marks = summary.markers
    click.echo(f"wrote {summary.path}: {summary.steps} steps, {marks['failure']} failure(s), "
               f"{marks['recovery']} recovery(ies), {marks['commit']} commit(s)")


# ----- dlrover checkpoint ls|inspect|export ---------------------------------------------------


@main.group()
def checkpoint() -> None:
    """Read a checkpoint directory without a job: list its committed steps, inspect one,
    export one to files plain torch loads (docs/checkpoint-format.md)."""


_storage_option = click.option("--storage", "storage_name", default="posix", show_default=True,
                               help="The registered storage the directory is on (Job.checkpoint.storage).")


def _open_storage(directory: str, storage_name: str) -> Any:
    """The storage backend ``storage_name`` at ``directory``; a missing local directory is an error."""
    if storage_name == "posix" and not Path(directory).expanduser().is_dir():
        raise click.ClickException(f"no such checkpoint directory: {directory!r} (the job's checkpoint.dir)")
    try:
        return get_host().registries.storage.get(storage_name)(directory)
    except DLRoverError as exc:
        raise click.ClickException(str(exc)) from None


def _size(n: int) -> str:
    if n < 0:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _when(t: float | None) -> str:
    return "" if t is None else strftime("%Y-%m-%d %H:%M:%S", gmtime(t))


@checkpoint.command("ls")
@click.argument("directory", metavar="DIR")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--no-verify", is_flag=True, help="Do not read the shards to check their CRC32 (only that they exist).")
@_storage_option
def checkpoint_ls(directory: str, as_json: bool, no_verify: bool, storage_name: str) -> None:
    """List the committed steps of DIR: world size, shards, bytes, commit time (UTC), and
    whether every shard is intact (header, size, CRC32 against the commit). Exits 1 when a
    step is damaged."""
    storage = _open_storage(directory, storage_name)
    try:
        steps = checkpoint_export.list_steps(storage, verify=not no_verify)
    except DLRoverError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps([s.to_dict() for s in steps], indent=1))
    elif not steps:
        click.echo(f"{directory}: no committed step")
    else:
        table = Table(title=f"committed steps in {directory}")
        for col in ("step", "world size", "shards", "bytes", "committed (UTC)", "round", "status"):
            table.add_column(col, justify="right" if col in ("step", "world size", "shards", "bytes", "round") else None,
                             overflow="fold")
        for s in steps:
            crc = "CRC ok" if all(sh.crc32 is not None for sh in s.shards) else "no CRC recorded"
            status = ("ok, " + (crc if not no_verify else "not verified")) if s.valid else "; ".join(
                sh.error for sh in s.shards if not sh.ok)
            table.add_row(f"{s.step}{' (latest)' if s.latest else ''}", str(s.world_size),
                          f"{sum(sh.ok for sh in s.shards)}/{s.world_size}", _size(s.bytes), _when(s.time),
                          "" if s.round is None else str(s.round), status, style=None if s.valid else "red")
        Console(width=max(Console().width, 120)).print(table)
    if any(not s.valid for s in steps):
        sys.exit(1)


@checkpoint.command("inspect")
@click.argument("directory", metavar="DIR")
@click.option("--step", type=int, default=None, help="A committed step (default: the newest).")
@click.option("--rank", type=int, default=0, show_default=True, help="Whose shard (entries that differ per rank).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_storage_option
def checkpoint_inspect(directory: str, step: int | None, rank: int, as_json: bool, storage_name: str) -> None:
    """Show what a committed step holds: each entry of the saved state (a model's tensors
    with shape, dtype and bytes; an optimizer's parameter count, per-parameter state and
    param_groups; other values), and the step's metadata."""
    storage = _open_storage(directory, storage_name)
    try:
        info = checkpoint_export.describe(checkpoint_export.read_step(storage, step, rank=rank))
    except DLRoverError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(info, indent=1))
        return
    meta = info["metadata"]
    console = Console(width=max(Console().width, 120))
    console.print(f"step {info['step']}  world size {info['world_size']}  rank {info['rank']}  "
                  f"format {meta['format']}  round {meta['round']}  committed {_when(meta['time'])} UTC")
    console.print(f"files: {', '.join(meta['files'].values())}")
    if meta["dtensors"]:
        console.print(f"DTensor shards assembled from every rank: {len(meta['dtensors'])}")
    for e in info["entries"]:
        what = {"model": f"model state_dict, {len(e.get('tensors', {}))} tensors", "optimizer": "optimizer state_dict",
                "other": "other value"}[e["kind"]]
        head = f"[bold]{e['key']}[/bold]: {what}, {_size(e['bytes'])} (exported as {e['export_as']})"
        if e["kind"] == "model":
            console.print(head)
            table = Table()
            for col in ("tensor", "shape", "dtype", "bytes"):
                table.add_column(col, justify="right" if col == "bytes" else None, overflow="fold")
            for name, t in e["tensors"].items():
                table.add_row(name, str(tuple(t["shape"])), t["dtype"], str(t["bytes"]))
            console.print(table)
        elif e["kind"] == "optimizer":
            console.print(head)
            console.print(f"  {e['params']} parameters keyed by {e['keyed_by']}; state per parameter: "
                          f"{', '.join(e['state_keys']) or '(none)'}")
            for i, g in enumerate(e["param_groups"]):
                console.print(f"  param_groups[{i}]: {json.dumps(g)}", markup=False)
        else:
            console.print(head)
            console.print(f"  {json.dumps(e['value'])}", markup=False)
    console.print(f"rng states (not exported): {', '.join(meta['rng']) or '(none)'}")


@checkpoint.command("export")
@click.argument("directory", metavar="DIR")
@click.argument("out", metavar="OUT")
@click.option("--to", "fmt", type=click.Choice(checkpoint_export.FORMATS), required=True,
              help="torch: OUT/<entry>.pt; safetensors: OUT/<entry>.safetensors; dcp: a torch.distributed.checkpoint "
                   "directory.")
@click.option("--step", type=int, default=None, help="A committed step (default: the newest).")
@click.option("--rank", type=int, default=0, show_default=True, help="Whose shard (entries that differ per rank).")
@_storage_option
def checkpoint_export_cmd(directory: str, out: str, fmt: str, step: int | None, rank: int, storage_name: str) -> None:
    """Write a committed step of DIR to OUT (a new or empty directory) as files plain torch
    loads: the model's state_dict (for model.load_state_dict), the optimizer's (for
    optimizer.load_state_dict; for dcp keyed by name, as get_state_dict gives it) and the
    other entries."""
    storage = _open_storage(directory, storage_name)
    try:
        done = checkpoint_export.export_step(storage, out, to=fmt, step=step, rank=rank)
    except DLRoverError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"step {done['step']} -> {done['out']} ({fmt}): {', '.join(done['files'])}")
    for name, why in done["skipped"].items():
        click.echo(f"skipped {name}: {why}", err=True)


if __name__ == "__main__":  # pragma: no cover
    main()
