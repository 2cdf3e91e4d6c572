"""``dlrover run``: the click command that takes torchrun's command line (docs/torchrun.md).

The flags are declared here, as torchrun spells them (both spellings, the ``PET_*`` variable
torchrun reads); what they mean is :mod:`dlrover_core.torchrun`'s, which turns them into the
Job, the host's plan and the agent's environment. This module does what a command does with
them: checks this machine can take the workers (:func:`check_worker_count`), creates the log
directory (:func:`ensure_log_dir`), keeps the stop signals asked for, then runs the job: on
this host, one agent, as torchrun (:func:`~dlrover_core.hostrun.run_host`), or every node on
this machine with ``--simulate-nodes`` (``Job.submit().wait()``); and exits with the job's code
(:func:`~dlrover_core.display.exit_code`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import attrs
import click

from dlrover_core import torchrun
from dlrover_core.display import exit_code
from dlrover_core.errors import DLRoverError
from dlrover_core.hostrun import run_host
from dlrover_core.plugins import get_host
from dlrover_core.runner import check_checkpoint_storage, check_worker_placement
from dlrover_core.signals import DEFAULT_STOP_SIGNALS
from dlrover_core.spec import NUMA_MODES, Nodes
from dlrover_core.stoplatch import StopLatch, process_latch
from dlrover_core.torchrun import TorchrunArgs, TorchrunArgumentError
from dlrover_core.validation import validate_job

__all__ = ["MAX_CPU_WORKERS_PER_CORE", "check_worker_count", "ensure_log_dir", "run"]

#: ``dlrover run`` refuses, without ``--force``, to start more cpu workers on this machine
#: than this many per CPU core: past it each worker gets a sliver of a core, steps crawl and
#: gloo's collectives time out, which reads as a hang rather than as the typo it usually is.
MAX_CPU_WORKERS_PER_CORE = 4


def ensure_log_dir(log_dir: str, flag: str) -> None:
    """Create ``log_dir`` (the run's logs go below it), or stop with one line naming ``flag``
    (how the user sets it: ``--log-dir``, or a Job's ``log_dir`` for ``dlrover submit``).

    Raises:
        click.ClickException: the directory cannot be created (why, and the fix).
    """
    try:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = exc.strerror or str(exc)
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != log_dir else ""
        raise click.ClickException(f"cannot create the log directory {log_dir!r}{where}: {why}; "
                                   f"pass {flag} with a directory you can write to") from None


def check_worker_count(nodes: Nodes, accelerator: str, scheduler: str, force: bool) -> None:
    """Refuse (unless ``force``) far more cpu workers than this machine has cores.

    Only the local scheduler puts every node's workers on this machine, so only it is
    checked: ``nproc_per_node * nodes.max`` workers against ``MAX_CPU_WORKERS_PER_CORE``
    times ``os.cpu_count()``. Other accelerators are bounded by their device count.

    Raises:
        click.UsageError: too many, with the count that fits and ``--force``.
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


def _click_error(exc: TorchrunArgumentError) -> click.UsageError:
    """The click error that says ``exc`` (a usage error, or an invalid value of its flag)."""
    if exc.flag is None:
        return click.UsageError(exc.message)
    return click.BadParameter(exc.message, param_hint=exc.flag)


@click.command(
    "run",
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
@click.option("--parallel", default=None, metavar="NAMES|JSON",
              help="dlrover's own: the strategies train.prepare() applies (Job.parallel): names joined by commas "
                   "(fsdp; ddp,amp) or Parallel's JSON list ('[[\"mesh\", [[\"data\", 2], [\"replicate\", 2]]], "
                   "\"fsdp\"]'). A sharded strategy makes a failure recover live with each rank's own shard. "
                   "Give the same on every host.  [default: ddp]")
@click.option("--dryrun", is_flag=True, help="With --simulate-nodes: print the plan and exit.")
@click.option("--progress/--no-progress", "progress", default=None,
              help="dlrover's own: the job's progress line on the job master's host. Default: live on a terminal "
                   "only; --progress: also plain progress lines (JSON records with DLROVER_LOG_FORMAT=json) "
                   "when stdout is not a terminal.")
@click.option("--force", is_flag=True,
              help=f"Start more than {MAX_CPU_WORKERS_PER_CORE} cpu workers per core of this machine anyway.")
@click.argument("entrypoint")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(dryrun: bool, progress: bool | None, force: bool, **flags: Any) -> None:
    """Run ENTRYPOINT (a script, or a module with -m) with ARGS: one agent on this host.

    \b
    One host:    dlrover run --nproc-per-node 2 train.py --lr 1e-3
    Each host:   dlrover run --nnodes 2:3 --nproc-per-node 2 --rdzv-backend c10d \\
                   --rdzv-endpoint node0:29400 --rdzv-id job1 train.py
    Static:      dlrover run --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 train.py

    torchrun's flags mean what they mean there (docs/torchrun.md lists the differences);
    --simulate-nodes runs several agents on this machine instead.
    """
    args = TorchrunArgs(**flags)
    try:
        sys.exit(_run(args, dryrun=dryrun, progress=progress, force=force))
    except TorchrunArgumentError as exc:
        raise _click_error(exc) from None
    except (DLRoverError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


def _run(args: TorchrunArgs, *, dryrun: bool, progress: bool | None, force: bool) -> int:
    """``dlrover run``'s steps, in torchrun's order; the exit code (0 after a dry run)."""
    conf = torchrun.check_supported(args)
    job = torchrun.to_job(args, conf)
    nodes = job.nodes
    latch = process_latch()  # armed at this process's first instruction (dlrover_core.stoplatch)
    if latch is not None:
        latch.handle_only(torchrun.stop_signals(args.signals_to_handle))
    if args.simulate_nodes is not None:
        check_worker_count(nodes, args.accelerator, "local", force)
        os.environ.update(torchrun.agent_environment(args, nodes.nproc_per_node))
        if dryrun:
            click.echo(str(job.dryrun()))
            return _stopped_code(latch)
        ensure_log_dir(args.log_dir, "--log-dir")
        job_run = job.submit()  # Job.run(): submit, then wait (which cancels the job on a stop signal)
        result = job_run.wait()
        return exit_code(result, job_run.stop_signal)
    check_worker_count(attrs.evolve(nodes, min=1, max=1), args.accelerator, "local", force)
    plan = torchrun.host_plan(job, args, conf)
    agent_env = torchrun.agent_environment(args, nodes.nproc_per_node)
    signals = torchrun.stop_signals(args.signals_to_handle)
    os.environ.update(agent_env)  # as torchrun: the agent and its workers inherit it
    if dryrun:
        node = "assigned by the job master" if plan.node_rank is None else str(plan.node_rank)
        click.echo(f"# this host: one agent, node {node}; the job master at {plan.endpoint} "
                   f"({'started here' if plan.standalone else 'started by the first dlrover run on that host'})")
        click.echo(str(attrs.evolve(job, nodes=attrs.evolve(nodes, min=1, max=1)).dryrun()))
        return _stopped_code(latch)
    ensure_log_dir(args.log_dir, "--log-dir")
    return run_host(plan, signals=signals, latch=latch, progress=progress,
                    preflight=lambda: (validate_job(job), check_checkpoint_storage(job), check_worker_placement(job)))


def _stopped_code(latch: StopLatch | None) -> int:
    """After a dry run: 128+N when a stop signal N came meanwhile (nothing was started), else 0."""
    if latch is not None and latch.signum is not None:
        return 128 + latch.signum
    return 0
