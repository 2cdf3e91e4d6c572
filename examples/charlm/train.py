"""Worker script: train the byte-level GPT with DDP, checkpointing and progress reports.

Run it through dlrover (``examples/charlm/run.py`` or ``dlrover run``); run directly it
trains in one process. Every rank calls ``train.report`` each step (with the run's length
and the step's job-wide samples and tokens, for the console's ETA, samples/s and tokens/s)
and ``Checkpointer.save`` (which persists every ``Checkpoint.persist_every_steps``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import load_corpus, n_windows, val_batches, windows  # noqa: E402
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
    device = next(model.parameters()).device  # the collective's backend needs its device's tensors
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches[rank::world_size]:
        total[0] += loss_fn(model(x.to(device)), y.to(device)).item()
        total[1] += 1
    if dist.is_initialized():
        dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


def no_sync(model: torch.nn.Module):
    """Accumulate gradients without DDP's all-reduce (a no-op on one process)."""
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


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
    model = CharLM(block_size=args.block_size).to(info.device)  # cpu, or cuda:LOCAL_RANK with accelerator cuda
    n_params = sum(p.numel() for p in model.parameters())
    model, optimizer = train.prepare(model, lr=args.lr, weight_decay=0.01)

    def lr_factor(step: int) -> float:  # linear warmup, then cosine decay to 10%
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    # every window of the corpus once per epoch, job-wide: the global batch (world size x
    # --batch-size) stays the same when the world shrinks or grows (docs/design.md §5a)
    sampler = train.ElasticSampler(n_windows(train_data, args.block_size), args.batch_size, seed=args.seed)
    val = val_batches(val_data, block_size=args.block_size, batch_size=args.batch_size, n_batches=args.eval_batches)
    torch.manual_seed(args.seed + 1 + info.rank)  # dropout masks differ per rank

    ckpt = train.Checkpointer()
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
    restored = ckpt.load(state)
    start = restored.step + 1 if restored else 0
    first_metrics: dict[str, float] = {}
    if restored is None and not train.worker_info().is_joiner:
        first_metrics["initial_val_loss"] = evaluate(model, val, info.rank, info.world_size)
        if info.rank == 0:
            print(f"charlm: {n_params / 1e6:.2f}M parameters, {len(train_data) / 1e6:.1f} MB train / "
                  f"{len(val_data) / 1e6:.2f} MB val, world size {info.world_size}; "
                  f"initial val loss {first_metrics['initial_val_loss']:.4f}", flush=True)
    elif restored is not None and info.rank == 0:
        print(f"charlm: resumed at step {start} from a checkpoint ({restored.source})", flush=True)

    for step in train.steps(args.steps, state, start=start):
        with step:  # a peer dies: this step is discarded, the survivors re-form and go on
            ids = sampler.next_batch()
            if ids is None:  # the epoch ended: the next call starts the next one
                ids = sampler.next_batch()
            optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            chunks = [ids[i : i + args.batch_size] for i in range(0, len(ids), args.batch_size)] or [[]]
            for j, chunk in enumerate(chunks):  # micro-batches: this rank's share grows when the world shrinks
                sync = contextlib.nullcontext() if j == len(chunks) - 1 else no_sync(model)
                with sync:
                    if not chunk:  # no sample left for this rank in the epoch's last step: a zero gradient
                        loss = sum(p.sum() for p in model.parameters()) * 0.0
                        loss.backward()
                        continue
                    x, y = windows(train_data, chunk, args.block_size)
                    loss = loss_fn(model(x.to(info.device)), y.to(info.device))
                    # a global-batch mean: DDP averages over world_size ranks
                    (loss * (len(chunk) * step.world_size / sampler.global_batch_size)).backward()
                    loss_sum += loss.item() * len(chunk)
            optimizer.step()
            scheduler.step()
            metrics = {"loss": loss_sum / max(1, len(ids)), "lr": scheduler.get_last_lr()[0], **first_metrics}
            first_metrics = {}
            last = step == args.steps - 1
            if (step + 1) % args.eval_every == 0 or last:
                metrics["val_loss"] = evaluate(model, val, step.rank, step.world_size)
                if last:
                    metrics["final_val_loss"] = metrics["val_loss"]
            # samples and tokens of the whole job's step (the global batch), not of this rank
            samples = sampler.global_batch_size
            train.report(step, total_steps=args.steps, samples=samples, tokens=samples * args.block_size, **metrics)
            ckpt.save(step, state, force=last)
            if step.rank == 0 and (step % args.log_every == 0 or "val_loss" in metrics):
                extra = f" val_loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""
                print(f"step {step:5d} loss {metrics['loss']:.4f}{extra} (world size {step.world_size})", flush=True)

    if (dist.get_rank() if dist.is_initialized() else 0) == 0 and args.params_hash_file:
        Path(args.params_hash_file).write_text(params_sha256(model) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
