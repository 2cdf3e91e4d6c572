"""The docker scheduler: its dry run against a golden file (no engine needed), its options, a
clear error without the docker SDK, and jobs in real containers on a private Docker engine that
the session starts and removes: a 2-node job trains to the end, a killed node container is
relaunched by the master from inside its container, and cancel leaves no container and no
network of the job."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from helpers import ROOT, SCRIPTS, shm_entries

from dlrover_core import Checkpoint, Failure, Job, JobSpecError, JobState, Nodes, control_plane
from dlrover_core.errors import SchedulerError
from dlrover_core.scheduler_backend import JobHandle
from dlrover_core.schedulers import docker as docker_backend
from dlrover_core.schedulers.docker import (
    DEFAULT_IMAGE,
    LABEL_JOB,
    LABEL_NODE,
    LABEL_ROLE,
    MIN_SHM_BYTES,
    DockerRequest,
    DockerScheduler,
    _engine,
    _mounts,
    _scheduler,
    shm_size_bytes,
)

GOLDEN = Path(__file__).resolve().parent / "golden" / "docker_containers.json"
_DOCKER_ENV = ("DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH", "DOCKER_CONTEXT")
#: The docker scheduler's option variables (each an option's fallback).
_OPTION_ENV = tuple(o.env for o in DockerScheduler.options if o.env)


# ----- the dry run (pure, no engine) ---------------------------------------------------------


def _golden_job(tmp: Path) -> Job:
    work = tmp / "project"
    work.mkdir()
    (work / "train.py").write_text("print('hello')\n")
    (tmp / "results").mkdir()
    return Job(
        name="golden", entrypoint="train.py", args=["--steps", "10", "--out", str(tmp / "results" / "hash.txt")],
        nodes=Nodes(min=2, max=2, nproc_per_node=2), accelerator="cpu", scheduler="docker", workdir=str(work),
        checkpoint=Checkpoint(dir="ck", persist_every_steps=5), failure=Failure(max_restarts=2),
        env={"EXTRA": "1"}, log_dir=str(tmp / "runs"),
    )


def _normalise(text: str, job_id: str, tmp: Path) -> str:
    """The job id, the temporary directory and the uid as placeholders; mounts sorted by the
    normalised path (where the temporary directory lies changes their order)."""
    text = (text.replace(job_id, "<job_id>").replace(str(tmp), "<tmp>")
            .replace(f'"{os.getuid()}:{os.getgid()}"', '"<uid>:<gid>"'))
    doc = json.loads(text)
    for c in doc["containers"]:
        c["mounts"].sort(key=lambda m: m["target"])
    return json.dumps(doc, indent=2) + "\n"


def test_dryrun_is_pure_and_matches_the_golden_file(tmp_path, monkeypatch):
    """dryrun returns the exact container specs (image, command, env, mounts, network,
    shm_size, labels, hostname) as containers.json, equal to the golden file once the job id,
    the temporary directory and the uid are normalised; it talks to no engine and writes nothing."""
    import docker

    for name in (*_DOCKER_ENV, *_OPTION_ENV, "OMP_NUM_THREADS", "DLROVER_LOG_LEVEL", "DLROVER_LOG_FORMAT",
                 "DLROVER_PLUGINS", "DLROVER_DISABLE_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DOCKER_HOST", "unix:///var/run/dlrover-test.sock")
    monkeypatch.setenv("DLROVER_DOCKER_STATE_MB", "600")
    monkeypatch.setenv("DLROVER_DOCKER_MOUNTS", "/data/corpus:ro")
    # the host's runtime differs between machines: pin it (runtime_mounts has its own test)
    monkeypatch.setattr(_scheduler, "runtime_mounts",
                        lambda: [("/usr", True), ("/opt/python", True), ("/opt/venv", True), ("/src/dlrover", True)])
    monkeypatch.setattr(sys, "executable", "/opt/venv/bin/python")
    monkeypatch.setattr(control_plane, "host_cores", lambda: 8)

    def no_engine(*a, **k):
        raise AssertionError("dryrun must not talk to the engine")

    monkeypatch.setattr(docker, "from_env", no_engine)
    monkeypatch.setattr(docker, "DockerClient", no_engine)
    job = _golden_job(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    plan = job.dryrun()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert plan.scheduler == "docker" and list(plan.files) == ["containers.json"]
    assert isinstance(plan.request, DockerRequest) and plan.files["containers.json"] == plan.request.render()
    assert DockerRequest.parse(plan.files["containers.json"], docker_host=plan.request.docker_host) == plan.request
    text = _normalise(plan.files["containers.json"], plan.job_id, tmp_path)
    if os.environ.get("DLROVER_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), f"no golden file {GOLDEN}; run with DLROVER_UPDATE_GOLDEN=1 to write it"
    assert text == GOLDEN.read_text()
    doc = json.loads(plan.files["containers.json"])
    master, *agents = doc["containers"]
    assert master["labels"] == {LABEL_JOB: plan.job_id, LABEL_ROLE: "master"}
    assert [a["labels"][LABEL_NODE] for a in agents] == ["0", "1"]
    assert {"type": "bind", "source": "/var/run/dlrover-test.sock", "target": "/var/run/dlrover-test.sock",
            "read_only": False} in master["mounts"]
    assert all(a["shm_size"] == shm_size_bytes(plan.job, 2, state_mb=600) > MIN_SHM_BYTES for a in agents)
    assert len(plan.workers) == 4 and plan.workers[3].env["MASTER_ADDR"] == "master"


def test_shm_size_rule():
    """/dev/shm of an agent: at least 1 GiB; with a state hint (option state_mb), two slots per
    rank plus 25 % and 256 MiB; the shm_size option wins; no hint or no memory snapshots: 1 GiB."""
    job = Job(name="shm", entrypoint="dlrover_core.agent", accelerator="cpu")
    assert shm_size_bytes(job, 4) == 2**30
    assert shm_size_bytes(job, 1, state_mb=10) == 2**30
    assert shm_size_bytes(job, 4, state_mb=1024) == (4 * 2 * 1024 * 5 // 4 + 256) * 2**20
    assert shm_size_bytes(job, 4, state_mb=1024, shm_size="3g") == 3 * 2**30
    no_memory = Job(name="shm", entrypoint="dlrover_core.agent", accelerator="cpu",
                    checkpoint=Checkpoint(memory_every_steps=0))
    assert shm_size_bytes(no_memory, 4, state_mb=4096) == 2**30


def test_an_option_in_the_job_wins_over_its_variable_and_shows_in_the_dry_run(tmp_path, monkeypatch):
    """scheduler_options={"image": ..., "shm_size": ...}: the containers use them although
    DLROVER_DOCKER_IMAGE says otherwise; the dry-run text lists every option with its value
    and where it came from (the Job, the variable, the default)."""
    for name in (*_DOCKER_ENV, *_OPTION_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DLROVER_DOCKER_IMAGE", "from-env:1")
    monkeypatch.setenv("DLROVER_DOCKER_STATE_MB", "600")
    job = _golden_job(tmp_path)
    plan = job.dryrun()
    assert {c.image for c in plan.request.containers} == {"from-env:1"}
    job = Job(**{**{f: getattr(job, f) for f in ("name", "entrypoint", "args", "nodes", "accelerator", "scheduler",
                                                    "workdir", "checkpoint", "log_dir")},
                 "scheduler_options": {"image": "from-job:2", "shm_size": "2g"}})
    plan = job.dryrun()
    assert {c.image for c in plan.request.containers} == {"from-job:2"}
    assert {c.shm_size for c in plan.request.agents} == {2 * 2**30}
    text = str(plan)
    assert '    image="from-job:2"  (job)' in text and '    shm_size="2g"  (job)' in text
    assert "    state_mb=600.0  ($DLROVER_DOCKER_STATE_MB)" in text
    assert '    docker_host="unix:///var/run/docker.sock"  (default)' in text


def test_options_are_checked_naming_the_option(tmp_path):
    """An unknown option, a value of the wrong type, or a size that is not one: JobSpecError
    naming scheduler_options['<name>'] and the fix."""
    job = _golden_job(tmp_path)
    fields = {f: getattr(job, f) for f in ("name", "entrypoint", "nodes", "accelerator", "scheduler", "workdir",
                                           "log_dir")}
    with pytest.raises(JobSpecError, match=r"scheduler_options\['imgae'\].*an option of scheduler 'docker': "
                                           r"docker_host, image, mounts"):
        Job(**fields, scheduler_options={"imgae": "x"}).validate()
    with pytest.raises(JobSpecError, match=r"scheduler_options\['mounts'\]='/data'.*a list\[str\]") as info:
        Job(**fields, scheduler_options={"mounts": "/data"}).dryrun()
    assert info.value.field == "scheduler_options['mounts']"
    with pytest.raises(JobSpecError, match=r"scheduler_options\['shm_size'\]='lots'.*not a size"):
        Job(**fields, scheduler_options={"shm_size": "lots"}).dryrun()


def test_without_the_docker_sdk_the_scheduler_says_what_to_install(tmp_path, monkeypatch):
    """dlrover-core does not need the docker SDK; using the docker scheduler without it fails
    at once with SchedulerError naming pip install 'dlrover-core[docker]'."""
    monkeypatch.setitem(sys.modules, "docker", None)  # `import docker` now raises ImportError
    with pytest.raises(SchedulerError, match=r"pip install 'dlrover-core\[docker\]'"):
        _golden_job(tmp_path).dryrun()
    with pytest.raises(SchedulerError, match=r"pip install 'dlrover-core\[docker\]'"):
        DockerScheduler().client  # noqa: B018 - the property connects
    check = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['docker'] = None; import dlrover_core, dlrover_core.cli; "
         "from dlrover_core.plugins import get_host; print(get_host().registries.scheduler.names())"],
        capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "docker" in check.stdout, check.stderr


def test_runtime_mounts_cover_the_interpreter_the_venv_and_dlrover():
    """Everything this interpreter loads lies under a read-only runtime mount."""
    import dlrover_core

    mounts = docker_backend.runtime_mounts()
    assert all(ro for _, ro in mounts)
    needed = [str(Path(sys.executable).resolve()), sys.prefix, str(Path(dlrover_core.__file__).resolve()),
              str(Path(os.__file__).resolve())]
    for path in needed:
        assert any(_mounts.under(path, m) for m, _ in mounts), (path, mounts)


def test_transient_errors_are_retried_and_permanent_ones_keep_the_engine_message():
    """A refused connection or a 5xx answer is retried (bounded); a 4xx answer fails at once
    as SchedulerError carrying the engine's explanation."""
    import docker.errors
    import requests

    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise requests.ConnectionError("connection refused")
        return "ok"

    assert docker_backend.docker_retrying(sleep=lambda s: None)(flaky) == "ok" and len(calls) == 3
    sleeps = []
    with pytest.raises(docker.errors.APIError):
        docker_backend.docker_retrying(attempts=3, sleep=sleeps.append)(
            lambda: (_ for _ in ()).throw(docker.errors.APIError("boom", response=_Response(503))))
    assert len(sleeps) == 2

    def bad_request():
        calls.append(1)
        raise docker.errors.APIError("400", response=_Response(400), explanation="invalid mount config for type bind")

    calls.clear()
    with pytest.raises(SchedulerError, match="create container x failed: invalid mount config for type bind"):
        _engine.call(bad_request, "create container x")
    assert len(calls) == 1


class _Response:
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code
        self.reason = "test"
        self.url = "http+docker://localhost/test"


# ----- a private Docker engine ----------------------------------------------------------------


def _free_pool() -> str:
    """A 10.x.0.0/16 address pool that no route on this machine uses."""
    used = set()
    try:
        for line in Path("/proc/net/route").read_text().splitlines()[1:]:
            dest = int(line.split()[1], 16)
            used.add((dest & 0xFF, (dest >> 8) & 0xFF))
    except OSError:
        pass
    second = next(n for n in range(200, 250) if (10, n) not in used)
    return f"10.{second}.0.0/16"


@pytest.fixture(scope="session")
def engine():
    """A private dockerd (own data root, socket and address pool) for the session, with the
    default image built offline; stopped, and its data removed, at the end."""
    if shutil.which("dockerd") is None:
        pytest.skip("dockerd is not installed (apt-get install -y --no-install-recommends docker.io)")
    if os.geteuid() != 0:
        pytest.skip("starting a private dockerd needs root")
    import docker

    tmp = Path(tempfile.mkdtemp(prefix="dlrd-"))  # short: unix socket paths are limited to 107 bytes
    sock = tmp / "docker.sock"
    log = open(tmp / "dockerd.log", "wb")
    proc = subprocess.Popen(
        ["dockerd", "--data-root", str(tmp / "root"), "--exec-root", str(tmp / "exec"), "--pidfile",
         str(tmp / "dockerd.pid"), "-H", f"unix://{sock}", "--iptables=false", "--bridge=none",
         "--default-address-pool", f"base={_free_pool()},size=24"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    saved = {k: os.environ.get(k) for k in _DOCKER_ENV}
    for k in _DOCKER_ENV:
        os.environ.pop(k, None)
    os.environ["DOCKER_HOST"] = f"unix://{sock}"
    client = None
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                client = docker.DockerClient(base_url=f"unix://{sock}", timeout=30)
                client.ping()
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (tmp / "dockerd.log").read_text(errors="replace")[-1500:]
                    _stop_dockerd(proc, tmp)
                    pytest.skip(f"the Docker engine could not be started here: {tail}")
                time.sleep(0.2)
        t0 = time.monotonic()
        docker_backend.build_image(client)
        print(f"default image built offline in {time.monotonic() - t0:.2f} s")
        yield client
    finally:
        if client is not None:
            for c in client.containers.list(all=True, filters={"label": LABEL_JOB}):
                c.remove(force=True)
            for n in client.networks.list(filters={"label": LABEL_JOB}):
                n.remove()
            client.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _stop_dockerd(proc, tmp)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _stop_dockerd(proc: subprocess.Popen, tmp: Path) -> None:
    try:
        children = psutil.Process(proc.pid).children(recursive=True)  # its containerd and shims
    except psutil.NoSuchProcess:
        children = []
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=10)
    # a dockerd that was killed can leave its overlay and netns mounts behind
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for point in sorted((m for m in mounts if m.startswith(str(tmp) + "/")), reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def _job(tmp: Path, *args: str) -> Job:
    return Job(
        name="dock", entrypoint=str(SCRIPTS / "tiny_train.py"), args=list(args), nodes=2, accelerator="cpu",
        scheduler="docker", workdir=str(tmp), checkpoint=Checkpoint(dir=str(tmp / "ck"), persist_every_steps=5),
        failure=Failure(max_restarts=2, stop_grace_s=2, heartbeat_timeout_s=3.0), log_dir=str(tmp / "runs"),
    )


def _left(client, job_id: str) -> tuple[list[str], list[str]]:
    containers = client.containers.list(all=True, filters={"label": f"{LABEL_JOB}={job_id}"})
    networks = client.networks.list(filters={"label": f"{LABEL_JOB}={job_id}"})
    return [c.name for c in containers], [n.name for n in networks]


@pytest.fixture
def submitted(engine):
    """Jobs a test submits (append their handles); cancelled even when the test fails."""
    handles: list[JobHandle] = []
    yield handles
    for handle in handles:
        DockerScheduler().cancel(handle)


def _wait_step(handle: JobHandle, step: int, timeout_s: float = 90) -> None:
    backend = DockerScheduler()  # a fresh backend: everything comes from the engine and log_dir
    deadline = time.monotonic() + timeout_s
    while backend.status(handle).step < step:
        assert time.monotonic() < deadline, f"no step {step}: {backend.status(handle)}"
        time.sleep(0.2)


def _events(log_dir: str) -> list[dict]:
    return [json.loads(line) for line in (Path(log_dir) / "events.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_node_job_trains_to_success_in_containers(engine, submitted, tmp_path, capsys):
    """A 2-node job runs as a master and two agent containers on the job's own network, with
    labels and a 1 GiB /dev/shm; it ends SUCCEEDED, its output streamed with the container's
    role; afterwards no container or network of the job is left and its logs are still readable."""
    shm_before = shm_entries()
    run = _job(tmp_path, "--steps", "20").submit()
    submitted.append(run.handle)
    containers = engine.containers.list(all=True, filters={"label": f"{LABEL_JOB}={run.job_id}"})
    roles = sorted((c.labels[LABEL_ROLE], c.labels.get(LABEL_NODE, "")) for c in containers)
    assert roles == [("agent", "0"), ("agent", "1"), ("master", "")]
    for c in containers:
        assert c.attrs["Config"]["Image"] == DEFAULT_IMAGE
        assert c.attrs["HostConfig"]["RestartPolicy"]["Name"] == "no"
        assert list(c.attrs["NetworkSettings"]["Networks"]) == [f"dlrover-{run.job_id}"]
        if c.labels[LABEL_ROLE] == "agent":
            assert c.attrs["HostConfig"]["ShmSize"] == MIN_SHM_BYTES
    result = run.wait(progress=True, timeout_s=120)
    assert result.state == JobState.SUCCEEDED, result.reason
    assert result.final_step == 19 and result.restarts == 0, [(f.kind, f.detail) for f in result.failures]
    out = capsys.readouterr().out
    assert "[master]" in out and "[node-0]" in out and "[node-1]" in out
    assert _left(engine, run.job_id) == ([], [])
    lines = list(DockerScheduler().logs(run.handle))
    assert any(line.startswith("[master] ") and "master_exited" in line for line in lines)
    assert any(line.startswith("[node-1] ") and "workers_succeeded" in line for line in lines)
    assert DockerScheduler().status(run.handle).state == JobState.SUCCEEDED
    assert {e for e in shm_entries() - shm_before if run.job_id in e} == set()  # other jobs may run meanwhile


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_killed_node_container_is_relaunched_by_the_master_and_the_job_finishes(engine, submitted, tmp_path):
    """`docker kill` of node 1's container: the master (in its own container) declares the node
    lost after the heartbeat timeout, starts a new agent container for it through the engine,
    and the job recovers from its checkpoint and finishes."""
    run = _job(tmp_path, "--steps", "60", "--step-sleep", "0.05").submit()
    submitted.append(run.handle)
    _wait_step(run.handle, 10)
    pids = run.status().worker_pids  # translated from the containers' pid namespaces into this machine's
    assert sorted(pids) == [0, 1] and pids[0] != pids[1]
    assert all(psutil.Process(pid).environ().get("DLROVER_JOB_ID") == run.job_id for pid in pids.values())
    engine.containers.get(f"dlrover-{run.job_id}-node-1").kill()
    result = run.wait(progress=False, timeout_s=150)
    assert result.state == JobState.SUCCEEDED, result.reason
    assert result.final_step == 59
    assert any(e["kind"] == "node_relaunched" and e["node_id"] == 1 for e in _events(result.log_dir))
    assert (Path(result.log_dir) / "node_1.log.1").exists()  # the replacement's output, saved by cancel
    assert _left(engine, run.job_id) == ([], [])


_FROM_A_NEW_PROCESS = """
import json, sys
from dlrover_core.scheduler_backend import JobHandle
from dlrover_core.schedulers.docker import DockerScheduler
handle = JobHandle(**json.loads(sys.argv[1]))
backend = DockerScheduler()
print("status", backend.status(handle).state.value, flush=True)
backend.cancel(handle)
backend.cancel(handle)
print("cancelled", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_cancel_from_a_new_process_removes_every_container_and_the_network(engine, submitted, tmp_path):
    """Given only the JobHandle, a new process reads the job's status and cancels it (twice:
    idempotent): the master ends the job CANCELLED, and no container or network with the job's
    label is left."""
    run = _job(tmp_path, "--steps", "100000", "--step-sleep", "0.05").submit()
    submitted.append(run.handle)
    _wait_step(run.handle, 2)
    handle = {"scheduler": "docker", "job_id": run.job_id, "log_dir": run.handle.log_dir,
              "native_id": run.handle.native_id}
    proc = subprocess.run([sys.executable, "-c", _FROM_A_NEW_PROCESS, json.dumps(handle)], cwd=ROOT,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["status", "RUNNING", "cancelled"]
    assert _left(engine, run.job_id) == ([], [])
    result = DockerScheduler().result(run.handle)
    assert result is not None and result.state == JobState.CANCELLED
    assert DockerScheduler().status(run.handle).state == JobState.CANCELLED


@pytest.mark.timeout(60)
def test_a_master_that_cannot_start_fails_the_submit_and_leaves_nothing(engine, tmp_path, monkeypatch):
    """An image without the interpreter the plan names: submit raises SchedulerError with the
    master container's exit code and output, and removes what it had created (network, master)."""
    monkeypatch.setenv("DLROVER_DOCKER_PYTHON", "/nonexistent/python3")
    with pytest.raises(SchedulerError, match=r"(?s)master did not start.*No such file or directory"):
        _job(tmp_path, "--steps", "1").submit()
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert _left(engine, run_dir.name) == ([], [])
