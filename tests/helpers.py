"""Helpers shared by tests: paths, and finding what a job left behind."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import psutil

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, *, poll_s: float = 0.1) -> Any:
    """Call ``predicate`` every ``poll_s`` seconds until it returns something true; return
    that. Raises AssertionError naming ``what`` after ``timeout_s`` seconds.

    Most predicates ask the master (``run.status()``: about 3 CPU-ms an answer on both
    sides); polling them at 50 Hz cost a tenth of a core for as long as a test waited. A
    test that must act within a short window passes a smaller ``poll_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(poll_s)
    return value


def job_processes(job_id: str) -> list[psutil.Process]:
    """Every live process that belongs to ``job_id``: by its DLROVER_JOB_ID variable, or with
    the id on its command line (``dlrover run --rdzv-id ID`` and the agent and master it forks)."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get("DLROVER_JOB_ID") == job_id or job_id in p.cmdline():
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def left_behind(job_id: str, *, grace_s: float = 5.0) -> list[str]:
    """The processes of ``job_id`` still running ``grace_s`` after the call (each as
    ``pid ppid cmdline``): what a launcher left behind, allowing those already on their way
    out (killed with their parent, e.g. a standby's workers) the moment to go."""
    procs = job_processes(job_id)
    _, alive = psutil.wait_procs(procs, timeout=grace_s) if procs else ([], [])
    out = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.ppid()} {' '.join(p.cmdline())[:200]}")
        except psutil.NoSuchProcess:
            continue
    return out


def shm_entries() -> set[str]:
    """Names in /dev/shm (empty where there is none)."""
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def writing_to(path: str | Path) -> list[psutil.Process]:
    """The live processes whose standard output is the file ``path`` (Linux: ``/proc/PID/fd/1``)."""
    target = os.path.realpath(path)
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and os.readlink(f"/proc/{p.pid}/fd/1") == target:
                found.append(p)
        except (OSError, psutil.Error):
            continue
    return found


def node_standbys(log_dir: str | Path, node_id: int) -> list[psutil.Process]:
    """The warm standbys of node ``node_id`` of the run in ``log_dir``: the processes whose
    output goes to the node's ``standby.log``. (Where nodes share the host's standby, a
    node's standby is not a child of its agent but of the shared one.)"""
    return writing_to(Path(log_dir) / f"node_{node_id}" / "standby.log")


def kill_node(run: Any, node_id: int) -> None:
    """Node ``node_id`` of a local-scheduler job dies as a machine does: its agent and every
    process under it SIGKILLed, its shared memory gone at once. Only the dying incarnation's
    segments (``...-n<node>-a<token>-...``, the tokens present before the kill) go: the job's
    supervision may relaunch the node meanwhile, and its new agent's segments (replicas it
    fetched) are not the dead machine's."""
    import json
    import signal

    from dlrover_core.checkpoint.shm import SHM_DIR, node_prefix, remove_segments

    handle = json.loads((Path(run.handle.log_dir) / "handle.json").read_text())
    agent = psutil.Process(handle["agents"][f"node-{node_id}"])
    victims = [agent, *agent.children(recursive=True)]
    for standby in node_standbys(run.handle.log_dir, node_id):  # (and their workers)
        victims += [standby, *standby.children(recursive=True)]
    prefix = node_prefix(run.job_id, node_id)
    tokens = {name[len(prefix):].split("-", 1)[0] for name in os.listdir(SHM_DIR) if name.startswith(prefix)}
    for p in victims:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for token in tokens:
        remove_segments(node_prefix(run.job_id, node_id, int(token)))
    psutil.wait_procs(victims, timeout=10)


def communicate_all(procs: list, timeout_s: float) -> list[str]:
    """Wait for each rank's process (``subprocess.Popen`` with text stdout); kill what is
    left; assert every one exited 0, showing the outputs' tail otherwise. Returns the outputs."""
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(outputs)[-4000:]
    return outputs


def install_dist(site: Path, dist: str, module: str, source: str, ep_name: str | None = None) -> None:
    """Make a real installed distribution (a dist-info with a `dlrover` entry point) under ``site``."""
    import textwrap

    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[dlrover]\n{ep_name or dist} = {module}\n")


#: A storage plugin whose disk "fills up": while the file FULL exists in its root, every
#: write fails with ENOSPC, as a full filesystem does.
FULL_DISK_PLUGIN = """
    import errno
    from pathlib import Path

    from dlrover_core import hookimpl
    from dlrover_core.storage.posix import PosixStorage

    class FullDiskStorage(PosixStorage):
        name = "fulldisk"

        def open_write(self, path):
            if (Path(self.root) / "FULL").exists():
                raise OSError(errno.ENOSPC, "No space left on device", str(Path(self.root) / path))
            return super().open_write(path)

    @hookimpl
    def dlrover_register_storages(register):
        register(FullDiskStorage)
"""


def run_checked(*cmd: str | Path, env: dict[str, str] | None = None, cwd: str | Path | None = None,
                timeout_s: float = 240) -> str:
    """Run ``cmd`` (outside the checkout by default: ``python -c`` puts the working directory
    first on sys.path); return its stdout, or fail with the end of its output."""
    import subprocess
    import tempfile

    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout_s,
                       env={**os.environ, **(env or {})}, cwd=str(cwd or tempfile.gettempdir()))
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd[:6]))} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout


#: What a source tree holds that no wheel needs: build output, caches, environments, and (for the
#: core's tree) the plugin projects, which are built from their own trees.
_SOURCE_LITTER = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".*", "plugins", "benchmarks")


def make_venv(tmp: Path, projects: list[Path]) -> Path:
    """A new virtual environment under ``tmp`` holding wheels built from ``projects`` (source
    trees with a pyproject.toml); returns its python.

    Third-party dependencies (torch above all) come from the test's own environment through a
    ``.pth`` entry appended after the venv's own site-packages, so the wheels' copies of our
    packages are the ones imported and found by ``importlib.metadata``. Install more into it
    with ``pip_into(python, ...)``.
    """
    import site
    import sys
    import sysconfig

    wheels = tmp / "wheels"
    # setuptools builds in the source tree (build/, *.egg-info): two tests building the same
    # project at once (pytest-xdist) would tear each other's build; each builds from its own copy.
    sources = [shutil.copytree(project, tmp / "src" / f"{i}-{project.name}", ignore=_SOURCE_LITTER)
               for i, project in enumerate(projects)]
    run_checked(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", wheels,
                *sources)
    venv = tmp / "venv"
    run_checked(sys.executable, "-m", "venv", "--without-pip", venv)
    py = venv / "bin" / "python"
    pip_into(py, "--no-index", *sorted(wheels.glob("*.whl")))
    purelib = Path(run_checked(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    ours = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if Path(p).is_dir()]
    (purelib / "zz_test_dependencies.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")
    return py


def pip_into(python: Path, *args: str | Path) -> str:
    """``pip install --no-deps --no-build-isolation ARGS`` into the environment of ``python``
    (this environment's pip, run with ``--python``; the venv needs no pip of its own)."""
    import sys

    return run_checked(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps",
                       "--no-build-isolation", *args)


#: A storage plugin ("flaky") for the checkpoint durability tests, set up by the environment
#: variable FLAKY_STORAGE (JSON) so that the agents, started with the test's environment, see
#: it too: ``delay_s`` (+ ``jitter_s`` at random) per shard write, ``fail_p`` (a shard write
#: raises EIO), ``fail_from_step`` (every shard write of a step at or above it raises EIO),
#: ``hang_from_step`` (shard writes of steps at or above it never return: a hung
#: mount), ``seed``.
FLAKY_STORAGE_PLUGIN = """
    import contextlib
    import errno
    import json
    import os
    import random
    import re
    import threading
    import time

    from dlrover_core import hookimpl
    from dlrover_core.storage.posix import PosixStorage

    _lock = threading.Lock()
    _rng = {}

    def _random():
        cfg = json.loads(os.environ.get("FLAKY_STORAGE", "{}"))
        with _lock:
            if "r" not in _rng:
                _rng["r"] = random.Random(f"{cfg.get('seed', 0)}-{os.getpid()}")
            return cfg, _rng["r"].random(), _rng["r"].random()

    class FlakyStorage(PosixStorage):
        name = "flaky"

        @contextlib.contextmanager
        def open_write(self, path):
            m = re.search(r"step_(\\d+)/rank_", path)
            cfg, u1, u2 = _random()
            if m and int(m.group(1)) >= cfg.get("hang_from_step", float("inf")):
                while True:
                    time.sleep(3600)
            if m and (u1 < cfg.get("fail_p", 0.0) or int(m.group(1)) >= cfg.get("fail_from_step", float("inf"))):
                raise OSError(errno.EIO, "Input/output error (flaky storage)", path)
            with super().open_write(path) as f:
                yield f
                if m:
                    time.sleep(cfg.get("delay_s", 0.0) + u2 * cfg.get("jitter_s", 0.0))

    @hookimpl
    def dlrover_register_storages(register):
        register(FlakyStorage)
"""


def use_flaky_storage(tmp: Path, monkeypatch, **config) -> None:
    """Install the ``flaky`` storage plugin for this test and its job's processes."""
    import json

    from dlrover_core.plugins import reset_host

    site = tmp / "site"
    site.mkdir(exist_ok=True)
    install_dist(site, "dlrover-plugin-flaky", "dlrover_plugin_flaky", FLAKY_STORAGE_PLUGIN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("FLAKY_STORAGE", json.dumps(config))
    monkeypatch.syspath_prepend(str(site))
    reset_host()


def job_events(result) -> list[dict]:
    """The job's ``events.jsonl`` records."""
    import json

    return [json.loads(line) for line in (Path(result.log_dir) / "events.jsonl").read_text().splitlines()]


def explain(result) -> str:
    """Why a job went as it did, for a test's failure message: its summary (failures and
    what was done about them), the ``worker_failed`` events, and the lines of its logs that
    name an error (a Traceback, an exception, a failed or restarted worker)."""

    run = Path(result.log_dir)
    parts = [result.summary()]
    events = run / "events.jsonl"
    if events.exists():
        parts += [line[:600] for line in events.read_text().splitlines() if '"worker_failed"' in line]
    marks = ("Traceback", "Error", "error", "worker_failed", "worker_exited", "restart", "stuck")
    for log in sorted(run.glob("**/*.log")):
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if any(m in ln for m in marks)]
        if lines:
            parts.append(f"--- {log.relative_to(run)}:\n" + "\n".join(ln[:400] for ln in lines[-30:]))
    return "\n".join(parts)


def check_committed_steps(ck: Path, *, replicated_prefix: str = "state/model/") -> list[int]:
    """Check every committed step under ``ck`` (each ``step_*/checkpoint.json``) and return
    them: every rank's shard file exists, is whole and has the committed CRC32; all shards
    come from one incarnation (round); and the replicated tensors (names starting with
    ``replicated_prefix``: the DDP model) are bit-equal across ranks — a commit mixing
    incarnations whose states differ fails here."""
    import json
    import zlib

    import torch

    from dlrover_core.checkpoint.layout import parse_header, tensor_views

    steps = []
    for meta_path in sorted(ck.glob("step_*/checkpoint.json")):
        meta = json.loads(meta_path.read_text())
        step = int(meta["step"])
        rounds = {s.get("round") for s in meta["shards"].values()}
        assert len(rounds) == 1 and meta.get("round") in rounds, f"step {step} mixes incarnations: {meta['shards']}"
        assert sorted(meta["shards"]) == [str(r) for r in range(meta["world_size"])], f"step {step}: ranks missing"
        reference = None
        for rank, shard in sorted(meta["shards"].items()):
            data = (meta_path.parent / shard["file"]).read_bytes()
            entries, _, start = parse_header(data)
            end = start + max((e["data_offsets"][1] for e in entries.values()), default=0)
            assert zlib.crc32(data[start:end]) == shard["crc32"], f"step {step} rank {rank}: CRC mismatch"
            views = tensor_views(bytearray(data), start, entries)
            model = {k.split(replicated_prefix, 1)[1].removeprefix("module."): v for k, v in views.items()
                     if k.startswith(replicated_prefix)}
            if reference is None:
                reference = model
            else:
                assert model.keys() == reference.keys()
                for k in model:
                    assert torch.equal(model[k], reference[k]), f"step {step}: rank {rank}'s {k} differs from rank 0's"
        steps.append(step)
    return steps
