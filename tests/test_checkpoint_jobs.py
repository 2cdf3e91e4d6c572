"""Flash Checkpoint in real jobs: FSDP2 resharding, a full disk, a too-small /dev/shm."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import FULL_DISK_PLUGIN, SCRIPTS, install_dist, wait_for

from dlrover_core import Checkpoint, Failure, Job, JobState, Nodes
from dlrover_core.checkpoint.layout import Layout
from dlrover_core.checkpoint.memory import MemorySnapshots, ShmTooSmall
from dlrover_core.checkpoint.shm import remove_segments, shm_free_bytes
from dlrover_core.plugins import reset_host
from dlrover_core.storage.posix import PosixStorage
from dlrover_core.train import Checkpointer

pytestmark = pytest.mark.slow


def fsdp_job(tmp: Path, mode: str, nproc: int, out: Path, **kw) -> Job:
    return Job(
        name=f"fsdp-{mode}", entrypoint=str(SCRIPTS / "fsdp_train.py"), args=["--mode", mode, "--out", str(out)],
        nodes=Nodes(min=1, max=1, nproc_per_node=nproc), accelerator="cpu",
        checkpoint=Checkpoint(dir=str(tmp / "ck"), persist_every_steps=0), failure=Failure(max_restarts=0),
        log_dir=str(tmp / "runs"), **kw,
    )


@pytest.mark.timeout(300)
def test_fsdp_saved_on_two_ranks_loads_on_one_and_two(tmp_path):
    """FSDP2 model and optimizer saved as per-rank shards load bit-exact at world size 1
    (DCP resharding) and 2."""
    saved = tmp_path / "saved.json"
    assert fsdp_job(tmp_path, "save", 2, saved).run(progress=False).state == JobState.SUCCEEDED
    want = json.loads(saved.read_text())["digest"]
    assert any("exp_avg" in k for k in want)  # optimizer state is in the comparison
    for nproc in (1, 2):
        out = tmp_path / f"load{nproc}.json"
        result = fsdp_job(tmp_path, "load", nproc, out).run(progress=False)
        assert result.state == JobState.SUCCEEDED, result.reason
        got = json.loads(out.read_text())
        assert (got["world_size"], got["source"], got["step"]) == (nproc, "storage", 2)
        assert got["digest"] == want


@pytest.mark.timeout(240)
def test_full_disk_is_reported_training_goes_on_previous_commit_intact(tmp_path, monkeypatch):
    """While the disk is full every persist fails with ENOSPC: the job keeps training, the
    failure is reported as an event, the last commit stays loadable; once space is back,
    commits resume."""
    site = tmp_path / "site"
    site.mkdir()
    install_dist(site, "dlrover-plugin-fulldisk", "dlrover_plugin_fulldisk", FULL_DISK_PLUGIN)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.syspath_prepend(str(site))
    reset_host()
    ck = tmp_path / "ck"
    job = Job(
        name="fulldisk", entrypoint=str(SCRIPTS / "tiny_train.py"), args=["--steps", "60", "--step-sleep", "0.1"],
        nodes=2, accelerator="cpu", checkpoint=Checkpoint(dir=str(ck), storage="fulldisk", persist_every_steps=5),
        failure=Failure(max_restarts=0), log_dir=str(tmp_path / "runs"),
    )
    storage = PosixStorage(str(ck))
    run = job.submit()
    wait_for(lambda: (storage.latest_step() or -1) >= 10, 60, "a first commit")
    (ck / "FULL").write_text("")
    full_at = storage.latest_step()
    wait_for(lambda: run.status().step >= full_at + 15, 60, "training to go on while the disk is full")
    during = storage.latest_step()
    restored = Checkpointer(str(ck)).load()
    (ck / "FULL").unlink()
    result = run.wait(progress=False)
    assert result.state == JobState.SUCCEEDED
    assert during <= full_at + 5  # at most a commit already in flight got through
    assert restored is not None and restored.step == during and restored.source == "storage"
    events = [json.loads(line) for line in (Path(result.log_dir) / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["kind"] in ("checkpoint_persist_failed", "checkpoint_commit_failed")]
    assert failed and all("No space left" in e["error"] for e in failed)
    assert storage.latest_step() >= 50  # commits resumed after the disk was freed


def test_shm_capacity_is_checked_before_allocating(monkeypatch):
    """A state larger than /dev/shm can hold raises ShmTooSmall naming the size needed,
    before anything is allocated."""
    snaps = MemorySnapshots(job_id=f"captest{os.getpid()}", node_id=0, rank=0)
    try:
        huge = Layout(entries={}, metadata={"format": "x"}, data_len=shm_free_bytes() + 2**30, sources=())
        with pytest.raises(ShmTooSmall) as err:
            snaps.save(huge, step=1, world_size=1, persist=False)
        assert err.value.needed_bytes > huge.data_len
        assert "MiB" in str(err.value) and "--shm-size" in str(err.value)
        assert all(s.size == 0 for s in snaps.slots)
    finally:
        snaps.close()
        remove_segments(f"dlrover-captest{os.getpid()}-")


def _can_mount_tmpfs(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], capture_output=True).returncode == 0
    return ok


@pytest.mark.timeout(180)
def test_small_dev_shm_falls_back_to_disk_with_a_warning(tmp_path, monkeypatch):
    """With a /dev/shm too small for the state (a 4 MiB tmpfs here, like a container's
    default), saves fall back to disk with a warning naming the size needed, and a restart
    restores from storage."""
    shm = tmp_path / "shm"
    if os.geteuid() != 0 or not _can_mount_tmpfs(shm):
        pytest.skip("needs permission to mount a tmpfs (root with CAP_SYS_ADMIN)")
    try:
        monkeypatch.setenv("DLROVER_SHM_DIR", str(shm))
        job = Job(
            name="smallshm", entrypoint=str(SCRIPTS / "tiny_train.py"),
            args=["--steps", "20", "--extra-mb", "8", "--fail-at", "12"], nodes=1, accelerator="cpu",
            checkpoint=Checkpoint(dir=str(tmp_path / "ck"), persist_every_steps=5), failure=Failure(max_restarts=1),
            log_dir=str(tmp_path / "runs"),
        )
        result = job.run(progress=False)
        assert result.state == JobState.SUCCEEDED
        assert [(f.restored_from, f.restored_step) for f in result.failures] == [("storage", 10)]
        log = (Path(result.log_dir) / "node_0" / "rank_0.log").read_text()
        assert "checkpoint_memory_disabled" in log and "need" in log and "MiB" in log
        assert os.listdir(shm) == []
    finally:
        subprocess.run(["umount", str(shm)], check=False)
