"""Seeded stress of the checkpoint path (issue 11): random schedules and faults, invariants
checked after every run.

In one process, with real shared memory, real threads and a real directory: ranks (one
thread each) save at random steps, some asking for persistence and the last one forced;
the node savers persist in the background to a storage with random delays and I/O errors;
random "kills" end a round with some ranks past a step and others not; every new round
restores as the master decides (memory, verified storage, or fresh) and adds noise to the
state, so each incarnation's state differs. After the run:

* every committed step holds every rank's shard, all of one incarnation, with the
  committed CRC32s, and each shard is the state that incarnation had at that step;
* every restore gave the state the lineage had at the restored step;
* the final forced save is committed, or the flush says it is not durable, naming the
  storage;
* nothing is left in /dev/shm.

``DLROVER_STRESS_SEEDS=N`` runs N seeds instead of the CI's handful. The real-process side
(SIGKILLed workers and agents, a flaky storage plugin) is
``test_real_jobs_with_kills_and_a_flaky_disk_keep_the_invariants``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch

from dlrover_core.checkpoint.layout import build_layout, parse_header, tensor_views
from dlrover_core.checkpoint.memory import MemorySnapshots
from dlrover_core.checkpoint.saver import CheckpointSaver
from dlrover_core.checkpoint.shm import remove_segments
from dlrover_core.master.checkpoints import CheckpointCoordinator
from dlrover_core.protocol import CheckpointErrorReport, RestorePlanRequest, RestoreVerify, ShardAnswer, ShardReport
from dlrover_core.retry import storage_retrying
from dlrover_core.storage.posix import PosixStorage

SEEDS = int(os.environ.get("DLROVER_STRESS_SEEDS", "8"))
N = 256  # elements of the state tensor


class FlakyStorage(PosixStorage):
    """Shard writes sleep a random while and fail at random with EIO (seeded)."""

    def __init__(self, url: str, rng: random.Random, fail_p: float, max_delay_s: float) -> None:
        super().__init__(url)
        self._rng, self._fail_p, self._max_delay_s = rng, fail_p, max_delay_s
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def open_write(self, path):
        shard = "/rank_" in path
        with self._lock:
            u1, u2 = self._rng.random(), self._rng.random()
        if shard and u1 < self._fail_p:
            raise OSError(errno.EIO, "Input/output error (stress storage)", path)
        with super().open_write(path) as f:
            yield f
            if shard:
                time.sleep(u2 * self._max_delay_s)


def _value(tensor: torch.Tensor) -> float:
    values = set(tensor.tolist())
    assert len(values) == 1, "a torn state"
    return values.pop()


def run_schedule(seed: int, tmp: Path) -> dict:
    rng = random.Random(seed)
    job_id = f"stress{os.getpid()}s{seed}"
    nodes, per_node = rng.choice([1, 2]), rng.choice([1, 2, 3])
    world = nodes * per_node
    total = rng.randint(25, 45)
    persist_every = rng.choice([1, 2, 3, 5])
    fail_p, max_delay_s = rng.choice([0.0, 0.1, 0.3]), rng.choice([0.0, 0.005, 0.03])
    ck = tmp / f"ck{seed}"
    storage = FlakyStorage(str(ck), random.Random(seed + 1), fail_p, max_delay_s)
    lock = threading.Lock()
    coordinator = CheckpointCoordinator(PosixStorage(str(ck)), keep_last=1000, event=lambda *a, **k: None)
    errors: list[CheckpointErrorReport] = []

    def report_shard(shard: ShardReport) -> ShardAnswer:  # what the master does with the savers' reports
        with lock:
            return coordinator.shard_done(shard)

    def report_error(error: CheckpointErrorReport) -> None:
        with lock:
            errors.append(error)

    savers = [CheckpointSaver(job_id=job_id, node_id=n, storage=storage, report_shard=report_shard,
                              report_error=report_error, poll_s=0.002,
                              persist_timeout_s=30, retrying=lambda: storage_retrying(sleep=lambda s: time.sleep(0.001)))
              for n in range(nodes)]
    for n, saver in enumerate(savers):
        saver.set_ranks(list(range(n * per_node, (n + 1) * per_node)))
        saver.start()
    history: dict[tuple[int, int], float] = {}  # (round, step) -> the state that incarnation had
    torn: set[str] = set()  # shard files torn after their commit
    restores = []
    round_index, start, value = 0, 0, 0.0
    flushes = []
    try:
        while True:
            memories = [MemorySnapshots(job_id=job_id, node_id=r // per_node, rank=r, round_index=round_index,
                                        wait_timeout_s=30) for r in range(world)]
            # ----- now and then a rank's shard of the newest commit is torn (a damaged disk):
            # the restore must fall back below it, and the steps trained again be committed anew
            if round_index > 0 and rng.random() < 0.3:
                with lock:
                    intact = [s for s in coordinator.committed_steps() if s not in coordinator.damaged]
                if len(intact) >= 2:
                    meta = json.loads((ck / f"step_{intact[-1]:010d}" / "checkpoint.json").read_text())
                    victim = ck / f"step_{intact[-1]:010d}" / meta["shards"][str(rng.randrange(world))]["file"]
                    victim.write_bytes(victim.read_bytes()[:64])
                    torn.add(str(victim.relative_to(ck)))
            # ----- restore, as the workers of a new round do
            if round_index > 0:
                plans = {}
                for r in range(world):
                    with lock:
                        plans[r] = coordinator.restore_plan(RestorePlanRequest(
                            round=round_index, rank=r, world_size=world, memory=tuple(memories[r].held(world))))
                plan = plans[world - 1]
                assert plan.state == "ready"
                if plan.source == "memory":
                    got = set()
                    for r in range(world):
                        with memories[r].read(plan.step, world, plan.snapshot_round) as (views, _):
                            got.add(_value(views["state/w"]))
                    assert got == {history[(plan.snapshot_round, plan.step)]}, "memory restore mixed lineages"
                    value, step = got.pop(), plan.step
                elif plan.source == "storage":
                    step = plan.step
                    while True:  # each rank checks its shard; a damaged one sends all to an older commit
                        meta = json.loads((ck / f"step_{step:010d}" / "checkpoint.json").read_text())
                        checks = {}
                        for r in range(world):
                            try:
                                checks[r] = (True, "", _shard_value(ck, meta, r))
                            except Exception as exc:  # noqa: BLE001 - a torn or corrupt shard
                                checks[r] = (False, str(exc), None)
                        with lock:
                            answers = [coordinator.verify(RestoreVerify(
                                round=round_index, rank=r, world_size=world, step=step, ok=checks[r][0],
                                error=checks[r][1])) for r in range(world)]
                        answer = answers[-1]
                        assert answer.state in ("ok", "retry"), answer
                        if answer.state == "ok":
                            break
                        step = answer.step
                    got = {c[2] for c in checks.values()}
                    assert got == {history[(meta["round"], step)]}, "storage restore is not the commit's state"
                    value = got.pop()
                else:
                    value, step = 0.0, -1
                for r in range(world):
                    memories[r].forget_after(step, keep_round=plan.snapshot_round
                                             if plan.source == "memory" else None)
                restores.append((round_index, plan.source, step))
                value += random.Random(f"{seed}-noise-{round_index}").uniform(1, 2)  # this incarnation differs
                start = step + 1
            # ----- train: every rank a thread, in lockstep per step, some stop early at a "kill"
            kill = rng.randint(start, total - 1) if rng.random() < 0.6 and start < total - 1 else None
            stops = {r: (rng.random() < 0.5) for r in range(world)}  # at the kill: saved the step or not
            values = {}
            v = value
            for step in range(start, total):
                v = v * 0.5 + step
                values[step] = v
                history[(round_index, step)] = v
            end = total if kill is None else kill + 1
            barrier = threading.Barrier(world)

            rng_local = {r: random.Random(f"{seed}-{round_index}-{r}") for r in range(world)}

            def rank_loop(r: int, start=start, end=end, barrier=barrier, kill=kill, stops=stops, values=values,
                          memories=memories, rng_local=rng_local) -> None:
                for step in range(start, end):
                    barrier.wait()
                    if step == kill and not stops[r]:
                        return  # killed before saving this step
                    time.sleep(rng_local[r].random() * 0.003)
                    force = step == total - 1
                    persist = force or step % persist_every == 0
                    layout = build_layout({"state": {"w": torch.full((N,), values[step], dtype=torch.float64)}},
                                          step=step, rank=r, world_size=world)
                    memories[r].save(layout, step=step, world_size=world, persist=persist)

            threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
                assert not t.is_alive(), "a save hung"
            for memory in memories:
                memory.close()
            if kill is None:
                flushes = [saver.flush(30) for saver in savers]
                break
            for saver in savers:
                saver.request_breakpoint()
            round_index += 1
            time.sleep(rng.random() * 0.02)
    finally:
        for saver in savers:
            saver.stop(timeout_s=30)
        remove_segments(f"dlrover-{job_id}-")
    return {"ck": ck, "history": history, "flushes": flushes, "world": world, "total": total, "errors": errors,
            "restores": restores, "coordinator": coordinator, "job_id": job_id, "storage": storage, "torn": torn}


def _shard_value(ck: Path, meta: dict, rank: int) -> float:
    shard = meta["shards"][str(rank)]
    data = (ck / f"step_{meta['step']:010d}" / shard["file"]).read_bytes()
    entries, _, start = parse_header(data)
    end = start + max(e["data_offsets"][1] for e in entries.values())
    assert zlib.crc32(data[start:end]) == shard["crc32"], f"step {meta['step']} rank {rank}: CRC"
    return _value(tensor_views(bytearray(data), start, entries)["state/w"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_schedules_keep_the_checkpoint_invariants(tmp_path, seed):
    out = run_schedule(seed, tmp_path)
    ck, history = out["ck"], out["history"]
    latest = PosixStorage(str(ck)).latest_step()
    damaged = out["coordinator"].damaged
    committed = []
    for meta_path in sorted(ck.glob("step_*/checkpoint.json")):
        meta = json.loads(meta_path.read_text())
        files = {f"{meta_path.parent.name}/{s['file']}" for s in meta["shards"].values()}
        if files & out["torn"]:
            continue  # a commit torn after it was made, not committed anew since (no restore read it, or
            # it lies above the marker the restore moved back)
        assert meta["step"] not in damaged and (latest is None or meta["step"] <= latest), meta["step"]
        assert sorted(meta["shards"]) == [str(r) for r in range(meta["world_size"])]
        assert {s["round"] for s in meta["shards"].values()} == {meta["round"]}, "a commit mixes incarnations"
        want = history[(meta["round"], meta["step"])]
        for r in range(meta["world_size"]):
            assert _shard_value(ck, meta, r) == want, f"step {meta['step']} rank {r} is not its incarnation's state"
        committed.append(meta["step"])
    assert committed == sorted(committed)
    assert not damaged.keys() & set(committed), "a damaged step is committed and not committed anew"
    final = out["total"] - 1
    if all(f.ok for f in out["flushes"]):
        assert latest == final, (latest, final, out["flushes"])
    else:
        bad = next(f for f in out["flushes"] if not f.ok)
        assert str(ck) in bad.reason and "not durable" in bad.reason and bad.step is not None
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"dlrover-{out['job_id']}-")]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("seed", range(max(1, SEEDS // 8)))
def test_real_jobs_with_kills_and_a_flaky_disk_keep_the_invariants(tmp_path, monkeypatch, seed):
    """A real job (2 nodes x 2 workers, DDP, noise added after every restart) on a disk that
    is slow and fails 10% of shard writes, with seeded SIGKILLs of random workers and of
    one agent: every committed step is whole, of one incarnation, with equal replicated
    state on every rank; the final forced save is committed (or the job FAILED naming the
    storage); nothing is left running or in /dev/shm."""
    import signal
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import SCRIPTS, check_committed_steps, job_processes, shm_entries, use_flaky_storage

    from dlrover_core import Checkpoint, Failure, Job, JobState, Nodes

    rng = random.Random(seed)
    use_flaky_storage(tmp_path, monkeypatch, seed=seed, fail_p=0.1, delay_s=0.02, jitter_s=0.15)
    ck = tmp_path / "ck"
    steps = 150
    job = Job(
        name="stress", entrypoint=str(SCRIPTS / "ckpt_train.py"),
        args=["--steps", str(steps), "--step-sleep", "0.03", "--noise", "--force-last"],
        nodes=Nodes(min=2, max=2, nproc_per_node=2), accelerator="cpu",
        checkpoint=Checkpoint(dir=str(ck), storage="flaky", persist_every_steps=rng.choice([2, 3, 5]), keep_last=1000,
                              persist_timeout_s=60),
        failure=Failure(max_restarts=8, heartbeat_interval_s=0.5, heartbeat_timeout_s=4.0, stop_grace_s=2,
                        max_node_failures=8),
        log_dir=str(tmp_path / "runs"),
    )
    run = job.submit()
    handle = Path(run.handle.log_dir) / "handle.json"
    agent_victim = rng.randrange(3)  # which of the three kills hits an agent
    for kill in range(3):
        deadline = time.monotonic() + 120
        target = run.status().step + rng.randint(10, 40)
        while run.status().step < target and not run.status().state.is_terminal:
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.05)
        time.sleep(rng.random() * 0.3)  # anywhere around a save, a persist, a commit
        status = run.status()
        if status.state.is_terminal or status.step >= steps - 5:
            break
        if kill == agent_victim:
            pid = json.loads(handle.read_text())["agents"].get(f"node-{rng.randrange(2)}")
        else:
            pid = rng.choice(sorted(status.worker_pids.values())) if status.worker_pids else None
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    result = run.wait(progress=False, timeout_s=300)
    assert result.restarts >= 2, "the kills did not happen"
    committed = check_committed_steps(ck)
    assert committed == sorted(committed)
    latest = PosixStorage(str(ck)).latest_step()
    if result.state == JobState.SUCCEEDED:
        assert latest == steps - 1, result
    else:
        assert str(ck) in result.reason, result.reason
    deadline = time.monotonic() + 30
    while job_processes(result.job_id) or [n for n in shm_entries() if n.startswith(f"dlrover-{result.job_id}-")]:
        assert time.monotonic() < deadline, "processes or segments left behind"
        time.sleep(0.2)
