"""Worker script: train the byte-level GPT with DDP, checkpointing and progress reports.

Run it through dlrover (``examples/charlm/run.py`` or ``dlrover run``); run directly it
trains in one process. Every rank calls ``train.report`` each step and
``Checkpointer.save`` (which persists every ``Checkpoint.persist_every_steps``).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import WindowSampler, load_corpus, val_batches  # noqa: E402
from model import CharLM, loss_fn  # noqa: E402

from dlrover_core import train  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in total")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=64, help="context length in bytes")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="a text file (default: the Python standard library's sources)")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="corpus size cap in bytes")
    p.add_argument("--eval-every", type=int, default=100, help="validate every N steps")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches (fixed)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--params-hash-file", default=None, help="rank 0 writes the sha256 of the final parameters here")
    return p.parse_args(argv)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list, rank: int, world_size: int) -> float:
    """Mean validation loss (nats/byte) over the fixed batches, split across ranks."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for x, y in batches[rank::world_size]:
        total[0] += loss_fn(model(x), y).item()
        total[1] += 1
    if dist.is_initialized():
        dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


def params_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = train.init()
    train_data, val_data = load_corpus(args.data, args.max_bytes)
    torch.manual_seed(args.seed)
    model = CharLM(block_size=args.block_size)
    n_params = sum(p.numel() for p in model.parameters())
    model, optimizer = train.prepare(model, lr=args.lr, weight_decay=0.01)

    def lr_factor(step: int) -> float:  # linear warmup, then cosine decay to 10%
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    sampler = WindowSampler(train_data, block_size=args.block_size, batch_size=args.batch_size,
                            rank=info.rank, world_size=info.world_size, seed=args.seed)
    val = val_batches(val_data, block_size=args.block_size, batch_size=args.batch_size, n_batches=args.eval_batches)
    torch.manual_seed(args.seed + 1 + info.rank)  # dropout masks differ per rank

    ckpt = train.Checkpointer()
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
    restored = ckpt.load(state)
    start = restored.step + 1 if restored else 0
    first_metrics: dict[str, float] = {}
    if restored is None:
        first_metrics["initial_val_loss"] = evaluate(model, val, info.rank, info.world_size)
        if info.rank == 0:
            print(f"charlm: {n_params / 1e6:.2f}M parameters, {len(train_data) / 1e6:.1f} MB train / "
                  f"{len(val_data) / 1e6:.2f} MB val, world size {info.world_size}; "
                  f"initial val loss {first_metrics['initial_val_loss']:.4f}", flush=True)
    elif info.rank == 0:
        print(f"charlm: resumed at step {start} from a checkpoint ({restored.source})", flush=True)

    for step in range(start, args.steps):
        x, y = sampler.next_batch()
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        metrics = {"loss": loss.item(), "lr": scheduler.get_last_lr()[0], **first_metrics}
        first_metrics = {}
        last = step == args.steps - 1
        if (step + 1) % args.eval_every == 0 or last:
            metrics["val_loss"] = evaluate(model, val, info.rank, info.world_size)
            if last:
                metrics["final_val_loss"] = metrics["val_loss"]
        train.report(step, **metrics)
        ckpt.save(step, state, force=last)
        if info.rank == 0 and (step % args.log_every == 0 or "val_loss" in metrics):
            extra = f" val_loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""
            print(f"step {step:5d} loss {metrics['loss']:.4f}{extra}", flush=True)

    if info.rank == 0 and args.params_hash_file:
        Path(args.params_hash_file).write_text(params_sha256(model) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
