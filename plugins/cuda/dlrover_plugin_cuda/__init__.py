"""dlrover-plugin-cuda: the ``cuda`` accelerator (NVIDIA GPUs, NCCL) for dlrover-core.

Installing the distribution registers :class:`CudaAccelerator` under the entry-point group
``dlrover``; ``Job(accelerator="cuda")`` (or ``"auto"`` on a GPU machine) then selects it.
"""

from importlib.metadata import PackageNotFoundError, version

from dlrover_plugin_cuda._accelerator import CudaAccelerator, dlrover_register_accelerators

try:
    __version__ = version("dlrover-plugin-cuda")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = ["CudaAccelerator", "__version__", "dlrover_register_accelerators"]
