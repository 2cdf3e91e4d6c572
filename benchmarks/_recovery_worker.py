"""dlrover-core worker for ``recovery.py``'s restore-latency and re-rendezvous experiments.

Trains the char LM (``examples/charlm``: same model and batch as ``train.py``) and, with
``--state-mib N``, carries extra buffers (16 float32 buffers in a module) so that each rank's
checkpointed state is N MiB plus the model, optimizer and sampler; saved with
``train.Checkpointer`` (every step to memory with the Job's default ``memory_every_steps=1``).

The model is saved unwrapped (``model.module`` under DDP), so a checkpoint taken at one world
size loads at another: ``train.prepare`` wraps the model in DDP only when the world has more
than one process, and the two state dicts' keys differ (``module.`` prefix).

Data: ``train.ElasticSampler`` over the corpus's windows (as ``examples/charlm/train.py``).
With ``--live`` the loop is ``train.steps()`` (``with step:``), so the job may recover
without stopping when the product can (docs/design.md §5a): each rank's share of the global batch
follows the world size, in micro-batches of ``--batch-size``. Without it, a plain ``range``
loop: a failure restarts every worker, which restores from the Checkpointer (what the
restore-latency experiment measures).

The state is allocated and touched before ``Checkpointer.load`` (as a model is initialised
before it is loaded), and after ``load`` returns each process appends one JSON line to
``<out-dir>/rank<r>.jsonl``:

``{"rank", "round", "pid", "t_proc", "t_import", "t_init", "t_data", "t_model", "t_state",
"t_load_start", "t_load_end", "source", "step", "load_s"}`` — wall-clock ``time.time()``
values: first line of this script, torch imported, process group ready, corpus loaded,
model and optimizer built (``train.prepare``), extra buffers allocated, ``load`` called,
``load`` returned. ``load_s`` is the Checkpointer's own figure (it also logs
``checkpoint_restored``).
"""

import time

T_PROC = time.time()  # before the slow imports (a warm standby has done them already)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

T_IMPORT = time.time()

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "charlm"))
from data import load_corpus, n_windows, windows  # noqa: E402
from model import CharLM, loss_fn  # noqa: E402

from dlrover_core import train  # noqa: E402

_BUFFERS = 16


class Ballast(torch.nn.Module):
    """Extra state: ``_BUFFERS`` float32 buffers totalling ``nbytes`` (pages touched)."""

    def __init__(self, nbytes: int, rank: int) -> None:
        super().__init__()
        per = nbytes // _BUFFERS // 4
        for i in range(_BUFFERS):
            self.register_buffer(f"b{i}", torch.full((per,), float(rank * _BUFFERS + i)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--state-mib", type=int, default=0, help="extra buffers per rank (0: none)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--max-bytes", type=int, default=500_000, help="corpus bytes (the data barely matters here)")
    p.add_argument("--synthetic-data", action="store_true",
                   help="random bytes instead of the standard library's sources (skips reading ~1000 files)")
    p.add_argument("--batch-size", type=int, default=16, help="windows per rank per step at the full world size")
    p.add_argument("--live", action="store_true", help="loop with train.steps() (recovery without stopping)")
    a = p.parse_args(argv)

    info = train.init()
    t_init = time.time()
    if a.synthetic_data:
        train_data = torch.randint(0, 256, (a.max_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    else:
        train_data, _ = load_corpus(None, a.max_bytes)
    t_data = time.time()
    torch.manual_seed(0)
    model, optimizer = train.prepare(CharLM(block_size=64), lr=3e-3, weight_decay=0.01)
    sampler = train.ElasticSampler(n_windows(train_data, 64), a.batch_size, seed=0)
    state = {"model": getattr(model, "module", model), "optimizer": optimizer, "sampler": sampler}
    t_model = time.time()
    ballast = Ballast(a.state_mib * 2**20, info.rank) if a.state_mib else None
    if ballast is not None:
        state["ballast"] = ballast
    t_state = time.time()

    ckpt = train.Checkpointer()
    t_load_start = time.time()
    restored = ckpt.load(state)
    t_load_end = time.time()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"rank{info.rank}.jsonl", "a") as f:
        f.write(json.dumps({
            "rank": info.rank, "round": info.round, "pid": os.getpid(), "t_proc": T_PROC, "t_import": T_IMPORT,
            "t_init": t_init, "t_data": t_data, "t_model": t_model, "t_state": t_state, "t_load_start": t_load_start, "t_load_end": t_load_end,
            "source": restored.source if restored else "fresh", "step": restored.step if restored else None,
            "load_s": restored.load_s if restored else None,
        }) + "\n")

    start = restored.step + 1 if restored else 0

    def one_step(step: int, world_size: int) -> None:
        ids = sampler.next_batch()
        if ids is None:  # the epoch ended: the next call starts the next one
            ids = sampler.next_batch()
        optimizer.zero_grad(set_to_none=True)
        chunks = [ids[i : i + a.batch_size] for i in range(0, len(ids), a.batch_size)] or [[]]
        loss_sum = 0.0
        for j, chunk in enumerate(chunks):  # this rank's share grows when the live world shrinks
            sync = contextlib.nullcontext() if j == len(chunks) - 1 or not hasattr(model, "no_sync") else model.no_sync()
            with sync:
                if not chunk:
                    (sum(p.sum() for p in model.parameters()) * 0.0).backward()
                    continue
                x, y = windows(train_data, chunk, 64)
                loss = loss_fn(model(x), y)
                (loss * (len(chunk) * world_size / sampler.global_batch_size)).backward()
                loss_sum += loss.item() * len(chunk)
        optimizer.step()
        if ballast is not None:
            with torch.no_grad():
                ballast.b0[step % ballast.b0.numel()] += 1.0  # the state changes every step
        train.report(step, loss=loss_sum / max(1, len(ids)))
        ckpt.save(step, state)

    if a.live:
        for step in train.steps(a.steps, state, start=start):
            with step:
                one_step(step, step.world_size)
    else:
        for step in range(start, a.steps):
            one_step(step, info.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
