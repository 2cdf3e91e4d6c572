"""What a job's containers bind-mount from the host (host path = container path).

The host's Python runtime, read-only, so the containers run the very interpreter, venv and
dlrover installation that submitted the job; the job's workdir, run directory, a local
checkpoint directory, the directory of an absolute entrypoint and every absolute path among
the job's arguments, read-write; the extra mounts of the ``mounts`` option; and, into the
master container only, the engine's socket.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

from dlrover_core.spec import JobSpec

__all__ = ["SYSTEM_DIRS", "arg_paths", "docker_endpoint", "merge_mounts", "parse_mounts", "runtime_mounts", "under"]

#: Top-level directories mirrored from the host: links into /usr where the host has links, else
#: mounted. Not /sbin: the image keeps its own, where the engine puts its init (/sbin/docker-init).
SYSTEM_DIRS = ("bin", "lib", "lib32", "lib64", "libx32")
#: The engine when ``DOCKER_HOST`` is not set.
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"


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
    (the default image mirrors the links; its /sbin is its own, PATH has /usr/sbin); the
    interpreter's installation (``sys.base_prefix``); the virtual environment (``sys.prefix``);
    and the directories that hold the imported ``dlrover_core`` and ``dlrover_plugin_*``
    packages (editable installs live in a checkout).
    """
    paths = ["/usr"]
    for name in SYSTEM_DIRS:
        p = Path("/") / name
        if p.is_dir() and not p.is_symlink():
            paths.append(str(p))
    paths += [str(Path(sys.base_prefix).resolve()), str(Path(sys.prefix).absolute()), *_package_roots()]
    return [(p, True) for p in paths]


def under(path: str, parent: str) -> bool:
    """Whether ``path`` is ``parent`` or lies inside it."""
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def merge_mounts(mounts: Iterable[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """Deduplicate: read-write wins for the same path; drop a path inside a read-write mount,
    or a read-only one inside a read-only mount. Sorted by path."""
    by_path: dict[str, bool] = {}
    for path, ro in mounts:
        by_path[path] = by_path.get(path, True) and ro
    kept = []
    for path, ro in sorted(by_path.items()):
        covered = any(other != path and under(path, other) and (not other_ro or ro)
                      for other, other_ro in by_path.items())
        if not covered:
            kept.append((path, ro))
    return kept


def arg_paths(job: JobSpec) -> list[str]:
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


def parse_mounts(items: Iterable[str]) -> list[tuple[str, bool]]:
    """``PATH``, ``PATH:ro`` or ``PATH:rw`` (the ``mounts`` option) as ``(absolute path, read_only)``."""
    out = []
    for item in filter(None, (s.strip() for s in items)):
        path, _, mode = item.partition(":")
        out.append((str(Path(path).resolve()), mode == "ro"))
    return out


def docker_endpoint(docker_host: str | None) -> tuple[str, str | None]:
    """(``DOCKER_HOST`` for the master container, the host's socket path to mount or None)."""
    host = docker_host or DEFAULT_DOCKER_HOST
    if host.startswith("unix://"):
        return host, host.removeprefix("unix://")
    return host, None
