"""The ``docker`` scheduler backend: plan the containers (pure), then create them on the engine;
status, logs, cancel, relaunch and master restarts of a running job, given only its handle."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import psutil

from dlrover_core import control_plane as cp
from dlrover_core import rundir
from dlrover_core.agent.launch import preview_workers
from dlrover_core.errors import JobSpecError, SchedulerError
from dlrover_core.fileio import write_atomic
from dlrover_core.logging import get_logger
from dlrover_core.plugins import get_host
from dlrover_core.protocol import JobState, JobStatus, NodeRelaunch, NodeRow
from dlrover_core.protocol.client import fetch_master_status
from dlrover_core.scheduler_backend import (
    Capabilities,
    JobHandle,
    Plan,
    SchedulerBackend,
    SchedulerOption,
    status_of_result,
)
from dlrover_core.schedulers.docker._engine import call, connect, sdk
from dlrover_core.schedulers.docker._image import DEFAULT_IMAGE, PATH, ensure_image
from dlrover_core.schedulers.docker._logs import follow_logs, log_file_name, saved_logs, source
from dlrover_core.schedulers.docker._mounts import (
    DEFAULT_DOCKER_HOST,
    arg_paths,
    docker_endpoint,
    merge_mounts,
    parse_mounts,
    runtime_mounts,
)
from dlrover_core.schedulers.docker._request import (
    LABEL_JOB,
    LABEL_NODE,
    LABEL_ROLE,
    ContainerSpec,
    DockerRequest,
    Mount,
    NetworkSpec,
    container_name,
    network_name,
)
from dlrover_core.schedulers.docker._shm import MASTER_SHM_BYTES, shm_size_bytes
from dlrover_core.spec import JobSpec

if TYPE_CHECKING:
    import docker

__all__ = ["MASTER_HOST", "MASTER_PORT", "OPTIONS", "DockerScheduler"]

log = get_logger()

#: Port of the master's HTTP API inside its container (every container has its own network stack).
MASTER_PORT = 29400
#: Network alias of the master container on the job's network.
MASTER_HOST = "master"
#: Host variables handed on to the master and agents when set (plugin selection, logging).
_PASS_ENV = ("DLROVER_PLUGINS", "DLROVER_DISABLE_PLUGINS", "DLROVER_LOG_LEVEL", "DLROVER_LOG_FORMAT")
_MASTER_START_TIMEOUT_S = 60.0
_MASTER_RESTARTS = 3
#: Files of the run directory: the container specs (the plan's file), and the engine and
#: master restarts of the job.
_CONTAINERS_FILE = rundir.CONTAINERS
_STATE_FILE = rundir.DOCKER_STATE

#: The docker scheduler's options (``Job(scheduler_options=...)``), each with its environment fallback.
OPTIONS = (
    SchedulerOption(name="image", type=str, default=DEFAULT_IMAGE, env="DLROVER_DOCKER_IMAGE",
                    help="image to run; the default one is built offline on the first submit"),
    SchedulerOption(name="python", type=str, default=None, env="DLROVER_DOCKER_PYTHON",
                    help="the interpreter inside a custom image (e.g. python3); when set, the host's runtime is not "
                         "mounted and the image must have dlrover-core installed"),
    SchedulerOption(name="shm_size", type=str, default=None, env="DLROVER_DOCKER_SHM_SIZE",
                    help="/dev/shm of agent containers (8g, 512m, bytes); default: from the checkpoint state"),
    SchedulerOption(name="state_mb", type=float, default=None, env="DLROVER_DOCKER_STATE_MB",
                    help="checkpoint state per rank in MiB, the hint for the /dev/shm rule"),
    SchedulerOption(name="mounts", type=list, default=(), env="DLROVER_DOCKER_MOUNTS",
                    help="extra bind mounts, PATH or PATH:ro (host path = container path)"),
    SchedulerOption(name="docker_host", type=str, default=DEFAULT_DOCKER_HOST, env="DOCKER_HOST",
                    help="the engine (unix:///path/docker.sock or tcp://host:port)"),
)


def _container_order(c: Any) -> tuple[int, int, str]:
    role = c.labels.get(LABEL_ROLE, "")
    node = c.labels.get(LABEL_NODE, "")
    return (0 if role == "master" else 1, int(node) if node.isdigit() else -1, c.attrs.get("Created", ""))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(data, indent=2))


class DockerScheduler(SchedulerBackend):
    """Runs the master and every node of a job in containers on a Docker engine (see
    :mod:`dlrover_core.schedulers.docker`)."""

    name = "docker"
    capabilities = Capabilities(elastic=True, relaunch_node=True, follow_logs=True, multi_host=False,
                                storage_on_submit_host=True, devices_on_submit_host=True)
    options = OPTIONS
    request_type = DockerRequest

    def __init__(self) -> None:
        self._clients: dict[str, docker.DockerClient] = {}

    def _client(self, docker_host: str | None = None) -> docker.DockerClient:
        key = docker_host or ""
        if key not in self._clients:
            self._clients[key] = connect(docker_host)
        return self._clients[key]

    @property
    def client(self) -> docker.DockerClient:
        """A client of the engine named by ``$DOCKER_HOST`` (the SDK's default)."""
        return self._client()

    def _engine(self, handle: JobHandle) -> docker.DockerClient:
        """A client of the engine the job was submitted to (recorded in its run directory)."""
        return self._client(self._state(handle).get("docker_host"))

    # ----- plan (pure) --------------------------------------------------------------------

    def build_plan(self, job: JobSpec, *, job_id: str, log_dir: str, options: dict[str, Any]) -> Plan:
        sdk()  # fail now, not at submit, when the SDK is missing
        job, accelerator = self.resolve_accelerator(job, get_host())
        if accelerator.name != "cpu":
            raise JobSpecError("accelerator", accelerator.name,
                               "'cpu' for the docker scheduler (devices are not passed into containers yet)")
        nproc = int(job.nodes.nproc_per_node)
        workdir = Path(job.workdir)
        if str(workdir) == "/":
            raise JobSpecError("workdir", job.workdir, "a directory other than / (it is bind-mounted)")
        checkpoint = job.checkpoint
        local_ckpt = checkpoint.storage == "posix" and ("://" not in checkpoint.dir or checkpoint.dir.startswith("file://"))
        if local_ckpt:
            ckpt_path = Path(checkpoint.dir.removeprefix("file://")).expanduser()
            job = attrs.evolve(job, checkpoint=attrs.evolve(
                checkpoint, dir=str(ckpt_path if ckpt_path.is_absolute() else workdir / ckpt_path)))
        try:
            shm = shm_size_bytes(job, nproc, shm_size=options["shm_size"], state_mb=options["state_mb"])
        except ValueError as exc:
            raise JobSpecError("scheduler_options['shm_size']", options["shm_size"], str(exc)) from None
        image = options["image"]
        python = options["python"] or sys.executable
        master_addr = f"{MASTER_HOST}:{MASTER_PORT}"
        network = network_name(job_id)

        mounts: list[tuple[str, bool]] = [] if options["python"] else runtime_mounts()
        mounts += [(str(workdir), False), (log_dir, False)]
        if local_ckpt:
            mounts.append((job.checkpoint.dir, False))
        if Path(job.entrypoint).is_absolute():
            mounts.append((str(Path(job.entrypoint).resolve().parent), True))
        mounts += [(p, False) for p in arg_paths(job)]
        mounts += parse_mounts(options["mounts"])
        docker_host, socket_path = docker_endpoint(options["docker_host"])

        base_env = cp.job_env(job, job_id=job_id, log_dir=log_dir, extra={
            "PATH": f"{Path(python).parent}:{PATH}" if Path(python).is_absolute() else PATH,
        })
        # every node's container shares this machine's cores: split them between all workers
        threads = cp.omp_num_threads(job, nproc=nproc, environ=os.environ, cores=cp.host_cores(), nodes_sharing=job.nodes.max)
        if threads is not None:
            base_env[cp.OMP_NUM_THREADS] = threads
        base_env.update({k: os.environ[k] for k in _PASS_ENV if k in os.environ})
        user = f"{os.getuid()}:{os.getgid()}"

        def container(role: str, name: str, command: list[str], extra_env: dict[str, str],
                      extra_mounts: list[tuple[str, bool]], shm_size: int, node_id: int | None,
                      **more: Any) -> ContainerSpec:
            labels = {LABEL_JOB: job_id, LABEL_ROLE: role}
            if node_id is not None:
                labels[LABEL_NODE] = str(node_id)
            return ContainerSpec(
                name=container_name(job_id, name), image=image, command=command,
                environment={**base_env, **extra_env}, hostname=name, network=network, aliases=(name,),
                labels=labels, user=user, working_dir=str(workdir), init=True, shm_size=shm_size,
                mounts=tuple(Mount(source=p, target=p, read_only=ro) for p, ro in merge_mounts(mounts + extra_mounts)),
                **more,
            )

        master_more: dict[str, Any] = {
            # The master looks up no name outside the job's network, but torch reverse-resolves the
            # address of each round's fresh store; with an unreachable upstream DNS that waits 2 × 5 s.
            "dns_opt": ("timeout:1", "attempts:1"),
        }
        if os.getuid() != 0 and socket_path and os.path.exists(socket_path):
            master_more["group_add"] = (str(os.stat(socket_path).st_gid),)  # to reach the engine as a plain user
        master = container(
            "master", MASTER_HOST,
            list(cp.master_argv(python, job_id=job_id, host="0.0.0.0", port=MASTER_PORT, store_host=MASTER_HOST,
                                log_dir=log_dir)),
            {"DOCKER_HOST": docker_host}, [(socket_path, False)] if socket_path else [], MASTER_SHM_BYTES, None,
            **master_more,
        )
        agents = [
            container(
                "agent", f"node-{i}",
                list(cp.agent_argv(python, job_id=job_id, node_id=i, master_addr=master_addr, log_dir=log_dir)),
                cp.agent_env({}, accelerator=accelerator.name, master_addr=master_addr), [], shm, i,
            )
            for i in range(job.nodes.max)
        ]
        request = DockerRequest(docker_host=docker_host, containers=(master, *agents),
                                network=NetworkSpec(name=network, driver="bridge", labels={LABEL_JOB: job_id}))
        workers = preview_workers(job, job_id=job_id, nproc=nproc, master_addr=master_addr, store_host=MASTER_HOST,
                                  accelerator=accelerator, log_dir=log_dir, python=python)
        return Plan(scheduler=self.name, job_id=job_id, job=job, log_dir=log_dir, request=request,
                    files={_CONTAINERS_FILE: request.render()}, workers=workers)

    # ----- side effects -----------------------------------------------------------------------

    def _create(self, client: docker.DockerClient, spec: ContainerSpec) -> Any:
        """Create and start one container of the plan."""
        types = sdk().types
        mounts = [types.Mount(m.target, m.source, type=m.type, read_only=m.read_only) for m in spec.mounts]
        endpoint = client.api.create_endpoint_config(aliases=list(spec.aliases))
        container = call(lambda: client.containers.create(
            spec.image, list(spec.command), name=spec.name, environment=dict(spec.environment),
            hostname=spec.hostname, labels=dict(spec.labels), user=spec.user, working_dir=spec.working_dir,
            init=spec.init, shm_size=spec.shm_size, restart_policy=dict(spec.restart_policy), mounts=mounts,
            network=spec.network, networking_config={spec.network: endpoint},
            group_add=list(spec.group_add) if spec.group_add is not None else None,
            dns_opt=list(spec.dns_opt) if spec.dns_opt is not None else None, detach=True,
        ), f"create container {spec.name}")
        call(container.start, f"start container {spec.name}")
        return container

    def execute(self, plan: Plan) -> JobHandle:
        request: DockerRequest = plan.request
        log_dir = Path(plan.log_dir)
        job = plan.job
        if job.checkpoint.storage == "posix" and Path(job.checkpoint.dir).is_absolute():
            Path(job.checkpoint.dir).mkdir(parents=True, exist_ok=True)  # a bind source must exist
        (log_dir / _CONTAINERS_FILE).write_text(request.render())
        _write_json(log_dir / _STATE_FILE, {"docker_host": request.docker_host, "master_restarts": 0})
        client = self._client(request.docker_host)
        ensure_image(client, request.master.image)
        net = request.network
        handle = JobHandle(scheduler=self.name, job_id=plan.job_id, log_dir=str(log_dir))
        try:
            network = call(lambda: client.networks.create(net.name, driver=net.driver, labels=dict(net.labels),
                                                          check_duplicate=True), f"create network {net.name}")
            _write_json(log_dir / _STATE_FILE, {"docker_host": request.docker_host, "network": net.name,
                                                "network_id": network.id, "master_restarts": 0})
            master = self._create(client, request.master)
            self._wait_master(master)
            for spec in request.agents:
                self._create(client, spec)
        except BaseException:
            self._remove_all(handle, save_logs=True)
            raise
        log.info("docker_job_started", job_id=plan.job_id, network=net.name, nodes=len(request.agents))
        return attrs.evolve(handle, native_id=master.name)

    def _wait_master(self, master: Any) -> None:
        """Until the master logs ``master_started``; SchedulerError with its output if it exits first."""
        deadline = time.monotonic() + _MASTER_START_TIMEOUT_S
        while True:
            output = call(lambda: master.logs(), "read the master's logs")
            if b"master_started" in output:
                return
            call(master.reload, "inspect the master container")
            if master.status not in ("created", "running") or time.monotonic() > deadline:
                code = master.attrs.get("State", {}).get("ExitCode")
                # read again: a master that exits between the read above and the inspection
                # wrote its last words (the error) after that read
                output = call(lambda: master.logs(), "read the master's logs")
                tail = output.decode(errors="replace")[-2000:]
                raise SchedulerError(f"the job master did not start (container {master.status}, exit code {code}); "
                                     f"its output ends:\n{tail}")
            time.sleep(0.2)

    # ----- where a job is ----------------------------------------------------------------------

    def _containers(self, handle: JobHandle, **labels: str) -> list[Any]:
        filters = [f"{LABEL_JOB}={handle.job_id}", *(f"{k}={v}" for k, v in labels.items())]
        client = self._engine(handle)
        found = call(lambda: client.containers.list(all=True, filters={"label": filters}),
                     f"list containers of {handle.job_id}")
        return sorted(found, key=_container_order)

    def _master(self, handle: JobHandle) -> Any | None:
        found = self._containers(handle, **{LABEL_ROLE: "master"})
        return found[0] if found else None

    def _state(self, handle: JobHandle) -> dict[str, Any]:
        try:
            return json.loads((Path(handle.log_dir) / _STATE_FILE).read_text())
        except FileNotFoundError:
            return {}

    def _finished(self, handle: JobHandle, master: Any | None = ...) -> bool:
        """The master wrote a result and exited, or it is gone for good."""
        if master is ...:
            master = self._master(handle)
        if master is not None and master.status in ("created", "running", "restarting"):
            return False
        if self.result(handle) is not None or master is None:
            return True
        return self._state(handle).get("master_restarts", 0) >= _MASTER_RESTARTS

    def supervise(self, handle: JobHandle) -> None:
        """Start the master container again if it died before writing a result (it resumes
        from its journal; agents reach it under the same name). At most ``_MASTER_RESTARTS`` times."""
        if self.result(handle) is not None:
            return
        try:
            master = self._master(handle)
        except SchedulerError as exc:
            log.warning("docker_engine_unreachable", job_id=handle.job_id, error=str(exc))
            return
        if master is None or master.status != "exited":
            return
        state = self._state(handle)
        if state.get("master_restarts", 0) >= _MASTER_RESTARTS:
            return
        call(master.start, "restart the master container")
        state["master_restarts"] = state.get("master_restarts", 0) + 1
        _write_json(Path(handle.log_dir) / _STATE_FILE, state)
        log.warning("master_restarted", job_id=handle.job_id, restarts=state["master_restarts"])

    # ----- status ---------------------------------------------------------------------------

    def status(self, handle: JobHandle) -> JobStatus:
        try:
            master = self._master(handle)
        except SchedulerError as exc:  # the engine is unreachable: the job may well be running
            result = self.result(handle)
            if result is not None:
                return status_of_result(result)
            return JobStatus(state=JobState.UNKNOWN, message=str(exc))
        if master is not None and master.status == "running":
            networks = master.attrs.get("NetworkSettings", {}).get("Networks", {})
            ip = (networks.get(network_name(handle.job_id)) or {}).get("IPAddress")
            answer = fetch_master_status(f"{ip}:{MASTER_PORT}") if ip else None
            if answer is not None:
                return answer.to_job_status(worker_pids=self._host_pids(handle, answer.node_table))
        result = self.result(handle)
        if result is not None:
            return status_of_result(result)
        if master is None:
            return JobStatus(state=JobState.UNKNOWN, message=f"no container of job {handle.job_id} on the engine")
        if master.status == "created":
            return JobStatus(state=JobState.PENDING, message="the master container is starting")
        if self._finished(handle, master):
            code = master.attrs.get("State", {}).get("ExitCode")
            return JobStatus(state=JobState.FAILED, message=f"the job master exited (code {code}) without a result")
        return JobStatus(state=JobState.UNKNOWN, message=f"the job master is not answering (container {master.status})")

    def _host_pids(self, handle: JobHandle, node_table: tuple[NodeRow, ...]) -> dict[int, int]:
        """Worker pids as this machine sees them, by global rank. Agents report pids of their
        container's pid namespace; they are translated through ``/proc/<pid>/status`` (NSpid)
        of the processes under each running agent container. Empty where the engine's
        processes are not visible here (a remote engine)."""
        wanted = {(str(n.node_id), int(pid)): int(rank) for n in node_table for rank, pid in n.workers.items()}
        if not wanted:
            return {}
        out: dict[int, int] = {}
        try:
            agents = self._containers(handle, **{LABEL_ROLE: "agent"})
        except SchedulerError:
            return out
        for c in agents:
            init_pid = c.attrs.get("State", {}).get("Pid") or 0
            if c.status != "running" or not init_pid:
                continue
            try:
                procs = psutil.Process(init_pid).children(recursive=True)
            except psutil.Error:
                continue
            for proc in procs:
                try:
                    with open(f"/proc/{proc.pid}/status") as f:
                        ns = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
                except OSError:
                    continue
                rank = wanted.get((c.labels.get(LABEL_NODE, ""), int(ns[-1]))) if ns else None
                if rank is not None:
                    out[rank] = proc.pid
        return out

    # ----- logs, cancel ------------------------------------------------------------------------

    def logs(self, handle: JobHandle, *, follow: bool = False) -> Iterator[str]:
        containers = self._containers(handle)
        if not containers:  # removed by cancel: read what it saved
            yield from saved_logs(Path(handle.log_dir))
            return
        if not follow:
            for c in containers:
                text = call(lambda c=c: c.logs(), f"read logs of {c.name}").decode(errors="replace")
                for line in text.splitlines():
                    yield f"[{source(c)}] {line}"
            return
        yield from follow_logs(lambda: self._containers(handle), lambda master: self._finished(handle, master))

    def cancel(self, handle: JobHandle) -> None:
        """Stop the master (SIGTERM: it cancels the job, agents drain, it writes the result),
        save every container's output into the run directory, then remove every container and
        the network. Idempotent."""
        master = self._master(handle)
        if master is not None and master.status == "running":
            grace_s = 30  # the master drains agents for stop_grace_s + 3 heartbeats + 5 s at most
            try:
                spec = self.submission(handle).job
                grace_s = int(spec.failure.stop_grace_s + 3 * spec.heartbeat_interval_s + 15)
            except SchedulerError:  # not submitted from this run directory: the default
                pass
            call(lambda: master.stop(timeout=grace_s), f"stop {master.name}")
        self._remove_all(handle, save_logs=True)

    def _remove_all(self, handle: JobHandle, *, save_logs: bool) -> None:
        errors = sdk().errors
        log_dir = Path(handle.log_dir)
        client = self._engine(handle)
        for attempt in range(3):
            for c in self._containers(handle):
                if save_logs and log_dir.is_dir():
                    try:
                        (log_dir / log_file_name(c)).write_bytes(c.logs())
                    except (errors.DockerException, OSError):
                        pass
                try:
                    call(lambda c=c: c.remove(force=True), f"remove container {c.name}", passthrough=(errors.NotFound,))
                except errors.NotFound:
                    pass
            networks = call(lambda: client.networks.list(filters={"label": f"{LABEL_JOB}={handle.job_id}"}),
                            f"list networks of {handle.job_id}")
            try:
                for n in networks:
                    try:
                        call(n.remove, f"remove network {n.name}", passthrough=(errors.NotFound,))
                    except errors.NotFound:
                        pass
                return
            except SchedulerError:  # a container appeared meanwhile (a relaunch): remove it too
                if attempt == 2:
                    raise

    # ----- relaunch ------------------------------------------------------------------------------

    def relaunch_node(self, handle: JobHandle, request: NodeRelaunch) -> None:
        """Start a new agent container for ``request.node_id`` (a node of the plan, or a new id:
        then made like the plan's first agent), killing the node's containers that still run
        (a lost node may be hung, or cut off: it must go). Every container runs on the same
        engine, so where the replaced node ran does not matter. Works from inside the master
        container."""
        node_id = request.node_id
        agents = self.submission(handle).request.agents
        template = next((c for c in agents if c.labels.get(LABEL_NODE) == str(node_id)), agents[0] if agents else None)
        if template is None:
            raise SchedulerError(f"job {handle.job_id} has no agent to copy for node {node_id}")
        old = self._containers(handle, **{LABEL_NODE: str(node_id)})
        for c in old:
            if c.status == "running":
                call(lambda c=c: c.kill(), f"kill {c.name}")
        container = self._create(self._engine(handle), template.as_node(handle.job_id, node_id, len(old)))
        log.info("node_relaunched", job_id=handle.job_id, node_id=node_id, replaces=request.replaces,
                 reason=request.reason, container=container.name)
