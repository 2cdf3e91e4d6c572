"""The plugin's hook implementations (entry point ``fsspec`` of group ``dlrover``)."""

from dlrover_core import hookimpl


@hookimpl
def dlrover_register_storages(register):
    """Register the ``fsspec`` storage."""
    from dlrover_plugin_fsspec._storage import FsspecStorage

    register(FsspecStorage)
