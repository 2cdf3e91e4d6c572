"""A scheduler backend that records what it is asked to do and starts nothing."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import attrs

from dlrover_core.protocol import JobResult, JobState, JobStatus, MasterStatus, NodeRelaunch
from dlrover_core.scheduler_backend import Capabilities, JobHandle, Plan, SchedulerBackend
from dlrover_core.spec import JobSpec

__all__ = ["RecordingRequest", "RecordingScheduler"]


@attrs.frozen(kw_only=True)
class RecordingRequest:
    """The recording scheduler's native request: the Job as JSON (what it would send)."""

    job_json: str


class RecordingScheduler(SchedulerBackend):
    """Registered as ``"recording"`` by the test kit: ``Job(scheduler="recording")``.

    ``dryrun(job)`` builds a :class:`~dlrover_core.backend.Plan` with no processes and
    the Job as JSON in ``files["job.json"]`` (its request: a :class:`RecordingRequest`);
    ``submit`` writes ``plan.txt`` into the run directory, as every backend does, and starts
    nothing. Every call is appended to a class-level list (the core instantiates backends
    anew for each use), so a test reads them after the fact:

    * :attr:`dryruns` — every Plan built, :attr:`submitted` — every Plan submitted;
    * :attr:`cancelled` — handles cancelled; :attr:`relaunched` — ``(handle, request)``, the
      :class:`~dlrover_core.protocol.NodeRelaunch` the master sent.

    A submitted job ends at once in :attr:`final_state` (``SUCCEEDED``; set it to
    ``FAILED`` to see how code reacts to a failed job), so ``job.run()`` returns a
    :class:`~dlrover_core.protocol.JobResult` immediately; its status is what a master in
    that state answers (:attr:`master_status`, mapped by ``MasterStatus.to_job_status``).
    It declares every capability and no option; subclass it with other :attr:`capabilities`
    or :attr:`options` to test capability and option checks. :meth:`reset` clears the
    records (the ``dlrover_host`` fixture calls it).
    """

    name = "recording"
    capabilities: ClassVar[Capabilities] = Capabilities(
        elastic=True, relaunch_node=True, follow_logs=True, multi_host=True
    )

    dryruns: ClassVar[list[Plan]] = []
    submitted: ClassVar[list[Plan]] = []
    cancelled: ClassVar[list[JobHandle]] = []
    relaunched: ClassVar[list[tuple[JobHandle, NodeRelaunch]]] = []
    final_state: ClassVar[JobState] = JobState.SUCCEEDED
    request_type = RecordingRequest

    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def reset(cls) -> None:
        """Clear every record and set :attr:`final_state` back to ``SUCCEEDED``."""
        with cls._lock:
            for records in (cls.dryruns, cls.submitted, cls.cancelled, cls.relaunched):
                records.clear()
            cls.final_state = JobState.SUCCEEDED

    def build_plan(self, job: JobSpec, *, job_id: str, log_dir: str, options: dict[str, Any]) -> Plan:
        text = json.dumps(job.to_dict(), indent=1, sort_keys=True)
        plan = Plan(scheduler=self.name, job_id=job_id, job=job, log_dir=log_dir,
                    request=RecordingRequest(job_json=text), files={"job.json": text})
        with self._lock:
            self.dryruns.append(plan)
        return plan

    def execute(self, plan: Plan) -> JobHandle:
        with self._lock:
            self.submitted.append(plan)
        return JobHandle(scheduler=self.name, job_id=plan.job_id, log_dir=plan.log_dir)

    def _plan(self, handle: JobHandle) -> Plan | None:
        with self._lock:
            return next((p for p in reversed(self.submitted) if p.job_id == handle.job_id), None)

    def master_status(self, plan: Plan) -> dict[str, Any]:
        """What the job's master would answer on ``/v1/status`` (the wire form)."""
        return {"job_id": plan.job_id, "state": self.final_state.value, "max_nodes": plan.job.nodes.max,
                "message": "", "node_table": []}

    def status(self, handle: JobHandle) -> JobStatus:
        plan = self._plan(handle)
        if plan is None:
            return JobStatus(state=JobState.UNKNOWN, message=f"{handle} was not submitted")
        return MasterStatus.from_wire(self.master_status(plan)).to_job_status()

    def logs(self, handle: JobHandle, *, follow: bool = False) -> Iterator[str]:
        return iter(())

    def cancel(self, handle: JobHandle) -> None:
        with self._lock:
            self.cancelled.append(handle)

    def relaunch_node(self, handle: JobHandle, request: NodeRelaunch) -> None:
        with self._lock:
            self.relaunched.append((handle, request))

    def result(self, handle: JobHandle) -> JobResult | None:
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
