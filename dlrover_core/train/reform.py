"""Asking the job master for a place in the live world (docs/design.md §5a): the question
both the training loop (``train.steps()``) and a sharded job's replacement (at
``train.init()``) ask, and the answer the replacement joined with."""

from __future__ import annotations

import time
from typing import Any

from dlrover_core.errors import DLRoverError, MasterUnavailableError
from dlrover_core.protocol.messages import LiveAssignment, LiveReform

__all__ = ["LiveRecoveryError", "ask", "joined", "set_joined"]

#: How often a worker asks the master again while its generation forms: first after
#: ``_POLL_S``, then each wait 1.5 times longer up to ``_POLL_MAX_S`` (seconds), so that a
#: re-form of thousands of workers does not flood the master.
_POLL_S = 0.005
_POLL_MAX_S = 0.1

_joined: LiveAssignment | None = None


class LiveRecoveryError(DLRoverError):
    """The job master cannot be reached while the world re-forms, or the training state
    cannot be sent to a replacement (a ``state_dict()`` value that ``pickle`` refuses: the
    message names it), or a sharded job's replacement restored another step than its peers
    resume after. A worker whose world cannot go on live — every worker restarts, or the
    job ended — exits quietly instead: its agent stops it anyway."""


def ask(client: Any, message: LiveReform) -> LiveAssignment:
    """Ask ``client`` (a :class:`~dlrover_core.protocol.client.MasterClient`) until the
    answer is not ``waiting``.

    Raises:
        LiveRecoveryError: the job master is unreachable.
    """
    wait_s = _POLL_S
    while True:
        try:
            answer = client.live_reform(message)
        except MasterUnavailableError as exc:
            raise LiveRecoveryError(f"the job master is unreachable: {exc}") from exc
        if answer.state != "waiting":
            return answer
        time.sleep(wait_s)
        wait_s = min(_POLL_MAX_S, wait_s * 1.5)


def set_joined(answer: LiveAssignment) -> None:
    """A sharded job's replacement joined the running generation at ``train.init()``."""
    global _joined
    _joined = answer


def joined() -> LiveAssignment | None:
    """The generation this process joined at ``train.init()`` as a sharded job's
    replacement (its ``resume_step`` is the step to load), or ``None``."""
    return _joined
