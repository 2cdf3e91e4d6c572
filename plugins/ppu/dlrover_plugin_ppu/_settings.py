"""Site settings of the ppu accelerator that public documentation does not pin down.

Each one has a default taken from public sources (see the plugin's README) and can be
changed without code: by an environment variable, or by a constructor argument of
:class:`~dlrover_plugin_ppu.PpuAccelerator`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from dlrover_core.backend import get_logger

__all__ = [
    "BACKEND_ENV",
    "K8S_RESOURCE_ENV",
    "NAME_PATTERN_ENV",
    "SLURM_GRES_ENV",
    "SMI_ENV",
    "SMI_TIMEOUT_ENV",
    "VISIBLE_DEVICES_ENV_ENV",
    "EnvSetting",
]

log = get_logger()

#: ``torch.distributed`` backend name (default ``nccl``: PCCL implements the NCCL API).
BACKEND_ENV = "DLROVER_PPU_BACKEND"
#: Variable that restricts the PPUs a process sees (default ``CUDA_VISIBLE_DEVICES``).
VISIBLE_DEVICES_ENV_ENV = "DLROVER_PPU_VISIBLE_DEVICES_ENV"
#: Kubernetes extended resource (default ``alibabacloud.com/ppu``, ack-ppu-device-plugin).
K8S_RESOURCE_ENV = "DLROVER_PPU_K8S_RESOURCE"
#: Slurm GRES name (default ``ppu``; GRES names are chosen by each site's gres.conf).
SLURM_GRES_ENV = "DLROVER_PPU_SLURM_GRES"
#: The ppu-smi program: a name looked up on PATH or a path (default ``ppu-smi``).
SMI_ENV = "DLROVER_PPU_SMI"
#: Seconds all ppu-smi calls of one probe may take together (default 5).
SMI_TIMEOUT_ENV = "DLROVER_PPU_SMI_TIMEOUT_S"
#: Regular expression (case-insensitive) a ``torch.cuda.get_device_name()`` must match to be
#: taken for a PPU when ppu-smi cannot be asked.
NAME_PATTERN_ENV = "DLROVER_PPU_NAME_PATTERN"


class EnvSetting:
    """A class attribute read from an environment variable on every access, else a default.

    Reading on access (not at import) lets a class-level read, e.g. a scheduler plugin that
    looks at ``PpuAccelerator.k8s_resource`` without making an instance, see the site's
    setting too. It is a non-data descriptor, so an instance attribute of the same name (set
    from a constructor argument) takes precedence. An empty variable counts as unset; a value
    ``convert`` rejects (``ValueError``) is logged and the default used.
    """

    def __init__(self, env: str, default: Any, convert: Callable[[str], Any] | None = None) -> None:
        self.env = env
        self.default = default
        self.convert = convert

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        value = os.environ.get(self.env, "").strip()
        if not value:
            return self.default
        if self.convert is None:
            return value
        try:
            return self.convert(value)
        except ValueError as exc:
            log.warning("ppu_setting_invalid", variable=self.env, value=value, error=str(exc), used=self.default)
            return self.default
