"""The job master: rendezvous rounds, node table, restart budget, goodput, the job's fate."""

from dlrover_core.master.job_master import JobMaster
from dlrover_core.master.rendezvous import RendezvousManager, Round

__all__ = ["JobMaster", "RendezvousManager", "Round"]
