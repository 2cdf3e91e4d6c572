"""Helpers for device probes: run a vendor's management tool, import a vendor module.

A probe must never crash on a machine without the vendor stack and never take more than a
few seconds (``Accelerator.probe``'s contract), so both helpers return a reason string
instead of raising.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
import subprocess
from typing import Any

import attrs

__all__ = ["ToolOutput", "run_tool", "try_import", "TOOL_TIMEOUT_S"]

#: Default time a management tool (``nvidia-smi``, ``npu-smi``...) gets to answer (seconds).
TOOL_TIMEOUT_S = 5.0


@attrs.frozen
class ToolOutput:
    """What running a tool gave.

    Attributes:
        ok: the tool ran and exited with status 0.
        stdout: its standard output (``""`` when it did not run).
        reason: why it is not ``ok`` (``"npu-smi not on PATH"``, ``"nvidia-smi timed out
            after 5 s"``, ``"ppu-smi exited with status 9: <stderr>"``); ``None`` when ok.
    """

    ok: bool
    stdout: str = ""
    reason: str | None = None


def run_tool(argv: list[str], *, timeout_s: float = TOOL_TIMEOUT_S, env: dict[str, str] | None = None) -> ToolOutput:
    """Run ``argv`` (its first item looked up on ``PATH``) with a timeout; never raises.

    Args:
        argv: the command, e.g. ``["nvidia-smi", "--query-gpu=name", "--format=csv"]``.
        timeout_s: seconds before the tool is killed and counted as hung.
        env: extra environment variables.

    Returns:
        A :class:`ToolOutput`; stderr's last 300 characters go into ``reason`` on failure.
    """
    tool = argv[0]
    path = shutil.which(tool)
    if path is None:
        return ToolOutput(False, reason=f"{tool} not on PATH")
    try:
        done = subprocess.run([path, *argv[1:]], capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **(env or {})}, errors="replace")
    except subprocess.TimeoutExpired:
        return ToolOutput(False, reason=f"{tool} timed out after {timeout_s:g} s")
    except OSError as exc:
        return ToolOutput(False, reason=f"{tool} could not be run: {exc}")
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-300:]
        return ToolOutput(False, stdout=done.stdout, reason=f"{tool} exited with status {done.returncode}: {tail}")
    return ToolOutput(True, stdout=done.stdout)


def cpu_only_torch() -> str | None:
    """The installed torch's version when it is a CPU build (``"2.13.0+cpu"``: the wheels of
    download.pytorch.org/whl/cpu carry the ``+cpu`` local version), else ``None``. Read from
    the package metadata: a probe learns that torch has no CUDA without importing it (about
    1.4 s, which every agent start would pay)."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    return version if version.endswith("+cpu") else None


def try_import(module: str) -> tuple[Any, str | None]:
    """Import ``module``; return ``(module, None)``, or ``(None, reason)`` when it is not
    importable (``"torch_npu not importable: ModuleNotFoundError: No module named
    'torch_npu'"``). Never raises (a broken vendor package can raise anything on import)."""
    try:
        return importlib.import_module(module), None
    except BaseException as exc:  # noqa: BLE001 - includes SystemExit from broken vendor inits
        if isinstance(exc, KeyboardInterrupt):
            raise
        return None, f"{module} not importable: {type(exc).__name__}: {exc}"
