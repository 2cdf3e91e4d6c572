"""Loading plugins and building the registries from them.

Load order: the core's built-ins (registered through the same hooks as everyone else), then
every entry point of group ``dlrover`` that passes the allow/block lists. A plugin that
fails to import, implements an unknown hook or registers a malformed backend is recorded
with its error and skipped; it never takes the host down.

Environment:
    DLROVER_PLUGINS: comma-separated allow-list of entry-point or distribution names; when
        set (even empty) only those external plugins load.
    DLROVER_DISABLE_PLUGINS: comma-separated block-list, applied after the allow-list.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import threading
import traceback
from collections.abc import Mapping
from typing import Any

import attrs
import pluggy

from dlrover_core import hookspecs
from dlrover_core.errors import DeviceError, PluginError
from dlrover_core.logging import get_logger
from dlrover_core.registry import KINDS, Registries

__all__ = ["BUILTIN_PLUGINS", "PluginHost", "PluginInfo", "get_host", "reset_host"]


#: The core's own plugins, registered before any external one.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "dlrover_core.accelerators.cpu",
    "dlrover_core.schedulers.local",
    "dlrover_core.schedulers.docker",
    "dlrover_core.storage.posix",
    "dlrover_core.optim.torch_optimizers",
    "dlrover_core.parallel.mesh",
    "dlrover_core.parallel.ddp",
    "dlrover_core.parallel.fsdp",
    "dlrover_core.parallel.amp",
    "dlrover_core.parallel.activation_checkpoint",
    "dlrover_core.parallel.compile",
    "dlrover_core.parallel.auto",
)

ENTRY_POINT_GROUP = "dlrover"

log = get_logger()


@attrs.define(kw_only=True)
class PluginInfo:
    """What ``dlrover plugins list`` shows about one plugin."""

    name: str
    distribution: str | None
    version: str | None
    builtin: bool
    hooks: list[str] = attrs.field(factory=list)
    backends: dict[str, list[str]] = attrs.field(factory=dict)
    errors: list[str] = attrs.field(factory=list)

    @property
    def loaded(self) -> bool:
        return not self.errors or bool(self.hooks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "builtin": self.builtin,
            "hooks": sorted(self.hooks),
            "backends": {k: sorted(v) for k, v in sorted(self.backends.items())},
            "errors": list(self.errors),
        }


def _split_list(value: str | None) -> set[str] | None:
    if value is None:
        return None
    return {v.strip() for v in value.split(",") if v.strip()}


def _core_version() -> str | None:
    try:
        return importlib.metadata.version("dlrover-core")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return None


class PluginHost:
    """A pluggy PluginManager plus the registries built from its plugins.

    Args:
        load_entry_points: load external plugins from the ``dlrover`` entry-point group.
        environ: where to read ``DLROVER_PLUGINS`` / ``DLROVER_DISABLE_PLUGINS``.
    """

    def __init__(self, *, load_entry_points: bool = True, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self._registries: Registries | None = None
        self._lock = threading.RLock()
        version = _core_version()
        for module_name in BUILTIN_PLUGINS:
            module = importlib.import_module(module_name)
            self.register(module, name=module_name, distribution="dlrover-core", version=version, builtin=True)
        if load_entry_points:
            self._load_entry_points(
                allow=_split_list(environ.get("DLROVER_PLUGINS")),
                block=_split_list(environ.get("DLROVER_DISABLE_PLUGINS")) or set(),
            )

    # ----- loading ---------------------------------------------------------------------

    def _load_entry_points(self, *, allow: set[str] | None, block: set[str]) -> None:
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = getattr(ep, "dist", None)
            dist_name = dist.name if dist is not None else None
            names = {ep.name, dist_name} - {None}
            if allow is not None and not names & allow:
                continue
            if names & block:
                continue
            if ep.name in self.plugins:
                continue
            version = dist.version if dist is not None else None
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin is reported, never fatal
                info = PluginInfo(name=ep.name, distribution=dist_name, version=version, builtin=False)
                info.errors.append(f"import failed: {type(exc).__name__}: {exc}")
                self.plugins[ep.name] = info
                log.warning("plugin_import_failed", plugin=ep.name, distribution=dist_name, error=str(exc))
                continue
            self.register(plugin, name=ep.name, distribution=dist_name, version=version)

    def register(
        self,
        plugin: Any,
        *,
        name: str,
        distribution: str | None = None,
        version: str | None = None,
        builtin: bool = False,
    ) -> PluginInfo:
        """Register a plugin object (a module or any object with hook implementations).

        Errors (unknown hook, bad hook signature) are recorded on the returned
        :class:`PluginInfo` and the plugin is not registered.
        """
        with self._lock:
            info = PluginInfo(name=name, distribution=distribution, version=version, builtin=builtin)
            self.plugins[name] = info
            try:
                self.pm.register(plugin, name=name)
            except Exception as exc:
                info.errors.append(f"invalid hooks: {exc}")
                log.warning("plugin_rejected", plugin=name, error=str(exc))
                return info
            try:
                self.pm.check_pending()
            except pluggy.PluginValidationError as exc:
                self.pm.unregister(plugin)
                info.errors.append(f"invalid hooks: {exc}")
                log.warning("plugin_rejected", plugin=name, error=str(exc))
                return info
            info.hooks = sorted(h.name for h in self.pm.get_hookcallers(plugin) or [])
            self._registries = None
            return info

    def unregister(self, name: str) -> None:
        """Remove a plugin registered under ``name`` (tests use this to clean up)."""
        with self._lock:
            plugin = self.pm.get_plugin(name)
            if plugin is not None:
                self.pm.unregister(plugin)
            self.plugins.pop(name, None)
            self._registries = None

    # ----- registries ------------------------------------------------------------------

    @property
    def registries(self) -> Registries:
        """The registries, rebuilt after any plugin change."""
        with self._lock:
            if self._registries is None:
                self._registries = self._build_registries()
            return self._registries

    def _build_registries(self) -> Registries:
        regs = Registries()
        for info in self.plugins.values():
            info.backends = {}
            info.errors = [e for e in info.errors if not e.startswith("register")]
        for kind, (hook_name, _) in KINDS.items():
            registry = regs.of(kind)
            # get_hookimpls() lists implementations in registration order (pluggy calls them
            # in reverse): registries fill in load order, so the plugin loaded later is the
            # one blamed for a name conflict, never a built-in.
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                info = self.plugins[impl.plugin_name]

                def register(obj: Any, name: str | None = None, *, replicated: bool | None = None,
                             _info: PluginInfo = info, _registry=registry) -> None:
                    try:
                        entry = _registry.register(obj, name, plugin=_info.name, distribution=_info.distribution,
                                                   replicated=replicated)
                    except PluginError as exc:
                        _info.errors.append(f"register: {exc}")
                        log.warning("plugin_register_failed", plugin=_info.name, error=str(exc))
                        return
                    _info.backends.setdefault(_registry.kind, []).append(entry.name)

                try:
                    impl.function(register=register)
                except Exception as exc:
                    info.errors.append(f"register: {hook_name} raised {type(exc).__name__}: {exc}")
                    log.warning("plugin_hook_failed", plugin=info.name, hook=hook_name, error=str(exc))
        return regs

    # ----- conveniences ----------------------------------------------------------------

    def create_accelerator(self, name: str) -> Any:
        """An :class:`~dlrover_core.accelerators.Accelerator` instance; ``"auto"`` picks the
        present one with the highest priority (cpu is always present).

        Raises:
            PluginNotFoundError: no accelerator of that name is registered.
            DeviceError: ``name`` is registered but its probe finds no device.
        """
        registry = self.registries.accelerator
        if name == "auto":
            for entry in sorted(registry.entries(), key=lambda e: (-e.obj.priority, e.name)):
                acc = entry.obj()
                if acc.probe().present:
                    return acc
            raise DeviceError("no accelerator is present, not even cpu; check `dlrover doctor`")
        acc = registry.get(name)()
        report = acc.probe()
        if not report.present:
            raise DeviceError(f"accelerator {name!r} is not usable here: {report.reason}; see `dlrover doctor`")
        return acc

    def emit(self, event: Any) -> None:
        """Call every ``dlrover_on_job_event`` observer; an observer's exception is logged."""
        for impl in self.pm.hook.dlrover_on_job_event.get_hookimpls():
            try:
                impl.function(event=event)
            except Exception:
                log.warning("job_event_observer_failed", plugin=impl.plugin_name, kind=getattr(event, "kind", None),
                            error=traceback.format_exc(limit=3))


_host: PluginHost | None = None
_host_lock = threading.Lock()


def get_host() -> PluginHost:
    """The process-wide :class:`PluginHost`, loaded on first use."""
    global _host
    with _host_lock:
        if _host is None:
            _host = PluginHost()
        return _host


def reset_host() -> None:
    """Forget the process-wide host so the next :func:`get_host` reloads plugins."""
    global _host
    with _host_lock:
        _host = None
