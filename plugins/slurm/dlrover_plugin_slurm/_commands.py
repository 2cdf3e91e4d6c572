"""Slurm's command-line tools, called and parsed: ``sbatch``, ``squeue``, ``sacct``, ``sinfo``,
``scontrol``, ``scancel``.

Every query names its fields (``squeue --format``, ``sacct --format``, ``sinfo --format``) and
drops headers (``--noheader``), so a change in Slurm's default layout changes nothing here.
Job states are mapped through :data:`SLURM_JOB_STATES` (the JOB STATE CODES of squeue(1) and
sacct(1)); a state missing from the table reads as ``UNKNOWN``, with Slurm's word in the message.

A command that fails with a message of :data:`TRANSIENT_MARKERS` (the controller is busy,
restarting or failing over) is retried under :func:`dlrover_core.retry.rpc_retrying`, bounded;
any other failure raises :class:`~dlrover_core.errors.SchedulerError` with Slurm's own message.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence

import attrs

from dlrover_core import JobState, SchedulerError, TransientError
from dlrover_core.backend import get_logger, rpc_retrying

__all__ = [
    "SLURM_JOB_STATES",
    "SlurmCli",
    "SlurmJob",
    "map_state",
    "parse_node_states",
    "parse_sacct",
    "parse_squeue",
    "slurm_env",
]

log = get_logger()

#: Seconds one Slurm command may take before it counts as a (transient) timeout.
COMMAND_TIMEOUT_S = 60.0

#: Slurm job states (squeue(1)/sacct(1) "JOB STATE CODES") → JobState. Pending-like states
#: include a requeued or suspended job (it will run again); COMPLETING is still RUNNING
#: (processes are ending). PREEMPTED is a pending state here because the job is submitted
#: with ``--requeue``: Slurm puts it back in the queue (see :func:`map_state` for a job
#: that is gone from the queue).
SLURM_JOB_STATES: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    "CONFIGURING": JobState.PENDING,
    "REQUEUED": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING,
    "REQUEUE_FED": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "SPECIAL_EXIT": JobState.PENDING,
    "SUSPENDED": JobState.PENDING,
    "STOPPED": JobState.PENDING,
    "PREEMPTED": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "COMPLETED": JobState.SUCCEEDED,
    "FAILED": JobState.FAILED,
    "TIMEOUT": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED,
    "BOOT_FAIL": JobState.FAILED,
    "DEADLINE": JobState.FAILED,
    "CANCELLED": JobState.CANCELLED,
    "REVOKED": JobState.CANCELLED,
}

#: Substrings of Slurm error messages that a retry may cure: the controller is unreachable,
#: busy, or failing over (messages of slurm_strerror and the client tools).
TRANSIENT_MARKERS: tuple[str, ...] = (
    "socket timed out",
    "unable to contact slurm controller",
    "slurm backup controller in standby mode",
    "transport endpoint is not connected",
    "connection refused",
    "connection reset",
    "resource temporarily unavailable",
    "zero bytes were transmitted or received",
    "slurmctld is busy",
    "slurm_receive_msg",
    "communication connection failure",
    "temporarily unable to accept job",
)

#: Messages meaning "this job is not (or no longer) known to the controller".
_UNKNOWN_JOB_MARKERS = ("invalid job id specified", "invalid job id", "no such job")


def slurm_env(base: dict[str, str] | None = None, *, unset: Sequence[str] = ()) -> dict[str, str]:
    """``base`` (default ``os.environ``) without the variables Slurm sets *inside* a job
    (``SLURM_JOB_ID``, ``SLURM_NTASKS``, ``SRUN_CPUS_PER_TASK``...), which srun and sbatch
    would read as options, and without ``unset``; ``SLURM_CONF`` (which cluster) and the
    user's other ``SBATCH_*`` options stay. Commands then behave the same from a login shell,
    from another job, and from the job master inside the allocation."""
    env = dict(os.environ if base is None else base)
    for key in list(env):
        if key in unset or (key.startswith(("SLURM_", "SRUN_", "SALLOC_")) and key not in ("SLURM_CONF",
                                                                                          "SLURM_CLUSTERS")):
            del env[key]
    return env


def map_state(raw: str, *, in_queue: bool = True) -> tuple[JobState, str]:
    """Slurm's state word → ``(JobState, note)``.

    ``raw`` may carry what sacct appends ("CANCELLED by 0"). ``in_queue=False`` (the job is
    known only to sacct, it will not run again): a pending-like state means the job ended
    there, so it reads as FAILED. A state not in :data:`SLURM_JOB_STATES` is UNKNOWN.
    """
    word = raw.strip().split(" ")[0].upper() if raw.strip() else ""
    state = SLURM_JOB_STATES.get(word)
    if state is None:
        return JobState.UNKNOWN, f"unknown Slurm job state {raw.strip()!r}"
    if not in_queue and state in (JobState.PENDING, JobState.RUNNING):
        return JobState.FAILED, f"Slurm job ended in state {word}"
    return state, ""


@attrs.frozen(kw_only=True)
class SlurmJob:
    """What Slurm says about a job.

    Attributes:
        native_id: Slurm's job id.
        raw_state: Slurm's state word, as printed.
        state: ``raw_state`` mapped (``UNKNOWN`` for a word not in the table).
        reason: squeue's reason (``%r``: why pending, or ``None``), or sacct's exit code.
        start_epoch_s: start time of the current (or expected) run, seconds since the epoch;
            ``None`` if Slurm printed none.
        nodelist: Slurm's compressed node list (``n[1-2]``), "" if none yet.
        source: ``"squeue"`` or ``"sacct"``.
        message: a note for the user (the unknown state, the reason).
    """

    native_id: str
    raw_state: str
    state: JobState
    reason: str = ""
    start_epoch_s: float | None = None
    nodelist: str = ""
    source: str = "squeue"
    message: str = ""


#: squeue fields, in order: job id, state (long form), reason, start time, node list.
SQUEUE_FORMAT = "%i|%T|%r|%S|%N"
#: sacct fields, in order (``--parsable2`` separates them with ``|``).
SACCT_FORMAT = "JobID,State,ExitCode,Start,NodeList"


def _epoch(text: str) -> float | None:
    """Slurm's ``YYYY-MM-DDTHH:MM:SS`` (local time) → epoch seconds; ``None`` for N/A, Unknown..."""
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def parse_squeue(text: str, native_id: str) -> SlurmJob | None:
    """The line of job ``native_id`` in the output of ``squeue --noheader --format``
    :data:`SQUEUE_FORMAT`; ``None`` if squeue listed no such job. A line with fewer fields
    than asked for (a format Slurm did not honour) reads as UNKNOWN, with the line."""
    for line in text.splitlines():
        fields = line.strip().split("|")
        if not fields or fields[0].strip() != native_id:
            continue
        if len(fields) < 5:
            return SlurmJob(native_id=native_id, raw_state=line.strip(), state=JobState.UNKNOWN,
                            message=f"cannot read squeue's line {line.strip()!r}")
        _, raw, reason, start, nodes = (f.strip() for f in fields[:5])
        state, note = map_state(raw)
        if not note and state == JobState.PENDING and reason not in ("", "None", "(null)"):
            note = f"Slurm job {native_id} is {raw} ({reason})"
        return SlurmJob(native_id=native_id, raw_state=raw, state=state, reason=reason, start_epoch_s=_epoch(start),
                        nodelist=nodes if nodes not in ("", "(null)") else "", source="squeue", message=note)
    return None


def parse_sacct(text: str, native_id: str) -> SlurmJob | None:
    """The last record of job ``native_id`` (its allocation, not its steps) in the output of
    ``sacct --noheader --parsable2 --format`` :data:`SACCT_FORMAT`; ``None`` if absent. A
    requeued job has one record per run; the last one is the latest run."""
    found = None
    for line in text.splitlines():
        fields = line.strip().split("|")
        if not fields or fields[0].strip() != native_id:
            continue
        if len(fields) < 2:
            found = SlurmJob(native_id=native_id, raw_state=line.strip(), state=JobState.UNKNOWN, source="sacct",
                             message=f"cannot read sacct's line {line.strip()!r}")
            continue
        raw = fields[1].strip()
        exit_code = fields[2].strip() if len(fields) > 2 else ""
        start = fields[3].strip() if len(fields) > 3 else ""
        nodes = fields[4].strip() if len(fields) > 4 else ""
        state, note = map_state(raw, in_queue=False)
        if not note and state in (JobState.FAILED, JobState.CANCELLED):
            note = f"Slurm job {native_id} ended {raw}" + (f" (exit code {exit_code})" if exit_code else "")
        found = SlurmJob(native_id=native_id, raw_state=raw, state=state, reason=exit_code,
                         start_epoch_s=_epoch(start), nodelist=nodes, source="sacct", message=note)
    return found


#: sinfo node states (sinfo(1) "NODE STATE CODES") in which a node can take a new step. A
#: trailing ``*`` (not responding) or any other word (down, drained, draining, fail, maint,
#: reboot, power...) makes a node unfit.
_FIT_NODE_STATES = {"allocated", "mixed", "idle", "completing", "planned"}


def parse_node_states(text: str) -> dict[str, bool]:
    """``sinfo --noheader --Node --format=%N|%T`` output → ``{node: fit for a new step}``.
    A node listed in several partitions is fit only if every line says so."""
    fit: dict[str, bool] = {}
    for line in text.splitlines():
        if "|" not in line:
            continue
        node, state = (f.strip() for f in line.split("|", 1))
        ok = state.lower() in _FIT_NODE_STATES  # "allocated*" (not responding) is not in the set
        fit[node] = fit.get(node, True) and ok
    return fit


class SlurmCli:
    """Runs Slurm's tools with a timeout and a bounded retry of transient failures.

    Args:
        run: ``subprocess.run`` (injectable for tests).
        sleep: the retry policy's sleep (injectable so tests run instantly).
        attempts: tries per command, the first included.
        max_total_s: seconds after which retries stop.
    """

    def __init__(
        self,
        *,
        run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
        sleep: Callable[[float], None] = time.sleep,
        attempts: int = 5,
        max_total_s: float = 60.0,
    ) -> None:
        self._run = run
        self._sleep = sleep
        self._attempts = attempts
        self._max_total_s = max_total_s

    def retrying(self):
        """The bounded retry policy of one command (a ``tenacity.Retrying``)."""
        return rpc_retrying(attempts=self._attempts, max_total_s=self._max_total_s, initial_wait_s=0.5,
                            max_wait_s=10.0, sleep=self._sleep)

    def __call__(self, argv: Sequence[str], *, input: str | None = None, unset: Sequence[str] = ()) -> str:
        """Run ``argv`` (without the variables ``unset``); return its stdout.

        Raises:
            SchedulerError: the command is missing, or failed for good (Slurm's message kept),
                or still failed transiently when the retries ran out.
        """
        try:
            for attempt in self.retrying():
                with attempt:
                    return self.once(list(argv), input=input, unset=unset)
        except TransientError as exc:
            raise SchedulerError(f"`{' '.join(argv)}` kept failing ({self._attempts} tries): {exc}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def once(self, argv: Sequence[str], *, input: str | None = None, unset: Sequence[str] = ()) -> str:
        """Run ``argv`` once (without the variables ``unset``); return its stdout.

        Raises:
            TransientError: a failure worth retrying (see :data:`TRANSIENT_MARKERS`), or a timeout.
            SchedulerError: the command is missing or failed for good.
        """
        argv = list(argv)
        try:
            proc = self._run(argv, input=input, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                             env=slurm_env(unset=unset))
        except FileNotFoundError:
            raise SchedulerError(f"the Slurm command {argv[0]!r} is not on PATH; install Slurm's client tools "
                                 "(Debian: slurm-client) on this machine") from None
        except subprocess.TimeoutExpired:
            log.warning("slurm_command_timeout", argv=argv, timeout_s=COMMAND_TIMEOUT_S)
            raise TransientError(f"`{' '.join(argv)}` did not answer within {COMMAND_TIMEOUT_S:g} s") from None
        if proc.returncode == 0:
            return proc.stdout
        message = (proc.stderr or proc.stdout or f"exit code {proc.returncode}").strip()
        if any(marker in message.lower() for marker in TRANSIENT_MARKERS):
            log.warning("slurm_command_retry", argv=argv, error=message)
            raise TransientError(message)
        raise SchedulerError(f"`{' '.join(argv)}` failed: {message}")

    # ----- queries -------------------------------------------------------------------------

    def job(self, native_id: str) -> SlurmJob | None:
        """The job as squeue sees it, else as sacct does (it left the queue); ``None`` if
        neither knows it."""
        try:
            out = self(["squeue", "--noheader", "--states=all", f"--jobs={native_id}", f"--format={SQUEUE_FORMAT}"])
        except SchedulerError as exc:
            if not any(m in str(exc).lower() for m in _UNKNOWN_JOB_MARKERS):
                raise
            out = ""
        found = parse_squeue(out, native_id)
        if found is not None:
            return found
        return self.accounted_job(native_id)

    def accounted_job(self, native_id: str) -> SlurmJob | None:
        """The job's latest record in accounting (slurmdbd), or in the job completion log
        (``sacct -c``) where the cluster keeps no accounting database."""
        argv = ["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={native_id}",
                f"--format={SACCT_FORMAT}"]
        try:
            out = self(argv)
        except SchedulerError as exc:
            if "accounting storage is disabled" not in str(exc).lower():
                raise
            out = self(["sacct", "--completion", "--noheader", "--parsable2", f"--jobs={native_id}",
                        f"--format={SACCT_FORMAT}"])
        return parse_sacct(out, native_id)

    def hostnames(self, nodelist: str) -> list[str]:
        """A compressed node list (``n[1-2]``) expanded, in Slurm's order."""
        if not nodelist:
            return []
        return [h.strip() for h in self(["scontrol", "show", "hostnames", nodelist]).splitlines() if h.strip()]

    def node_fitness(self, nodes: Sequence[str]) -> dict[str, bool]:
        """``{node: can take a new step}`` for ``nodes`` (see :func:`parse_node_states`)."""
        if not nodes:
            return {}
        out = self(["sinfo", "--noheader", "--Node", f"--nodes={','.join(nodes)}", "--format=%N|%T"])
        fit = parse_node_states(out)
        return {n: fit.get(n, False) for n in nodes}

    def steps(self, native_id: str) -> list[tuple[str, str, str]]:
        """Running steps of the job as ``(step id, step name, node list)``."""
        try:
            out = self(["squeue", "--noheader", "--steps", f"--jobs={native_id}", "--format=%i|%j|%N"])
        except SchedulerError as exc:
            if any(m in str(exc).lower() for m in _UNKNOWN_JOB_MARKERS):
                return []
            raise
        rows = []
        for line in out.splitlines():
            fields = [f.strip() for f in line.split("|")]
            if len(fields) >= 3:
                rows.append((fields[0], fields[1], fields[2]))
        return rows
