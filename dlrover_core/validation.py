"""``Job.validate()``: what a plain-data spec cannot check by itself.

A :class:`~dlrover_core.spec.JobSpec` checks its own fields when it is built. Whether its
backend names are installed, its workdir exists and its entrypoint can be found depends on
the machine it is checked on, so that is done here, once, before a job is planned (by
``Job.validate()``, ``dryrun``, ``run``, ``submit`` and the ``dlrover`` commands), never when
the master, an agent or a worker decodes the spec.

What the installed plugins declare about the job's backends is resolved here too and
carried in the spec as data (:func:`declare_replicated`: which parallel strategies keep the
training state replicated), so the processes that decode the spec need no plugin for it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
from pathlib import Path
from typing import TypeVar

import attrs

from dlrover_core import env
from dlrover_core.errors import KNOWN_PLUGIN_PACKAGES, JobSpecError
from dlrover_core.plugins import get_host
from dlrover_core.spec import MODULE_PATTERN, JobSpec

__all__ = ["declare_replicated", "validate_job"]

JobT = TypeVar("JobT", bound=JobSpec)


def validate_job(job: JobSpec) -> None:
    """Check ``job`` against this machine: backend names against the installed plugins,
    ``workdir`` and ``entrypoint`` against the filesystem, ``scheduler_options`` against
    what the scheduler backend declares.

    Raises:
        JobSpecError: names the field, the value and the fix (the plugin package to install,
            the directory looked in, the options the backend knows).
    """
    workdir = Path(job.workdir)
    if not workdir.is_dir():
        raise JobSpecError("workdir", job.workdir, "an existing directory")
    _check_entrypoint(job.entrypoint, workdir)
    _check_name("scheduler", job.scheduler, "scheduler")
    if job.accelerator != "auto":
        _check_name("accelerator", job.accelerator, "accelerator")
    _check_name("checkpoint.storage", job.checkpoint.storage, "storage")
    _check_name("optimizer.name", job.optimizer.name, "optimizer")
    for i, (name, _) in enumerate(job.parallel.strategies if job.parallel else ()):
        _check_name(f"parallel.strategies[{i}]", name, "parallel_strategy")
    backend = get_host().registries.scheduler.get(job.scheduler)
    check_options = getattr(backend, "check_options", None)
    if check_options is not None:
        check_options(job.scheduler_options)


def declare_replicated(job: JobT) -> JobT:
    """``job`` with ``parallel.replicated`` filled in from the plugin registry: the names of
    its parallel strategies whose registrations declared replicated training state
    (``register(fn, name=..., replicated=True)``; one that did not say counts as sharding
    it). This decides ``JobSpec.live_blocker``. ``Job.dryrun()``, ``submit()`` and ``run()``
    call it; a name no plugin registered is left out here (:func:`validate_job` reports it).
    A job without ``parallel`` is returned as it is."""
    if job.parallel is None:
        return job
    registry = get_host().registries.parallel_strategy
    replicated = [name for name, _ in job.parallel.strategies if name in registry and registry.entry(name).replicated]
    return attrs.evolve(job, parallel=attrs.evolve(job.parallel, replicated=replicated))


def _check_entrypoint(ep: str, workdir: Path) -> None:
    if os.environ.get(env.WORKER_EXEC) == "1":  # dlrover run --no-python: run as an executable, as torchrun does
        path = workdir / ep
        found = (path.is_file() and os.access(path, os.X_OK)) if "/" in ep else shutil.which(ep) is not None
        if not found:
            raise JobSpecError("entrypoint", ep, "an executable (--no-python): a path to one (relative to workdir "
                                                 f"{str(workdir)!r}) or a command on PATH")
        return
    if ep.endswith(".py") or "/" in ep:
        if not (workdir / ep).is_file():
            raise JobSpecError("entrypoint", ep, f"an existing script (looked in workdir {str(workdir)!r})")
        return
    if not MODULE_PATTERN.fullmatch(ep):
        raise JobSpecError("entrypoint", ep, "a script path, 'pkg.module' or 'pkg.module:function'")
    module = ep.split(":")[0]
    if not _module_found(module, workdir):
        raise JobSpecError("entrypoint", ep, f"an importable module; {module!r} was not found on sys.path "
                                             f"nor in workdir {str(workdir)!r}")


def _module_found(module: str, workdir: Path) -> bool:
    """Whether the workers' ``python -m`` finds ``module``: on this sys.path or in ``workdir``
    (their working directory, which ``python -m`` puts first on sys.path); nothing is imported
    from ``workdir``."""
    try:
        if importlib.util.find_spec(module) is not None:
            return True
    except (ImportError, ValueError):
        pass
    path = [str(workdir.resolve())]
    parts = module.split(".")
    for i in range(len(parts)):
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), path)
        if spec is None:
            return False
        path = list(spec.submodule_search_locations or [])
        if i < len(parts) - 1 and not path:
            return False
    return True


def _check_name(field: str, name: str, kind: str) -> None:
    known = get_host().registries.of(kind).names()
    if name not in known:
        package = KNOWN_PLUGIN_PACKAGES.get((kind, name))
        fix = (f"pip install {package} (the plugin package that provides {name!r})" if package else
               f"install the plugin that provides {name!r}")
        raise JobSpecError(field, name, f"one of the registered {kind}s: {', '.join(known) or 'none'}; or {fix}")
