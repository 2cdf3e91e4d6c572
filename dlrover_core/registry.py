"""Registries the core owns: one per kind of backend, filled by plugins' register hooks."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import attrs

from dlrover_core.accelerators.base import Accelerator
from dlrover_core.errors import PluginError, PluginNotFoundError
from dlrover_core.scheduler_backend import SchedulerBackend
from dlrover_core.storage.base import CheckpointStorage

__all__ = ["KINDS", "Entry", "Registries", "Registry"]


@attrs.frozen(kw_only=True)
class Entry:
    """One registered backend: its name, the object, which plugin registered it, and what it
    declared with it.

    Attributes:
        replicated: a parallel strategy keeps the training state whole on every
            data-parallel rank (``register(fn, name=..., replicated=True)``), so failures can
            be recovered live; ``False`` when it shards the state or did not say, and for
            every other kind of backend.
    """

    kind: str
    name: str
    obj: Any
    plugin: str
    distribution: str | None
    replicated: bool = False


def _subclass_of(base: type) -> Callable[[Any], str | None]:
    def check(obj: Any) -> str | None:
        if not (inspect.isclass(obj) and issubclass(obj, base)):
            return f"expected a subclass of {base.__module__}.{base.__qualname__}, got {obj!r}"
        if inspect.isabstract(obj):
            missing = ", ".join(sorted(obj.__abstractmethods__))
            return f"{obj.__qualname__} leaves abstract methods unimplemented: {missing}"
        return None

    return check


def _callable(obj: Any) -> str | None:
    return None if callable(obj) else f"expected a callable factory, got {obj!r}"


#: kind -> (hook name, validator of registered objects)
KINDS: dict[str, tuple[str, Callable[[Any], str | None]]] = {
    "accelerator": ("dlrover_register_accelerators", _subclass_of(Accelerator)),
    "scheduler": ("dlrover_register_schedulers", _subclass_of(SchedulerBackend)),
    "storage": ("dlrover_register_storages", _subclass_of(CheckpointStorage)),
    "optimizer": ("dlrover_register_optimizers", _callable),
    "parallel_strategy": ("dlrover_register_parallel_strategies", _callable),
}


class Registry:
    """Backends of one kind, by name. Lookups are deterministic; an unknown name raises
    :class:`PluginNotFoundError` listing the known ones; a name registered by two plugins
    raises :class:`PluginError` naming both distributions when it is used."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._validate = KINDS[kind][1]
        self._entries: dict[str, Entry] = {}
        self._conflicts: dict[str, list[Entry]] = {}

    def register(self, obj: Any, name: str | None = None, *, plugin: str, distribution: str | None,
                 replicated: bool | None = None) -> Entry:
        """Add ``obj`` under ``name`` (default: ``obj.name``); ``replicated``: what a parallel
        strategy declares (see :class:`Entry`; ``None``: it did not say, so ``False``).
        Raises PluginError if malformed."""
        problem = self._validate(obj)
        if problem:
            raise PluginError(f"plugin {plugin!r} registered a malformed {self.kind}: {problem}")
        name = name if name is not None else getattr(obj, "name", None)
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r} registered a {self.kind} without a name: {obj!r}")
        if replicated is not None and self.kind != "parallel_strategy":
            raise PluginError(f"plugin {plugin!r} registered {self.kind} {name!r} with replicated={replicated!r}: only "
                              "parallel strategies declare it; leave it out")
        if replicated is not None and not isinstance(replicated, bool):
            raise PluginError(f"plugin {plugin!r} registered parallel strategy {name!r} with replicated={replicated!r}: "
                              "pass True (every data-parallel rank keeps the whole training state) or False")
        entry = Entry(kind=self.kind, name=name, obj=obj, plugin=plugin, distribution=distribution,
                      replicated=bool(replicated))
        if name in self._entries:
            self._conflicts.setdefault(name, [self._entries[name]]).append(entry)
            raise PluginError(self._conflict_message(name))
        self._entries[name] = entry
        return entry

    def _conflict_message(self, name: str) -> str:
        who = " and ".join(f"{e.distribution or e.plugin}" for e in self._conflicts[name])
        return f"{self.kind} {name!r} is registered by more than one plugin: {who}; uninstall or block one (DLROVER_DISABLE_PLUGINS)"

    def get(self, name: str) -> Any:
        """The object registered under ``name``."""
        return self.entry(name).obj

    def entry(self, name: str) -> Entry:
        if name in self._conflicts:
            raise PluginError(self._conflict_message(name))
        try:
            return self._entries[name]
        except KeyError:
            raise PluginNotFoundError(self.kind, name, list(self._entries)) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries


@attrs.define
class Registries:
    """One :class:`Registry` per kind."""

    accelerator: Registry = attrs.field(factory=lambda: Registry("accelerator"))
    scheduler: Registry = attrs.field(factory=lambda: Registry("scheduler"))
    storage: Registry = attrs.field(factory=lambda: Registry("storage"))
    optimizer: Registry = attrs.field(factory=lambda: Registry("optimizer"))
    parallel_strategy: Registry = attrs.field(factory=lambda: Registry("parallel_strategy"))

    def of(self, kind: str) -> Registry:
        return getattr(self, kind)
