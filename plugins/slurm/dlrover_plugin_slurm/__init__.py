"""dlrover-plugin-slurm: the ``slurm`` scheduler for dlrover-core.

Installing the distribution registers :class:`SlurmScheduler` under the entry-point group
``dlrover``; ``Job(scheduler="slurm")`` then runs a job as one sbatch job: the master on the
first node of the allocation, one ``srun``'d elastic agent per node, lost agents relaunched
as new ``srun`` steps, and a requeue (resuming from the latest checkpoint) at preemption or
near the time limit.
"""

from importlib.metadata import PackageNotFoundError, version

from dlrover_plugin_slurm._commands import SLURM_JOB_STATES, SlurmCli, SlurmJob, map_state, parse_sacct, parse_squeue
from dlrover_plugin_slurm._scheduler import SlurmScheduler, dlrover_register_schedulers

try:
    __version__ = version("dlrover-plugin-slurm")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "SLURM_JOB_STATES",
    "SlurmCli",
    "SlurmJob",
    "SlurmScheduler",
    "__version__",
    "dlrover_register_schedulers",
    "map_state",
    "parse_sacct",
    "parse_squeue",
]
