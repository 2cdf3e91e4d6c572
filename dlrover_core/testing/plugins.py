"""Registering plugins for the length of a test, and a fresh process-wide plugin host."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from dlrover_core import plugins as _plugins
from dlrover_core.errors import PluginError
from dlrover_core.markers import hookimpl
from dlrover_core.plugins import PluginHost, PluginInfo, get_host
from dlrover_core.testing.scheduler import RecordingScheduler
from dlrover_core.testing.storage import InMemoryStorage

__all__ = ["TESTING_PLUGIN", "fresh_host", "register_plugin"]

#: Name under which :func:`fresh_host` registers the kit's own backends.
TESTING_PLUGIN = "dlrover_core.testing"


class _TestingBackends:
    """The kit's backends, as a plugin: the ``memory`` storage and ``recording`` scheduler."""

    @hookimpl
    def dlrover_register_storages(self, register):
        register(InMemoryStorage)

    @hookimpl
    def dlrover_register_schedulers(self, register):
        register(RecordingScheduler)


def _swap_host(host: PluginHost | None) -> PluginHost | None:
    with _plugins._host_lock:
        previous, _plugins._host = _plugins._host, host
    return previous


@contextlib.contextmanager
def fresh_host(
    *,
    load_entry_points: bool = False,
    environ: Mapping[str, str] | None = None,
    testing_backends: bool = True,
) -> Iterator[PluginHost]:
    """Make a new :class:`~dlrover_core.plugins.PluginHost` the process-wide one
    (what :func:`~dlrover_core.plugins.get_host`, ``Job(...)`` validation and the
    Checkpointer use) inside the ``with`` block; the previous host comes back after it.

    Args:
        load_entry_points: also load installed plugins (``dlrover`` entry points), filtered
            by ``DLROVER_PLUGINS`` / ``DLROVER_DISABLE_PLUGINS`` from ``environ``. Default:
            only the core's built-ins, so a test does not depend on what else is installed.
        environ: where to read the allow/block lists (default ``os.environ``).
        testing_backends: register the kit's ``memory`` storage and ``recording``
            scheduler (as plugin ``dlrover_core.testing``).

    The kit's records (:class:`InMemoryStorage` files, :class:`RecordingScheduler`
    calls) are cleared on entry and on exit.
    """
    host = PluginHost(load_entry_points=load_entry_points, environ=environ)
    if testing_backends:
        host.register(_TestingBackends(), name=TESTING_PLUGIN, distribution="dlrover-core", builtin=True)
    InMemoryStorage.reset()
    RecordingScheduler.reset()
    previous = _swap_host(host)
    try:
        yield host
    finally:
        _swap_host(previous)
        InMemoryStorage.reset()
        RecordingScheduler.reset()


@contextlib.contextmanager
def register_plugin(
    plugin: Any,
    name: str | None = None,
    *,
    distribution: str | None = None,
    version: str | None = None,
    host: PluginHost | None = None,
    check: bool = True,
) -> Iterator[PluginInfo]:
    """Register ``plugin`` (a module, a class or an object with ``@hookimpl`` functions) in
    ``host`` (default: the process-wide host) for the ``with`` block, then unregister it and
    put back whatever was registered under the same name before.

    ``name`` defaults to the module's ``__name__`` or the object's class name. With
    ``check`` (the default) a plugin the host would only report — unknown hook, bad hook
    signature, a malformed or conflicting backend, a register hook that raises — raises
    :class:`~dlrover_core.errors.PluginError` with the host's messages instead, so a test
    fails where the plugin is wrong. Yields the plugin's
    :class:`~dlrover_core.plugins.PluginInfo` (``backends``, ``hooks``, ``errors``)::

        with register_plugin(dlrover_plugin_mine.hooks) as info:
            assert info.backends == {"storage": ["mine"]}
            job = Job(..., checkpoint=Checkpoint(storage="mine", dir="..."))
    """
    host = host if host is not None else get_host()
    if name is None:
        name = getattr(plugin, "__name__", None) or type(plugin).__qualname__
    previous = host.pm.get_plugin(name)
    previous_info = host.plugins.get(name)
    if previous is not None or previous_info is not None:
        host.unregister(name)
    try:
        info = host.register(plugin, name=name, distribution=distribution, version=version)
        host.registries  # noqa: B018 - run the register hooks now so their errors are known
        if check and info.errors:
            raise PluginError(f"plugin {name!r} did not register cleanly: " + "; ".join(info.errors))
        yield info
    finally:
        host.unregister(name)
        if previous is not None and previous_info is not None:
            host.register(previous, name=name, distribution=previous_info.distribution,
                          version=previous_info.version, builtin=previous_info.builtin)
        elif previous_info is not None:  # a plugin that had failed to load: keep its report
            host.plugins[name] = previous_info
