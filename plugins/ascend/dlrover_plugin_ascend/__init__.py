"""dlrover-plugin-ascend: the ``ascend`` accelerator for Huawei Ascend NPUs.

Registered under the entry-point group ``dlrover``; ``Job(accelerator="ascend")`` selects it
and ``accelerator="auto"`` prefers it (priority 90) over ``cpu`` wherever its probe finds a
device. ``torch_npu`` is not a dependency: install the build that matches the machine's CANN.
"""

import importlib.metadata

from dlrover_plugin_ascend._accelerator import AscendAccelerator, dlrover_register_accelerators
from dlrover_plugin_ascend._cann import cann_version
from dlrover_plugin_ascend._npu_smi import NpuChip, NpuSmiInfo, parse_npu_smi_info, visible_device_ids

__all__ = [
    "AscendAccelerator",
    "NpuChip",
    "NpuSmiInfo",
    "__version__",
    "cann_version",
    "dlrover_register_accelerators",
    "parse_npu_smi_info",
    "visible_device_ids",
]

try:
    __version__ = importlib.metadata.version("dlrover-plugin-ascend")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree
    __version__ = "0.0.0"
