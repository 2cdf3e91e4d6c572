"""Follow a job's log files, as backends whose processes write into the run directory do."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["tail_logs"]


def tail_logs(
    sources: Callable[[], list[tuple[str, Path]]],
    *,
    follow: bool,
    finished: Callable[[], bool],
    poll_s: float = 0.1,
    check_every_s: float = 0.0,
) -> Iterator[str]:
    """Lines of the files ``sources()`` names, each prefixed ``[name] ``.

    Args:
        sources: ``(name, path)`` pairs, asked again on every pass (files may appear later,
            e.g. a relaunched node's log); a missing file is skipped until it exists.
        follow: keep yielding new lines until ``finished()``; else return what is there now.
        finished: whether the job has ended (asked at most every ``check_every_s`` seconds).
        poll_s: seconds between passes while following.
        check_every_s: least seconds between two calls of ``finished`` (it may be costly, e.g.
            a call to the scheduler).

    A last line without a newline is held back until it is completed, and yielded at the end.
    """
    offsets: dict[Path, int] = {}
    partial: dict[Path, bytes] = {}
    names: dict[Path, str] = {}

    def read_new() -> Iterator[str]:
        for name, path in sources():
            names[path] = name
            try:
                with open(path, "rb") as f:
                    f.seek(offsets.get(path, 0))
                    chunk = f.read()
            except FileNotFoundError:
                continue
            offsets[path] = offsets.get(path, 0) + len(chunk)
            lines = (partial.get(path, b"") + chunk).split(b"\n")
            partial[path] = lines.pop()
            for line in lines:
                yield f"[{name}] {line.decode(errors='replace')}"

    done = not follow
    last_check = float("-inf")
    while True:
        if follow and time.monotonic() - last_check >= check_every_s:
            last_check = time.monotonic()
            done = finished()
        yield from read_new()
        if done:
            for path, rest in partial.items():
                if rest:
                    yield f"[{names[path]}] {rest.decode(errors='replace')}"
            return
        time.sleep(poll_s)
