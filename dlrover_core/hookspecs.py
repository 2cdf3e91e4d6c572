"""Hook specifications: every way a plugin extends dlrover-core.

A plugin is a module (or object) with functions named like the specs below, marked with
:data:`dlrover_core.hookimpl`, and published under the entry-point group ``dlrover``::

    [project.entry-points.dlrover]
    myplugin = "dlrover_plugin_myplugin"

Backends are not returned from hooks: each ``dlrover_register_*`` hook receives a
``register(obj, name=None)`` callback into a registry the core owns, so one plugin may add
several backends, lookups by name are deterministic, and the core knows which plugin
registered what. The core's own built-ins register through these same hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

__all__ = ["PROJECT_NAME"]

PROJECT_NAME = "dlrover"

_hookspec = pluggy.HookspecMarker(PROJECT_NAME)

Register = Callable[..., None]

# ---------------------------------------------------------------------------------------
# Backends: accelerators, schedulers, checkpoint storage, optimizers, parallel strategies
# ---------------------------------------------------------------------------------------


@_hookspec
def dlrover_register_accelerators(register: Register) -> None:
    """Register accelerator backends (device probes).

    Call ``register(cls)`` once per :class:`~dlrover_core.accelerators.Accelerator`
    subclass; its ``name`` attribute is the name a Job's ``accelerator=`` field selects and
    its ``priority`` orders candidates for ``accelerator="auto"`` (highest present wins).
    An object that is not an Accelerator subclass is not registered; the error is recorded
    against the plugin and shown by ``dlrover plugins list`` (the hook is not interrupted).

    Return value is ignored. Implemented by the core (``cpu``) and accelerator plugins
    (``dlrover-plugin-cuda``, ``-ascend``, ``-ppu``). Importing the hook's module must not
    import a vendor stack: probe lazily in ``probe()``.
    """


@_hookspec
def dlrover_register_schedulers(register: Register) -> None:
    """Register scheduler backends.

    Call ``register(cls)`` once per :class:`~dlrover_core.backend.SchedulerBackend`
    subclass; its ``name`` is what ``Job(scheduler=...)`` selects. The class is
    instantiated with no arguments; its ``build_plan(job, ...)`` must be pure (no side
    effects): the template's ``dryrun`` calls it, ``submit`` executes the plan's request.

    Return value is ignored. Implemented by the core (``local``) and scheduler plugins.
    """


@_hookspec
def dlrover_register_storages(register: Register) -> None:
    """Register checkpoint storage backends.

    Call ``register(cls)`` once per :class:`~dlrover_core.storage.CheckpointStorage`
    subclass; its ``name`` is what ``Checkpoint(storage=...)`` selects. Instances are built
    as ``cls(url)`` where ``url`` is the Checkpoint's ``dir``. Writes must be atomic
    (staging name, fsync, rename) so a crash never leaves a torn file under a final name.

    Return value is ignored. Implemented by the core (``posix``) and storage plugins.
    """


@_hookspec
def dlrover_register_optimizers(register: Register) -> None:
    """Register optimizers by name.

    Call ``register(factory, name="...")`` where ``factory(params, **kwargs)`` returns a
    :class:`torch.optim.Optimizer` (an optimizer class is such a factory). ``kwargs`` are the
    options of ``Optimizer(name, **kwargs)`` in the Job.

    Return value is ignored. Implemented by the core (torch's ``adamw``, ``adam``, ``sgd``)
    and optimizer plugins (``dlrover-plugin-optim-agd``).
    """


@_hookspec
def dlrover_register_parallel_strategies(register: Register) -> None:
    """Register parallel strategies by name (ATorch style).

    Call ``register(fn, name="...")`` where ``fn(model, ctx, **options)`` returns the
    transformed :class:`torch.nn.Module` (the same object changed in place, or a wrapper;
    returning ``None`` is an error). ``options`` are the JSON options of the Job's
    ``Parallel([(name, {options})])`` entry. ``ctx`` is a
    :class:`~dlrover_core.parallel.ParallelContext`: the worker (``rank``, ``world_size``,
    ``local_rank``, ``device``, ``info``), the optimizer spec, the ``mesh`` built by a
    ``mesh`` strategy (``data_mesh()`` gives the data-parallel ranks), ``sharded`` (set it
    when you shard parameters), ``field(option)`` (the Job field to name in a
    :class:`~dlrover_core.errors.JobSpecError`) and ``apply(name, model, **options)`` to
    compose registered strategies.

    ``train.prepare()`` applies the Job's strategies in the order given, then builds the
    optimizer over the returned model's parameters, then calls the hooks strategies
    registered with ``ctx.on_optimizer(hook)`` as ``hook(optimizer)`` (change it in place:
    the float16 ``amp`` strategy replaces ``optimizer.step`` with a gradient-scaled one).
    A strategy that changes what the forward computes (``amp``'s ``torch.autocast``)
    wraps the model's ``forward``. Every rank runs the same strategies in the same order,
    so collectives inside them (mesh creation, sharding) match up.

    Declare whether the strategy keeps the training state replicated:
    ``register(fn, name="...", replicated=True)`` when after it every data-parallel rank
    still holds the whole model and optimizer state (``ddp``, ``amp``, ``compile``,
    ``checkpoint``), so a live peer can give a replacement its state and a job's failures
    can be recovered without stopping the survivors (``Failure.live_recovery``);
    ``replicated=False`` when it shards the state (``fsdp``, ``mesh``, ``auto``). A strategy
    registered without ``replicated`` is treated as not replicated: a job that uses it
    restarts every worker from a checkpoint on a failure. ``Job.dryrun()``, ``submit()``
    and ``run()`` copy the declarations of the job's strategies into the spec
    (``Parallel.replicated``), so the master, agents and workers agree without loading
    plugins.

    Return value is ignored. Implemented by the core (``mesh``, ``ddp``, ``fsdp``, ``amp``,
    ``checkpoint``, ``compile``, ``auto``) and strategy plugins. The core checks its own
    names' options and conflicts when a ``Parallel`` is built; a plugin validates its
    options when called, raising JobSpecError naming ``ctx.field(option)``.
    """


# ---------------------------------------------------------------------------------------
# Lifecycle observers
# ---------------------------------------------------------------------------------------


@_hookspec
def dlrover_on_job_event(event: Any) -> None:
    """Observe a job event in the job master.

    ``event`` is a :class:`~dlrover_core.protocol.JobEvent` with ``kind`` one of
    :class:`~dlrover_core.protocol.EventKind` (str-valued: ``rendezvous_completed``,
    ``worker_failed``, ``workers_restarted``, ``checkpoint_committed``,
    ``checkpoint_restored``, ``job_finished``...; its members list each kind's data fields;
    more may be added, ignore kinds you do not know) and ``data``, a JSON-safe dict.

    Return value is ignored. Exceptions are logged and swallowed: an observer never stops
    the job. Called on the master's thread, so do not block (queue slow work).
    """
