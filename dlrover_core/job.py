"""The user's :class:`Job`: the plain-data :class:`~dlrover_core.spec.JobSpec` plus what a
user does with it (``validate``, ``dryrun``, ``submit``, ``run``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from dlrover_core.runner import JobRun, dryrun, submit
from dlrover_core.spec import JobSpec
from dlrover_core.validation import declare_replicated, validate_job

if TYPE_CHECKING:
    from dlrover_core.protocol import JobResult
    from dlrover_core.scheduler_backend import Plan

__all__ = ["Job"]


@attrs.frozen(kw_only=True)
class Job(JobSpec):
    """A distributed training job (the fields are :class:`~dlrover_core.spec.JobSpec`'s)::

        job = Job(name="charlm", entrypoint="examples/charlm/train.py", nodes="1:2")
        print(job.dryrun())
        result = job.run()

    Building a Job checks each field by itself; :meth:`validate` (run by :meth:`dryrun`,
    :meth:`submit` and :meth:`run`) checks it against this machine's plugins and files.
    :meth:`dryrun`, :meth:`submit` and :meth:`run` plan the job with what the plugins declare
    about it filled in as data (each parallel strategy's replicated state:
    :func:`~dlrover_core.validation.declare_replicated`).
    """

    def validate(self) -> Job:
        """Check backend names, ``workdir``, ``entrypoint`` and ``scheduler_options`` against
        this machine; return ``self``. Raises :class:`~dlrover_core.errors.JobSpecError`
        naming the field and the fix."""
        validate_job(self)
        return self

    def dryrun(self) -> Plan:
        """The exact plan the scheduler would execute (processes, scripts, manifests). Pure."""
        return dryrun(declare_replicated(self))

    def submit(self, *, detach: bool = False) -> JobRun:
        """Start the job and return a handle without waiting (see :class:`~dlrover_core.runner.JobRun`).
        With ``detach``, the job outlives the calling process (else it is cancelled when it exits)."""
        return submit(declare_replicated(self), detach=detach)

    def run(self, *, progress: bool = True) -> JobResult:
        """Run the job to the end, showing logs and live progress; return its JobResult
        (:meth:`~dlrover_core.runner.JobRun.wait`). Ctrl-C (SIGINT) or SIGTERM meanwhile cancels
        the job: the result is CANCELLED, and a script exits with
        ``dlrover_core.runner.exit_code(result, run.stop_signal)`` (130, 143) when it needs the
        signal, by calling ``submit()`` and ``wait()`` itself."""
        return self.submit().wait(progress=progress)
