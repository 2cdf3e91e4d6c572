"""SIGKILL workers or agents of a Flash Checkpoint job at random moments; check that what
storage and memory give back is always a whole checkpoint, bit-exact.

Used by ``tests/test_kill.py`` (20 seeded runs in CI) and ``tests/soak_checkpoint.py``
(as many as asked).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import zlib
from pathlib import Path

import torch
from helpers import SCRIPTS, job_processes, shm_entries

from dlrover_core import Checkpoint, Failure, Job, JobState
from dlrover_core.checkpoint.layout import decode, parse_header
from dlrover_core.storage.posix import PosixStorage

SIZE_MB = 16


def _job(tmp: Path, name: str, *, nodes: int, max_restarts: int, heartbeat_timeout_s: float = 30.0) -> Job:
    return Job(
        name=name, entrypoint=str(SCRIPTS / "kill_target.py"),
        args=["--size-mb", str(SIZE_MB), "--verify-file", str(tmp / "verify.jsonl")],
        nodes=nodes, accelerator="cpu",
        checkpoint=Checkpoint(dir=str(tmp / "ck"), memory_every_steps=1, persist_every_steps=2, keep_last=8),
        failure=Failure(max_restarts=max_restarts, heartbeat_interval_s=0.25, heartbeat_timeout_s=heartbeat_timeout_s,
                        stop_grace_s=2),
        log_dir=str(tmp / "runs"),
    )


def check_storage(ck: Path, floor: int | None) -> int | None:
    """Check the committed step in storage (what a fresh process would load) is whole and
    bit-exact for every rank — CRC32 as committed, and content — and return it. It may never
    go below ``floor``. (Commits go on meanwhile; retention keeps enough steps.)"""
    storage = PosixStorage(str(ck))
    step = storage.latest_step()
    if step is None:
        return None
    assert floor is None or step >= floor, f"latest went back from {floor} to {step}"
    meta = json.loads((ck / f"step_{step:010d}" / "checkpoint.json").read_text())
    for rank in range(meta["world_size"]):
        data = (ck / f"step_{step:010d}" / meta["shards"][str(rank)]["file"]).read_bytes()
        entries, _, start = parse_header(data)
        end = start + max(e["data_offsets"][1] for e in entries.values())
        assert zlib.crc32(data[start:end]) == meta["shards"][str(rank)]["crc32"], f"rank {rank} step {step}: CRC"
        state, metadata = decode(data)
        base = torch.randn(int(SIZE_MB * 2**20) // 4, generator=torch.Generator().manual_seed(1000 + rank))
        assert int(metadata["step"]) == step and state["state"]["meta"]["step"] == step
        assert torch.equal(state["state"]["w"], base + float(step)), f"rank {rank} step {step} is not bit-exact"
    return step


def verified(tmp: Path) -> list[dict]:
    path = tmp / "verify.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def worker_kills(tmp: Path, seed: int, kills: int) -> dict:
    """One 2-node job; SIGKILL a random worker ``kills`` times at random moments (each
    between two saves, during a save to memory, a persist or a commit). After each kill the
    restarted workers must restore bit-exact, from memory, and storage must hold a whole
    committed step that never goes back."""
    rng = random.Random(seed)
    shm_before = shm_entries()
    run = _job(tmp, f"wkill{seed}", nodes=2, max_restarts=kills).submit()
    floor = None
    try:
        for i in range(kills):
            _wait(lambda i=i: (s := run.status()).restarts == i and s.step >= 3 and len(s.worker_pids) == 2, 120,
                  f"training before kill {i}")
            start = run.status().step
            _wait(lambda start=start: run.status().step >= start + 2, 60, "two more steps")
            time.sleep(rng.uniform(0.0, 0.06))
            rank = rng.randrange(2)
            os.kill(run.status().worker_pids[rank], signal.SIGKILL)
            floor = check_storage(tmp / "ck", floor)
        _wait(lambda: run.status().restarts == kills and len(verified(tmp)) >= 2 * kills, 120, "the last restore")
    finally:
        run.cancel()
    result = run.wait(progress=False)
    floor = check_storage(tmp / "ck", floor)
    records = verified(tmp)
    assert result.restarts == kills
    assert records and all(r["ok"] for r in records), records
    assert job_processes(result.job_id) == []
    assert {e for e in shm_entries() - shm_before if result.job_id in e} == set()  # other jobs may run meanwhile
    events = [json.loads(line) for line in (Path(result.log_dir) / "events.jsonl").read_text().splitlines()]
    decisions = [e for e in events if e["kind"] == "restore_decided" and e["round"] > 0]
    return {"seed": seed, "kills": kills, "restores": [(r["source"], r["step"]) for r in records],
            "decisions": decisions, "committed": floor}


def agent_kill(tmp: Path, seed: int) -> dict:
    """One 2-node job; SIGKILL one node's agent (its workers die with it) at a random moment.
    Storage must hold a whole committed step; the master relaunches the node and the job
    trains on in a later round with both nodes, past the step of the kill, on the one
    restart of its budget (the node loss and its consequence on the survivor are one failure);
    cancelled then, it leaves no process and no shared memory behind."""
    rng = random.Random(seed)
    shm_before = shm_entries()
    run = _job(tmp, f"akill{seed}", nodes=2, max_restarts=1, heartbeat_timeout_s=2.0).submit()
    try:
        _wait(lambda: run.status().step >= 3, 120, "training")
        time.sleep(rng.uniform(0.0, 0.3))
        before = PosixStorage(str(tmp / "ck")).latest_step()
        handle = json.loads((Path(run.handle.log_dir) / "handle.json").read_text())
        node = rng.randrange(2)
        step_at_kill = run.status().step
        os.kill(handle["agents"][f"node-{node}"], signal.SIGKILL)

        def recovered() -> bool:
            s = run.status()
            assert not s.state.is_terminal, f"job ended: {s.state} {s.message}"
            return s.round >= 1 and s.nodes == 2 and s.step > step_at_kill + 3

        _wait(recovered, 120, "the job to recover with a relaunched node")
        assert run.status().restarts == 1
    finally:
        run.cancel()
    result = run.wait(progress=False, timeout_s=60)
    committed = check_storage(tmp / "ck", before)
    assert result.state == JobState.CANCELLED, result.reason
    events = [json.loads(line) for line in (Path(result.log_dir) / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "node_relaunched" and e["node_id"] == node for e in events)
    assert job_processes(result.job_id) == []
    assert {e for e in shm_entries() - shm_before if result.job_id in e} == set()  # other jobs may run meanwhile
    return {"seed": seed, "node": node, "committed_before": before, "committed": committed}
