"""``dlrover doctor``: run every installed accelerator probe and say what was found.

Each probe runs in a thread with a deadline (``Accelerator.probe`` promises seconds, and a
vendor library can still hang on import); the result lists, per accelerator, what was found
or why nothing was, the accelerators of this project's plugin packages that are not
installed, and which one ``accelerator="auto"`` picks: the present one with the highest
priority (:meth:`dlrover_core.plugins.PluginHost.create_accelerator`).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import attrs

from dlrover_core.accelerators.base import DeviceReport
from dlrover_core.errors import KNOWN_PLUGIN_PACKAGES
from dlrover_core.plugins import get_host

__all__ = ["Diagnosis", "ProbeResult", "diagnose", "PROBE_DEADLINE_S"]

#: Seconds ``diagnose`` waits for one probe before reporting it as hung.
PROBE_DEADLINE_S = 15.0


@attrs.frozen(kw_only=True)
class ProbeResult:
    """One accelerator's probe.

    Attributes:
        name: the accelerator's registered name.
        distribution: the package that registered it (``None`` for the core's built-ins).
        priority: its priority for ``"auto"`` (higher wins).
        report: what the probe returned (a report with ``present=False`` and a reason when
            the probe raised or passed its deadline).
        probe_s: how long the probe took, seconds.
    """

    name: str
    distribution: str | None
    priority: int
    report: DeviceReport
    probe_s: float


@attrs.frozen(kw_only=True)
class Diagnosis:
    """Everything ``dlrover doctor`` prints.

    Attributes:
        probes: one :class:`ProbeResult` per registered accelerator, highest priority first.
        not_installed: ``{name: package}`` for this project's accelerator plugins that are not
            installed.
        auto: the name ``accelerator="auto"`` picks here, or ``None`` if nothing is present.
    """

    probes: tuple[ProbeResult, ...]
    not_installed: dict[str, str]
    auto: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "auto": self.auto,
            "accelerators": [
                {"name": p.name, "distribution": p.distribution, "priority": p.priority,
                 "probe_s": round(p.probe_s, 3), **{k: list(v) if isinstance(v, tuple) else v for k, v in attrs.asdict(p.report).items()}}
                for p in self.probes],
            "not_installed": self.not_installed,
        }

    def summary(self) -> str:
        """Plain words: what ``auto`` picks and why the others are not available."""
        lines = [f"accelerator=\"auto\" picks: {self.auto or 'nothing (no accelerator is present)'}"]
        for p in self.probes:
            r = p.report
            if r.present:
                sick = sum(1 for h in r.healthy if not h)
                health = f", {sick} unhealthy" if sick else ""
                lines.append(f"  {p.name}: {r.count} device(s) found ({r.model or 'model unknown'}{health})")
            else:
                lines.append(f"  {p.name}: not available: {r.reason or 'no reason given'}")
        for name, package in sorted(self.not_installed.items()):
            lines.append(f"  {name}: not installed (pip install {package})")
        return "\n".join(lines)


def _probe(cls: Any) -> tuple[DeviceReport, float]:
    start = time.perf_counter()
    try:
        report = cls().probe()
    except Exception as exc:  # the contract says never, but doctor must still print the rest
        report = DeviceReport(accelerator=cls.name, present=False, reason=f"probe raised {type(exc).__name__}: {exc}")
    return report, time.perf_counter() - start


def diagnose(host: Any = None, *, deadline_s: float = PROBE_DEADLINE_S) -> Diagnosis:
    """Probe every registered accelerator, in parallel, each within ``deadline_s``.

    Args:
        host: a :class:`~dlrover_core.plugins.PluginHost` (default: the process's).
        deadline_s: seconds a probe may take before it is reported as hung.

    Returns:
        A :class:`Diagnosis`. Never raises for a failing probe.
    """
    if host is None:
        host = get_host()
    entries = host.registries.accelerator.entries()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(entries)), thread_name_prefix="doctor")
    futures = {e.name: pool.submit(_probe, e.obj) for e in entries}
    probes = []
    for e in entries:
        try:
            report, took = futures[e.name].result(timeout=deadline_s)
        except concurrent.futures.TimeoutError:
            report, took = DeviceReport(accelerator=e.name, present=False,
                                        reason=f"probe did not answer within {deadline_s:g} s"), deadline_s
        probes.append(ProbeResult(name=e.name, distribution=e.distribution, priority=int(getattr(e.obj, "priority", 0)),
                                  report=report, probe_s=took))
    pool.shutdown(wait=False, cancel_futures=True)  # a hung probe's thread is left behind
    probes.sort(key=lambda p: (-p.priority, p.name))
    auto = next((p.name for p in probes if p.report.present), None)
    installed = {p.name for p in probes}
    missing = {name: pkg for (kind, name), pkg in KNOWN_PLUGIN_PACKAGES.items()
               if kind == "accelerator" and name not in installed}
    return Diagnosis(probes=tuple(probes), not_installed=missing, auto=auto)
