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
