"""Fakes of what the ppu probe observes: a ``ppu-smi`` program on PATH and torch.cuda's answers.

Nothing here imitates PPU software beyond its documented interface. The fake ppu-smi answers
only the selective queries (``--query-ppu=...`` / ``--query-remapped-rows=...`` with
``--format=csv,noheader,nounits``) the way the PPU-SMI manual's examples show them: one CSV
line per PPU, ``N/A`` for unsupported values. The exact spelling of the remapped-row flags in
CSV is not shown in public material; the fake uses ``Yes``/``No`` as ``ppu-smi -q`` prints
them (an assumption, stated in the README).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dlrover_core.plugins import reset_host

#: Two PPU-ZW810E as ``ppu-smi --query-ppu=index,uuid,name,memory.total,compute_mode,
#: driver_version --format=csv,noheader,nounits`` lists them (values in the manual's style).
TWO_PPUS = (
    "0, GPU-019e2226-4211-0208-0000-000000ab261d, PPU-ZW810E, 98304, Default, 1.3.2-d7f5a2\n"
    "1, GPU-019e2226-84c1-0200-0000-0000c020e701, PPU-ZW810E, 98304, Default, 1.3.2-d7f5a2\n"
)
UUID0 = "GPU-019e2226-4211-0208-0000-000000ab261d"
UUID1 = "GPU-019e2226-84c1-0200-0000-0000c020e701"

_FAKE_SMI = '''#!{python}
"""A fake ppu-smi: answers selective queries from files in {state!r}."""
import pathlib, sys, time
state = pathlib.Path({state!r})
args = sys.argv[1:]
with open(state / "calls.log", "a") as log:
    log.write(" ".join(args) + "\\n")
if (state / "hang").exists():
    time.sleep(60)
if len(args) != 2 or args[1] != "--format=csv,noheader,nounits" or "=" not in args[0]:
    print("Invalid combination of input arguments. Please run 'ppu-smi -h' for help.", file=sys.stderr)
    sys.exit(2)
query = args[0].split("=", 1)[0].lstrip("-")
answer, code, err = state / (query + ".out"), state / (query + ".rc"), state / (query + ".err")
if not answer.exists():
    print("Invalid combination of input arguments. Please run 'ppu-smi -h' for help.", file=sys.stderr)
    sys.exit(2)
sys.stdout.write(answer.read_text())
if err.exists():
    sys.stderr.write(err.read_text())
sys.exit(int(code.read_text()) if code.exists() else 0)
'''

_SETTINGS = ("DLROVER_PPU_BACKEND", "DLROVER_PPU_VISIBLE_DEVICES_ENV", "DLROVER_PPU_K8S_RESOURCE",
             "DLROVER_PPU_SLURM_GRES", "DLROVER_PPU_SMI", "DLROVER_PPU_SMI_TIMEOUT_S", "DLROVER_PPU_NAME_PATTERN")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    """No site setting, no inherited device restriction, a fresh plugin host per test."""
    for var in (*_SETTINGS, "CUDA_VISIBLE_DEVICES", "PPU_VISIBLE_DEVICES", "DLROVER_PLUGINS",
                "DLROVER_DISABLE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    reset_host()
    yield
    reset_host()


class FakeSmi:
    """Controls the fake ppu-smi: what each query prints, its exit status, whether it hangs."""

    TWO_PPUS = TWO_PPUS
    UUID0 = UUID0
    UUID1 = UUID1

    def __init__(self, state: Path, path: Path) -> None:
        self.state = state
        self.path = path

    def lists(self, stdout: str, *, rc: int = 0, stderr: str = "") -> FakeSmi:
        """What ``--query-ppu=...`` prints."""
        return self._answer("query-ppu", stdout, rc, stderr)

    def remapped(self, stdout: str, *, rc: int = 0, stderr: str = "") -> FakeSmi:
        """What ``--query-remapped-rows=...`` prints."""
        return self._answer("query-remapped-rows", stdout, rc, stderr)

    def hangs(self) -> FakeSmi:
        (self.state / "hang").touch()
        return self

    @property
    def calls(self) -> list[str]:
        log = self.state / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    def _answer(self, query: str, stdout: str, rc: int, stderr: str) -> FakeSmi:
        (self.state / f"{query}.out").write_text(stdout)
        (self.state / f"{query}.rc").write_text(str(rc))
        (self.state / f"{query}.err").write_text(stderr)
        return self


@pytest.fixture
def fake_smi(tmp_path, monkeypatch) -> FakeSmi:
    """A fake ``ppu-smi`` first on PATH (answers nothing until told)."""
    bindir, state = tmp_path / "bin", tmp_path / "smi-state"
    bindir.mkdir()
    state.mkdir()
    path = bindir / "ppu-smi"
    path.write_text(_FAKE_SMI.format(python=sys.executable, state=str(state)))
    path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    return FakeSmi(state, path)


@pytest.fixture
def no_smi(tmp_path, monkeypatch) -> None:
    """A PATH on which no ppu-smi can be found."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


@pytest.fixture
def torch_cuda(monkeypatch):
    """Make torch.cuda answer as a machine with the given device names would.

    ``torch_cuda(["PPU-ZW810E"] * 2)`` — two devices named so; ``torch_cuda(None)`` — CUDA
    not available (as CPU-only torch says); ``memory_mb`` sets device 0's total memory.
    Only the calls the probe makes are replaced, at torch.cuda's module boundary.
    """
    import torch

    from dlrover_plugin_ppu import _accelerator

    def configure(names: list[str] | None, *, memory_mb: int | None = None) -> None:
        available = names is not None
        # a PPU build of torch: not the CPU wheel this machine has (whose metadata says so)
        monkeypatch.setattr(_accelerator, "cpu_only_torch", lambda: None)
        names = list(names or [])
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))

        def get_device_name(device=None):
            index = 0 if device is None else int(getattr(device, "index", device) or 0)
            if not available or index >= len(names):
                raise RuntimeError(f"invalid device ordinal {index}")
            return names[index]

        def get_device_properties(device=None):
            if memory_mb is None or not available:
                raise RuntimeError("no device properties in this fake")
            return SimpleNamespace(total_memory=memory_mb * 2**20, name=get_device_name(device))

        monkeypatch.setattr(torch.cuda, "get_device_name", get_device_name)
        monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)

    return configure
