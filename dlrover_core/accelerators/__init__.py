"""Accelerators: the base class device plugins subclass, and the built-in ``cpu``."""

from dlrover_core.accelerators.base import Accelerator, DeviceReport, NodeCheckResult

__all__ = ["Accelerator", "DeviceReport", "NodeCheckResult"]
