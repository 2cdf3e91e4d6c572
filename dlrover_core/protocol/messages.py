"""Messages between the master, the agents, the workers and the scheduler backends.

Each is a frozen attrs class; :mod:`dlrover_core.protocol.codec` turns it into JSON and back.
``docs/architecture.md`` has the table of who sends which, and when.
"""

from __future__ import annotations

import attrs

__all__ = ["NodeRelaunch"]


@attrs.frozen(kw_only=True)
class NodeRelaunch:
    """The master asks the scheduler backend for a new agent (master → backend).

    Attributes:
        node_id: the id the new agent takes (``--node-id``).
        replaces: the node id whose agent it replaces (the same id when the node is replaced
            in place; ``None`` for a node added to scale up).
        reason: why, in words (``"node 1 lost its heartbeat"``).
        attempt: how many times this node id was launched before (0 for the first).
    """

    node_id: int
    replaces: int | None = None
    reason: str = ""
    attempt: int = 0
