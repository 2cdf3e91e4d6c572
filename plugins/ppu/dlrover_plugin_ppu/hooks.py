"""The plugin's hook implementations, the target of its ``dlrover`` entry point.

Importing this module imports neither torch nor any PPU software: the probe looks for them
when it runs.
"""

from __future__ import annotations

from dlrover_core import hookimpl
from dlrover_plugin_ppu._accelerator import PpuAccelerator

__all__ = ["dlrover_register_accelerators"]


@hookimpl
def dlrover_register_accelerators(register):
    """Register the ``ppu`` accelerator."""
    register(PpuAccelerator)
