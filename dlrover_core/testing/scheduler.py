"""A scheduler backend that records what it is asked to do and starts nothing."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from dlrover_core.protocol import JobState, JobStatus
from dlrover_core.schedulers.base import Capabilities, JobHandle, Plan, SchedulerBackend

if TYPE_CHECKING:
    from dlrover_core.protocol import JobResult
    from dlrover_core.spec import JobSpec

__all__ = ["RecordingScheduler"]


class RecordingScheduler(SchedulerBackend):
    """Registered as ``"recording"`` by the test kit: ``Job(scheduler="recording")``.

    ``dryrun(job)`` builds a :class:`~dlrover_core.schedulers.Plan` with no processes and
    the Job as JSON in ``files["job.json"]``; ``submit`` starts nothing. Every call is
    appended to a class-level list (the core instantiates backends anew for each use), so
    a test reads them after the fact:

    * :attr:`dryruns` — every Plan built, :attr:`submitted` — every Plan submitted;
    * :attr:`cancelled` — handles cancelled; :attr:`relaunched` — ``(handle, node_id)``.

    A submitted job ends at once in :attr:`final_state` (``SUCCEEDED``; set it to
    ``FAILED`` to see how code reacts to a failed job), so ``job.run()`` returns a
    :class:`~dlrover_core.protocol.JobResult` immediately. It declares every capability;
    subclass it with other :attr:`capabilities` to test capability checks.
    :meth:`reset` clears the records (the ``dlrover_host`` fixture calls it).
    """

    name = "recording"
    capabilities: ClassVar[Capabilities] = Capabilities(
        elastic=True, relaunch_node=True, follow_logs=True, multi_host=True
    )

    dryruns: ClassVar[list[Plan]] = []
    submitted: ClassVar[list[Plan]] = []
    cancelled: ClassVar[list[JobHandle]] = []
    relaunched: ClassVar[list[tuple[JobHandle, int]]] = []
    final_state: ClassVar[JobState] = JobState.SUCCEEDED

    _ids: ClassVar[Iterator[int]] = itertools.count()
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def reset(cls) -> None:
        """Clear every record and set :attr:`final_state` back to ``SUCCEEDED``."""
        with cls._lock:
            for records in (cls.dryruns, cls.submitted, cls.cancelled, cls.relaunched):
                records.clear()
            cls.final_state = JobState.SUCCEEDED

    def dryrun(self, job: JobSpec) -> Plan:
        self.check(job)
        with self._lock:
            job_id = f"{job.name}-{next(self._ids):04d}"
        plan = Plan(
            scheduler=self.name, job_id=job_id, job=job, log_dir=str(Path(job.log_dir) / job_id),
            files={"job.json": json.dumps(job.to_dict(), indent=1, sort_keys=True)},
        )
        with self._lock:
            self.dryruns.append(plan)
        return plan

    def submit(self, plan: Plan) -> JobHandle:
        with self._lock:
            self.submitted.append(plan)
        return JobHandle(scheduler=self.name, job_id=plan.job_id, log_dir=plan.log_dir)

    def _plan(self, handle: JobHandle) -> Plan | None:
        with self._lock:
            return next((p for p in reversed(self.submitted) if p.job_id == handle.job_id), None)

    def status(self, handle: JobHandle) -> JobStatus:
        plan = self._plan(handle)
        if plan is None:
            return JobStatus(state=JobState.UNKNOWN, message=f"{handle} was not submitted")
        return JobStatus(state=self.final_state, max_nodes=plan.job.nodes.max)

    def logs(self, handle: JobHandle, *, follow: bool = False) -> Iterator[str]:
        return iter(())

    def cancel(self, handle: JobHandle) -> None:
        with self._lock:
            self.cancelled.append(handle)

    def relaunch_node(self, handle: JobHandle, node_id: int) -> None:
        with self._lock:
            self.relaunched.append((handle, node_id))

    def result(self, handle: JobHandle) -> JobResult | None:
        from dlrover_core.protocol import JobResult

        plan = self._plan(handle)
        if plan is None:
            return None
        failed = self.final_state != JobState.SUCCEEDED
        return JobResult(
            job_id=handle.job_id, state=self.final_state,
            reason=f"{self.name} scheduler: final_state={self.final_state.value}" if failed else "",
            final_step=-1, restarts=0, wall_time_s=0.0, productive_s=0.0, goodput=0.0, checkpoint_stall_s=0.0,
            restore_s=0.0, recomputed_s=0.0, detection_s=0.0, restart_s=0.0, rendezvous_s=0.0, startup_s=0.0,
            failures=(), metrics={}, log_dir=handle.log_dir,
        )

