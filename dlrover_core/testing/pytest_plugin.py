"""pytest fixtures for testing dlrover plugins, loaded automatically where dlrover-core is
installed (entry point ``pytest11: dlrover``; disable with ``-p no:dlrover``).

* ``dlrover_host`` — a fresh process-wide plugin host: the core's built-ins plus the test
  kit's ``memory`` storage and ``recording`` scheduler, no installed plugin; register yours
  with :func:`~dlrover_core.testing.register_plugin` or ``dlrover_host.register(...)``.
* ``make_job`` — ``make_job(**fields)`` builds a valid :class:`~dlrover_core.Job` whose
  paths (script, workdir, logs, checkpoints) lie in the test's ``tmp_path``.
* ``log_events`` — the structlog events logged during the test, as dicts
  (``structlog.testing.capture_logs``).
"""

from __future__ import annotations

from typing import Any

import pytest
import structlog

from dlrover_core import Job
from dlrover_core.spec import Checkpoint
from dlrover_core.testing.plugins import fresh_host

__all__ = ["dlrover_host", "log_events", "make_job"]

#: The script ``make_job`` uses as entrypoint unless told otherwise: one step, reported.
TINY_SCRIPT = '''"""A one-step training script written by the make_job fixture."""
from dlrover_core import train

info = train.init()
train.report(0, loss=0.0)
'''


@pytest.fixture
def dlrover_host() -> Any:
    """A fresh :class:`~dlrover_core.plugins.PluginHost` installed as the process-wide host for
    this test (built-ins, plus the kit's ``memory`` storage and ``recording`` scheduler)."""
    with fresh_host() as host:
        yield host


@pytest.fixture
def make_job(tmp_path) -> Any:
    """A factory of valid Jobs: ``make_job(scheduler="recording", checkpoint=Checkpoint(...))``.

    Defaults: ``name="test-job"``, a one-step script as ``entrypoint``, ``accelerator="cpu"``,
    ``workdir``/``log_dir``/``checkpoint.dir`` under ``tmp_path``. Any Job field may be given;
    the Job is validated (``Job.validate()``): names (scheduler, storage, optimizer...) and
    ``scheduler_options`` are checked against the current plugin host.
    """
    def make(**fields: Any) -> Job:
        script = tmp_path / "train.py"
        if not script.exists():
            script.write_text(TINY_SCRIPT)
        defaults: dict[str, Any] = {
            "name": "test-job", "entrypoint": str(script), "accelerator": "cpu", "workdir": str(tmp_path),
            "log_dir": str(tmp_path / "runs"), "checkpoint": Checkpoint(dir=str(tmp_path / "checkpoints")),
        }
        return Job(**{**defaults, **fields}).validate()

    return make


@pytest.fixture
def log_events() -> Any:
    """Structlog events logged during the test, each a dict with ``event`` and ``log_level``
    plus its key-value context: ``assert {"event": "plugin_import_failed", ...} in ...``."""
    with structlog.testing.capture_logs() as events:
        yield events
