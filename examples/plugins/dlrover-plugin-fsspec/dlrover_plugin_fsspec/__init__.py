"""dlrover-plugin-fsspec: checkpoint storage on any fsspec filesystem.

Registers the ``fsspec`` storage: ``Checkpoint(storage="fsspec", dir="s3://bucket/run1")``
(or ``file:///...``, ``memory://...``, ``gcs://...`` — whatever fsspec and its installed
backends understand).
"""

from importlib.metadata import PackageNotFoundError, version

from dlrover_plugin_fsspec._storage import FsspecStorage

try:
    __version__ = version("dlrover-plugin-fsspec")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = ["FsspecStorage", "__version__"]
