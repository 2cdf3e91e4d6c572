"""The per-node elastic agent: rendezvous, worker processes, progress, restarts.

``ElasticAgent`` is imported on first use: the package's small processes (the shared
standby, ``python -m dlrover_core.agent.zygote``) import a module of it without the agent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dlrover_core.agent.agent import ElasticAgent

__all__ = ["ElasticAgent"]


def __getattr__(name: str) -> Any:
    if name == "ElasticAgent":
        # lazy: the shared standby (agent/zygote.py) imports this package without the agent
        from dlrover_core.agent.agent import ElasticAgent

        return ElasticAgent
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
