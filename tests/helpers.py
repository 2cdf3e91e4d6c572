"""Helpers shared by tests: paths, and finding what a job left behind."""

from __future__ import annotations

import os
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def job_processes(job_id: str) -> list[psutil.Process]:
    """Every live process that belongs to ``job_id`` (by its DLROVER_JOB_ID variable)."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get("DLROVER_JOB_ID") == job_id:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def shm_entries() -> set[str]:
    """Names in /dev/shm (empty where there is none)."""
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


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
    run_checked(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", wheels,
                *projects)
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
