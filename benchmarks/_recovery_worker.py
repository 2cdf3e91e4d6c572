"""dlrover-core worker for ``recovery.py``'s restore-latency and re-rendezvous experiments.

Trains the char LM (``examples/charlm``: same model and batch as ``train.py``) and, with
``--state-mib N``, carries extra buffers (16 float32 buffers in a module) so that each rank's
checkpointed state is N MiB plus the model, optimizer and sampler; saved with
``train.Checkpointer`` (every step to memory with the Job's default ``memory_every_steps=1``).

The model is saved unwrapped (``model.module`` under DDP), so a checkpoint taken at one world
size loads at another: ``train.prepare`` wraps the model in DDP only when the world has more
than one process, and the two state dicts' keys differ (``module.`` prefix).

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
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

T_IMPORT = time.time()

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "charlm"))
from data import WindowSampler, load_corpus  # noqa: E402
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
    sampler = WindowSampler(train_data, block_size=64, batch_size=16, rank=info.rank, world_size=info.world_size,
                            seed=0)
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

    for step in range(restored.step + 1 if restored else 0, a.steps):
        x, y = sampler.next_batch()
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if ballast is not None:
            with torch.no_grad():
                ballast.b0[step % ballast.b0.numel()] += 1.0  # the state changes every step
        train.report(step, loss=loss)
        ckpt.save(step, state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
