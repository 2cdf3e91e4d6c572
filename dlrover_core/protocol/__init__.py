"""Every message that crosses a process boundary, as frozen attrs classes with one converter.

Layer: the bottom of the core with :mod:`dlrover_core.spec`; it imports nothing of the core
but :mod:`dlrover_core.errors`, :mod:`dlrover_core.env`, :mod:`dlrover_core.logging` and
:mod:`dlrover_core.retry`. See ``docs/architecture.md`` for the table of messages.
"""

from dlrover_core.protocol.codec import converter, decode, encode
from dlrover_core.protocol.events import JobEvent
from dlrover_core.protocol.messages import (
    ENDPOINTS,
    Action,
    ActionAnswer,
    Cancel,
    CheckpointErrorReport,
    Endpoint,
    Exited,
    FailureReport,
    Heartbeat,
    HeartbeatAnswer,
    Join,
    Joined,
    NodeCheckReport,
    NodeCheckResult,
    NodeRelaunch,
    Poll,
    PollState,
    Register,
    Registered,
    RestoreDecision,
    RestorePlanRequest,
    RestoreVerify,
    RestoreVerifyAnswer,
    RoundAssignment,
    ShardAnswer,
    ShardReport,
    Succeeded,
    WorkerException,
    WorkerFailure,
)
from dlrover_core.protocol.result import FailureRecord, JobResult
from dlrover_core.protocol.status import JobState, JobStatus, MasterStatus, NodeRow

__all__ = [
    "Action",
    "ActionAnswer",
    "Cancel",
    "CheckpointErrorReport",
    "ENDPOINTS",
    "Endpoint",
    "Exited",
    "FailureRecord",
    "FailureReport",
    "Heartbeat",
    "HeartbeatAnswer",
    "JobEvent",
    "JobResult",
    "JobState",
    "JobStatus",
    "Join",
    "Joined",
    "MasterStatus",
    "NodeCheckReport",
    "NodeCheckResult",
    "NodeRelaunch",
    "NodeRow",
    "Poll",
    "PollState",
    "Register",
    "Registered",
    "RestoreDecision",
    "RestorePlanRequest",
    "RestoreVerify",
    "RestoreVerifyAnswer",
    "RoundAssignment",
    "ShardAnswer",
    "ShardReport",
    "Succeeded",
    "WorkerException",
    "WorkerFailure",
    "converter",
    "decode",
    "encode",
]
