"""The built-in ``local`` scheduler: the master and one agent process per node, on this machine.

Each simulated node is a real agent process with its own workers; they rendezvous over
loopback, exactly as on a cluster. ``submit`` writes into the run's log directory:

    plan.txt      the dry-run plan            master.log   the master's output
    handle.json   pids and the master address node_<i>.log each agent's output (workers prefixed)
    events.jsonl  job events (by the master)  node_<i>/     per-rank logs and progress files
    result.json   the JobResult (by the master, at the end)
    master_addr   the master's current host:port (written by the master once it listens)
    shared_standby.log  the output of the process that forks every node's warm standby
                  (the nodes share this machine: ``DLROVER_SHARED_STANDBY``)

A master that dies before writing a result is started again (``supervise``), after a backoff
that doubles each time, and resumes from its journal. If its port was taken meanwhile it
listens on a free one and writes it to ``master_addr``, where agents and workers
(``DLROVER_MASTER_ADDR_FILE``) and this backend look for it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import psutil

from dlrover_core import control_plane as cp
from dlrover_core import env
from dlrover_core.agent.launch import preview_workers
from dlrover_core.checkpoint.shm import remove_segments
from dlrover_core.errors import DLRoverError, SchedulerError
from dlrover_core.fileio import write_atomic
from dlrover_core.logging import get_logger
from dlrover_core.markers import hookimpl
from dlrover_core.plugins import get_host
from dlrover_core.proctree import kill_trees
from dlrover_core.protocol import Cancel, JobState, JobStatus, NodeRelaunch
from dlrover_core.protocol.client import MasterClient, fetch_master_status
from dlrover_core.protocol.messages import FailureReport, WorkerFailure
from dlrover_core.retry import rpc_retrying
from dlrover_core.rundir import MASTER_LOG, NODE_LOG_GLOB, RunDir
from dlrover_core.scheduler_backend import (
    Capabilities,
    JobHandle,
    Plan,
    ProcessSpec,
    SchedulerBackend,
    status_of_result,
)
from dlrover_core.schedulers.logtail import tail_logs
from dlrover_core.spec import JobSpec

__all__ = ["LocalRequest", "LocalScheduler"]

_MASTER_START_TIMEOUT_S = 60.0
_MASTER_RESTARTS = 3
#: Seconds before the first restart of a dead master; each further restart waits twice as long.
_MASTER_BACKOFF_S = 1.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@attrs.frozen(kw_only=True)
class LocalRequest:
    """How ``submit`` finds the master it starts. The processes themselves are the plan's
    ``processes`` (typed :class:`ProcessSpec`, the master first, then one agent per node):
    ``submit`` starts the master, waits until it answers, then starts the agents.

    Attributes:
        master_addr: ``host:port`` the master is asked to listen on.
        addr_file: where the master writes the address it really listens on (another port
            when the planned one was taken meanwhile).
    """

    master_addr: str
    addr_file: str


class LocalScheduler(SchedulerBackend):
    """Runs every node of a job as processes on this machine. It has no options."""

    name = "local"
    capabilities = Capabilities(elastic=True, relaunch_node=True, follow_logs=True, multi_host=False,
                                storage_on_submit_host=True, devices_on_submit_host=True)
    request_type = LocalRequest

    def __init__(self) -> None:
        self._popens: dict[str, dict[str, subprocess.Popen]] = {}
        self._reported: dict[str, set[int]] = {}  # job id -> agent pids whose exit the master was told

    # ----- plan --------------------------------------------------------------------------

    def build_plan(self, job: JobSpec, *, job_id: str, log_dir: str, options: dict[str, Any]) -> Plan:
        job, accelerator = self.resolve_accelerator(job, get_host())
        nproc = int(job.nodes.nproc_per_node)
        port = _free_port()
        master_addr = f"127.0.0.1:{port}"
        python = sys.executable
        run = RunDir(log_dir)
        addr_file = str(run.master_addr)
        base_env = cp.job_env(job, job_id=job_id, log_dir=log_dir, extra={
            env.WATCH_PID: str(os.getpid()),
            env.MASTER_ADDR_FILE: addr_file,
        })
        # every node shares this machine: split its cores between all workers
        threads = cp.omp_num_threads(job, nproc=nproc, environ=os.environ, cores=cp.host_cores(), nodes_sharing=job.nodes.max)
        if threads is not None:
            base_env[cp.OMP_NUM_THREADS] = threads
        master = cp.master_process(python=python, job_id=job_id, host="127.0.0.1", port=port, store_host="127.0.0.1",
                                   log_dir=log_dir, variables=base_env, cwd=job.workdir)
        agent_variables = cp.agent_env(base_env, accelerator=accelerator.name, master_addr=master_addr)
        # the nodes share this machine: one warm process forks every node's standby (unless
        # the user's environment says DLROVER_SHARED_STANDBY=0: a standby process per node)
        agent_variables[env.SHARED_STANDBY] = "0" if os.environ.get(env.SHARED_STANDBY) == "0" else "1"
        agents = tuple(
            cp.agent_process(python=python, job_id=job_id, node_id=i, master_addr=master_addr, log_dir=log_dir,
                             variables=agent_variables, cwd=job.workdir)
            for i in range(job.nodes.max)
        )
        workers = preview_workers(job, job_id=job_id, nproc=nproc, master_addr=master_addr, store_host="127.0.0.1",
                                  accelerator=accelerator, log_dir=log_dir, python=python)
        request = LocalRequest(master_addr=master_addr, addr_file=addr_file)
        return Plan(scheduler=self.name, job_id=job_id, job=job, log_dir=log_dir, request=request,
                    processes=(master, *agents), workers=workers)

    # ----- side effects ------------------------------------------------------------------

    def _start(self, job_id: str, spec: ProcessSpec) -> subprocess.Popen:
        log_file = open(spec.log_file, "ab")
        try:
            popen = subprocess.Popen(
                list(spec.argv), env={**os.environ, **spec.env}, cwd=spec.cwd, stdin=subprocess.DEVNULL,
                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
            )
        finally:
            log_file.close()
        self._popens.setdefault(job_id, {})[f"{spec.name}:{popen.pid}"] = popen
        return popen

    def execute(self, plan: Plan) -> JobHandle:
        request: LocalRequest = plan.request
        master_spec = next(p for p in plan.processes if p.role == "master")
        agent_specs = [p for p in plan.processes if p.role == "agent"]
        master_addr = request.master_addr
        addr_file = Path(request.addr_file)
        master = self._start(plan.job_id, master_spec)
        deadline = time.monotonic() + _MASTER_START_TIMEOUT_S
        while True:
            try:  # the address the master listens on (another one if the planned port was taken)
                master_addr = addr_file.read_text().strip() or master_addr
            except OSError:
                pass
            answer = fetch_master_status(master_addr, timeout_s=1.0)
            if answer is not None and answer.job_id == plan.job_id:
                break
            if master.poll() is not None or time.monotonic() > deadline:
                kill_trees([master.pid], grace_s=1.0)
                tail = Path(master_spec.log_file).read_text(errors="replace")[-2000:]
                raise SchedulerError(f"the job master did not start (exit code {master.poll()}); {MASTER_LOG} ends:\n{tail}")
            time.sleep(0.1)
        agents = {spec.name: self._start(plan.job_id, spec).pid for spec in agent_specs}
        handle_info = {
            "job_id": plan.job_id, "master_addr": master_addr, "master_pid": master.pid, "agents": agents,
        }  # the processes' descriptions are in request.json (SchedulerBackend.submission)
        RunDir(plan.log_dir).handle.write_text(json.dumps(handle_info, indent=2))
        return JobHandle(scheduler=self.name, job_id=plan.job_id, log_dir=plan.log_dir, native_id=str(master.pid))

    def _info(self, handle: JobHandle) -> dict:
        try:
            return json.loads(RunDir(handle.log_dir).handle.read_text())
        except FileNotFoundError:
            raise SchedulerError(f"no local job {handle.job_id} under {handle.log_dir}") from None

    def _write_info(self, handle: JobHandle, update: dict) -> dict:
        """Merge ``update`` into handle.json (shared with the master, which records relaunched
        agents there): re-read, merge, replace atomically."""
        info = {**self._info(handle), **update}
        write_atomic(RunDir(handle.log_dir).handle, json.dumps(info, indent=2))
        return info

    def _master_addr(self, handle: JobHandle, info: dict | None = None) -> str:
        """The master's current ``host:port``: its address file, else the one in handle.json."""
        try:
            addr = RunDir(handle.log_dir).master_addr.read_text().strip()
        except OSError:
            addr = ""
        return addr or (info or self._info(handle))["master_addr"]

    def _reap(self, handle: JobHandle) -> None:
        for popen in self._popens.get(handle.job_id, {}).values():
            popen.poll()

    def _finished(self, handle: JobHandle) -> bool:
        """The master wrote a result and exited, or died for good (restarts used up)."""
        if not self.master_exited(handle):
            return False
        return self.result(handle) is not None or self._info(handle).get("master_restarts", 0) >= _MASTER_RESTARTS

    def master_exited(self, handle: JobHandle) -> bool:
        """Whether the job's master process has exited."""
        self._reap(handle)
        return not _alive(int(self._info(handle)["master_pid"]))

    def supervise(self, handle: JobHandle) -> None:
        """Restart the master if it died before writing a result; it resumes from its journal,
        on the same port or, if that is taken, on a free one that agents find in the address
        file. At most ``_MASTER_RESTARTS`` times, the first after ``_MASTER_BACKOFF_S`` and
        each next one after twice as long (call this periodically: it never sleeps)."""
        if self.result(handle) is not None:
            return
        info = self._info(handle)
        if not self.master_exited(handle):
            addr = self._master_addr(handle, info)
            if addr != info["master_addr"]:  # a restarted master listens elsewhere
                self._write_info(handle, {"master_addr": addr})
            self._report_lost_agents(handle, info, addr)
            return
        restarts = info.get("master_restarts", 0)
        if restarts >= _MASTER_RESTARTS:
            return
        now = time.time()
        due = info.get("master_restart_due")
        if due is None:  # just found dead
            due = now + _MASTER_BACKOFF_S * 2 ** restarts
            self._write_info(handle, {"master_restart_due": due})
            get_logger().warning("master_died", job_id=handle.job_id, restart_in_s=round(due - now, 1),
                                 restart=restarts + 1, of=_MASTER_RESTARTS)
        if now < due:
            return
        master = next(p for p in self.submission(handle).processes if p.role == "master")
        popen = self._start(handle.job_id, master)
        self._write_info(handle, {"master_pid": popen.pid, "master_restarts": restarts + 1,
                                  "master_restart_due": None})

    def _report_lost_agents(self, handle: JobHandle, info: dict, addr: str) -> None:
        """Tell the master at once about a node whose agent process exited (killed, crashed):
        evidence, so it need not wait ``Failure.heartbeat_timeout_s`` of silence. Each node's
        newest agent only (an older one was replaced); each exit once. An agent that exited
        because its job or node ended changes nothing (the master knows it has gone)."""
        newest: dict[int, int] = {}
        for name, pid in info["agents"].items():
            newest[int(name.split("-", 1)[1])] = int(pid)
        for key, pid in info.get("relaunched", {}).items():  # "node-<id>:<pid>", in launch order
            newest[int(key.split(":", 1)[0].split("-", 1)[1])] = int(pid)
        reported = self._reported.setdefault(handle.job_id, set())
        for node_id, pid in newest.items():
            if pid in reported or _alive(pid):
                continue
            reported.add(pid)
            client = MasterClient(addr, timeout_s=2.0, retrying=lambda: rpc_retrying(attempts=1), addr_file="")
            try:
                client.failure(FailureReport(node_id=node_id, round=-1, failures=(WorkerFailure(
                    kind="node_lost", detail=f"its agent process (pid {pid}) exited, seen by the local scheduler"),)))
            except (DLRoverError, ValueError):
                pass  # not answering: the heartbeat timeout is the fallback
            finally:
                client.close()

    def status(self, handle: JobHandle) -> JobStatus:
        answer = fetch_master_status(self._master_addr(handle, self._info(handle)))
        if answer is not None:
            return answer.to_job_status()
        result = self.result(handle)
        if result is not None:
            return status_of_result(result)
        if self._finished(handle):
            return JobStatus(state=JobState.FAILED, message="the job master exited without a result")
        return JobStatus(state=JobState.UNKNOWN, message="the job master is not answering (restarting?)")

    def logs(self, handle: JobHandle, *, follow: bool = False) -> Iterator[str]:
        log_dir = Path(handle.log_dir)

        def sources() -> list[tuple[str, Path]]:
            return [("master", log_dir / MASTER_LOG),
                    *((p.stem.replace("_", "-"), p) for p in sorted(log_dir.glob(NODE_LOG_GLOB)))]

        return tail_logs(sources, follow=follow, finished=lambda: self._finished(handle))

    def cancel(self, handle: JobHandle) -> None:
        info = self._info(handle)
        grace_s = 5.0
        if _alive(int(info["master_pid"])):
            client = MasterClient(self._master_addr(handle, info), timeout_s=2.0, retrying=lambda: rpc_retrying(attempts=1),
                                  addr_file="")
            try:
                client.cancel(Cancel(reason="cancelled by the user"))
            except (DLRoverError, ValueError):  # not answering: the processes are killed below
                pass
            finally:
                client.close()
            deadline = time.monotonic() + 30.0
            while _alive(int(info["master_pid"])) and time.monotonic() < deadline:
                self._reap(handle)
                time.sleep(0.1)
        for pid in [*info["agents"].values(), *info.get("relaunched", {}).values(), info["master_pid"]]:
            kill_trees([int(pid)], grace_s=grace_s)
        self._reap(handle)
        # agents remove their node's segments when they exit; this catches a SIGKILLed agent
        remove_segments(f"dlrover-{handle.job_id}-")

    def relaunch_node(self, handle: JobHandle, request: NodeRelaunch) -> None:
        """Start a new agent process for ``request.node_id`` (a node of the plan, or a new id:
        then made like the plan's first agent). Every node is on this machine, so where the
        replaced node ran does not matter."""
        node_id = request.node_id
        info = self._info(handle)
        agents = [p for p in self.submission(handle).processes if p.role == "agent"]
        spec = next((p for p in agents if p.name == f"node-{node_id}"), None)
        if spec is None:  # a new id: made like the plan's first agent
            if not agents:
                raise SchedulerError(f"job {handle.job_id} has no agent to copy for node {node_id}")
            spec = cp.node_process(agents[0], node_id)
        addr = self._master_addr(handle, info)  # the master's address now (a restart may have moved it)
        spec = attrs.evolve(spec, argv=cp.with_master_addr(spec.argv, addr), env={**spec.env, env.MASTER_ADDR: addr})
        popen = self._start(handle.job_id, spec)
        # handle.json is shared with the runner (cancel reads it): rewrite it atomically
        relaunched = {**self._info(handle).get("relaunched", {}), f"node-{node_id}:{popen.pid}": popen.pid}
        self._write_info(handle, {"relaunched": relaunched})


@hookimpl
def dlrover_register_schedulers(register):
    register(LocalScheduler)
