"""dlrover-plugin-ppu: T-Head Zhenwu PPUs (PPU-ZW810E...) for dlrover-core.

Registers the ``ppu`` accelerator (``Job(accelerator="ppu")``, or ``"auto"`` on a PPU
machine). PPUs are CUDA devices to PyTorch (``torch.device("cuda", i)``) and collectives run
over PCCL through the ``nccl`` backend. Settings public documentation leaves open are read
from ``DLROVER_PPU_*`` variables; see the README.
"""

from importlib.metadata import PackageNotFoundError, version

from dlrover_plugin_ppu._accelerator import DEFAULT_NAME_PATTERN, PpuAccelerator
from dlrover_plugin_ppu._settings import (
    BACKEND_ENV,
    K8S_RESOURCE_ENV,
    NAME_PATTERN_ENV,
    SLURM_GRES_ENV,
    SMI_ENV,
    SMI_TIMEOUT_ENV,
    VISIBLE_DEVICES_ENV_ENV,
)

try:
    __version__ = version("dlrover-plugin-ppu")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "BACKEND_ENV",
    "DEFAULT_NAME_PATTERN",
    "K8S_RESOURCE_ENV",
    "NAME_PATTERN_ENV",
    "PpuAccelerator",
    "SLURM_GRES_ENV",
    "SMI_ENV",
    "SMI_TIMEOUT_ENV",
    "VISIBLE_DEVICES_ENV_ENV",
    "__version__",
]
