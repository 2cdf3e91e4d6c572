"""The ``dlrover`` command line: the ``dlrover`` group (the console script's entry point,
also ``python -m dlrover_core.cli``) with ``dlrover run`` (torchrun-compatible: its command in
:mod:`dlrover_core.run_command`, its flags' meaning in :mod:`dlrover_core.torchrun`) and here
``dlrover submit``, ``status``, ``logs``, ``cancel``, ``plot``,
``dlrover checkpoint ls|inspect|export``, ``dlrover plugins`` and ``dlrover doctor``."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from time import gmtime, strftime
from typing import Any

import attrs
import click
from rich.console import Console
from rich.table import Table

from dlrover_core import jobplot, plugin_docs, rundir
from dlrover_core.checkpoint import export as checkpoint_export
from dlrover_core.display import exit_code, log_record, progress_fields, progress_line
from dlrover_core.doctor import diagnose
from dlrover_core.errors import DLRoverError
from dlrover_core.job import Job
from dlrover_core.logging import json_mode, write_record
from dlrover_core.plugins import get_host
from dlrover_core.protocol.result import NO_STEPS_NOTE, format_exit_codes
from dlrover_core.protocol.state import JobState
from dlrover_core.run_command import ensure_log_dir, run
from dlrover_core.runner import find_job

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dlrover-core", prog_name="dlrover")
def main() -> None:
    """Self-healing distributed PyTorch training."""


main.add_command(run)  # dlrover run: torchrun's command line (dlrover_core.run_command)


# ----- dlrover submit | status | logs | cancel ----------------------------------------------


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
        ensure_log_dir(job.log_dir, f"a Job(log_dir=...) in {job_file}")
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
    if ("/" in job_id or job_id in (".", "..")) and (run_dir / rundir.JOB).is_file():
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
    if not goodput and (run_dir / rundir.GOODPUT).exists():
        goodput = json.loads((run_dir / rundir.GOODPUT).read_text())
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
