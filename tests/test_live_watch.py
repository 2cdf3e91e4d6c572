"""The live world's watch thread: when a training thread that its group was severed under
counts as stuck (unit level; the end-to-end cut and thaw is tests/test_hostrun.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from dlrover_core.train import live
from dlrover_core.train.progress import ProgressWriter


class Exited(Exception):
    pass


@pytest.fixture
def exits(monkeypatch):
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise Exited

    monkeypatch.setattr(live.os, "_exit", fake_exit)
    monkeypatch.setattr(live, "_stuck_after_s", lambda: 0.2)
    return codes


def loop(phase: str, seq: int) -> SimpleNamespace:
    return SimpleNamespace(phase=phase, phase_seq=seq, rank=1, generation=0, _in_flight=7)


def watch_after_sever(state: SimpleNamespace) -> live._GrowWatch:
    watch = live._GrowWatch(state)  # type: ignore[arg-type]
    watch._severed, watch._still = 0, (state.phase_seq, time.monotonic())
    return watch


@pytest.mark.parametrize("phase", ["step", "boundary"])
def test_a_thread_that_stays_in_a_collective_after_the_sever_exits_for_a_replacement(exits, phase):
    state = loop(phase, 5)
    watch = watch_after_sever(state)
    watch._check_stuck(state)
    assert exits == []  # not yet: a collective fails at once after the sever, give it the time
    time.sleep(0.25)
    with pytest.raises(Exited):
        watch._check_stuck(state)
    assert exits == [live.EXIT_STUCK]


def test_a_thread_that_moves_on_or_recovers_is_left_alone(exits):
    state = loop("step", 5)
    watch = watch_after_sever(state)
    for phase in ("between", "recover", "boundary", "step"):  # it failed, re-formed, trains again
        time.sleep(0.15)
        state.phase, state.phase_seq = phase, state.phase_seq + 1
        watch._check_stuck(state)
    state.phase = "recover"  # asking the master for a long time is no collective
    time.sleep(0.25)
    watch._check_stuck(state)
    watch._check_stuck(state)
    assert exits == []


def _reported(monkeypatch, dts: list[float]) -> None:
    """The writer saw reports whose step times were ``dts`` (seconds)."""
    writer = ProgressWriter(None)
    for step, dt in enumerate(dts):
        writer._mark = time.monotonic() - dt  # the step began dt ago
        writer.step(step, {})
    monkeypatch.setattr(live, "get_writer", lambda: writer)


def test_the_grace_is_three_steps_when_steps_are_long(monkeypatch):
    _reported(monkeypatch, [4.0] * 5)
    assert live._stuck_after_s() == pytest.approx(12.0, abs=0.01) and 12.0 > live._STUCK_MIN_S
    _reported(monkeypatch, [0.1] * 5)
    assert live._stuck_after_s() == live._STUCK_MIN_S


def test_one_stalled_report_does_not_stretch_the_grace(monkeypatch):
    """A host frozen for 16 s between a step's end and its report: that report's time is the
    freeze, but the grace stays three typical steps (it was 48 s: the thawed worker sat in its
    stuck collective until the survivor had finished without it)."""
    _reported(monkeypatch, [0.1] * 20 + [16.0])
    assert live.get_writer().last_dt == pytest.approx(16.0, abs=0.01)
    assert live._stuck_after_s() == live._STUCK_MIN_S
    _reported(monkeypatch, [4.0] * 20 + [0.1])  # and one fast step does not shorten long ones
    assert live._stuck_after_s() == pytest.approx(12.0, abs=0.01)


@pytest.mark.parametrize("seed", [1, 2])
def test_the_grace_read_by_the_watch_thread_while_steps_are_reported_stays_in_range(seed):
    """The training thread reports steps (random times, one long stall among them) while the
    watch thread reads the grace: every read succeeds and lies between 5 s and three of the
    longest step time reported."""
    import random
    import threading

    rnd = random.Random(seed)
    writer = ProgressWriter(None)
    dts = [rnd.uniform(0.01, 3.0) for _ in range(3000)]
    dts[rnd.randrange(len(dts))] = 100.0
    done, errors, reads = threading.Event(), [], []

    def watch() -> None:
        while not done.is_set():
            try:
                reads.append(max(live._STUCK_MIN_S, 3 * writer.typical_dt_s))
            except Exception as exc:  # noqa: BLE001 (the invariant: none)
                errors.append(exc)

    thread = threading.Thread(target=watch)
    thread.start()
    for step, dt in enumerate(dts):
        writer._mark = time.monotonic() - dt
        writer.step(step, {})
        if rnd.random() < 0.01:
            time.sleep(0)
    done.set()
    thread.join()
    assert errors == [] and reads
    assert all(live._STUCK_MIN_S <= r <= 3 * 100.1 for r in reads)
    assert max(live._STUCK_MIN_S, 3 * writer.typical_dt_s) < 3 * 3.1  # the stall alone moved no median
