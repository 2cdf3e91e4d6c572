"""DLRover 0.6.1's own Flash Checkpoint (``DdpCheckpointer``), measured as a peer.

DLRover lives in its own venv (``ensure_dlrover_venv``). ``measure_dlrover_fcp``
starts DLRover's master and ``dlrover-run --standalone --max-restarts CYCLES`` on
``_dlrover_fcp_worker.py``, which times saves (next to a raw write + fsync floor,
``_ckpt_common.DiskFloor``), kills itself, and times the first restore of each
restarted process (cold), SIGKILLing itself again until it has ``cycles`` of them;
the last process also times warm restores. All times are seconds.

Try it alone::

    python benchmarks/dlrover_peer.py --size-mib 256 --reps 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = HERE / ".cache" / "dlrover-venv"
WORKER = HERE / "_dlrover_fcp_worker.py"
PACKAGES = ["torch==2.13.0", "numpy", "dlrover[torch]==0.6.1", "grpcio", "protobuf", "kubernetes", "tornado"]
SOCKET_DIR = Path("/tmp/ckpt_sock")  # DLRover's SOCKET_TMP_DIR; one subfolder per job
SHM_DIR = Path("/dev/shm")


def ensure_dlrover_venv(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Create (once) a venv with DLRover 0.6.1 in ``cache_dir``; return its python.

    A ``.complete`` marker is written last, so an interrupted install is redone.
    Raises ``RuntimeError`` if pip fails (e.g. no registry reachable).
    """
    cache_dir = Path(cache_dir)
    py = cache_dir / "bin" / "python"
    marker = cache_dir / ".complete"
    if marker.exists() and py.exists():
        return py
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        [sys.executable, "-m", "venv", str(cache_dir)],
        [str(py), "-m", "pip", "install", "-q", *PACKAGES],
        [str(py), "-c", "import grpc, kubernetes, dlrover.trainer.torch.flash_checkpoint.ddp"],
    ]
    print(f"dlrover venv: installing into {cache_dir} ...", flush=True)
    for cmd in steps:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            p = subprocess.CompletedProcess(cmd, "timeout", "", "")
        if p.returncode:
            shutil.rmtree(cache_dir, ignore_errors=True)
            tail = "\n".join(line for line in (p.stdout + p.stderr).splitlines()
                             if not line.startswith("WARNING: Location"))[-1500:]
            raise RuntimeError(f"failed ({p.returncode}): {' '.join(cmd[:4])}\n{tail}")
    marker.write_text(" ".join(PACKAGES) + "\n")
    return py


def measure_dlrover_fcp(size_bytes: int, reps: int, workdir: Path, cache_dir: Path = DEFAULT_CACHE,
                        cycles: int | None = None) -> dict:
    """Time DLRover's ``DdpCheckpointer`` on a state of ``size_bytes``
    (16 equal float32 tensors, seed 0), ``reps`` repetitions after a warm-up,
    and ``cycles`` (default ``reps``) kill + restart cycles.

    Keys (seconds unless noted): ``save_memory_block_s``, ``save_disk_block_s``,
    ``commit_s`` (DISK save call until ``dlrover_latest.txt`` names the step),
    ``disk_floor_samples`` (raw write + fsync of the same bytes, one before
    each timed disk save), ``restore_cold_s`` (= ``restore_memory_s``: after
    each SIGKILL, the restarted worker's first ``load_checkpoint()`` + copy
    into preallocated tensors; ``restore_sources`` is where DLRover says it
    read from), ``restore_warm_s`` (more loads in the last process),
    ``kill_to_restored_s``, ``dropped_saves`` (memory saves DLRover skipped
    while a disk save persisted; per-gap details under ``during_persist``),
    ``disk_saves_lost`` (count), ``fsyncs_data`` (bool), and ``*_samples``
    lists. Checkpoint files go under ``workdir``.

    Returns ``{"available": False, "reason": ...}`` if the venv cannot be
    built; raises ``RuntimeError`` if the run itself fails. Every process
    started is killed and DLRover's /dev/shm segment, socket folder and files
    are removed before returning.
    """
    try:
        py = ensure_dlrover_venv(cache_dir)
    except (RuntimeError, OSError) as e:
        return {"available": False, "reason": f"cannot build DLRover venv: {e}"}

    cycles = reps if cycles is None else cycles
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="dlrover-peer-", dir=workdir))
    job = f"fcppeer{uuid.uuid4().hex[:10]}"
    out_json, ckpt_dir, log_path = tmp / "result.json", tmp / "ckpt", tmp / "dlrover.log"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(ELASTIC_JOB_NAME=job, DLROVER_MASTER_ADDR=f"127.0.0.1:{port}", PYTHONUNBUFFERED="1",
               PATH=f"{py.parent}:{env.get('PATH', '')}")
    timeout = (120 + 20 * (reps + cycles)) * max(1.0, size_bytes / 2**30)  # a good run: ~40 s at 256 MiB
    procs: list[subprocess.Popen] = []
    had_socket_dir = SOCKET_DIR.exists()
    load_before = os.getloadavg()[0]  # other work on the machine skews timings
    t0 = time.perf_counter()
    try:
        with open(log_path, "wb") as log:
            def start(cmd):
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              cwd=tmp, start_new_session=True))
                return procs[-1]

            master = start([str(py), "-m", "dlrover.python.master.main", "--port", str(port),
                            "--node_num", "1", "--job_name", job, "--platform", "local"])
            _wait_port(port, master, timeout=90)
            run = start([str(py.parent / "dlrover-run"), "--standalone", "--nproc_per_node=1",
                         "--max-restarts", str(cycles), "--log-dir", str(tmp / "torchelastic"),
                         str(WORKER), str(out_json), str(ckpt_dir), str(size_bytes), str(reps), str(cycles)])
            try:
                rc = run.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = f"timeout after {timeout:.0f} s"
        if rc != 0 or not out_json.exists():
            raise RuntimeError(f"dlrover-run failed ({rc}); log kept in {_keep_log(log_path, job)}; "
                               f"tail:\n{_tail(log_path)}")
        result = json.loads(out_json.read_text())
        if "failed" in result:
            raise RuntimeError(f"DLRover worker failed (log kept in {_keep_log(log_path, job)}):\n{result['failed']}")
    finally:
        _kill_all(procs, tmp / "worker_pids.txt")
        shm_removed = _remove_job_shm(job)
        shutil.rmtree(SOCKET_DIR / job, ignore_errors=True)
        if not had_socket_dir:
            _rmdir_if_empty(SOCKET_DIR)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"available": True, "dlrover": "0.6.1", "loadavg_1min_before": load_before, **result,
            "shm_segments_removed": shm_removed, "wall_s": time.perf_counter() - t0}


# ---------------------------------------------------------------- process hygiene


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"DLRover master exited ({proc.returncode})")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"DLRover master not listening on {port} after {timeout} s")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(d))
    return tree


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kill_all(procs: list[subprocess.Popen], pid_file: Path) -> None:
    """SIGTERM, then SIGKILL, our processes, their descendants (collected
    before anything dies, as orphans lose their parent link) and any worker
    listed in ``pid_file`` that still runs our worker script."""
    tree = _children()
    pids, todo = set(), [p.pid for p in procs if p.poll() is None]
    while todo:
        pid = todo.pop()
        if pid not in pids:
            pids.add(pid)
            todo += tree.get(pid, [])
    if pid_file.exists():
        pids |= {int(x) for x in pid_file.read_text().split() if WORKER.name in _cmdline(int(x))}
    cmd = {pid: _cmdline(pid) for pid in pids}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in pids if cmd[p] and _cmdline(p) == cmd[p]]  # not exited, not reused
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while alive and time.monotonic() < deadline and any(_cmdline(p) for p in alive):
            for p in procs:
                p.poll()  # reap our direct children
            time.sleep(0.05)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _remove_job_shm(job: str) -> list[str]:
    """Remove DLRover's segments for this job (``<job>_ckpt_shm_<i>``)."""
    removed = []
    for name in os.listdir(SHM_DIR):
        if name.startswith(job + "_"):
            (SHM_DIR / name).unlink(missing_ok=True)
            removed.append(name)
    return removed


def _rmdir_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def _keep_log(log_path: Path, job: str) -> Path:
    """Copy a failed run's log where the caller's scratch directory cleanup leaves it."""
    kept = HERE / ".cache" / f"dlrover-peer-failed-{job}.log"
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(log_path, kept)
    return kept


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cycles", type=int, default=None, help="kill + restart cycles (default: --reps)")
    p.add_argument("--workdir", type=Path, default=HERE / ".cache" / "work",
                   help="checkpoint files go here (a real disk, not tmpfs)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="DLRover's venv")
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    out = measure_dlrover_fcp(a.size_mib << 20, a.reps, a.workdir, a.cache_dir, cycles=a.cycles)
    out["command"] = shlex.join(["python", f"benchmarks/{Path(__file__).name}",
                                 *(sys.argv[1:] if argv is None else argv)])
    if not out["available"]:
        print(f"DLRover unavailable: {out['reason']}")
    else:
        keys = ("save_memory_block_s", "save_disk_block_s", "commit_s", "disk_floor_s", "restore_cold_s",
                "restore_warm_s", "kill_to_restored_s")
        print(", ".join(f"{k}={out[k]:.3f}" for k in keys))
        for r in out["during_persist"]:
            print(f"  memory saves every {r['gap_s']:.2f} s during a persist: "
                  f"{r['dropped_saves']}/{r['memory_saves_issued']} dropped, "
                  f"disk save {'persisted' if r['disk_save_persisted'] else 'LOST'}")
        print(f"restore_sources={out['restore_sources']}, dropped_saves={out['dropped_saves']}"
              f"/{out['memory_saves_during_persist']}, disk_saves_lost={out['disk_saves_lost']}, "
              f"fsyncs_data={out['fsyncs_data']}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"done in {time.perf_counter() - t0:.1f} s" + (f", wrote {a.json}" if a.json else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
