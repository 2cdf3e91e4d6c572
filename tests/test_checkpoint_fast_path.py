"""The save's fast path: a reused layout plan, cached views of the slot, the grouped copy,
no garbage collection in a save. Each must give the bytes the plain path gives and keep the
slot protocol: what is not completely written is never read."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from dlrover_core.checkpoint import layout as layout_mod
from dlrover_core.checkpoint.layout import _SMALL_NUMEL, build_layout, decode, encode
from dlrover_core.checkpoint.memory import MemorySnapshots
from dlrover_core.checkpoint.shm import remove_segments
from dlrover_core.checkpoint.state_format import flatten
from dlrover_core.train.checkpointer import _gc_paused


@pytest.fixture
def job_id(request):
    jid = f"fast{os.getpid()}{abs(hash(request.node.name)) % 10**6}"
    yield jid
    remove_segments(f"dlrover-{jid}-")


def make_state(step: int, *, big: bool = False) -> dict:
    """Every kind of leaf the copy treats apart, with values that change with ``step``:
    small and large (over ``_SMALL_NUMEL`` elements) tensors of several dtypes, bfloat16
    (numpy has no such dtype), a 0-d tensor, a non-contiguous view, a numpy array, NaNs
    with a payload (bit-exact, not just equal), an empty tensor; ``big`` adds one over
    16 MiB (copied in chunks across threads)."""
    g = torch.Generator().manual_seed(step)
    large = torch.randn(_SMALL_NUMEL + 17, generator=g)
    nan = torch.tensor([0x7FC00123 + step], dtype=torch.int32).view(torch.float32)
    state = {
        "model": {"w": torch.randn(64, 48, generator=g), "b": torch.randn(48, generator=g), "large": large,
                  "wt": torch.randn(48, 64, generator=g).t()},  # non-contiguous
        "half": torch.randn(1000, generator=g).to(torch.bfloat16),
        "half_large": torch.randn(_SMALL_NUMEL * 2, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 2**40, (300,), generator=g), "mask": torch.rand(77, generator=g) > 0.5,
        "step": torch.tensor(float(step)), "nan": nan, "empty": torch.zeros(0, 3),
        "array": np.arange(step, step + 50, dtype=np.int16), "scalars": (step, 1.5, "x", None, True),
    }
    if big:
        state["big"] = torch.randn(5_000_000, generator=g)  # 20 MB
        state["big64"] = torch.randn(2_500_000, generator=g, dtype=torch.float64)  # 20 MB
    return state


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_bit_exact(views: dict, state: dict) -> None:
    _, leaves = flatten({"state": state})
    assert sorted(views) == sorted(leaves)
    def tensor(t):
        return torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t

    for key, leaf in leaves.items():
        got, want = tensor(views[key]), tensor(leaf)
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert as_bytes(got) == as_bytes(want), key


def region(layout, targets=None) -> bytes:
    buf = bytearray(layout.data_len + 4096)
    layout.copy_into(buf, 4096, targets)
    return bytes(buf[4096:])


@pytest.mark.parametrize("big", [False, True])
def test_a_reused_plan_and_cached_views_write_the_bytes_of_the_plain_file(big):
    """Step after step with the previous plan and the same views, the header and the data
    are byte for byte the file ``encode`` writes tensor by tensor."""
    plan = None
    buf = bytearray(0)
    targets = None
    for step in range(3):
        state = {"state": make_state(step, big=big)}
        layout = build_layout(state, step=step, rank=0, world_size=1, plan=plan)
        if plan is not None:
            assert layout.plan is plan  # the same tensors: the plan was reused
        plan = layout.plan
        if targets is None:
            buf = bytearray(layout.data_len + 4096)
            targets = layout.targets(buf, 4096)
        layout.copy_into(buf, 4096, targets)
        header = layout.header_bytes()
        assert header + bytes(buf[4096:]) == encode(state, step=step)
        back, _ = decode(header + bytes(buf[4096:]))
        assert_bit_exact(flatten(back)[1], state["state"])


def test_tensors_that_change_get_a_new_plan():
    """A new key, another shape or dtype: the old plan is not used, the bytes stay right."""
    first = build_layout({"w": torch.ones(4)}, step=0, rank=0, world_size=1)
    for other in ({"w": torch.ones(5)}, {"w": torch.ones(4, dtype=torch.float64)}, {"w": torch.ones(4), "v": torch.ones(1)},
                  {"v": torch.ones(4)}):
        layout = build_layout(other, step=1, rank=0, world_size=1, plan=first.plan)
        assert layout.plan is not first.plan
        assert layout.header_bytes() + region(layout) == encode(other, step=1)


def test_snapshots_read_back_bit_exact_through_the_cached_views(job_id):
    """Saves reusing a plan and the slots' cached views hold exactly each step's values,
    also after a larger state grew the slots (new mappings) and the smaller one came back."""
    snaps = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    plan = None
    try:
        for step, big in ((1, False), (2, False), (3, False), (4, True), (5, True), (6, False), (7, False)):
            state = make_state(step, big=big)
            layout = build_layout({"state": state}, step=step, rank=0, world_size=1, plan=plan)
            plan = layout.plan
            assert snaps.save(layout, step=step, world_size=1, persist=False)
            with snaps.read(step, 1) as (views, _):
                assert_bit_exact(views, state)
        assert snaps.held_steps(1) == [6, 7]
        with snaps.read(6, 1) as (views, _):  # the older slot was not touched by the newer save
            assert_bit_exact(views, make_state(6))
    finally:
        snaps.close()


def test_a_save_that_fails_mid_copy_leaves_no_readable_snapshot(job_id, monkeypatch):
    """The grouped copy stops half way (an error): the slot it wrote is not READY, the
    previous snapshot is intact, and the next save works."""
    snaps = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    try:
        plan = None
        for step in (1, 2):
            layout = build_layout({"state": make_state(step)}, step=step, rank=0, world_size=1, plan=plan)
            plan = layout.plan
            snaps.save(layout, step=step, world_size=1, persist=False)

        def half_then_fail(pairs):
            for dst, src in pairs[: len(pairs) // 2]:
                np.copyto(dst, src)
            raise OSError("copy failed")

        monkeypatch.setattr(layout_mod, "copy_all", half_then_fail)
        with pytest.raises(OSError):
            snaps.save(build_layout({"state": make_state(3)}, step=3, rank=0, world_size=1, plan=plan), step=3,
                       world_size=1, persist=False)
        assert snaps.held_steps(1) == [2]
        with snaps.read(2, 1) as (views, _):
            assert_bit_exact(views, make_state(2))
        monkeypatch.undo()
        snaps.save(build_layout({"state": make_state(4)}, step=4, rank=0, world_size=1, plan=plan), step=4,
                   world_size=1, persist=False)
        assert snaps.held_steps(1) == [2, 4]
    finally:
        snaps.close()


def test_a_writer_killed_mid_copy_on_the_fast_path_leaves_no_torn_snapshot(job_id):
    """A worker SIGKILLed half way through a save's copy (its plan and views reused from
    the saves before) leaves the slot not READY: only complete snapshots are held."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        import numpy as np
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_checkpoint_fast_path import make_state
        from dlrover_core.checkpoint import layout as layout_mod
        from dlrover_core.checkpoint.layout import build_layout
        from dlrover_core.checkpoint.memory import MemorySnapshots
        snaps = MemorySnapshots(job_id={job_id!r}, node_id=0, rank=0)
        plan = None
        for step in (1, 2, 3):
            layout = build_layout({{"state": make_state(step)}}, step=step, rank=0, world_size=1, plan=plan)
            plan = layout.plan
            if step == 3:
                def half_then_die(pairs):
                    for dst, src in pairs[: len(pairs) // 2]:
                        np.copyto(dst, src)
                    os.kill(os.getpid(), signal.SIGKILL)
                layout_mod.copy_all = half_then_die
            snaps.save(layout, step=step, world_size=1, persist=False)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    snaps = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    try:
        assert snaps.held_steps(1) == [2]
        with snaps.read(2, 1) as (views, _):
            assert_bit_exact(views, make_state(2))
    finally:
        snaps.close()


def test_flatten_leaves_no_garbage_for_the_collector():
    """The tree and leaves of a state are freed by reference counting alone (no cycle to
    wait for a collection); a tensor that does not require grad is its own leaf."""
    model = torch.nn.Linear(3, 2)
    state = {"model": model, "w": torch.ones(2, requires_grad=True), "x": [torch.zeros(1), {"y": (1, 2)}]}
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(3):
            tree, leaves = flatten(state)
        del tree, leaves
        assert gc.collect() == 0
    finally:
        if enabled:
            gc.enable()
    _, leaves = flatten(state)
    assert not leaves["w"].requires_grad and leaves["w"].data_ptr() == state["w"].data_ptr()
    assert leaves["x/0"] is state["x"][0]


@pytest.mark.parametrize("enabled", [True, False])
def test_a_save_pauses_garbage_collection_and_gives_it_back_as_it_was(enabled):
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        with _gc_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError), _gc_paused():
            raise RuntimeError("boom")
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


def test_prestart_spawns_the_copy_threads_before_the_first_copy(monkeypatch):
    """A restarted worker's first restore must not wait for the copy threads to spawn."""
    import threading

    from dlrover_core.checkpoint import copy as copy_mod

    monkeypatch.setattr(copy_mod, "_pool", None)
    monkeypatch.setattr(copy_mod, "_threads", lambda: 2)
    before = {t.ident for t in threading.enumerate()}
    copy_mod.prestart()
    new = [t.name for t in threading.enumerate() if t.ident not in before]
    assert len(new) == 2 and all(name.startswith("dlrover-copy") for name in new), new
    copy_mod._pool.shutdown()
