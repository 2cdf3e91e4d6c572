"""What a strategy sees while ``train.prepare()`` applies it: :class:`ParallelContext`."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from dlrover_core.errors import JobSpecError, PluginError
from dlrover_core.logging import get_logger
from dlrover_core.plugins import get_host

__all__ = ["ParallelContext", "apply_strategies", "current_mesh", "find_modules", "replace_forward"]

log = get_logger()

_last: ParallelContext | None = None


@attrs.define(kw_only=True, eq=False)
class ParallelContext:
    """The state shared by the strategies of one ``train.prepare()`` call.

    A strategy is ``fn(model, ctx, **options) -> model`` (see the
    ``dlrover_register_parallel_strategies`` hook). It reads the worker's place from ``ctx``,
    may set :attr:`mesh` / :attr:`sharded`, and hooks the optimizer (built after every
    strategy ran) with :meth:`on_optimizer`.

    Attributes:
        info: the worker's :class:`~dlrover_core.train.WorkerInfo` (``device`` set by ``init()``).
        optimizer: the :class:`~dlrover_core.spec.Optimizer` spec ``prepare()`` will build.
        mesh: the ``torch.distributed.device_mesh.DeviceMesh`` built by the ``mesh``
            strategy, or ``None`` (one data-parallel dimension over the whole world).
        mesh_dims: its ``(name, size)`` dimensions as listed (first varies fastest).
        sharded: a strategy sharded the parameters (FSDP); gradient scalers must then agree
            on overflow across ranks.
        applied: names of the strategies applied so far, in order.
        device_mb: per-worker device memory override (MiB) for ``auto``; ``None``: probe.
        live: the job re-forms its world without stopping (``Failure(live_recovery=True)``
            under a dlrover agent): ``ddp`` returns a model whose wrapper can be rebuilt.
        joining: this worker replaces a dead one in a sharded job's running world: its
            state comes from its memory snapshot, and its peers (who keep their wrappers)
            run no wrapper's first broadcast with it, so ``ddp`` skips it (``init_sync=False``).
    """

    info: Any
    optimizer: Any = None
    mesh: Any = None
    mesh_dims: tuple[tuple[str, int], ...] = ()
    sharded: bool = False
    applied: list[str] = attrs.field(factory=list)
    device_mb: float | None = None
    live: bool = False
    joining: bool = False
    _optimizer_hooks: list[tuple[str, Callable[[Any], Any]]] = attrs.field(factory=list, init=False)
    _current: str = attrs.field(default="", init=False)
    _index: int | None = attrs.field(default=None, init=False)

    # ----- the worker (WorkerInfo's fields, for strategies written against it) -----------

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def local_rank(self) -> int:
        return self.info.local_rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def device(self) -> Any:
        """The worker's ``torch.device`` (``cpu`` when ``init()`` set none)."""
        if self.info.device is not None:
            return self.info.device
        import torch  # torch: heavy, workers only

        return torch.device("cpu")

    def field(self, option: str = "") -> str:
        """The Job field an error about the strategy being applied should name, e.g.
        ``"parallel.strategies[1].wrap_class"``."""
        base = "parallel.strategies" if self._index is None else f"parallel.strategies[{self._index}]"
        return f"{base}.{option}" if option else base

    # ----- data parallelism ---------------------------------------------------------------

    @property
    def data_parallel_size(self) -> int:
        """Ranks that replicate or shard the model: the mesh's ``data`` size (times its
        ``replicate`` size, HSDP's), else the world."""
        if self.mesh_dims:
            dims = dict(self.mesh_dims)
            return dims.get("data", 1) * dims.get("replicate", 1)
        return self.world_size

    def data_mesh(self) -> Any:
        """The 1-D ``DeviceMesh`` that ddp / fsdp replicate or shard over: ``mesh["data"]``,
        or one over the whole world (built here) when no mesh was given.

        Raises:
            JobSpecError: the mesh has no ``data`` dimension.
        """
        if self.mesh is not None:
            names = self.mesh.mesh_dim_names or ()
            if "data" not in names:
                raise JobSpecError("parallel.strategies[0].dims", [list(d) for d in self.mesh_dims],
                                   f"a 'data' dimension for {self._current or 'data parallelism'!r} to use")
            return self.mesh["data"]
        from torch.distributed.device_mesh import init_device_mesh  # torch: heavy, workers only

        self.mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("data",))
        self.mesh_dims = (("data", self.world_size),)
        return self.mesh

    # ----- the optimizer ------------------------------------------------------------------

    def on_optimizer(self, hook: Callable[[Any], Any]) -> None:
        """Call ``hook(optimizer)`` once ``prepare()`` has built the optimizer (hooks run in
        the order registered; a hook changes the optimizer in place, e.g. wraps its ``step``;
        its return value is ignored)."""
        self._optimizer_hooks.append((self._current, hook))

    def finish(self, optimizer: Any) -> None:
        """Run the optimizer hooks (``prepare()`` calls this)."""
        for name, hook in self._optimizer_hooks:
            try:
                hook(optimizer)
            except Exception as exc:
                raise PluginError(f"parallel strategy {name!r}: its optimizer hook failed: "
                                  f"{type(exc).__name__}: {exc}") from exc

    # ----- composition --------------------------------------------------------------------

    def apply(self, name: str, model: Any, **options: Any) -> Any:
        """Apply the registered strategy ``name`` to ``model`` (what ``prepare()`` does for each
        of the Job's strategies; composite strategies such as ``auto`` call it too)."""
        entry = get_host().registries.parallel_strategy.entry(name)
        outer, self._current = self._current, name
        try:
            result = entry.obj(model, self, **options)
        finally:
            self._current = outer
        if result is None:
            raise PluginError(f"parallel strategy {name!r} (from {entry.distribution or entry.plugin}) returned None; "
                              "a strategy returns the model")
        self.applied.append(name)
        log.debug("parallel_strategy_applied", strategy=name, options=options, rank=self.rank)
        return result


def apply_strategies(model: Any, strategies: Sequence[tuple[str, dict[str, Any]]], ctx: ParallelContext) -> Any:
    """Apply ``strategies`` in order; remember ``ctx`` for :func:`current_mesh`."""
    global _last
    for i, (name, options) in enumerate(strategies):
        ctx._index = i
        model = ctx.apply(name, model, **options)
    ctx._index = None
    _last = ctx
    return model


def current_mesh() -> Any:
    """The ``DeviceMesh`` of the last ``train.prepare()`` (``mesh`` strategy, or the 1-D data
    mesh ddp / fsdp built), or ``None``. Tensor- or pipeline-parallel code takes its groups
    from it: ``current_mesh()["tensor"].get_group()``."""
    return _last.mesh if _last is not None else None


def _class_names(cls: type) -> Iterable[str]:
    for c in cls.__mro__:
        yield c.__name__
        yield f"{c.__module__}.{c.__qualname__}"


def find_modules(model: Any, wrap_class: str | Sequence[str], *, field: str, outermost: bool = False) -> list[Any]:
    """The submodules of ``model`` (itself included) whose class, or a base class, is named by
    ``wrap_class``: a class name (``"Block"``) or a dotted path (``"mypkg.model.Block"``).

    Returned in pre-order (parents before children); with ``outermost``, modules inside an
    earlier match are left out.

    Raises:
        JobSpecError: no module matches (naming ``field``, and listing the classes there are).
    """
    wanted = {wrap_class} if isinstance(wrap_class, str) else set(wrap_class)
    found: list[Any] = []
    inside: set[int] = set()
    for _, module in model.named_modules():
        if outermost and id(module) in inside:
            continue
        if wanted & set(_class_names(type(module))):
            found.append(module)
            if outermost:
                inside.update(id(m) for m in module.modules())
    if not found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise JobSpecError(field, wrap_class, f"a class of the model's modules: {', '.join(present)}")
    return found


def replace_forward(module: Any, wrapper: Callable[..., Any]) -> None:
    """Make ``module(...)`` run ``wrapper(forward, *args, **kwargs)``, where ``forward`` is the
    module's forward until now.

    The new forward is a method bound on the instance (HF Accelerate's pattern for autocast):
    parameter names and hooks are untouched, and ``copy.deepcopy(module)`` rebinds it to the
    copy (a closure over the bound method would keep running the original's parameters).
    """
    current = module.forward
    if isinstance(current, types.MethodType) and current.__self__ is module:
        func = current.__func__

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            return wrapper(types.MethodType(func, self), *args, **kwargs)
    else:
        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            return wrapper(current, *args, **kwargs)

    functools.update_wrapper(forward, current)
    module.forward = types.MethodType(forward, module)
