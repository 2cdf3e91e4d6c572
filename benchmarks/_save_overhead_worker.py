"""Worker of the save-overhead benchmark: runs under dlrover (1 node x 1 worker) and times
``train.Checkpointer().save(step, state)`` for one model size, side by side with its floor.

The state is what the demo saves: the byte-level GPT of ``examples/charlm`` (at the size
given), its AdamW optimizer after one step (so ``exp_avg``, ``exp_avg_sq`` and ``step``
exist for every parameter) and an LR scheduler. The floor copies the same tensors (the
model's ``state_dict`` and the optimizer's state) with ``copy_`` into tensors allocated and
written once before (pre-touched), one ``copy_`` per tensor: each time both with torch's
intra-op threads as the job set them and with one (on shared cores torch's OpenMP threads
wait for each other, which can make the threaded copy several times slower), the faster
counting.

Memory-only saves and saves due for persistence (``force=True``) are timed separately, each
interleaved with a floor copy (alternating which goes first). After a save due for
persistence the worker waits, untimed, until the agent has persisted it and the master has
committed it, so every such save meets a free slot, as in a loop whose storage keeps up
with ``persist_every_steps``. Results go to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "charlm"))
from model import CharLM, loss_fn  # noqa: E402

from dlrover_core import train  # noqa: E402
from dlrover_core.storage.posix import PosixStorage  # noqa: E402

#: model size -> CharLM(d_model, n_layer, n_head): about 1M, 10M and 100M parameters
SIZES = {"1m": (128, 5, 4), "10m": (320, 8, 4), "100m": (768, 14, 12)}


def build_state(size: str) -> tuple[dict, list[torch.Tensor], int]:
    """``(state, its tensors, parameter count)``: the model, AdamW after one step, a scheduler."""
    d_model, n_layer, n_head = SIZES[size]
    torch.manual_seed(0)
    model = CharLM(block_size=64, d_model=d_model, n_layer=n_layer, n_head=n_head)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    x = torch.randint(0, 256, (1, 16))
    loss_fn(model(x), x).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    tensors = [t.detach() for t in model.state_dict().values()]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    params = sum(p.numel() for p in model.parameters())
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler}, tensors, params


def wait_committed(storage: PosixStorage, step: int, timeout_s: float = 600) -> float:
    t0 = time.perf_counter()
    while storage.latest_step() != step:
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"step {step} was not committed within {timeout_s} s")
        time.sleep(0.002)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=sorted(SIZES), required=True)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    train.init()
    state, tensors, params = build_state(a.size)
    floor_dst = [torch.empty_like(t) for t in tensors]
    for d, s in zip(floor_dst, tensors, strict=True):
        d.copy_(s)  # pre-touch
    threads = torch.get_num_threads()

    def copy(n_threads: int) -> float:
        torch.set_num_threads(n_threads)
        t0 = time.perf_counter()
        for d, s in zip(floor_dst, tensors, strict=True):
            d.copy_(s)
        elapsed = time.perf_counter() - t0
        torch.set_num_threads(threads)
        return elapsed

    def floor() -> float:
        """Seconds of the faster copy: with the job's threads, or one."""
        return min(copy(threads), copy(1)) if threads > 1 else copy(1)

    ckpt = train.Checkpointer()
    storage = PosixStorage(ckpt.storage.url)
    step = 0

    def save(force: bool) -> float:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        taken = ckpt.save(step, state, force=force)
        elapsed = time.perf_counter() - t0
        if not taken:
            raise RuntimeError(f"save of step {step} was skipped (both slots waited for their persist)")
        return elapsed

    out: dict = {"size": a.size, "params": params, "tensors": len(tensors),
                 "bytes": sum(t.numel() * t.element_size() for t in tensors), "reps": a.reps,
                 "torch_threads": threads}
    first = [save(False), save(False)]  # each allocates and pre-touches one slot
    out["first_saves_s"] = first
    for _ in range(a.warmup):  # warm-up: both slots reused, a persist through the agent
        save(False)
        floor()
    save(True)
    wait_committed(storage, step)

    for kind, force in (("memory", False), ("persist", True)):
        stalls, floors, commits = [], [], []
        for i in range(a.reps):
            if i % 2:
                floors.append(floor())
            stalls.append(save(force))
            if force:  # the agent persists it: the floor is not timed beside that write
                commits.append(wait_committed(storage, step))
            if not i % 2:
                floors.append(floor())
        out[kind] = {"stall_s": stalls, "floor_s": floors}
        if commits:
            out[kind]["commit_wait_s"] = commits
    Path(a.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
