"""The job's output: each container's log prefixed by its source, followed live, or read from
the files ``cancel`` saved into the run directory before it removed the containers."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dlrover_core import rundir
from dlrover_core.errors import SchedulerError
from dlrover_core.schedulers.docker._request import LABEL_ATTEMPT, LABEL_NODE, LABEL_ROLE

__all__ = ["follow_logs", "log_file_name", "saved_logs", "source"]


def source(c: Any) -> str:
    """``master`` or ``node-<id>``: what a log line of container ``c`` is prefixed with."""
    node = c.labels.get(LABEL_NODE)
    return "master" if c.labels.get(LABEL_ROLE) == "master" else f"node-{node}"


def log_file_name(c: Any) -> str:
    """Where ``cancel`` saves container ``c``'s output: ``master.log``, ``node_<i>.log[.<attempt>]``."""
    attempt = c.labels.get(LABEL_ATTEMPT)
    if c.labels.get(LABEL_ROLE) == "master":
        return rundir.MASTER_LOG + (f".{attempt}" if attempt and attempt != "0" else "")
    return rundir.node_log(c.labels.get(LABEL_NODE), attempt)


def saved_logs(log_dir: Path) -> Iterator[str]:
    """The lines of the logs saved under ``log_dir``, master first, then by node."""
    nodes = [(node, p) for p in log_dir.glob(rundir.NODE_LOG_GLOB + "*")
             if (node := rundir.node_of_log(p.name)) is not None]
    files = [(None, p) for p in sorted(log_dir.glob(rundir.MASTER_LOG_GLOB))] + sorted(
        nodes, key=lambda np: (np[0], np[1].name))
    for node, path in files:
        name = "master" if node is None else f"node-{node}"
        for line in path.read_text(errors="replace").splitlines():
            yield f"[{name}] {line}"


def follow_logs(containers: Callable[[], list[Any]], finished: Callable[[Any | None], bool]) -> Iterator[str]:
    """Stream every container's output (new ones too, e.g. relaunched nodes) until the job
    has finished.

    Args:
        containers: the job's containers now (listed about once a second).
        finished: whether the job is over, given its master container (or None).
    """
    lines: queue.Queue[str] = queue.Queue()
    streams: dict[str, threading.Thread] = {}
    closers: list[Any] = []

    def pump(container: Any) -> None:
        prefix, rest = f"[{source(container)}] ", b""
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
        found: list[Any] = []
        while True:
            if time.monotonic() - listed_at >= 1.0:  # new containers (relaunched nodes), states
                listed_at = time.monotonic()
                try:
                    found = containers()
                except SchedulerError:
                    found = []
            for c in found:
                if c.id not in streams:
                    streams[c.id] = threading.Thread(target=pump, args=(c,), daemon=True, name="dlrover-logs")
                    streams[c.id].start()
            try:
                done = not found or finished(next((c for c in found if c.labels.get(LABEL_ROLE) == "master"), None))
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
