"""The ``slurm`` scheduler backend: one sbatch job per dlrover job.

The batch script (:mod:`dlrover_plugin_slurm._script`) runs the master on the first node of the
allocation and ``srun``\\ s one agent per node. Everything a later process needs to find the
job again lives in Slurm (the job id, its name = the dlrover job id) or in files under the
run's log directory, which must be on a filesystem every node and the submitting machine share:

    job.sbatch          the script handed to sbatch       slurm.out        the batch script's output
    plan.txt            the dry-run plan                  master.log       the master's output
    slurm/submit.json   Slurm job id, python, agent env   node_<i>.log     each agent's output
    slurm/master_addr   host:port of the master           events.jsonl     job events (master)
    slurm/nodes.json    node id → Slurm node, relaunches  result.json      the JobResult (master)
    slurm/relaunch_node_<i>.log  srun's own messages      run_<n>/         a requeued run's leftovers

So ``status``, ``logs``, ``cancel``, ``result`` and ``relaunch_node`` work from any process given a
:class:`~dlrover_core.scheduler_backend.JobHandle` — the master calls ``relaunch_node`` from inside
the allocation.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from dlrover_core import JobSpec, JobSpecError, SchedulerError, TransientError, hookimpl
from dlrover_core.backend import (
    Capabilities,
    JobHandle,
    JobResult,
    JobState,
    JobStatus,
    NodeRelaunch,
    Plan,
    SchedulerBackend,
    SchedulerOption,
    Submission,
    control_plane,
    env,
    fetch_master_status,
    get_host,
    get_logger,
    read_result,
    remove_segments,
    rundir,
    status_of_result,
    tail_logs,
    write_atomic,
)
from dlrover_plugin_slurm._commands import SlurmCli, SlurmJob, slurm_env
from dlrover_plugin_slurm._script import node_task_argv, render_sbatch

__all__ = ["OPTIONS", "SbatchRequest", "SlurmScheduler"]

log = get_logger()

#: After the master wrote its result, how long ``cancel`` lets the batch script end by itself
#: (agents exiting) before it calls scancel, so Slurm records COMPLETED (seconds).
FINISH_GRACE_S = 30.0
#: How long ``cancel`` waits for Slurm to end the job after scancel (SIGTERM, then SIGKILL
#: after the cluster's KillWait) (seconds).
CANCEL_WAIT_S = 120.0
#: How long ``relaunch_node`` waits to see its srun step running (seconds).
RELAUNCH_START_S = 20.0
#: How long an answer of squeue/sacct is reused by status, result and logs (seconds).
STATE_TTL_S = 1.0
#: Seconds between Slurm state checks while ``logs(follow=True)`` tails the files.
FOLLOW_STATE_S = 1.0
#: Errors of ``scancel`` that mean the job is already over (nothing to do).
_ALREADY_DONE = ("already completing or completed", "invalid job id specified")


#: The slurm scheduler's options (``Job(scheduler_options=...)``). The ``SBATCH_*`` fallbacks are
#: sbatch's own input variables: an option set either way becomes an ``#SBATCH`` line of the
#: script, and its variable is then removed from sbatch's environment (it would override the line).
OPTIONS = (
    SchedulerOption(name="partition", type=str, default=None, env="SBATCH_PARTITION",
                    help="the partition (sbatch --partition)"),
    SchedulerOption(name="account", type=str, default=None, env="SBATCH_ACCOUNT",
                    help="the account charged (sbatch --account)"),
    SchedulerOption(name="qos", type=str, default=None, env="SBATCH_QOS",
                    help="the quality of service (sbatch --qos)"),
    SchedulerOption(name="time", type=str, default=None, env="SBATCH_TIMELIMIT",
                    help="the time limit, e.g. 4:00:00 (sbatch --time); near it the job saves and requeues"),
    SchedulerOption(name="python", type=str, default=sys.executable,
                    help="the interpreter every node runs (the same path on every node)"),
)
#: Options that are sbatch's own, in the order of their #SBATCH lines.
_SBATCH_OPTIONS = ("partition", "account", "qos", "time")


def _write_atomic(path: Path, text: str) -> None:
    write_atomic(path, text)


@attrs.frozen(kw_only=True)
class SbatchRequest:
    """What ``submit`` hands to Slurm.

    Attributes:
        script: the batch script (``job.sbatch``).
        script_path: where ``submit`` writes it (in the run directory: every node reads it there).
        argv: the sbatch command line.
        unset_env: variables removed from sbatch's environment (the ``SBATCH_*`` of the options
            the script sets: they would override its lines).
        python: the interpreter every node runs.
    """

    script: str
    script_path: str
    argv: tuple[str, ...]
    unset_env: tuple[str, ...] = ()
    python: str


class SlurmScheduler(SchedulerBackend):
    """Runs a job as one Slurm batch job: master on the first node, an ``srun``'d agent per node.

    Args:
        cli: how Slurm's tools are run (a :class:`SlurmCli`; tests inject fakes).
    """

    name = "slurm"
    capabilities = Capabilities(elastic=True, relaunch_node=True, follow_logs=True, multi_host=True)
    options = OPTIONS
    request_type = SbatchRequest

    def __init__(self, cli: SlurmCli | None = None) -> None:
        self._cli = cli or SlurmCli()
        self._seen: dict[str, tuple[float, SlurmJob | None]] = {}  # native id -> (monotonic time, answer)

    # ----- plan --------------------------------------------------------------------------

    def _gres(self, job: JobSpec, accelerator: Any) -> str | None:
        """``--gres`` for the job's accelerator (``gpu:8``), from its ``slurm_gres``; none for
        cpu or ``"auto"`` (probed on each node; name the accelerator to request devices). The
        submitting machine is not probed: it need not have the devices."""
        gres = getattr(accelerator, "slurm_gres", None) if accelerator is not None else None
        if not gres:
            return None
        nproc = job.nodes.nproc_per_node
        if nproc == "auto":
            raise JobSpecError("nodes.nproc_per_node", nproc, f"a number with scheduler='slurm' and accelerator="
                                                              f"{job.accelerator!r}: it is the count in --gres={gres}:N")
        return f"{gres}:{int(nproc)}"

    def build_plan(self, job: JobSpec, *, job_id: str, log_dir: str, options: dict[str, Any]) -> Plan:
        job, accelerator = self.resolve_accelerator(job, get_host())  # no probe: the devices are on the nodes
        gres = self._gres(job, accelerator)
        sbatch_options = {name: options[name] for name in _SBATCH_OPTIONS if options[name]}
        for name, value in sbatch_options.items():
            if any(c.isspace() or c in "'\"" for c in value):
                raise JobSpecError(f"scheduler_options[{name!r}]", value, "a value without spaces or quotes (sbatch "
                                                                          "reads #SBATCH lines word by word)")
        python = options["python"]
        script = render_sbatch(job, job_id=job_id, log_dir=log_dir, python=python, gres=gres,
                               sbatch_options=sbatch_options)
        script_path = str(Path(log_dir) / rundir.SLURM_SCRIPT)
        unset = tuple(str(o.env) for o in OPTIONS if o.name in sbatch_options and o.env)
        request = SbatchRequest(script=script, script_path=script_path, argv=("sbatch", "--parsable", script_path),
                                unset_env=unset, python=python)
        return Plan(scheduler=self.name, job_id=job_id, job=job, log_dir=log_dir, request=request,
                    files={rundir.SLURM_SCRIPT: script})

    # ----- submit ------------------------------------------------------------------------

    def execute(self, plan: Plan) -> JobHandle:
        request: SbatchRequest = plan.request
        log_dir = Path(plan.log_dir)
        (log_dir / rundir.SLURM_DIR).mkdir(parents=True, exist_ok=True)
        Path(request.script_path).write_text(request.script)
        native_id = self._sbatch(plan.job_id, request)
        # Slurm's job id only: the request and the Job are in request.json (SchedulerBackend.submit)
        info = {"job_id": plan.job_id, "native_id": native_id}
        _write_atomic(log_dir / rundir.SLURM_SUBMIT, json.dumps(info, indent=2))
        log.info("slurm_job_submitted", job_id=plan.job_id, native_id=native_id, script=request.script_path)
        return JobHandle(scheduler=self.name, job_id=plan.job_id, log_dir=str(log_dir), native_id=native_id)

    def _sbatch(self, job_id: str, request: SbatchRequest) -> str:
        """``request.argv`` (``sbatch --parsable``) with bounded retries. sbatch may have queued
        the job although its answer was lost (a timeout): before each retry, look for the job
        by its name."""
        first = True
        try:
            for attempt in self._cli.retrying():
                with attempt:
                    if not first:
                        found = self._cli.once(["squeue", "--noheader", f"--name={job_id}", "--format=%i"]).split()
                        if found:
                            return found[0]
                    first = False
                    out = self._cli.once(list(request.argv), unset=request.unset_env)
                    native_id = out.strip().split(";")[0]
                    if not native_id.isdigit():
                        raise SchedulerError(f"sbatch answered {out.strip()!r}, not a job id")
                    return native_id
        except TransientError as exc:
            raise SchedulerError(f"sbatch kept failing: {exc}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    # ----- finding the job again ---------------------------------------------------------

    @staticmethod
    def _info(handle: JobHandle) -> dict[str, Any]:
        try:
            return json.loads((Path(handle.log_dir) / rundir.SLURM_SUBMIT).read_text())
        except FileNotFoundError:
            return {}

    def _native_id(self, handle: JobHandle) -> str:
        """Slurm's job id: from the handle, else from ``slurm/submit.json``, else — inside the
        job itself (the master) — from ``SLURM_JOB_ID``."""
        native = handle.native_id or self._info(handle).get("native_id", "")
        if not native and os.environ.get(env.JOB_ID) == handle.job_id:
            native = os.environ.get("SLURM_JOB_ID", "")
        if not native:
            raise SchedulerError(f"no Slurm job id for {handle.job_id}: no native_id and no "
                                 f"{Path(handle.log_dir) / rundir.SLURM_SUBMIT}")
        return str(native)

    # ----- status and result -------------------------------------------------------------

    def _current_result(self, handle: JobHandle, job: SlurmJob | None) -> JobResult | None:
        """``result.json``, unless it is not final: a previous run's (the job was requeued:
        Slurm has it pending again, or running since after the file was written), or a
        CANCELLED one while Slurm still runs the job (a master stopped by the SIGTERM of a
        requeue or preemption writes that; after a real cancel Slurm soon says CANCELLED)."""
        try:
            mtime = rundir.RunDir(handle.log_dir).result.stat().st_mtime
        except FileNotFoundError:
            return None
        result = read_result(handle.log_dir)
        if result is None:
            return None
        if job is not None and not job.state.is_terminal and job.state != JobState.UNKNOWN:
            if job.state == JobState.PENDING or result.state == JobState.CANCELLED:
                return None
            if job.start_epoch_s is not None and mtime < job.start_epoch_s + 1:
                return None
        return result

    def _slurm_job(self, handle: JobHandle, *, fresh: bool = False) -> SlurmJob | None:
        """What Slurm says about the job; an answer younger than :data:`STATE_TTL_S` is reused
        (``fresh=False``) so that a runner polling status, result and logs together asks the
        controller about once a second, not several times."""
        native = self._native_id(handle)
        seen = self._seen.get(native)
        if not fresh and seen is not None and time.monotonic() - seen[0] < STATE_TTL_S:
            return seen[1]
        job = self._cli.job(native)
        self._seen[native] = (time.monotonic(), job)
        return job

    def result(self, handle: JobHandle) -> JobResult | None:
        if not rundir.RunDir(handle.log_dir).result.exists():
            return None
        try:
            job = self._slurm_job(handle)
        except SchedulerError:
            job = None  # Slurm unreachable: the file is the best answer there is
        return self._current_result(handle, job)

    def _master_status(self, handle: JobHandle) -> JobStatus | None:
        try:
            addr = (Path(handle.log_dir) / rundir.SLURM_MASTER_ADDR).read_text().strip()
        except FileNotFoundError:
            return None
        answer = fetch_master_status(addr)
        return answer.to_job_status() if answer is not None else None

    def status(self, handle: JobHandle) -> JobStatus:
        native = self._native_id(handle)
        try:
            job = self._slurm_job(handle)
        except SchedulerError as exc:
            result = self._current_result(handle, None)
            if result is not None:
                return status_of_result(result)
            return JobStatus(state=JobState.UNKNOWN, message=f"Slurm did not answer: {exc}")
        result = self._current_result(handle, job)
        if result is not None:
            return status_of_result(result)
        if job is None:
            return JobStatus(state=JobState.UNKNOWN, message=f"Slurm knows no job {native} (neither squeue nor sacct)")
        if job.state == JobState.RUNNING:
            live = self._master_status(handle)
            if live is not None and live.state == JobState.CANCELLED:
                # a signal stopped the master (scancel, requeue, preemption): Slurm has the final word
                return attrs.evolve(live, state=JobState.RUNNING, message=f"the job master was stopped ({live.message}); "
                                                                           f"Slurm job {native} is {job.raw_state}")
            if live is not None:
                return live
            return JobStatus(state=JobState.RUNNING,
                             message=f"Slurm job {native} is {job.raw_state}; the job master is not answering yet")
        return JobStatus(state=job.state, message=job.message or f"Slurm job {native} is {job.raw_state}")

    # ----- logs --------------------------------------------------------------------------

    def logs(self, handle: JobHandle, *, follow: bool = False) -> Iterator[str]:
        log_dir = Path(handle.log_dir)

        def sources() -> list[tuple[str, Path]]:
            return [("batch", log_dir / rundir.SLURM_OUT), ("master", log_dir / rundir.MASTER_LOG),
                    *((p.stem.replace("_", "-"), p) for p in sorted(log_dir.glob(rundir.NODE_LOG_GLOB)))]

        return tail_logs(sources, follow=follow, finished=lambda: self._over(handle), poll_s=0.2,
                         check_every_s=FOLLOW_STATE_S)

    def _over(self, handle: JobHandle) -> bool:
        """Slurm has ended the job (or forgotten it)."""
        try:
            job = self._slurm_job(handle)
        except SchedulerError:
            return False
        return job is None or job.state.is_terminal or job.state == JobState.UNKNOWN

    # ----- cancel ------------------------------------------------------------------------

    def _wait_over(self, handle: JobHandle, timeout_s: float) -> SlurmJob | None:
        deadline = time.monotonic() + timeout_s
        while True:
            job = self._slurm_job(handle, fresh=True)
            if job is None or job.state.is_terminal or job.state == JobState.UNKNOWN or time.monotonic() > deadline:
                return job
            time.sleep(0.5)

    def cancel(self, handle: JobHandle) -> None:
        """End the job (``scancel``: SIGTERM to every process, SIGKILL after Slurm's KillWait)
        and wait until Slurm has. A job whose master already wrote its result gets
        :data:`FINISH_GRACE_S` to end by itself first. Idempotent."""
        native = self._native_id(handle)
        job = self._slurm_job(handle, fresh=True)
        if job is not None and not job.state.is_terminal and self._current_result(handle, job) is not None:
            job = self._wait_over(handle, FINISH_GRACE_S)
        if job is not None and not job.state.is_terminal:
            try:
                self._cli(["scancel", native])
                log.info("slurm_job_cancelled", job_id=handle.job_id, native_id=native)
            except SchedulerError as exc:
                if not any(m in str(exc).lower() for m in _ALREADY_DONE):
                    raise
            job = self._wait_over(handle, CANCEL_WAIT_S)
            if job is not None and not job.state.is_terminal and job.state != JobState.UNKNOWN:
                raise SchedulerError(f"Slurm job {native} is still {job.raw_state} {CANCEL_WAIT_S:g} s after scancel")
        # agents remove their node's segments when they exit, and each node's srun task
        # (node_task) those of an agent that could not; this catches what a task SIGKILLed
        # by Slurm left on this machine
        remove_segments(f"dlrover-{handle.job_id}-")
        if job is not None and job.state == JobState.CANCELLED and not rundir.RunDir(handle.log_dir).result.exists():
            self._write_cancelled(handle, job)

    @staticmethod
    def _write_cancelled(handle: JobHandle, job: SlurmJob) -> None:
        """The job ended before its master wrote a result (cancelled while pending, or killed
        before it could): record that, so ``result`` has an answer."""
        result = JobResult(
            job_id=handle.job_id, state=JobState.CANCELLED,
            reason=f"Slurm job {job.native_id} was cancelled ({job.raw_state}) before the master wrote a result",
            final_step=-1, restarts=0, wall_time_s=0.0, productive_s=0.0, goodput=0.0, checkpoint_stall_s=0.0,
            restore_s=0.0, recomputed_s=0.0, detection_s=0.0, restart_s=0.0, rendezvous_s=0.0, startup_s=0.0,
            failures=(), metrics={}, log_dir=handle.log_dir,
        )
        _write_atomic(rundir.RunDir(handle.log_dir).result, json.dumps(result.to_dict(), indent=2))

    # ----- relaunch ----------------------------------------------------------------------

    @staticmethod
    def _node_map(handle: JobHandle) -> dict[int, str]:
        try:
            return {int(k): v for k, v in json.loads((Path(handle.log_dir) / rundir.SLURM_NODES).read_text()).items()}
        except FileNotFoundError:
            return {}

    def relaunch_node(self, handle: JobHandle, request: NodeRelaunch) -> None:
        """Start an agent for ``request.node_id`` as a new ``srun`` step of the job.

        Where: when the node is replaced in place (``request.replaces`` is its own id), on the
        Slurm node it ran on if Slurm still finds that node fit: the agent died, the node did
        not. When it replaces another node (``request.replaces``: an excluded node), or its own
        Slurm node is not fit, on a fit node of the allocation other than the replaced node's
        (``--exclude``), the least used first. With no fit node left, a job with a fixed node
        count is requeued (it resumes from its latest checkpoint on a new allocation); an
        elastic one goes on with fewer nodes (this raises :class:`SchedulerError`).
        """
        node_id = request.node_id
        native = self._native_id(handle)
        submission = self.submission(handle)
        job = self._slurm_job(handle, fresh=True)
        if job is None or job.state != JobState.RUNNING:
            raise SchedulerError(f"cannot relaunch node {node_id}: Slurm job {native} is "
                                 f"{job.raw_state if job else 'unknown'}, not running")
        hosts = self._cli.hostnames(job.nodelist)
        mapping = self._node_map(handle)
        for index, host in enumerate(hosts):  # the first step's node ids follow the allocation's order
            mapping.setdefault(index, host)
        failed_id = request.replaces if request.replaces is not None else node_id
        failed_host = mapping.get(failed_id)
        fit = self._cli.node_fitness(hosts)
        if failed_host is not None and fit.get(failed_host) and failed_id == node_id:
            target = failed_host
        else:
            candidates = [h for h in hosts if fit.get(h) and h != failed_host]
            if not candidates:
                if submission.job.nodes.min != submission.job.nodes.max:
                    raise SchedulerError(f"no fit node left in Slurm job {native} for node {node_id} "
                                         f"(nodes {fit}); the job goes on with fewer nodes")
                self._requeue(native, f"no fit node left for node {node_id} (nodes {fit})")
                return
            load = collections.Counter(h for i, h in mapping.items() if i != failed_id)
            target = min(candidates, key=lambda h: (load[h], hosts.index(h)))
        mapping[node_id] = target
        (Path(handle.log_dir) / rundir.SLURM_DIR).mkdir(parents=True, exist_ok=True)
        _write_atomic(Path(handle.log_dir) / rundir.SLURM_NODES, json.dumps({str(k): v for k, v in sorted(mapping.items())}, indent=2))
        self._start_agent_step(handle, native, submission, node_id, target,
                               exclude=failed_host if failed_host not in (None, target) else None)

    def _start_agent_step(self, handle: JobHandle, native: str, submission: Submission, node_id: int, target: str,
                          *, exclude: str | None) -> None:
        log_dir = Path(handle.log_dir)
        try:
            master_addr = (log_dir / rundir.SLURM_MASTER_ADDR).read_text().strip()
        except FileNotFoundError:
            raise SchedulerError(f"no master address in {log_dir / rundir.SLURM_MASTER_ADDR}: "
                                 "has the batch script started?") from None
        request: SbatchRequest = submission.request
        python = request.python
        step_name = f"dlrover-node-{node_id}"
        workdir = submission.job.workdir
        argv = ["srun", f"--jobid={native}", "--nodes=1", "--ntasks=1", "--overlap", "--kill-on-bad-exit=0",
                f"--nodelist={target}", *([f"--exclude={exclude}"] if exclude else []), f"--job-name={step_name}",
                f"--chdir={workdir}",
                f"--output={log_dir / rundir.node_log(node_id)}", "--open-mode=append",
                *node_task_argv(python, handle.job_id, str(node_id), master_addr, str(log_dir))]
        variables = {**slurm_env(), **control_plane.job_env(submission.job, job_id=handle.job_id, log_dir=str(log_dir),
                                                             sort_keys=True), env.MASTER_ADDR: master_addr}
        before = {step for step, _, _ in self._cli.steps(native)}
        with open(log_dir / rundir.slurm_relaunch_log(node_id), "ab") as out:
            out.write(f"$ {' '.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(argv, env=variables, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT)
        threading.Thread(target=proc.wait, name=f"dlrover-srun-node-{node_id}", daemon=True).start()
        log.info("slurm_node_relaunched", job_id=handle.job_id, node_id=node_id, slurm_node=target, exclude=exclude,
                 pid=proc.pid)
        deadline = time.monotonic() + RELAUNCH_START_S
        while time.monotonic() < deadline:
            code = proc.poll()
            if code is not None and code != 0:
                tail = (log_dir / rundir.slurm_relaunch_log(node_id)).read_text(errors="replace")[-1500:]
                raise SchedulerError(f"srun for node {node_id} on {target} exited with {code}:\n{tail}")
            if code == 0 or any(name == step_name and step not in before for step, name, _ in self._cli.steps(native)):
                return
            time.sleep(0.5)
        log.warning("slurm_relaunch_step_not_seen", node_id=node_id, waited_s=RELAUNCH_START_S)

    def _requeue(self, native: str, why: str) -> None:
        """Put the whole job back in the queue: every process gets SIGTERM now (agents save at
        the breakpoint) and the next run resumes from the latest checkpoint."""
        log.warning("slurm_job_requeued", native_id=native, reason=why)
        self._cli(["scontrol", "requeue", native])


@hookimpl
def dlrover_register_schedulers(register):
    register(SlurmScheduler)
