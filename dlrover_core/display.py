"""What a user sees of a running job on the console, the same for ``Job.run()`` (and
``dlrover submit --wait``) and ``dlrover run``: the progress line, the job's log lines above it,
the result's summary at the end, and the exit code a command gives for the result.

:class:`ProgressDisplay` decides how to show progress as ``Job.run()`` always has: a live line
(rich) on a terminal; plain ``progress: ...`` lines every :data:`PLAIN_PROGRESS_EVERY_S` seconds
and at each change when stdout is not a terminal; with ``DLROVER_LOG_FORMAT=json``, JSON Lines
only (``{"event": "progress", ...}``, ``{"event": "result", ...}``), never a human line.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

from rich.console import Console
from rich.live import Live
from rich.text import Text

from dlrover_core.logging import as_record, json_mode, write_record
from dlrover_core.protocol import JobResult, JobState, JobStatus

__all__ = ["PLAIN_PROGRESS_EVERY_S", "ProgressDisplay", "exit_code", "log_record", "progress_fields", "progress_line"]

#: Seconds between two plain progress lines (or JSON progress objects) when nothing changed.
PLAIN_PROGRESS_EVERY_S = 15.0


def _duration(seconds: float) -> str:
    """``45s``, ``1m05s``, ``2h03m``, ``3d04h``."""
    total = int(round(seconds))
    if total < 60:
        return f"{total}s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _rate(value: float) -> str:
    """``512``, ``3.4``, ``32.8k``, ``1.25M``."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def progress_fields(s: JobStatus, elapsed_s: float | None = None) -> dict[str, Any]:
    """The numbers of the progress line, as a JSON-ready dict (``None``: unknown): ``state``,
    ``step``, ``total_steps``, ``percent``, ``eta_s``, ``step_time_s``, ``samples_per_s``,
    ``tokens_per_s``, ``loss``, ``val_loss``, ``goodput`` (0..1, so far), ``nodes``,
    ``max_nodes``, ``restarts``, ``elapsed_s`` (``s.elapsed_s``, else ``elapsed_s``)."""
    reported = s.step >= 0
    percent = None
    if reported and s.total_steps:
        percent = round(min(100.0, 100.0 * (s.step + 1) / s.total_steps), 1)
    goodput = s.goodput.get("goodput") if reported else None
    elapsed = s.elapsed_s if s.elapsed_s is not None else elapsed_s
    return {
        "state": s.state.value, "step": s.step if reported else None, "total_steps": s.total_steps,
        "percent": percent, "eta_s": s.eta_s if reported else None, "step_time_s": s.step_time_s,
        "samples_per_s": s.samples_per_s, "tokens_per_s": s.tokens_per_s,
        "loss": s.metrics.get("loss"), "val_loss": s.metrics.get("val_loss"), "goodput": goodput,
        "nodes": s.nodes, "max_nodes": s.max_nodes, "restarts": s.restarts,
        "elapsed_s": None if elapsed is None else round(elapsed, 1),
    }


def progress_line(s: JobStatus, elapsed_s: float | None = None) -> str:
    """``running | step 120/300 (40%) | ETA 1m05s | 512 samples/s | 32.8k tokens/s | loss 2.3100 |
    goodput 91% | nodes 2/2 | restarts 1 | 45 s``; what is unknown is left out (the step and
    goodput before the first ``train.report``, the total and the ETA without ``total_steps``,
    the rates without ``samples``/``tokens``)."""
    f = progress_fields(s, elapsed_s)
    parts = [f["state"].lower()]
    if f["step"] is not None:
        done = f" ({math.floor(f['percent'])}%)" if f["percent"] is not None else ""  # 100% only at the end
        parts.append(f"step {f['step']}" + (f"/{f['total_steps']}{done}" if f["total_steps"] else ""))
    if f["eta_s"] is not None and not s.state.is_terminal:
        parts.append(f"ETA {_duration(f['eta_s'])}")
    for key, unit in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s")):
        if f[key] is not None:
            parts.append(f"{_rate(f[key])} {unit}")
    for key in ("loss", "val_loss"):
        if f[key] is not None:
            parts.append(f"{key} {f[key]:.4f}")
    if f["goodput"] is not None:
        parts.append(f"goodput {f['goodput']:.0%}")
    if s.max_nodes:  # (0: unknown, e.g. an ended job's status read from its result)
        parts.append(f"nodes {s.nodes}/{s.max_nodes}")
    parts.append(f"restarts {s.restarts}")
    if f["elapsed_s"] is not None:
        parts.append(f"{f['elapsed_s']:.0f} s")
    return " | ".join(parts)


def exit_code(result: JobResult | None, stop_signal: int | None = None) -> int:
    """The exit code of a command that ran a job to its end (``dlrover run``, ``dlrover submit
    --wait``, a script around ``Job.run()``): 0 when it SUCCEEDED; ``128 + N`` when it was
    CANCELLED because this process received signal N (``stop_signal``: SIGINT → 130, SIGTERM →
    143), the shell's convention for a command ended by a signal; 1 otherwise (failed, cancelled
    from elsewhere, no result)."""
    if result is not None and result.state == JobState.SUCCEEDED:
        return 0
    if stop_signal is not None and (result is None or result.state == JobState.CANCELLED):
        return 128 + int(stop_signal)
    return 1


_SOURCE = re.compile(r"^\[([^\]]+)\] ?(.*)$", re.DOTALL)


def log_record(line: str) -> dict[str, Any]:
    """A line of ``backend.logs()`` (``[node-0] text``, ``[master] {json}``) as a JSON Lines
    object: a JSON line as it is, any other wrapped (``as_record``), with the node it came
    from (``node``) or ``"process": "master"``."""
    match = _SOURCE.match(line)
    if match is None:
        return as_record(line)
    source, text = match.groups()
    node = re.fullmatch(r"node[-_](\d+)", source)
    tags: dict[str, Any] = {"node": int(node.group(1))} if node else {"process": source}
    return as_record(text, **tags)


Mode = Literal["live", "plain", "json", "off"]


class ProgressDisplay:
    """A running job's progress on this process's stdout (see the module docstring).

    Args:
        job_id: named in the JSON progress records.
        progress: ``True``: always show progress (live on a terminal, plain lines or JSON
            records otherwise: ``Job.run()``); ``None``: only as a live line on a terminal,
            never in JSON mode (``dlrover run`` without ``--progress``); ``False``: never.
        every_s: seconds between plain lines (JSON records) when nothing changed.
        console: where to print (default: a rich console on stdout).

    Use it as a context manager (or :meth:`start` / :meth:`stop`): the live line is drawn
    between them; :meth:`line` prints a log line above it.
    """

    def __init__(self, job_id: str, *, progress: bool | None = True, every_s: float = PLAIN_PROGRESS_EVERY_S,
                 console: Console | None = None) -> None:
        if not every_s > 0:
            raise ValueError(f"progress_every_s={every_s!r} must be > 0 (seconds between plain progress "
                             f"lines; the default is {PLAIN_PROGRESS_EVERY_S:g})")
        self.job_id = job_id
        self.as_json = json_mode()
        self.console = console if console is not None else Console(highlight=False)
        self.every_s = every_s
        mode: Mode = "off"
        if progress is not False:
            if self.as_json:
                mode = "json" if progress else "off"
            elif self.console.is_terminal:
                mode = "live"
            elif progress:
                mode = "plain"
        self.mode: Mode = mode
        self._live = Live(console=self.console, auto_refresh=False, transient=True) if mode == "live" else None
        self._last_plain = 0.0
        self._last_key: tuple[Any, ...] = ()

    @property
    def is_live(self) -> bool:
        """Whether a live line is drawn (a terminal, not JSON mode)."""
        return self._live is not None

    def start(self) -> ProgressDisplay:
        if self._live is not None:
            self._live.start()
        return self

    def stop(self) -> None:
        """Take the live line away (idempotent)."""
        if self._live is not None:
            self._live.stop()

    def __enter__(self) -> ProgressDisplay:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def update(self, status: JobStatus, elapsed_s: float) -> None:
        """Show ``status`` (:func:`progress_line`): redraw the live line, or print a plain
        line (JSON record) when ``every_s`` passed or the state, nodes or restarts changed."""
        key = (status.state, status.nodes, status.restarts)
        if self._live is not None:
            self._live.update(Text(progress_line(status, elapsed_s), style="bold"), refresh=True)
        elif self.mode != "off" and (time.monotonic() - self._last_plain > self.every_s or key != self._last_key):
            if self.mode == "json":
                write_record({"event": "progress", "job_id": self.job_id, **progress_fields(status, elapsed_s)})
            else:
                self.console.print(Text("progress: " + progress_line(status, elapsed_s)), soft_wrap=True)
            self._last_plain = time.monotonic()
        self._last_key = key

    def line(self, text: str) -> None:
        """A line of the job's output, printed as it is (above the live line)."""
        self.console.print(Text(text), soft_wrap=True)

    def output(self, line: str) -> None:
        """A line of the job's logs (``[node-0] text``): printed as it is (:meth:`line`), or
        in JSON mode written as its record (:func:`log_record`)."""
        if self.as_json:
            write_record(log_record(line))
        else:
            self.line(line)

    def follow(self, lines: Callable[[], Iterable[str]]) -> threading.Thread:
        """Show the job's logs as they come: a daemon thread (started, returned for the
        caller to join) calls ``lines`` (``backend.logs(handle, follow=True)``) and shows each
        (:meth:`output`) until it ends."""
        def copy() -> None:
            for line in lines():
                self.output(line)

        pump = threading.Thread(target=copy, name="dlrover-logs", daemon=True)
        pump.start()
        return pump

    def note(self, event: str, text: str) -> None:
        """Something the command itself says (``interrupted: cancelling the job``): a line, or
        ``{"event": event, "job_id": ..., "text": text}`` in JSON mode."""
        if self.as_json:
            write_record({"event": event, "job_id": self.job_id, "text": text})
        else:
            self.console.print(Text(f"{event}: {text}"), soft_wrap=True)

    def result(self, result: JobResult) -> None:
        """The end: the result's summary, or its JSON record (``JobResult.to_record()``)."""
        self.stop()
        if self.as_json:
            write_record(result.to_record())
        else:
            self.console.print(Text(result.summary()), soft_wrap=True)
