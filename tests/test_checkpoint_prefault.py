"""A restarted worker's snapshot pages are faulted in at ``train.init()``, before ``load()``.

A fresh process that maps a 1 GiB slot pays one page fault per 4 KiB page on its first read
(about 0.09 s on 2 cores), inside the first restore. ``train.init()`` maps the rank's slots
and reads a byte of every page in a thread, while the script builds its model. Seen from
outside: the segment's pages are resident in the restarted worker (``Rss`` of its mapping in
``/proc/self/smaps``) before it calls ``load()``, and the restore is bit-exact from memory.
A real job, a real SIGKILL, the real /dev/shm.
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest
from test_checkpoint_fast_path import assert_bit_exact, make_state

from dlrover_core import Checkpoint, Failure, Job, JobState, train
from dlrover_core.checkpoint.layout import build_layout
from dlrover_core.checkpoint.memory import MemorySnapshots, prefault_for_restore, take_prefaulted
from dlrover_core.checkpoint.shm import SHM_DIR, remove_segments

pytestmark = pytest.mark.slow

SIZE_MIB = 64

WORKER = r'''
import json, os, resource, signal, sys, threading, time
from pathlib import Path
import torch
from dlrover_core import train

out = Path(sys.argv[1])
info = train.init()


def model(fill):
    """A module with one float32 parameter of SIZE bytes (a module: ``load()`` copies into
    its own tensors, allocating nothing)."""
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(fill(SIZE // 4, dtype=torch.float32))
    return m


if info.restart_count == 0:
    state = {"model": model(torch.arange)}
    ckpt = train.Checkpointer()
    ckpt.save(7, state)  # memory only (persist_every_steps=0)
    out.write_text(json.dumps({"saved": 7}))
    os.kill(os.getpid(), signal.SIGKILL)

threads = [t for t in threading.enumerate() if t.name == "dlrover-shm-prefault"]
for t in threads:
    t.join(60)


def resident_kib():
    """Rss of this process's mappings of its rank's snapshot segments (proc(5), smaps)."""
    total, mine = 0, False
    prefix = "dlrover-" + os.environ["DLROVER_JOB_ID"] + "-"
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's first line
            mine = len(fields) >= 6 and Path(fields[5]).name.startswith(prefix)
        elif mine and fields[0] == "Rss:":
            total += int(fields[1])
    return total


before_load = resident_kib()
state = {"model": model(torch.zeros)}
ckpt = train.Checkpointer()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
restored = ckpt.load(state)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults  # the load's page faults (getrusage(2))
exact = bool(torch.equal(state["model"].w.detach(), torch.arange(SIZE // 4, dtype=torch.float32)))
out.write_text(json.dumps({"threads": len(threads), "resident_kib_before_load": before_load,
                           "load_page_faults": faults, "source": restored.source, "step": restored.step,
                           "exact": exact}))
'''


@pytest.mark.timeout(180)
def test_restarted_worker_has_its_snapshot_resident_before_load(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.replace("SIZE", str(SIZE_MIB << 20)))
    out = tmp_path / "out.json"
    job = Job(name="prefault", entrypoint=str(script), args=[str(out)], nodes=1, accelerator="cpu",
              checkpoint=Checkpoint(dir=str(tmp_path / "ckpt"), persist_every_steps=0),
              # cold workers: a worker forked by the node's standby also faults on the pages it
              # shares with the standby as it writes them (copy-on-write), hundreds of faults
              # that have nothing to do with the snapshot's mapping this test counts
              failure=Failure(max_restarts=1, warm_restart=False), log_dir=str(tmp_path / "runs"))
    result = job.run(progress=False)
    assert result.state == JobState.SUCCEEDED, result.reason
    seen = json.loads(out.read_text())
    assert (seen["source"], seen["step"], seen["exact"]) == ("memory", 7, True), seen
    # the prefault thread may have finished before the script looked (at most one was started);
    # that it ran shows in the pages: every page of the snapshot's data (64 MiB) was mapped
    # before load() touched one, which only the prefault does
    assert seen["threads"] <= 1, seen
    assert seen["resident_kib_before_load"] >= SIZE_MIB * 1024, seen
    # and load() read through that mapping (the Checkpointer took it): a mapping of its own
    # faults once per 64 KiB (the kernel maps 16 pages around each read fault of a shared
    # file, fault_around_bytes), about 1,100 times here; through the taken one about 80
    assert seen["load_page_faults"] < (SIZE_MIB << 20) // (64 << 10) // 2, seen


@pytest.fixture
def job_id(request):
    jid = f"prefault{os.getpid()}{abs(hash(request.node.name)) % 10**6}"
    yield jid
    remove_segments(f"dlrover-{jid}-")


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's errors fail it
@pytest.mark.parametrize("seed", range(12))
def test_prefault_thread_races_saves_reads_and_close_seeded(job_id, seed):
    """The new incarnation's prefault thread reads its mappings while the main thread saves
    (small and large states: the slots grow, so they are mapped anew), reads back and
    closes, at random moments. Invariants: every read is bit-exact, nothing raises, the
    thread ends, and a closed slot's mapping is not used after the thread lets it go."""
    rng = random.Random(seed)
    old = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    try:
        for step in (1, 2):
            old.save(build_layout({"state": make_state(step, big=rng.random() < 0.5)}, step=step, rank=0,
                                  world_size=1), step=step, world_size=1, persist=False)
    finally:
        old.close()
    new = MemorySnapshots(job_id=job_id, node_id=0, rank=0, round_index=1)
    thread = new.prefault()
    assert thread is not None
    try:
        for step in range(3, 3 + rng.randint(0, 4)):
            time.sleep(rng.random() * 0.01)
            state = make_state(step, big=rng.random() < 0.5)
            assert new.save(build_layout({"state": state}, step=step, rank=0, world_size=1), step=step,
                            world_size=1, persist=False)
            with new.read(step, 1) as (views, _):
                assert_bit_exact(views, state)
        if rng.random() < 0.5:
            time.sleep(rng.random() * 0.01)
            new.close()  # while the thread may still read: its view keeps the mapping alive
    finally:
        new.close()
    thread.join(30)
    assert not thread.is_alive()


def test_prefault_on_a_fresh_start_creates_nothing(job_id):
    """No segment of this rank: nothing is mapped, nothing is created in /dev/shm."""
    assert not prefault_for_restore(job_id=job_id, node_id=0, rank=0, agent=0, round_index=0)
    assert not [p for p in SHM_DIR.iterdir() if p.name.startswith(f"dlrover-{job_id}-")]
    assert take_prefaulted(job_id=job_id, node_id=0, rank=0, agent=0, round_index=0, wait_timeout_s=1.0) is None


def test_prefaulted_slots_of_another_rank_are_let_go(job_id):
    """The Checkpointer takes the prefaulted slots only if they are its own (the rank may
    have changed hands in the live world); otherwise it maps its own."""
    old = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    old.save(build_layout({"state": make_state(1)}, step=1, rank=0, world_size=1), step=1, world_size=1,
             persist=False)
    old.close()
    assert prefault_for_restore(job_id=job_id, node_id=0, rank=0, agent=0, round_index=1)
    assert take_prefaulted(job_id=job_id, node_id=0, rank=1, agent=0, round_index=1, wait_timeout_s=1.0) is None
    assert take_prefaulted(job_id=job_id, node_id=0, rank=0, agent=0, round_index=1, wait_timeout_s=1.0) is None
    assert prefault_for_restore(job_id=job_id, node_id=0, rank=0, agent=0, round_index=1)
    mine = take_prefaulted(job_id=job_id, node_id=0, rank=0, agent=0, round_index=1, wait_timeout_s=1.0)
    assert mine is not None
    try:
        with mine.read(1, 1) as (views, _):
            assert_bit_exact(views, make_state(1))
    finally:
        mine.close()


def test_a_training_loop_lets_go_of_slots_no_checkpointer_took(job_id):
    """A script whose loop begins without a Checkpointer holds no mapping for nothing."""
    old = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    old.save(build_layout({"state": make_state(1)}, step=1, rank=0, world_size=1), step=1, world_size=1,
             persist=False)
    old.close()
    assert prefault_for_restore(job_id=job_id, node_id=0, rank=0, agent=0, round_index=0)
    assert list(train.steps(2, {})) == [0, 1]  # outside a job: a plain loop
    assert take_prefaulted(job_id=job_id, node_id=0, rank=0, agent=0, round_index=0, wait_timeout_s=1.0) is None
