"""The scheduler-backend interface, its template, and the plain data it exchanges with the runner.

A backend is a template (TorchX's ``submit_dryrun`` → ``schedule``): :meth:`SchedulerBackend.dryrun`
checks the Job against the backend's capabilities and declared options, resolves the options
(the Job's ``scheduler_options``, else an option's environment variable, else its default),
makes the workdir and log_dir absolute, mints the job id and then asks the backend to
:meth:`~SchedulerBackend.build_plan`: a :class:`Plan` carrying a typed, backend-specific
``request`` (k8s manifests, an sbatch script and its argv, container specs, processes).
:meth:`SchedulerBackend.submit` records the plan in the run directory (``plan.txt`` for
people; ``request.json``, the typed :class:`Submission`, for the backend itself) and hands it
to :meth:`~SchedulerBackend.execute`, which acts on ``plan.request`` as it is, never on the
text rendered from it. A backend that needs its request or the Job again (a relaunch, a
status after the submitting process restarted) reads :meth:`SchedulerBackend.submission`,
never its own output.

``JobState``, ``JobStatus`` and ``JobResult`` live in :mod:`dlrover_core.protocol` and are
re-exported here for backend authors."""

from __future__ import annotations

import abc
import json
import os
import secrets
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from dlrover_core import rundir
from dlrover_core.errors import JobSpecError, ProtocolError, SchedulerError
from dlrover_core.fileio import write_atomic
from dlrover_core.logging import get_logger
from dlrover_core.protocol import JobResult, JobState, JobStatus, NodeRelaunch
from dlrover_core.protocol.codec import decode, encode
from dlrover_core.spec import JobSpec

if TYPE_CHECKING:
    from dlrover_core.accelerators.base import Accelerator

__all__ = [
    "Capabilities",
    "JobHandle",
    "JobResult",
    "JobState",
    "JobStatus",
    "OptionValue",
    "Plan",
    "ProcessSpec",
    "SchedulerBackend",
    "SchedulerOption",
    "Submission",
    "new_job_id",
    "read_result",
    "resolve_options",
    "status_of_result",
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
        devices_on_submit_host: the nodes use this machine's devices, so ``dryrun`` probes
            them here: ``accelerator="auto"`` becomes the accelerator found and
            ``nproc_per_node="auto"`` its device count (see
            :meth:`SchedulerBackend.resolve_accelerator`).
    """

    elastic: bool = False
    relaunch_node: bool = False
    follow_logs: bool = False
    multi_host: bool = False
    storage_on_submit_host: bool = False
    devices_on_submit_host: bool = False


# ----- options as data ------------------------------------------------------------------------

#: The value types an option may declare, by their name in messages and ``dlrover plugins list``.
_TYPE_NAMES: dict[type, str] = {str: "str", int: "int", float: "float", bool: "bool", list: "list[str]"}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@attrs.frozen(kw_only=True)
class SchedulerOption:
    """One setting of a scheduler backend that is not part of the job's shape (an image, a
    namespace, a partition), given as ``Job(scheduler_options={name: value})``.

    Attributes:
        name: the key in ``scheduler_options``.
        type: ``str``, ``int``, ``float``, ``bool`` or ``list`` (a list of strings; from the
            environment, comma-separated).
        default: the value when neither the Job nor ``env`` sets it (``None``: unset).
        help: what it does, in one line.
        env: an environment variable read (by ``dryrun``, on the submitting machine) when the
            Job does not set the option: a fallback only.
    """

    name: str
    type: type = attrs.field(validator=attrs.validators.in_(tuple(_TYPE_NAMES)))
    default: Any = None
    help: str = ""
    env: str | None = None

    @property
    def type_name(self) -> str:
        """``"str"``, ``"int"``, ``"float"``, ``"bool"`` or ``"list[str]"``."""
        return _TYPE_NAMES[self.type]

    def convert(self, value: Any, *, field: str | None = None) -> Any:
        """``value`` (a JSON value) as this option's type: a list becomes a tuple, an int a
        float where a float is expected.

        Raises:
            JobSpecError: naming ``field`` (default ``scheduler_options['<name>']``), the value
                and the expected type.
        """
        field = field or f"scheduler_options[{self.name!r}]"
        t = self.type
        if value is None and self.default is None:
            return None
        if t is list:
            if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                return tuple(value)
        elif t is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        elif t is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif isinstance(value, t):
            return value
        what = ("an " if self.type_name[0] in "aeiou" else "a ") + self.type_name
        raise JobSpecError(field, value, f"{what} for scheduler option {self.name!r}" + (
            f": {self.help}" if self.help else ""))

    def parse_env(self, raw: str) -> Any:
        """The text of ``env`` as this option's type (a list is comma-separated).

        Raises:
            JobSpecError: naming the variable, its text and the expected type.
        """
        text = raw.strip()
        try:
            if self.type is list:
                return tuple(s.strip() for s in text.split(",") if s.strip())
            if self.type is bool:
                if text.lower() in _TRUE + _FALSE:
                    return text.lower() in _TRUE
                raise ValueError(text)
            return self.type(text)
        except ValueError:
            expected = {int: "a whole number", float: "a number", bool: f"one of {', '.join(_TRUE + _FALSE)}"}
            raise JobSpecError(str(self.env), raw, f"{expected.get(self.type, self.type_name)}: it is the fallback "
                                                   f"of scheduler_options[{self.name!r}]") from None

    def describe(self) -> dict[str, Any]:
        """Name, type, default, env and help as plain data (``dlrover plugins list --json``)."""
        default = list(self.default) if isinstance(self.default, tuple) else self.default
        return {"name": self.name, "type": self.type_name, "default": default, "env": self.env, "help": self.help}


@attrs.frozen(kw_only=True)
class OptionValue:
    """A resolved option, as the plan shows it.

    Attributes:
        name: the option.
        value: the value the backend uses.
        source: ``"job"`` (``scheduler_options``), ``"configured"`` (the backend instance
            was built with it), ``"$VAR"`` (the environment fallback) or ``"default"``.
    """

    name: str
    value: Any
    source: str


def resolve_options(
    declared: tuple[SchedulerOption, ...],
    given: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    configured: Mapping[str, Any] | None = None,
) -> tuple[OptionValue, ...]:
    """Every declared option's value: ``given`` (the Job's), else ``configured`` (what the
    backend instance was built with), else its environment variable in ``environ`` (default
    ``os.environ``; empty counts as unset), else its default. Unknown names in ``given`` are
    :meth:`SchedulerBackend.check_options`'s business, not this function's.

    Raises:
        JobSpecError: a given value of the wrong type, or an environment variable that does
            not parse as the option's type.
    """
    environ = os.environ if environ is None else environ
    configured = configured or {}
    out = []
    for option in declared:
        if option.name in given:
            value, source = option.convert(given[option.name]), "job"
        elif option.name in configured:
            value, source = configured[option.name], "configured"
        elif option.env and environ.get(option.env, "").strip():
            value, source = option.parse_env(environ[option.env]), f"${option.env}"
        else:
            value, source = option.default, "default"
        out.append(OptionValue(name=option.name, value=value, source=source))
    return tuple(out)


# ----- the plan -------------------------------------------------------------------------------


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


def _json(value: Any) -> str:
    return json.dumps(list(value) if isinstance(value, tuple) else value)


@attrs.frozen(kw_only=True)
class Plan:
    """The exact native request a backend would submit; returned by ``dryrun`` (pure).

    Attributes:
        scheduler: the backend's name.
        job_id: unique id of this job run.
        job: the Job it was made from (workdir and log_dir absolute).
        log_dir: where the job writes logs, events and its result.
        request: the backend's typed native request (a frozen attrs object of its own, e.g.
            the manifests, the sbatch script and its argv, the container specs): what
            ``submit`` executes.
        options: the backend's options as resolved for this plan (value and source).
        processes: processes to start (local backends); empty for remote ones.
        files: native documents by name (an sbatch script, manifests...), rendered from
            ``request`` for people, golden files and ``kubectl``.
        workers: preview of the worker processes of the first rendezvous round, as
            ``ProcessSpec`` with role ``"worker"``; ranks can differ in later rounds.
    """

    scheduler: str
    job_id: str
    job: JobSpec
    log_dir: str
    request: Any = None
    options: tuple[OptionValue, ...] = ()
    processes: tuple[ProcessSpec, ...] = ()
    files: dict[str, str] = attrs.field(factory=dict)
    workers: tuple[ProcessSpec, ...] = ()

    def option(self, name: str) -> Any:
        """The resolved value of option ``name``."""
        for o in self.options:
            if o.name == name:
                return o.value
        raise KeyError(name)

    def __str__(self) -> str:
        lines = [f"# plan: scheduler={self.scheduler} job_id={self.job_id} log_dir={self.log_dir}"]
        if self.options:
            lines.append("## scheduler options (the Job's scheduler_options, else the environment variable, "
                         "else the default)")
            lines.extend(f"    {o.name}={_json(o.value)}  ({o.source})" for o in self.options)
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
class Submission:
    """What :meth:`SchedulerBackend.submit` persisted of a plan (``<run dir>/request.json``):
    typed, so a backend finds its request and the Job again without reading its own output.

    Attributes:
        scheduler: the backend's name.
        job_id: the run's id.
        log_dir: the run directory.
        job: the Job the plan was made from.
        request: the plan's typed request (of the backend's ``request_type``; where it declares
            none, the request as JSON data).
        processes: the plan's processes (local backends).
    """

    scheduler: str
    job_id: str
    log_dir: str
    job: JobSpec
    request: Any = None
    processes: tuple[ProcessSpec, ...] = ()

    @classmethod
    def of(cls, plan: Plan) -> Submission:
        """The submission of ``plan``."""
        return cls(scheduler=plan.scheduler, job_id=plan.job_id, log_dir=plan.log_dir, job=plan.job,
                   request=plan.request, processes=plan.processes)

    def to_json(self) -> str:
        """As ``request.json`` holds it.

        Raises:
            TypeError, ValueError: the request does not turn into JSON.
        """
        return json.dumps({
            "scheduler": self.scheduler, "job_id": self.job_id, "log_dir": self.log_dir, "job": self.job.to_dict(),
            "request": encode(self.request), "processes": [encode(p) for p in self.processes],
        }, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, request_type: type | None = None) -> Submission:
        """Read ``request.json`` back, its request as ``request_type`` (``None``: plain data).

        Raises:
            ValueError: not JSON; JobSpecError (a ValueError): the Job does not decode;
            ProtocolError (a ValueError): the request or a process does not decode.
        """
        data = json.loads(text)
        request = data.get("request")
        return cls(scheduler=data["scheduler"], job_id=data["job_id"], log_dir=data["log_dir"],
                   job=JobSpec.from_dict(data["job"]),
                   request=request if request_type is None else decode(request_type, request),
                   processes=tuple(decode(ProcessSpec, p) for p in data.get("processes", ())))


@attrs.frozen(kw_only=True)
class JobHandle:
    """How to find a submitted job again: ``str(handle)`` is ``"<scheduler>://<job_id>"``."""

    scheduler: str
    job_id: str
    log_dir: str
    native_id: str = ""

    def __str__(self) -> str:
        return f"{self.scheduler}://{self.job_id}"


# ----- what every backend shares --------------------------------------------------------------


def new_job_id(name: str) -> str:
    """A fresh id for a run of the job ``name``: ``<name>-<YYYYmmdd-HHMMSS>-<4 hex digits>``."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def read_result(log_dir: str | Path) -> JobResult | None:
    """The :class:`JobResult` the master wrote to ``<log_dir>/result.json``; ``None`` while
    there is none."""
    try:
        text = rundir.RunDir(log_dir).result.read_text()
    except FileNotFoundError:
        return None
    return JobResult.from_dict(json.loads(text))


def status_of_result(result: JobResult) -> JobStatus:
    """The status of a finished job, from its result: what the master's last status said
    that the result keeps (the run's length, throughput, goodput, wall time), so the final
    progress line of a job whose master has exited is not poorer than the one before it."""
    return JobStatus(state=result.state, step=result.final_step, metrics=dict(result.metrics),
                     restarts=result.restarts, message=result.reason,
                     root_cause=result.root_cause if result.failures else None,
                     total_steps=result.total_steps, samples_per_s=result.samples_per_s,
                     tokens_per_s=result.tokens_per_s, elapsed_s=result.wall_time_s,
                     goodput={"goodput": result.goodput} if result.steps_reported else {})


class SchedulerBackend(abc.ABC):
    """Runs the master and one agent per node somewhere, registered through
    ``dlrover_register_schedulers``.

    A backend declares :attr:`name`, :attr:`capabilities`, :attr:`options` and
    :attr:`request_type`, and implements :meth:`build_plan` (pure) and :meth:`execute`, plus
    :meth:`status`, :meth:`logs`, :meth:`cancel` and :meth:`relaunch_node`; :meth:`result`
    reads ``<log_dir>/result.json`` unless overridden. :meth:`dryrun` and :meth:`submit` are
    the template around them (do not override them)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: The backend's settings, as data: ``Job(scheduler_options=...)`` names them.
    options: ClassVar[tuple[SchedulerOption, ...]] = ()
    #: The class of ``Plan.request`` that :meth:`build_plan` makes and :meth:`execute` takes
    #: (``None``: not checked).
    request_type: ClassVar[type | None] = None

    # ----- options -----------------------------------------------------------------------

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Refuse an option this backend does not declare, or a value of the wrong type.

        Raises:
            JobSpecError: naming ``scheduler_options['<name>']``, the value and the fix (the
                known options, or the expected type).
        """
        declared = {o.name: o for o in cls.options}
        for key, value in options.items():
            option = declared.get(key)
            if option is None:
                known = (f"an option of scheduler {cls.name!r}: {', '.join(sorted(declared))}" if declared else
                         f"nothing: scheduler {cls.name!r} takes no options")
                raise JobSpecError(f"scheduler_options[{key!r}]", value, f"{known} (`dlrover plugins list` shows "
                                                                         "every scheduler's options)")
            option.convert(value)

    @classmethod
    def resolve_options(cls, given: Mapping[str, Any], *, environ: Mapping[str, str] | None = None,
                        configured: Mapping[str, Any] | None = None) -> tuple[OptionValue, ...]:
        """This backend's options for a Job: see :func:`resolve_options`."""
        return resolve_options(cls.options, given, environ=environ, configured=configured)

    def configured_options(self) -> Mapping[str, Any]:
        """Option values this instance was built with (e.g. ``K8sScheduler(K8sConfig(...))``):
        below the Job's ``scheduler_options``, above the environment. Default: none."""
        return {}

    # ----- checks and the job's devices ----------------------------------------------------

    def check(self, job: JobSpec) -> None:
        """Raise :class:`~dlrover_core.errors.JobSpecError` if ``job`` needs a capability
        this backend lacks."""
        if job.nodes.min != job.nodes.max and not self.capabilities.elastic:
            raise JobSpecError(
                "nodes",
                f"{job.nodes.min}:{job.nodes.max}",
                f"scheduler {self.name!r} does not run elastic jobs; use min == max",
            )

    def resolve_accelerator(self, job: JobSpec, host: Any) -> tuple[JobSpec, Accelerator | None]:
        """The job's accelerator, looked up in ``host`` (the plugin host: ``get_host()``).

        With :attr:`Capabilities.devices_on_submit_host`, the devices are probed here:
        ``"auto"`` becomes the present accelerator of highest priority, ``nproc_per_node="auto"``
        its :meth:`~dlrover_core.accelerators.base.Accelerator.default_nproc_per_node`, and the
        returned job says both. Otherwise the nodes' devices are elsewhere: nothing is probed,
        a named accelerator is instantiated as registered, ``"auto"`` gives ``None`` (each node
        probes its own) and ``nproc_per_node`` is left as it is.

        Raises:
            PluginNotFoundError: no accelerator of that name is registered.
            DeviceError: probing here found no device of the named accelerator.
        """
        if self.capabilities.devices_on_submit_host:
            accelerator = host.create_accelerator(job.accelerator)
            nproc = job.nodes.nproc_per_node
            nproc = accelerator.default_nproc_per_node() if nproc == "auto" else int(nproc)
            job = attrs.evolve(job, accelerator=accelerator.name, nodes=attrs.evolve(job.nodes, nproc_per_node=nproc))
            return job, accelerator
        if job.accelerator == "auto":
            return job, None
        return job, host.registries.accelerator.get(job.accelerator)()

    # ----- the template --------------------------------------------------------------------

    def dryrun(self, job: JobSpec) -> Plan:
        """The exact native request for ``job``. Pure: starts and writes nothing.

        Checks the job against :attr:`capabilities` and :attr:`options`, resolves the options,
        makes ``workdir`` and ``log_dir`` absolute, mints the job id, then calls
        :meth:`build_plan`; the plan it returns carries the resolved options."""
        self.check(job)
        self.check_options(job.scheduler_options)
        resolved = self.resolve_options(job.scheduler_options, configured=self.configured_options())
        job = attrs.evolve(job, workdir=str(Path(job.workdir).resolve()), log_dir=str(Path(job.log_dir).resolve()))
        job_id = new_job_id(job.name)
        plan = self.build_plan(job, job_id=job_id, log_dir=str(Path(job.log_dir) / job_id),
                               options={o.name: o.value for o in resolved})
        if self.request_type is not None and not isinstance(plan.request, self.request_type):
            raise TypeError(f"{type(self).__name__}.build_plan made a request of type "
                            f"{type(plan.request).__name__}, not {self.request_type.__name__}")
        return attrs.evolve(plan, options=resolved)

    def submit(self, plan: Plan) -> JobHandle:
        """Start what ``plan`` describes; return without waiting for the job.

        Refuses a plan another backend made, writes ``<log_dir>/plan.txt`` and
        ``<log_dir>/request.json`` (the :class:`Submission`, read by :meth:`submission`), then
        calls :meth:`execute`."""
        if plan.scheduler != self.name or (self.request_type is not None
                                           and not isinstance(plan.request, self.request_type)):
            raise SchedulerError(f"scheduler {self.name!r} cannot submit this plan (made by {plan.scheduler!r}, "
                                 f"request {type(plan.request).__name__}): submit what its dryrun returned")
        log_dir = Path(plan.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        run = rundir.RunDir(log_dir)
        run.plan.write_text(str(plan) + "\n")
        try:
            text = Submission.of(plan).to_json()
        except (TypeError, ValueError) as exc:  # a request of a third-party backend without JSON form
            get_logger().warning("request_not_persisted", job_id=plan.job_id, scheduler=self.name,
                                 error=f"{type(exc).__name__}: {exc}")
        else:
            write_atomic(run.request, text)
        return self.execute(plan)

    def submission(self, handle: JobHandle) -> Submission:
        """What :meth:`submit` persisted of the job of ``handle`` (its typed request, Job and
        processes), from ``<log_dir>/request.json``.

        Raises:
            SchedulerError: there is none (not submitted from this run directory, or the
                request had no JSON form), or it does not decode.
        """
        path = rundir.RunDir(handle.log_dir).request
        try:
            text = path.read_text()
            scheduler = json.loads(text).get("scheduler")
            if scheduler != self.name:
                raise SchedulerError(f"{path} is a submission to scheduler {scheduler!r}, not {self.name!r}")
            return Submission.from_json(text, self.request_type)
        except FileNotFoundError:
            raise SchedulerError(f"no {rundir.REQUEST} in {handle.log_dir}: job {handle.job_id} was not submitted "
                                 f"from there") from None
        except (AttributeError, KeyError, TypeError, ValueError, ProtocolError) as exc:
            raise SchedulerError(f"{path} does not decode: {type(exc).__name__}: {exc}") from None

    @abc.abstractmethod
    def build_plan(self, job: JobSpec, *, job_id: str, log_dir: str, options: dict[str, Any]) -> Plan:
        """The plan of ``job``, with this backend's typed ``request``. Pure.

        Args:
            job: the Job (``workdir`` and ``log_dir`` absolute; capabilities and options checked).
            job_id: the run's id (from :func:`new_job_id`).
            log_dir: the run's directory, ``<job.log_dir>/<job_id>``.
            options: every declared option's resolved value, by name.
        """

    @abc.abstractmethod
    def execute(self, plan: Plan) -> JobHandle:
        """Act on ``plan.request`` (the run directory exists and holds ``plan.txt``); return
        without waiting for the job."""

    # ----- a submitted job ---------------------------------------------------------------

    @abc.abstractmethod
    def status(self, handle: JobHandle) -> JobStatus:
        """The job's live status (``UNKNOWN`` when it cannot be reached); map the master's
        answer with ``MasterStatus.to_job_status``."""

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

    def result(self, handle: JobHandle) -> JobResult | None:
        """The final :class:`~dlrover_core.protocol.JobResult`, or ``None`` while running.
        Default: what the master wrote to ``<log_dir>/result.json``."""
        return read_result(handle.log_dir)
