"""The built-in ``docker`` scheduler: the master and one agent per node, each in its own container.

A job gets its own user-defined bridge network ``dlrover-<job_id>``; on it the master
container answers as ``master`` (HTTP API on port 29400, rendezvous stores on fresh ports) and
each agent container as ``node-<id>``. Containers carry the labels ``dlrover.job_id``,
``dlrover.role`` (``master`` | ``agent``) and ``dlrover.node_id``, run with restart policy
``no`` and a tiny init (``docker run --init``) that reaps orphans; the master relaunches a lost
node itself, from inside its container, through the Docker socket that is bind-mounted into it
(whoever controls the master container therefore controls the engine, as with any container
that is given the socket).

Image: ``DLROVER_DOCKER_IMAGE``, default :data:`DEFAULT_IMAGE`, a root-filesystem skeleton
that :func:`build_image` makes from nothing (no registry needed; built automatically on the
first submit, or ``python -m dlrover_core.schedulers.docker build-image``). The host's Python
runtime is bind-mounted read-only at the same paths (see :func:`runtime_mounts`), so the
containers run the very interpreter, venv and dlrover installation that submitted the job.

Mounts (host path = container path): the runtime (read-only); the job's ``workdir``, its run
directory under ``log_dir``, a local checkpoint directory, the directory of an absolute
entrypoint, and every absolute path among ``Job.args`` that exists (or whose parent exists),
read-write; ``DLROVER_DOCKER_MOUNTS`` (``PATH[:ro|rw],...``) adds more.

/dev/shm of agent containers is sized by :func:`shm_size_bytes`, never Docker's 64 MB default.

Files ``submit`` writes into the run's log directory:

    plan.txt          the dry-run plan           containers.json  the container specs (the plan's file)
    docker.json       network, master restarts   events.jsonl / result.json / goodput.json (by the master)
    master.log, node_<i>.log[.<n>]  each container's output, saved by ``cancel`` before it removes them

Environment (read on the submitting machine, by ``dryrun``):
    DLROVER_DOCKER_IMAGE: image to run (default :data:`DEFAULT_IMAGE`, built on demand).
    DLROVER_DOCKER_PYTHON: the interpreter inside a custom image (e.g. ``python3``); when set,
        the host's runtime is not mounted and the image must have dlrover-core installed.
    DLROVER_DOCKER_SHM_SIZE: /dev/shm size of agent containers (``8g``, ``512m``, bytes).
    DLROVER_DOCKER_STATE_MB: checkpoint state per rank in MiB, the hint for the shm rule.
    DLROVER_DOCKER_MOUNTS: extra bind mounts, comma-separated ``PATH`` or ``PATH:ro``.
    DOCKER_HOST (and the docker SDK's other variables): the engine to use.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import httpx
import tenacity

from dlrover_core import env
from dlrover_core.agent.launch import preview_workers
from dlrover_core.errors import JobSpecError, SchedulerError
from dlrover_core.fileio import write_atomic
from dlrover_core.logging import get_logger
from dlrover_core.markers import hookimpl
from dlrover_core.plugins import get_host
from dlrover_core.protocol import JobResult, JobState, JobStatus
from dlrover_core.schedulers.base import Capabilities, JobHandle, Plan, SchedulerBackend
from dlrover_core.spec import JobSpec

if TYPE_CHECKING:
    import docker

__all__ = [
    "DEFAULT_IMAGE",
    "DockerScheduler",
    "build_image",
    "docker_retrying",
    "runtime_mounts",
    "shm_size_bytes",
]

log = get_logger()

#: The image ``build_image`` makes: a root-filesystem skeleton for the host's bind-mounted runtime.
DEFAULT_IMAGE = "dlrover-runtime:2"
#: Port of the master's HTTP API inside its container (every container has its own network stack).
MASTER_PORT = 29400
#: Network alias of the master container on the job's network.
MASTER_HOST = "master"

LABEL_JOB = "dlrover.job_id"
LABEL_ROLE = "dlrover.role"
LABEL_NODE = "dlrover.node_id"
LABEL_IMAGE = "dlrover.image"

ENV_IMAGE = "DLROVER_DOCKER_IMAGE"
ENV_PYTHON = "DLROVER_DOCKER_PYTHON"
ENV_SHM_SIZE = "DLROVER_DOCKER_SHM_SIZE"
ENV_STATE_MB = "DLROVER_DOCKER_STATE_MB"
ENV_MOUNTS = "DLROVER_DOCKER_MOUNTS"
#: Host variables handed on to the master and agents when set (plugin selection, logging).
_PASS_ENV = ("DLROVER_PLUGINS", "DLROVER_DISABLE_PLUGINS", "DLROVER_LOG_LEVEL", "DLROVER_LOG_FORMAT")

_MIB = 2**20
_GIB = 2**30
#: Smallest /dev/shm an agent container gets.
MIN_SHM_BYTES = 1 * _GIB
#: /dev/shm of the master container (it holds no snapshot).
MASTER_SHM_BYTES = 256 * _MIB
#: Top-level directories mirrored from the host: links into /usr where the host has links, else
#: mounted. Not /sbin: the image keeps its own, where the engine puts its init (/sbin/docker-init).
_SYSTEM_DIRS = ("bin", "lib", "lib32", "lib64", "libx32")
_MASTER_START_TIMEOUT_S = 60.0
_MASTER_RESTARTS = 3
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

T = TypeVar("T")


# ----- sizes and mounts (pure) ---------------------------------------------------------------


def parse_size(text: str) -> int:
    """``"8g"`` → bytes; accepts a plain byte count or a ``k``/``m``/``g``/``t`` suffix (powers of 1024)."""
    value = text.strip().lower().removesuffix("b").removesuffix("i")
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    try:
        if value and value[-1] in units:
            return int(float(value[:-1]) * units[value[-1]])
        return int(value)
    except ValueError:
        raise ValueError(f"{text!r} is not a size like 8g, 512m or a number of bytes") from None


def shm_size_bytes(job: JobSpec, nproc: int, environ: dict[str, str] | None = None) -> int:
    """/dev/shm size of an agent container, in bytes.

    Flash Checkpoint keeps two snapshot slots per rank in /dev/shm, each as large as the
    rank's state. The rule:

    - ``DLROVER_DOCKER_SHM_SIZE`` when set (exactly that);
    - else, with a state hint of S MiB per rank (``Checkpoint.state_size_mb`` where the spec
      has it, else ``DLROVER_DOCKER_STATE_MB``) and memory snapshots on:
      ``max(1 GiB, nproc × 2 × S MiB × 1.25 + 256 MiB)``, rounded up to a MiB (25 % for
      headers and metadata, 256 MiB for what torch and gloo put there);
    - else 1 GiB (:data:`MIN_SHM_BYTES`). A state larger than the slots allow is saved to
      storage only, with a warning naming the size needed.
    """
    environ = dict(os.environ if environ is None else environ)
    if environ.get(ENV_SHM_SIZE):
        return parse_size(environ[ENV_SHM_SIZE])
    hint = getattr(job.checkpoint, "state_size_mb", None) or environ.get(ENV_STATE_MB)
    if not hint or job.checkpoint.memory_every_steps == 0:
        return MIN_SHM_BYTES
    need = nproc * 2 * float(hint) * _MIB * 1.25 + 256 * _MIB
    return max(MIN_SHM_BYTES, math.ceil(need / _MIB) * _MIB)


def _package_roots() -> list[str]:
    """Directories holding the imported ``dlrover_core`` and ``dlrover_plugin_*`` packages."""
    roots = []
    for name, module in list(sys.modules.items()):
        if "." in name or not (name == "dlrover_core" or name.startswith("dlrover_plugin_")):
            continue
        paths = list(getattr(module, "__path__", None) or [])
        if not paths and getattr(module, "__file__", None):
            paths = [str(Path(module.__file__).parent / "_")]
        for p in paths:
            roots.append(str(Path(p).resolve().parent))
    return roots


def runtime_mounts() -> list[tuple[str, bool]]:
    """Host paths that make up this Python runtime, as ``(path, read_only=True)``.

    ``/usr``; ``/bin``, ``/lib``... where they are directories rather than links into /usr
    (the default image mirrors the links; its /sbin is its own, PATH has /usr/sbin); the interpreter's installation
    (``sys.base_prefix``); the virtual environment (``sys.prefix``); and the directories
    that hold the imported ``dlrover_core`` and ``dlrover_plugin_*`` packages (editable
    installs live in a checkout).
    """
    paths = ["/usr"]
    for name in _SYSTEM_DIRS:
        p = Path("/") / name
        if p.is_dir() and not p.is_symlink():
            paths.append(str(p))
    paths += [str(Path(sys.base_prefix).resolve()), str(Path(sys.prefix).absolute()), *_package_roots()]
    return [(p, True) for p in paths]


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _merge_mounts(mounts: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """Deduplicate: read-write wins for the same path; drop a path inside a read-write mount,
    or a read-only one inside a read-only mount. Sorted by path."""
    by_path: dict[str, bool] = {}
    for path, ro in mounts:
        by_path[path] = by_path.get(path, True) and ro
    kept = []
    for path, ro in sorted(by_path.items()):
        covered = any(other != path and _under(path, other) and (not other_ro or ro)
                      for other, other_ro in by_path.items())
        if not covered:
            kept.append((path, ro))
    return kept


def _arg_paths(job: JobSpec) -> list[str]:
    """Absolute paths among the job's arguments (``--x=/p`` too): the path if it exists, else
    its parent if that exists."""
    out = []
    for arg in job.args:
        value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        if not value.startswith("/") or value == "/":
            continue
        p = Path(value)
        if p.exists():
            out.append(str(p.resolve()))
        elif p.parent.is_dir() and str(p.parent) != "/":
            out.append(str(p.parent.resolve()))
    return out


def _docker_endpoint(environ: dict[str, str]) -> tuple[str, str | None]:
    """(``DOCKER_HOST`` for the master container, the host's socket path to mount or None)."""
    host = environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if host.startswith("unix://"):
        return host, host.removeprefix("unix://")
    return host, None


# ----- the engine: client, retries, image ------------------------------------------------------


def _transient(exc: BaseException) -> bool:
    """Whether a Docker API error may go away: the engine unreachable, a timeout, a 5xx answer."""
    import docker.errors
    import requests

    if isinstance(exc, (requests.ConnectionError, requests.Timeout)):
        return True
    if isinstance(exc, docker.errors.APIError):
        return exc.status_code is not None and exc.status_code >= 500 and exc.status_code != 501
    return False


def docker_retrying(*, attempts: int = 4, max_total_s: float = 20.0, initial_wait_s: float = 0.2,
                    max_wait_s: float = 3.0, sleep: Callable[[float], None] = time.sleep) -> tenacity.Retrying:
    """Policy for Docker API calls: retry what :func:`_transient` accepts, at most ``attempts``
    tries or ``max_total_s`` seconds, waiting exponentially with jitter; re-raise the last error."""
    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(attempts) | tenacity.stop_after_delay(max_total_s),
        wait=tenacity.wait_exponential(multiplier=initial_wait_s, max=max_wait_s) + tenacity.wait_random(0, initial_wait_s),
        retry=tenacity.retry_if_exception(_transient),
        sleep=sleep,
        reraise=True,
    )


def _engine_message(exc: BaseException) -> str:
    explanation = getattr(exc, "explanation", None)
    if explanation:
        return str(explanation.decode() if isinstance(explanation, bytes) else explanation)
    return str(exc) or type(exc).__name__


def _skeleton_tar(uid: int, gid: int) -> bytes:
    """A root filesystem for the bind-mounted host runtime: the host's links into /usr
    (``bin -> usr/bin``...), empty mount points, /tmp, and /etc with just what glibc needs."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        def add_file(name: str, text: str) -> None:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))

        for name in ("usr", "sbin", "etc", "proc", "sys", "dev", "root", "home", "run", "var", "opt"):
            add_dir(name)
        add_dir("tmp", 0o1777)
        add_dir("var/tmp", 0o1777)
        for name in _SYSTEM_DIRS:
            p = Path("/") / name
            if p.is_symlink():
                info = tarfile.TarInfo(name)
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(p)
                tar.addfile(info)
        users = "root:x:0:0:root:/root:/bin/sh\n"
        groups = "root:x:0:\n"
        if uid != 0:
            users += f"dlrover:x:{uid}:{gid}:dlrover:/tmp:/bin/sh\n"
        if gid != 0:
            groups += f"dlrover:x:{gid}:\n"
        add_file("etc/passwd", users)
        add_file("etc/group", groups)
        add_file("etc/nsswitch.conf", "passwd: files\ngroup: files\nhosts: files dns\n")
    return buf.getvalue()


def build_image(client: docker.DockerClient | None = None, tag: str = DEFAULT_IMAGE) -> str:
    """Make ``tag`` from this host's files, offline (``docker import`` of a generated root
    filesystem skeleton, no registry); return the image id. Replaces an older ``tag``."""
    client = client or _client()
    data = _skeleton_tar(os.getuid(), os.getgid())
    repository, _, version = tag.rpartition(":") if ":" in tag.rsplit("/", 1)[-1] else (tag, "", "latest")
    changes = [f"ENV PATH={_PATH}", f"LABEL {LABEL_IMAGE}=runtime", 'CMD ["/bin/sh"]']
    _call(lambda: client.api.import_image_from_data(data, repository=repository, tag=version, changes=changes),
          f"import image {tag}")
    image = _call(lambda: client.images.get(tag), f"inspect image {tag}")
    log.info("docker_image_built", image=tag, id=image.id)
    return image.id


def _ensure_image(client: docker.DockerClient, tag: str) -> None:
    import docker.errors

    try:
        _call(lambda: client.images.get(tag), f"inspect image {tag}", passthrough=(docker.errors.ImageNotFound,))
    except docker.errors.ImageNotFound:
        if tag != DEFAULT_IMAGE:
            raise SchedulerError(f"docker image {tag!r} ({ENV_IMAGE}) is not on the engine; build or pull it") from None
        build_image(client, tag)


def _call(fn: Callable[[], T], what: str, *, passthrough: tuple[type[BaseException], ...] = ()) -> T:
    """``fn()`` under :func:`docker_retrying`; a final failure becomes SchedulerError with the
    engine's message (exceptions in ``passthrough`` are re-raised as they are)."""
    import docker.errors
    import requests

    try:
        return docker_retrying()(fn)
    except passthrough:
        raise
    except (docker.errors.DockerException, requests.RequestException) as exc:
        raise SchedulerError(f"docker: {what} failed: {_engine_message(exc)}") from exc


def _client() -> docker.DockerClient:
    import docker

    return _call(lambda: docker.from_env(timeout=60), "connect to the engine (DOCKER_HOST)")


# ----- the backend ------------------------------------------------------------------------


def _container_name(job_id: str, name: str) -> str:
    return f"dlrover-{job_id}-{name}"


def _network_name(job_id: str) -> str:
    return f"dlrover-{job_id}"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class DockerScheduler(SchedulerBackend):
    """Runs the master and every node of a job in containers on a Docker engine."""

    name = "docker"
    capabilities = Capabilities(elastic=True, relaunch_node=True, follow_logs=True, multi_host=False,
                                storage_on_submit_host=True)

    def __init__(self) -> None:
        self._docker: docker.DockerClient | None = None

    @property
    def client(self) -> docker.DockerClient:
        if self._docker is None:
            self._docker = _client()
        return self._docker

    # ----- plan (pure) --------------------------------------------------------------------

    def dryrun(self, job: JobSpec) -> Plan:
        self.check(job)
        accelerator = get_host().create_accelerator(job.accelerator)
        if accelerator.name != "cpu":
            raise JobSpecError("accelerator", job.accelerator,
                               f"'cpu' for the docker scheduler (found {accelerator.name!r}; devices are not "
                               "passed into containers yet)")
        nproc = job.nodes.nproc_per_node
        nproc = accelerator.default_nproc_per_node() if nproc == "auto" else int(nproc)
        workdir = Path(job.workdir).resolve()
        if str(workdir) == "/":
            raise JobSpecError("workdir", job.workdir, "a directory other than / (it is bind-mounted)")
        checkpoint = job.checkpoint
        local_ckpt = checkpoint.storage == "posix" and ("://" not in checkpoint.dir or checkpoint.dir.startswith("file://"))
        if local_ckpt:
            ckpt_path = Path(checkpoint.dir.removeprefix("file://")).expanduser()
            checkpoint = attrs.evolve(checkpoint, dir=str(ckpt_path if ckpt_path.is_absolute() else workdir / ckpt_path))
        job = attrs.evolve(
            job, accelerator=accelerator.name, nodes=attrs.evolve(job.nodes, nproc_per_node=nproc),
            workdir=str(workdir), log_dir=str(Path(job.log_dir).resolve()), checkpoint=checkpoint,
        )
        environ = dict(os.environ)
        job_id = f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        log_dir = Path(job.log_dir) / job_id
        image = environ.get(ENV_IMAGE) or DEFAULT_IMAGE
        python = environ.get(ENV_PYTHON) or sys.executable
        master_addr = f"{MASTER_HOST}:{MASTER_PORT}"
        network = _network_name(job_id)

        mounts: list[tuple[str, bool]] = [] if environ.get(ENV_PYTHON) else runtime_mounts()
        mounts += [(str(workdir), False), (str(log_dir), False)]
        if local_ckpt:
            mounts.append((job.checkpoint.dir, False))
        if Path(job.entrypoint).is_absolute():
            mounts.append((str(Path(job.entrypoint).resolve().parent), True))
        mounts += [(p, False) for p in _arg_paths(job)]
        for item in filter(None, (s.strip() for s in environ.get(ENV_MOUNTS, "").split(","))):
            path, _, mode = item.partition(":")
            mounts.append((str(Path(path).resolve()), mode == "ro"))
        docker_host, socket_path = _docker_endpoint(environ)

        base_env = {
            env.JOB_SPEC: json.dumps(job.to_dict(), separators=(",", ":")),
            env.JOB_ID: job_id,
            env.LOG_DIR: str(log_dir),
            "PYTHONUNBUFFERED": "1",
            "PATH": f"{Path(python).parent}:{_PATH}" if Path(python).is_absolute() else _PATH,
        }
        if "OMP_NUM_THREADS" not in environ and "OMP_NUM_THREADS" not in job.env:
            # every node's container shares this machine's cores: split them between all workers
            base_env["OMP_NUM_THREADS"] = str(max(1, _cores() // (job.nodes.max * nproc)))
        base_env.update({k: environ[k] for k in _PASS_ENV if k in environ})
        user = f"{os.getuid()}:{os.getgid()}"

        def container(role: str, name: str, command: list[str], extra_env: dict[str, str],
                      extra_mounts: list[tuple[str, bool]], shm_size: int, node_id: int | None) -> dict[str, Any]:
            labels = {LABEL_JOB: job_id, LABEL_ROLE: role}
            if node_id is not None:
                labels[LABEL_NODE] = str(node_id)
            return {
                "name": _container_name(job_id, name), "image": image, "command": command,
                "environment": {**base_env, **extra_env}, "hostname": name, "network": network, "aliases": [name],
                "labels": labels, "user": user, "working_dir": str(workdir), "init": True,
                "shm_size": shm_size, "restart_policy": {"Name": "no"},
                "mounts": [{"type": "bind", "source": p, "target": p, "read_only": ro}
                           for p, ro in _merge_mounts(mounts + extra_mounts)],
            }

        master_mounts: list[tuple[str, bool]] = [(socket_path, False)] if socket_path else []
        master = container(
            "master", MASTER_HOST,
            [python, "-m", "dlrover_core.master", "--job-id", job_id, "--host", "0.0.0.0", "--port", str(MASTER_PORT),
             "--store-host", MASTER_HOST, "--log-dir", str(log_dir)],
            {"DOCKER_HOST": docker_host}, master_mounts, MASTER_SHM_BYTES, None,
        )
        # The master looks up no name outside the job's network, but torch reverse-resolves the
        # address of each round's fresh store; with an unreachable upstream DNS that waits 2 × 5 s.
        master["dns_opt"] = ["timeout:1", "attempts:1"]
        if os.getuid() != 0 and socket_path and os.path.exists(socket_path):
            master["group_add"] = [str(os.stat(socket_path).st_gid)]  # to reach the engine as a plain user
        shm = shm_size_bytes(job, nproc, environ)
        agents = [
            container(
                "agent", f"node-{i}",
                [python, "-m", "dlrover_core.agent", "--job-id", job_id, "--node-id", str(i),
                 "--master-addr", master_addr, "--log-dir", str(log_dir)],
                {env.ACCELERATOR: accelerator.name, env.MASTER_ADDR: master_addr}, [], shm, i,
            )
            for i in range(job.nodes.max)
        ]
        document = {
            "network": {"name": network, "driver": "bridge", "labels": {LABEL_JOB: job_id}},
            "containers": [master, *agents],
        }
        workers = preview_workers(job, job_id=job_id, nproc=nproc, master_addr=master_addr, store_host=MASTER_HOST,
                                  accelerator=accelerator, log_dir=str(log_dir), python=python)
        return Plan(scheduler=self.name, job_id=job_id, job=job, log_dir=str(log_dir),
                    files={"containers.json": json.dumps(document, indent=2) + "\n"}, workers=workers)

    # ----- side effects -----------------------------------------------------------------------

    def _create(self, spec: dict[str, Any]) -> Any:
        """Create and start one container of the plan."""
        import docker.types

        client = self.client
        mounts = [docker.types.Mount(m["target"], m["source"], type=m["type"], read_only=m["read_only"])
                  for m in spec["mounts"]]
        endpoint = client.api.create_endpoint_config(aliases=spec["aliases"])
        container = _call(lambda: client.containers.create(
            spec["image"], spec["command"], name=spec["name"], environment=spec["environment"],
            hostname=spec["hostname"], labels=spec["labels"], user=spec["user"], working_dir=spec["working_dir"],
            init=spec["init"], shm_size=spec["shm_size"], restart_policy=spec["restart_policy"], mounts=mounts,
            network=spec["network"], networking_config={spec["network"]: endpoint},
            group_add=spec.get("group_add"), dns_opt=spec.get("dns_opt"), detach=True,
        ), f"create container {spec['name']}")
        _call(container.start, f"start container {spec['name']}")
        return container

    def submit(self, plan: Plan) -> JobHandle:
        document = json.loads(plan.files["containers.json"])
        specs = document["containers"]
        log_dir = Path(plan.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        job = plan.job
        if job.checkpoint.storage == "posix" and Path(job.checkpoint.dir).is_absolute():
            Path(job.checkpoint.dir).mkdir(parents=True, exist_ok=True)  # a bind source must exist
        (log_dir / "plan.txt").write_text(str(plan) + "\n")
        (log_dir / "containers.json").write_text(plan.files["containers.json"])
        client = self.client
        _ensure_image(client, specs[0]["image"])
        net = document["network"]
        handle = JobHandle(scheduler=self.name, job_id=plan.job_id, log_dir=str(log_dir))
        try:
            network = _call(lambda: client.networks.create(net["name"], driver=net["driver"], labels=net["labels"],
                                                           check_duplicate=True), f"create network {net['name']}")
            _write_json(log_dir / "docker.json", {"network": net["name"], "network_id": network.id,
                                                  "master_restarts": 0})
            master = self._create(next(s for s in specs if s["labels"][LABEL_ROLE] == "master"))
            self._wait_master(master)
            for spec in specs:
                if spec["labels"][LABEL_ROLE] == "agent":
                    self._create(spec)
        except BaseException:
            self._remove_all(handle, save_logs=True)
            raise
        log.info("docker_job_started", job_id=plan.job_id, network=net["name"], nodes=len(specs) - 1)
        return attrs.evolve(handle, native_id=master.name)

    def _wait_master(self, master: Any) -> None:
        """Until the master logs ``master_started``; SchedulerError with its output if it exits first."""
        deadline = time.monotonic() + _MASTER_START_TIMEOUT_S
        while True:
            output = _call(lambda: master.logs(), "read the master's logs")
            if b"master_started" in output:
                return
            _call(master.reload, "inspect the master container")
            if master.status not in ("created", "running") or time.monotonic() > deadline:
                code = master.attrs.get("State", {}).get("ExitCode")
                tail = output.decode(errors="replace")[-2000:]
                raise SchedulerError(f"the job master did not start (container {master.status}, exit code {code}); "
                                     f"its output ends:\n{tail}")
            time.sleep(0.2)

    def _containers(self, handle: JobHandle, **labels: str) -> list[Any]:
        filters = [f"{LABEL_JOB}={handle.job_id}", *(f"{k}={v}" for k, v in labels.items())]
        found = _call(lambda: self.client.containers.list(all=True, filters={"label": filters}),
                      f"list containers of {handle.job_id}")
        return sorted(found, key=_container_order)

    def _master(self, handle: JobHandle) -> Any | None:
        found = self._containers(handle, **{LABEL_ROLE: "master"})
        return found[0] if found else None

    def _state(self, handle: JobHandle) -> dict[str, Any]:
        try:
            return json.loads((Path(handle.log_dir) / "docker.json").read_text())
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
        _call(master.start, "restart the master container")
        state["master_restarts"] = state.get("master_restarts", 0) + 1
        _write_json(Path(handle.log_dir) / "docker.json", state)
        log.warning("master_restarted", job_id=handle.job_id, restarts=state["master_restarts"])

    def status(self, handle: JobHandle) -> JobStatus:
        try:
            master = self._master(handle)
        except SchedulerError as exc:  # the engine is unreachable: the job may well be running
            result = self.result(handle)
            if result is not None:
                return JobStatus(state=result.state, step=result.final_step, metrics=result.metrics,
                                 restarts=result.restarts, message=result.reason)
            return JobStatus(state=JobState.UNKNOWN, message=str(exc))
        if master is not None and master.status == "running":
            networks = master.attrs.get("NetworkSettings", {}).get("Networks", {})
            ip = (networks.get(_network_name(handle.job_id)) or {}).get("IPAddress")
            if ip:
                try:
                    s = httpx.get(f"http://{ip}:{MASTER_PORT}/v1/status", timeout=2.0).json()
                    return JobStatus(
                        state=JobState(s["state"]), step=s["step"], metrics=s["metrics"], nodes=s["nodes"],
                        max_nodes=s["max_nodes"], restarts=s["restarts"], round=s["round"], message=s["message"],
                        worker_pids=self._host_pids(handle, s["node_table"]), goodput=s.get("goodput", {}),
                    )
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
        result = self.result(handle)
        if result is not None:
            return JobStatus(state=result.state, step=result.final_step, metrics=result.metrics,
                             restarts=result.restarts, message=result.reason)
        if master is None:
            return JobStatus(state=JobState.UNKNOWN, message=f"no container of job {handle.job_id} on the engine")
        if master.status == "created":
            return JobStatus(state=JobState.PENDING, message="the master container is starting")
        if self._finished(handle, master):
            code = master.attrs.get("State", {}).get("ExitCode")
            return JobStatus(state=JobState.FAILED, message=f"the job master exited (code {code}) without a result")
        return JobStatus(state=JobState.UNKNOWN, message=f"the job master is not answering (container {master.status})")

    def _host_pids(self, handle: JobHandle, node_table: list[dict[str, Any]]) -> dict[int, int]:
        """Worker pids as this machine sees them, by global rank. Agents report pids of their
        container's pid namespace; they are translated through ``/proc/<pid>/status`` (NSpid)
        of the processes under each running agent container. Empty where the engine's
        processes are not visible here (a remote engine)."""
        import psutil

        wanted = {(str(n["node_id"]), int(pid)): int(rank) for n in node_table for rank, pid in n["workers"].items()}
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

    def logs(self, handle: JobHandle, *, follow: bool = False) -> Iterator[str]:
        containers = self._containers(handle)
        if not containers:  # removed by cancel: read what it saved
            yield from _saved_logs(Path(handle.log_dir))
            return
        if not follow:
            for c in containers:
                text = _call(lambda c=c: c.logs(), f"read logs of {c.name}").decode(errors="replace")
                for line in text.splitlines():
                    yield f"[{_source(c)}] {line}"
            return
        yield from self._follow(handle)

    def _follow(self, handle: JobHandle) -> Iterator[str]:
        """Stream every container's output (new ones too) until the job has finished."""
        lines: queue.Queue[str] = queue.Queue()
        streams: dict[str, threading.Thread] = {}
        closers: list[Any] = []

        def pump(container: Any) -> None:
            prefix, rest = f"[{_source(container)}] ", b""
            try:
                stream = container.logs(stream=True, follow=True)
                closers.append(stream)
                for chunk in stream:
                    parts = (rest + chunk).split(b"\n")
                    rest = parts.pop()
                    for part in parts:
                        lines.put(prefix + part.decode(errors="replace"))
            except Exception:  # the container was removed, or the engine went away
                pass
            if rest:
                lines.put(prefix + rest.decode(errors="replace"))

        try:
            finished_at: float | None = None
            listed_at = 0.0
            containers: list[Any] = []
            while True:
                if time.monotonic() - listed_at >= 1.0:  # new containers (relaunched nodes), states
                    listed_at = time.monotonic()
                    try:
                        containers = self._containers(handle)
                    except SchedulerError:
                        containers = []
                for c in containers:
                    if c.id not in streams:
                        streams[c.id] = threading.Thread(target=pump, args=(c,), daemon=True, name="dlrover-logs")
                        streams[c.id].start()
                try:
                    done = not containers or self._finished(handle, next(
                        (c for c in containers if c.labels.get(LABEL_ROLE) == "master"), None))
                except SchedulerError:
                    done = True
                while not lines.empty():
                    yield lines.get_nowait()
                if done:
                    finished_at = finished_at or time.monotonic()
                    if all(not t.is_alive() for t in streams.values()) or time.monotonic() - finished_at > 5.0:
                        while not lines.empty():
                            yield lines.get_nowait()
                        return
                try:
                    yield lines.get(timeout=0.3)
                except queue.Empty:
                    pass
        finally:
            for stream in closers:
                try:
                    stream.close()
                except Exception:
                    pass

    def cancel(self, handle: JobHandle) -> None:
        """Stop the master (SIGTERM: it cancels the job, agents drain, it writes the result),
        save every container's output into the run directory, then remove every container and
        the network. Idempotent."""
        master = self._master(handle)
        if master is not None and master.status == "running":
            grace_s = 30  # the master drains agents for stop_grace_s + 3 heartbeats + 5 s at most
            try:
                failure = json.loads(_env_of(master)[env.JOB_SPEC])["failure"]
                grace_s = int(failure["stop_grace_s"] + 3 * failure["heartbeat_interval_s"] + 15)
            except (KeyError, ValueError, TypeError):
                pass
            _call(lambda: master.stop(timeout=grace_s), f"stop {master.name}")
        self._remove_all(handle, save_logs=True)

    def _remove_all(self, handle: JobHandle, *, save_logs: bool) -> None:
        import docker.errors

        log_dir = Path(handle.log_dir)
        for attempt in range(3):
            for c in self._containers(handle):
                if save_logs and log_dir.is_dir():
                    try:
                        (log_dir / _log_file_name(c)).write_bytes(c.logs())
                    except (docker.errors.DockerException, OSError):
                        pass
                try:
                    _call(lambda c=c: c.remove(force=True), f"remove container {c.name}",
                          passthrough=(docker.errors.NotFound,))
                except docker.errors.NotFound:
                    pass
            networks = _call(lambda: self.client.networks.list(filters={"label": f"{LABEL_JOB}={handle.job_id}"}),
                             f"list networks of {handle.job_id}")
            try:
                for n in networks:
                    try:
                        _call(n.remove, f"remove network {n.name}", passthrough=(docker.errors.NotFound,))
                    except docker.errors.NotFound:
                        pass
                return
            except SchedulerError:  # a container appeared meanwhile (a relaunch): remove it too
                if attempt == 2:
                    raise

    def relaunch_node(self, handle: JobHandle, node_id: int) -> None:
        """Start a new agent container for ``node_id`` (a node of the plan, or a new id: then
        made like the plan's first agent). Works from inside the master container."""
        try:
            document = json.loads((Path(handle.log_dir) / "containers.json").read_text())
        except FileNotFoundError:
            raise SchedulerError(f"no docker job {handle.job_id} under {handle.log_dir}") from None
        agents = [c for c in document["containers"] if c["labels"][LABEL_ROLE] == "agent"]
        spec = next((c for c in agents if c["labels"][LABEL_NODE] == str(node_id)), None)
        if spec is None:
            if not agents:
                raise SchedulerError(f"job {handle.job_id} has no agent to copy for node {node_id}")
            spec = json.loads(json.dumps(agents[0]))
            command = spec["command"]
            command[command.index("--node-id") + 1] = str(node_id)
            spec.update(hostname=f"node-{node_id}", aliases=[f"node-{node_id}"],
                        name=_container_name(handle.job_id, f"node-{node_id}"))
            spec["labels"][LABEL_NODE] = str(node_id)
        old = self._containers(handle, **{LABEL_NODE: str(node_id)})
        for c in old:  # a lost node's container may still run (hung, or cut off): it must go
            if c.status == "running":
                _call(lambda c=c: c.kill(), f"kill {c.name}")
        spec = {**spec, "name": f"{spec['name']}-{len(old)}" if old else spec["name"],
                "labels": {**spec["labels"], "dlrover.attempt": str(len(old))}}
        container = self._create(spec)
        log.info("node_relaunched", job_id=handle.job_id, node_id=node_id, container=container.name)

    def result(self, handle: JobHandle) -> JobResult | None:
        path = Path(handle.log_dir) / "result.json"
        try:
            return JobResult.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            return None


def _env_of(container: Any) -> dict[str, str]:
    return dict(item.split("=", 1) for item in container.attrs["Config"]["Env"] if "=" in item)


def _container_order(c: Any) -> tuple[int, int, str]:
    role = c.labels.get(LABEL_ROLE, "")
    node = c.labels.get(LABEL_NODE, "")
    return (0 if role == "master" else 1, int(node) if node.isdigit() else -1, c.attrs.get("Created", ""))


def _source(c: Any) -> str:
    """``master`` or ``node-<id>``: what a log line is prefixed with."""
    node = c.labels.get(LABEL_NODE)
    return "master" if c.labels.get(LABEL_ROLE) == "master" else f"node-{node}"


def _log_file_name(c: Any) -> str:
    attempt = c.labels.get("dlrover.attempt")
    base = "master" if c.labels.get(LABEL_ROLE) == "master" else f"node_{c.labels.get(LABEL_NODE)}"
    return f"{base}.log" + (f".{attempt}" if attempt and attempt != "0" else "")


def _saved_logs(log_dir: Path) -> Iterator[str]:
    files = sorted(log_dir.glob("master.log*")) + sorted(
        log_dir.glob("node_*.log*"), key=lambda p: (int(p.name.split("_")[1].split(".")[0]), p.name))
    for path in files:
        source = "master" if path.name.startswith("master") else f"node-{path.name.split('_')[1].split('.')[0]}"
        for line in path.read_text(errors="replace").splitlines():
            yield f"[{source}] {line}"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(data, indent=2))


@hookimpl
def dlrover_register_schedulers(register):
    register(DockerScheduler)


def main(argv: list[str] | None = None) -> int:
    """``python -m dlrover_core.schedulers.docker build-image [--tag T]``."""
    parser = argparse.ArgumentParser(prog="python -m dlrover_core.schedulers.docker")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build-image", help="make the default runtime image from this host's files, offline")
    build.add_argument("--tag", default=os.environ.get(ENV_IMAGE) or DEFAULT_IMAGE)
    args = parser.parse_args(argv)
    if args.command == "build-image":
        try:
            image_id = build_image(tag=args.tag)
        except SchedulerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{args.tag} {image_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
