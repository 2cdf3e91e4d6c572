"""The fsspec storage on fsspec's local and in-memory filesystems: the storage contract,
registration through the entry point, and Flash Checkpoint's atomic commit through a Job's
``Checkpoint(storage="fsspec", dir=URL)`` — including a real crash (SIGKILL) mid-save."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import uuid

import fsspec
import pytest
import torch

import dlrover_plugin_fsspec.hooks
from dlrover_core import Checkpoint
from dlrover_core.backend import PluginHost
from dlrover_core.testing import StorageContract, register_plugin
from dlrover_core.train import Checkpointer
from dlrover_plugin_fsspec import FsspecStorage


@pytest.fixture
def memory_url():
    """A fresh root on fsspec's process-wide in-memory filesystem, removed afterwards."""
    root = f"memory://dlrover-test-{uuid.uuid4().hex[:8]}/ck"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


class TestLocalFilesystem(StorageContract):
    @pytest.fixture
    def storage(self, tmp_path):
        return FsspecStorage(f"file://{tmp_path}/ck")


class TestMemoryFilesystem(StorageContract):
    @pytest.fixture
    def storage(self, memory_url):
        return FsspecStorage(memory_url)


class TestUploadOnCloseFilesystem(StorageContract):
    """The object-store path (spool locally, one upload on clean exit), run on the memory
    filesystem by turning the rename path off."""

    @pytest.fixture
    def storage(self, memory_url):
        storage = FsspecStorage(memory_url)
        storage.atomic_rename = False
        return storage


def test_local_files_are_where_the_url_says(tmp_path):
    """A file:// URL and a plain path name the same directory; nothing else is left there."""
    FsspecStorage(f"file://{tmp_path}/ck").write_bytes("step_1/a", b"x")
    assert (tmp_path / "ck" / "step_1" / "a").read_bytes() == b"x"
    assert FsspecStorage(str(tmp_path / "ck")).read("step_1/a") == b"x"
    assert [p.name for p in (tmp_path / "ck" / "step_1").iterdir()] == ["a"]


def test_installed_plugin_registers_the_fsspec_storage():
    """Installed, the distribution's `dlrover` entry point registers storage "fsspec"."""
    host = PluginHost(environ={"DLROVER_PLUGINS": "dlrover-plugin-fsspec"})
    entry = host.registries.storage.entry("fsspec")
    assert entry.obj is FsspecStorage and entry.distribution == "dlrover-plugin-fsspec"
    assert host.plugins["fsspec"].errors == []


def test_a_job_selects_the_storage_and_the_checkpointer_builds_it_from_dir(dlrover_host, make_job, memory_url):
    with register_plugin(dlrover_plugin_fsspec.hooks) as info:
        assert info.backends == {"storage": ["fsspec"]}
        job = make_job(checkpoint=Checkpoint(storage="fsspec", dir=memory_url, persist_every_steps=1))
        assert job.checkpoint.dir == memory_url
        ck = Checkpointer(job.checkpoint.dir, storage=job.checkpoint.storage, memory_every_steps=0)
        assert isinstance(ck.storage, FsspecStorage) and ck.storage.url == memory_url


def _state(value: float) -> dict:
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return {"model": model}


def _loaded_value(url: str) -> tuple[int, float] | None:
    target = _state(0.0)
    restored = Checkpointer(url, storage="fsspec", memory_every_steps=0).load(target)
    if restored is None:
        return None
    return restored.step, target["model"].weight[0, 0].item()


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_checkpointer_saves_and_restores_through_fsspec(dlrover_host, kind, tmp_path, memory_url):
    url = f"file://{tmp_path}/ck" if kind == "local" else memory_url
    with register_plugin(dlrover_plugin_fsspec.hooks):
        ck = Checkpointer(url, storage="fsspec", memory_every_steps=0, persist_every_steps=1, keep_last=2)
        for step in range(4):
            assert ck.save(step, _state(float(step)))
        assert ck.storage.latest_step() == 3
        assert sorted({p.split("/")[0] for p in ck.storage.list() if p.startswith("step_")}) == [
            "step_0000000002", "step_0000000003"]
        assert _loaded_value(url) == (3, 3.0)


def test_failed_commit_leaves_the_previous_checkpoint_loadable(dlrover_host, memory_url, monkeypatch, log_events):
    """Shards of step 2 are written, then writing the commit marker fails: step 2 is never
    loaded, step 1 is."""
    with register_plugin(dlrover_plugin_fsspec.hooks):
        ck = Checkpointer(memory_url, storage="fsspec", memory_every_steps=0, persist_every_steps=1)
        ck.save(1, _state(1.0))

        def interrupted(self, step):
            raise OSError("connection reset while writing the marker")

        monkeypatch.setattr(FsspecStorage, "commit", interrupted)
        ck.save(2, _state(2.0))
        monkeypatch.undo()
        assert any(p.startswith("step_0000000002/rank_") for p in ck.storage.list())  # the shard is there
        assert ck.storage.latest_step() == 1
        assert _loaded_value(memory_url) == (1, 1.0)
    failed = [e for e in log_events if e["event"] == "checkpoint_commit_failed"]
    assert failed and failed[0]["step"] == 2 and "connection reset" in failed[0]["error"]


CRASHER = """
import os, signal, sys
import torch
from dlrover_core.train import Checkpointer
from dlrover_plugin_fsspec import FsspecStorage

url, where = sys.argv[1], sys.argv[2]

def state(v):
    m = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(v)
    return {"model": m}

ck = Checkpointer(url, storage="fsspec", memory_every_steps=0, persist_every_steps=1)
ck.save(1, state(1.0))
if where == "before-commit":  # every shard of step 2 is durable; die writing the marker
    FsspecStorage.commit = lambda self, step: os.kill(os.getpid(), signal.SIGKILL)
else:  # die halfway through writing the shard of step 2
    real_open_write = FsspecStorage.open_write

    class Dying:
        def __init__(self, f):
            self.f, self.n = f, 0
        def write(self, b):
            self.n += len(b)
            if self.n > 64:
                os.kill(os.getpid(), signal.SIGKILL)
            return self.f.write(b)
        def __getattr__(self, name):
            return getattr(self.f, name)

    import contextlib
    @contextlib.contextmanager
    def open_write(self, path):
        with real_open_write(self, path) as f:
            yield Dying(f) if "rank_" in path else f
    FsspecStorage.open_write = open_write
ck.save(2, state(2.0))
print("not killed")
"""


@pytest.mark.parametrize("where", ["before-commit", "mid-shard"])
def test_a_crash_mid_save_never_leaves_a_checkpoint_that_loads(tmp_path, where):
    """A process SIGKILLed between writing step 2's shards and its commit marker, or in the
    middle of a shard, leaves step 1 as the checkpoint that loads; the torn step is invisible."""
    url = f"file://{tmp_path}/ck"
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent(CRASHER))
    proc = subprocess.run([sys.executable, str(script), url, where], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    storage = FsspecStorage(url)
    assert storage.latest_step() == 1
    step2 = [p for p in storage.list() if p.startswith("step_0000000002/")]
    if where == "before-commit":
        assert step2 == ["step_0000000002/checkpoint.json", "step_0000000002/rank_00000-round0.safetensors"]
    else:
        assert step2 == []  # the torn shard stays under its hidden staging name
        assert any(p.name.endswith(".staging") for p in (tmp_path / "ck" / "step_0000000002").iterdir())
    assert _loaded_value(url) == (1, 1.0)
