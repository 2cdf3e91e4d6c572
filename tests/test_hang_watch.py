"""The agent's hang watcher (``dlrover_core.agent.hang``) on real worker processes: when a
worker counts as hung, and a replacement's wait to join the live world."""

from __future__ import annotations

import json
import sys
import time

import pytest

from dlrover_core.agent.hang import STARTUP_S, HangWatcher
from dlrover_core.agent.progress import ProgressTail
from dlrover_core.agent.workers import WorkerProcess, kill_trees


@pytest.fixture
def worker(tmp_path):
    """A real worker process that sleeps (it makes no progress of its own)."""
    w = WorkerProcess(rank=1, local_rank=0, argv=[sys.executable, "-c", "import time; time.sleep(60)"], env={},
                      cwd=str(tmp_path), log_file=tmp_path / "rank_1.log")
    yield w
    kill_trees([w], grace_s=0.0)


def watcher(tmp_path, timeout_s=None):
    return HangWatcher(node_id=0, node_dir=tmp_path, hang_timeout_s=timeout_s, storage_busy=lambda: False)


def write(path, *records):
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_a_replacement_waiting_to_join_past_the_hang_timeout_is_hung(tmp_path, worker):
    """A replacement that asked to join (``live_ready``) but is never let in — its world
    waits for a state no one can send, say — is a hang once the hang timeout has passed; it
    does not get the start-up allowance (``STARTUP_S``) of a worker still setting up. The
    timeout is its node's, derived from the step times of the worker it replaced."""
    old = ProgressTail(tmp_path / "old.jsonl", started=time.monotonic())
    write(old.path, *({"type": "step", "step": s, "dt": 1.0} for s in range(5)))
    old.read()
    started = time.monotonic() - 61.0  # it started, then asked to join, a minute ago
    tail = ProgressTail(tmp_path / "new.jsonl", started=started, joiner=True, step_times=old.step_times)
    hangs = watcher(tmp_path)
    assert hangs.timeout_s({1: tail}) == 60.0  # 20 x 1 s steps, at least 60 s: carried over
    assert hangs.hung([worker], {1: tail}) == []  # not asked to join yet: still starting (STARTUP_S)
    write(tail.path, {"type": "live_ready", "rank": 1})
    tail.read()
    tail.last_progress = started
    assert hangs.hung([worker], {1: tail}) == [worker]


def test_a_worker_still_starting_gets_the_start_up_allowance(tmp_path, worker):
    tail = ProgressTail(tmp_path / "p.jsonl", started=time.monotonic() - 120.0)
    write(tail.path, {"type": "live_ready", "rank": 1})  # the round's own worker, in train.steps()
    tail.read()
    tail.last_progress = time.monotonic() - 120.0
    hangs = watcher(tmp_path, timeout_s=60.0)
    assert hangs.hung([worker], {1: tail}) == []  # no step yet: STARTUP_S
    tail.last_progress = time.monotonic() - STARTUP_S - 1
    assert hangs.hung([worker], {1: tail}) == [worker]
