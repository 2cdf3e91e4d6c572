"""dlrover-plugin-optim-agd: the AGD optimizer (Yue et al., NeurIPS 2023) for dlrover-core.

Installing the distribution registers the optimizer ``agd`` under the entry-point group
``dlrover``; ``Job(optimizer=Optimizer("agd", lr=3e-4))`` then makes ``train.prepare()`` build
an :class:`AGD`. ``AGD`` itself is imported lazily (it needs torch).
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from dlrover_plugin_optim_agd._plugin import agd, dlrover_register_optimizers

try:
    __version__ = version("dlrover-plugin-optim-agd")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = ["AGD", "__version__", "agd", "dlrover_register_optimizers"]


def __getattr__(name: str) -> Any:
    if name == "AGD":
        from dlrover_plugin_optim_agd._agd import AGD  # subclasses torch.optim.Optimizer: torch is heavy

        return AGD
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
