"""The scheduler-backend interface and the plain data it exchanges with the runner.

``JobState``, ``JobStatus`` and ``JobResult`` live in :mod:`dlrover_core.protocol` and are
re-exported here for backend authors."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

import attrs

from dlrover_core.protocol import JobResult, JobState, JobStatus, NodeRelaunch

if TYPE_CHECKING:
    from dlrover_core.spec import JobSpec

__all__ = [
    "Capabilities",
    "JobHandle",
    "JobResult",
    "JobState",
    "JobStatus",
    "Plan",
    "ProcessSpec",
    "SchedulerBackend",
]


@attrs.frozen(kw_only=True)
class Capabilities:
    """What a scheduler backend can do, declared as data so a Job fails early.

    Attributes:
        elastic: runs jobs whose node count varies (``Nodes(min < max)``).
        relaunch_node: can replace a failed node (``relaunch_node``).
        follow_logs: ``logs(follow=True)`` streams until the job ends.
        multi_host: nodes can live on different machines.
        storage_on_submit_host: the nodes see the checkpoint storage as the submitting
            machine does (local processes, containers with it bound in), so ``submit``
            refuses one that this machine cannot write before anything starts.
    """

    elastic: bool = False
    relaunch_node: bool = False
    follow_logs: bool = False
    multi_host: bool = False
    storage_on_submit_host: bool = False


@attrs.frozen(kw_only=True)
class ProcessSpec:
    """One process a backend will start, exactly.

    Attributes:
        role: ``"master"`` or ``"agent"``.
        name: unique within the plan, e.g. ``"master"``, ``"node-1"``.
        argv: the full command line.
        env: variables set on top of the inherited environment.
        cwd: working directory.
        log_file: where its stdout and stderr go.
    """

    role: str
    name: str
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    log_file: str


@attrs.frozen(kw_only=True)
class Plan:
    """The exact native request a backend would submit; returned by ``dryrun`` (pure).

    Attributes:
        scheduler: the backend's name.
        job_id: unique id of this job run.
        job: the Job it was made from.
        log_dir: where the job writes logs, events and its result.
        processes: processes to start (local backends); empty for remote ones.
        files: native documents by name (an sbatch script, manifests...).
        workers: preview of the worker processes of the first rendezvous round, as
            ``ProcessSpec`` with role ``"worker"``; ranks can differ in later rounds.
    """

    scheduler: str
    job_id: str
    job: JobSpec
    log_dir: str
    processes: tuple[ProcessSpec, ...] = ()
    files: dict[str, str] = attrs.field(factory=dict)
    workers: tuple[ProcessSpec, ...] = ()

    def __str__(self) -> str:
        lines = [f"# plan: scheduler={self.scheduler} job_id={self.job_id} log_dir={self.log_dir}"]
        for title, procs in (("processes", self.processes), ("workers (first round)", self.workers)):
            if procs:
                lines.append(f"## {title}")
            for p in procs:
                lines.append(f"[{p.name}] cwd={p.cwd} log={p.log_file}")
                for k in sorted(p.env):
                    v = p.env[k]
                    if len(v) > 160:
                        v = v[:157] + "..."
                    lines.append(f"    {k}={v}")
                lines.append("    $ " + " ".join(p.argv))
        if self.job.parallel is not None:
            lines.append("## parallel strategies (applied in this order by train.prepare())")
            lines.extend(f"    {line}" for line in self.job.parallel.describe())
        for name, text in self.files.items():
            lines.append(f"## file {name}")
            lines.append(text.rstrip("\n"))
        return "\n".join(lines)


@attrs.frozen(kw_only=True)
class JobHandle:
    """How to find a submitted job again: ``str(handle)`` is ``"<scheduler>://<job_id>"``."""

    scheduler: str
    job_id: str
    log_dir: str
    native_id: str = ""

    def __str__(self) -> str:
        return f"{self.scheduler}://{self.job_id}"


class SchedulerBackend(abc.ABC):
    """Runs the master and one agent per node somewhere, registered through
    ``dlrover_register_schedulers``. Every method but ``dryrun`` may have side effects;
    ``dryrun`` builds the exact native request and nothing else (TorchX's model)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities] = Capabilities()

    def check(self, job: JobSpec) -> None:
        """Raise :class:`~dlrover_core.errors.JobSpecError` if ``job`` needs a capability
        this backend lacks."""
        from dlrover_core.errors import JobSpecError

        if job.nodes.min != job.nodes.max and not self.capabilities.elastic:
            raise JobSpecError(
                "nodes",
                f"{job.nodes.min}:{job.nodes.max}",
                f"scheduler {self.name!r} does not run elastic jobs; use min == max",
            )

    @abc.abstractmethod
    def dryrun(self, job: JobSpec) -> Plan:
        """Build the exact native request for ``job``. Pure: starts and writes nothing."""

    @abc.abstractmethod
    def submit(self, plan: Plan) -> JobHandle:
        """Start what ``plan`` describes; return without waiting for the job."""

    @abc.abstractmethod
    def status(self, handle: JobHandle) -> JobStatus:
        """The job's live status (``UNKNOWN`` when it cannot be reached)."""

    @abc.abstractmethod
    def logs(self, handle: JobHandle, *, follow: bool = False) -> Iterator[str]:
        """Lines of the job's logs, each prefixed by its source; with ``follow`` keep
        yielding until the job ends."""

    @abc.abstractmethod
    def cancel(self, handle: JobHandle) -> None:
        """Stop the job and remove everything it started. Idempotent."""

    @abc.abstractmethod
    def relaunch_node(self, handle: JobHandle, request: NodeRelaunch) -> None:
        """Start an agent for ``request.node_id``, replacing ``request.replaces`` (the same id
        when a node is replaced in place; another when an excluded node gets a successor)."""

    def supervise(self, handle: JobHandle) -> None:
        """Keep the job's control plane alive (called regularly while a runner waits): e.g.
        restart a master that died. Default: nothing (the platform restarts it)."""

    @abc.abstractmethod
    def result(self, handle: JobHandle) -> JobResult | None:
        """The final :class:`~dlrover_core.protocol.JobResult`, or ``None`` while running."""
