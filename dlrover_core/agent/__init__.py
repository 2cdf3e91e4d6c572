"""The per-node elastic agent: rendezvous, worker processes, progress, restarts."""

from dlrover_core.agent.agent import ElasticAgent

__all__ = ["ElasticAgent"]
