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
