"""The ``dlrover`` command line: ``dlrover run`` (torchrun-compatible), ``dlrover submit``,
``status``, ``logs``, ``cancel``, ``dlrover plugins`` and ``dlrover doctor``."""

from __future__ import annotations

import json
import os
import re
import runpy
import sys
from pathlib import Path
from typing import Any

import attrs
import click
from rich.console import Console
from rich.table import Table

from dlrover_core import plugin_docs
from dlrover_core.doctor import diagnose
from dlrover_core.errors import DLRoverError
from dlrover_core.job import Job
from dlrover_core.plugins import get_host
from dlrover_core.runner import find_job
from dlrover_core.spec import Checkpoint, Failure, Nodes

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


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    short_help="Run a training script on this machine, like torchrun.",
)
@click.option("--nnodes", default="1", show_default=True, help="Nodes as N or MIN:MAX (elastic).")
@click.option("--nproc-per-node", "--nproc_per_node", "nproc_per_node", default="1", show_default=True,
              help="Workers per node, or 'auto' (one per device; on cpu half the cores).")
@click.option("--max-restarts", "--max_restarts", "max_restarts", type=int, default=3, show_default=True,
              help="Job-wide restart budget (all nodes together).")
@click.option("--node-unit", "--node_unit", "node_unit", type=int, default=1, show_default=True,
              help="Node count of a round is a multiple of this.")
@click.option("--rdzv-conf", "--rdzv_conf", "rdzv_conf", default="", help="last_call_timeout=S,join_timeout=S")
@click.option("--monitor-interval", "--monitor_interval", "monitor_interval", type=float, default=0.5,
              show_default=True, help="Seconds between agent heartbeats.")
@click.option("--run-id", "--run_id", "run_id", default=None, help="Job name (default: from the script).")
@click.option("--log-dir", "--log_dir", "log_dir", default="dlrover-runs", show_default=True)
@click.option("--accelerator", default="auto", show_default=True, help="cpu, cuda, ascend, ppu or auto.")
@click.option("--scheduler", default="local", show_default=True)
@click.option("--checkpoint-dir", default="checkpoints", show_default=True, help="Where train.Checkpointer saves.")
@click.option("-m", "--module", "module", is_flag=True, help="Run the entrypoint as a module (python -m).")
@click.option("--standalone", is_flag=True, help="Accepted for torchrun compatibility (always true here).")
@click.option("--rdzv-backend", "--rdzv_backend", "rdzv_backend", default=None, hidden=True)
@click.option("--rdzv-endpoint", "--rdzv_endpoint", "rdzv_endpoint", default=None, hidden=True)
@click.option("--rdzv-id", "--rdzv_id", "rdzv_id", default=None, hidden=True)
@click.option("--dryrun", is_flag=True, help="Print the plan (processes and environment) and exit.")
@click.option("--force", is_flag=True,
              help=f"Start more than {MAX_CPU_WORKERS_PER_CORE} cpu workers per core of this machine anyway.")
@click.argument("entrypoint")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(nnodes, nproc_per_node, max_restarts, node_unit, rdzv_conf, monitor_interval, run_id, log_dir, accelerator,
        scheduler, checkpoint_dir, module, standalone, rdzv_backend, rdzv_endpoint, rdzv_id, dryrun, force, entrypoint,
        args):
    """Run ENTRYPOINT (a script, or a module with -m) with ARGS on this machine.

    Accepts torchrun's flags: dlrover run --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 train.py --lr 1e-3

    On the cpu, more than 4 workers per core of this machine (all nodes together with the
    local scheduler) are refused unless --force is given.
    """
    for flag, value in (("--rdzv-backend", rdzv_backend), ("--rdzv-endpoint", rdzv_endpoint), ("--rdzv-id", rdzv_id)):
        if value:
            click.echo(f"note: {flag} is ignored: the job master runs the rendezvous", err=True)
    conf = _rdzv_conf(rdzv_conf)
    try:
        nodes = Nodes.parse(nnodes)
        nodes = Nodes(
            min=nodes.min, max=nodes.max, node_unit=node_unit,
            nproc_per_node="auto" if nproc_per_node in ("auto", "cpu", "gpu") else int(nproc_per_node),
            last_call_s=float(conf.pop("last_call_timeout", nodes.last_call_s)),
            join_timeout_s=float(conf.pop("join_timeout", nodes.join_timeout_s)),
        )
        if conf:
            raise click.BadParameter(f"unknown keys {sorted(conf)}; known: last_call_timeout, join_timeout",
                                     param_hint="--rdzv-conf")
        if module and entrypoint.endswith(".py"):
            raise click.BadParameter("with -m give a module name, not a file", param_hint="ENTRYPOINT")
        _check_worker_count(nodes, accelerator, scheduler, force)
        job = Job(
            name=_job_name(run_id or entrypoint), entrypoint=entrypoint, args=list(args), nodes=nodes,
            accelerator=accelerator, scheduler=scheduler, checkpoint=Checkpoint(dir=checkpoint_dir),
            failure=Failure(max_restarts=max_restarts, heartbeat_interval_s=monitor_interval,
                            heartbeat_timeout_s=max(30.0, 10 * monitor_interval)),
            log_dir=log_dir,
        )
        if dryrun:
            click.echo(str(job.dryrun()))
            return
        _ensure_log_dir(log_dir, "--log-dir")
        result = job.run()
    except (DLRoverError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(0 if result.state.value == "SUCCEEDED" else 1)


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
        if result.state.value != "SUCCEEDED":
            sys.exit(1)


def _find(job_id: str, log_dir: str) -> Any:
    try:
        return find_job(job_id, log_dir)
    except DLRoverError as exc:
        raise click.ClickException(str(exc)) from exc


@main.command()
@click.argument("job_id")
@click.option("--log-dir", default="dlrover-runs", show_default=True, help="The Job's log_dir.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(job_id: str, log_dir: str, as_json: bool) -> None:
    """Show a job on any scheduler: state, step, nodes, restarts, goodput timeline."""
    run = _find(job_id, log_dir)
    st = run.status()
    goodput = st.goodput
    run_dir = Path(run.handle.log_dir)
    if not goodput and (run_dir / "goodput.json").exists():
        goodput = json.loads((run_dir / "goodput.json").read_text())
    if as_json:
        click.echo(json.dumps({**attrs.asdict(st), "state": st.state.value, "scheduler": run.handle.scheduler,
                               "native_id": run.handle.native_id, "goodput": goodput}, indent=2))
        return
    console = Console()
    console.print(f"job {job_id} ({run.handle}): [b]{st.state.value}[/b]" + (f" — {st.message}" if st.message else ""))
    console.print(f"  step {st.step}, nodes {st.nodes}/{st.max_nodes}, restarts {st.restarts}, round {st.round}")
    if st.metrics:
        console.print("  metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(st.metrics.items())))
    if goodput:
        table = Table(title="goodput timeline (seconds)", title_justify="left")
        table.add_column("phase")
        table.add_column("s", justify="right")
        for key, value in goodput.items():
            table.add_row(key.removesuffix("_s"), f"{value:.3f}" if key != "goodput" else f"{value:.1%}")
        console.print(table)


@main.command()
@click.argument("job_id")
@click.option("--log-dir", default="dlrover-runs", show_default=True, help="The Job's log_dir.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job ends.")
def logs(job_id: str, log_dir: str, follow: bool) -> None:
    """Print a job's logs (each line prefixed by its node and rank)."""
    run = _find(job_id, log_dir)
    try:
        for line in run.logs(follow=follow):
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


if __name__ == "__main__":  # pragma: no cover
    main()
