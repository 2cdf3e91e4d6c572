"""The marker plugins decorate their hook implementations with (pluggy's ``HookimplMarker``)::

    from dlrover_core import hookimpl

    @hookimpl
    def dlrover_register_storages(register):
        register(MyStorage)

A module of its own so that a backend can import it without importing the plugin host.
"""

from __future__ import annotations

import pluggy

from dlrover_core.hookspecs import PROJECT_NAME

__all__ = ["hookimpl"]

#: Marker for plugin hook implementations: ``@hookimpl def dlrover_register_...``.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
