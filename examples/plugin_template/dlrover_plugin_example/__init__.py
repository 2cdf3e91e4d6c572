"""dlrover-plugin-example: the ``signsgd`` optimizer for dlrover-core.

``Job(optimizer=Optimizer("signsgd", lr=1e-3, momentum=0.9))`` selects it once this
distribution is installed; ``train.prepare(model)`` builds it in every worker.
"""

from importlib.metadata import PackageNotFoundError, version

from dlrover_plugin_example._optimizer import SignSGD

try:
    __version__ = version("dlrover-plugin-example")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = ["SignSGD", "__version__"]
