"""The torchrun side of ``recovery.py``: the char LM with plain DDP, ``torch.save`` + fsync
every K steps from rank 0, ``torch.load`` on start.

    torchrun --standalone --nnodes 1 --nproc-per-node 2 --max-restarts N \\
        benchmarks/_recovery_torchrun_train.py --steps S --ckpt-every K --ckpt-dir D --out-dir O

Same model, data, optimizer, LR schedule, seeds and evaluation schedule as
``examples/charlm/train.py`` (what the dlrover-core side runs), written the way a torchrun
user writes it: rank 0 saves ``{model, optimizer, scheduler, step}`` with ``torch.save``
to a staging name, fsyncs, renames, fsyncs the directory and then updates ``latest`` the same
way; every rank loads ``latest`` with ``torch.load`` when it starts.

Data order (:func:`batch_ids`): the same as ``train.ElasticSampler`` at a world of 2 — every
non-overlapping window of the corpus once per epoch, a permutation seeded ``seed + epoch``,
``world_size x batch_size`` windows a step job-wide, rank ``r`` taking every ``world_size``-th
from ``r`` — computed from the step number, so the step is the whole data position (nothing
else to checkpoint). ``_recovery_torchft_train.py`` imports it, :func:`lr_factor` and the save
helpers from here, so all three sides see the same batches.

Gloo restart trap (torch 2.13, see the project's environment notes): a restarted worker that
re-uses torchrun's store without a per-attempt prefix can read the dead workers' addresses and
hang in ``connectFullMesh`` or fail with "Connection refused". ``--store prefix`` (default)
joins through ``PrefixStore(f"attempt_{TORCHELASTIC_RESTART_COUNT}", store)``; ``--store
plain`` uses ``init_method="env://"`` as most scripts do (to show the trap).

Every rank appends JSON lines to ``<out-dir>/rank<r>.jsonl`` (``t``: ``time.time()``):

* ``launch``: ``restart``, ``pid`` (first thing the script does);
* ``start``: ``restart``, ``pid``, ``t_proc`` (first line of this file), ``t_import`` (torch
  imported), ``t_init`` (process group ready);
* ``restore``: ``step`` loaded, ``load_s``, ``t``; ``fresh`` when there was nothing to load;
* ``step``: ``step``, ``dt``, ``t``, ``restart``, ``loss``; ``val_loss`` at a validation step;
* ``save`` (rank 0): ``step``, ``stall_s``, ``t``.

``dt`` is measured like dlrover-core's ``train.report``: from the end of the previous step, save
or restore (whichever is newest) to the end of this step, so save and restore time are not
step time. ``<out-dir>/pid_rank<r>.json`` names the current process of each rank (for the
fault injector).
"""

import time

T_PROC = time.time()  # before the slow imports: part of a restart

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def add_training_args(p: argparse.ArgumentParser) -> None:
    """The char LM's training settings, the same for every side of the benchmark."""
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-bytes", type=int, default=4_000_000)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--ckpt-every", type=int, default=25, help="save when step %% K == 0 (and at the end)")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out-dir", required=True)


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_args(p)
    p.add_argument("--store", choices=("prefix", "plain"), default="prefix")
    p.add_argument("--pg-timeout-s", type=float, default=300.0,
                   help="process-group (collective) timeout; 0: torch's default (30 minutes for gloo)")
    p.add_argument("--connect-timeout-s", type=float, default=60.0, help="timeout to reach torchrun's store")
    return p.parse_args(argv)


class _Log:
    def __init__(self, path: Path) -> None:
        self._f = open(path, "a", buffering=1)

    def write(self, **record) -> None:
        self._f.write(json.dumps(record) + "\n")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=2)
def _permutation(n: int, seed: int) -> list:
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def batch_ids(step: int, rank: int, world_size: int, *, n: int, batch_size: int, seed: int) -> list:
    """Window indices of ``rank`` at ``step``: what ``train.ElasticSampler(n, batch_size,
    seed=seed)`` gives it at that step at a constant ``world_size`` (an epoch is
    ``ceil(n / (world_size * batch_size))`` steps; its last step may be short)."""
    per_step = world_size * batch_size
    steps_per_epoch = -(-n // per_step)
    epoch, index = divmod(step, steps_per_epoch)
    window = _permutation(n, seed + epoch)[index * per_step : (index + 1) * per_step]
    return window[rank::world_size]


def lr_factor(step: int, *, steps: int, warmup_steps: int) -> float:
    """``examples/charlm/train.py``'s schedule: linear warmup, then cosine decay to 10%."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def save_checkpoint(ckpt_dir: Path, step: int, state: dict) -> None:
    """``torch.save`` to a staging name, fsync, rename, fsync the directory, then point
    ``latest`` at it the same way; keep the last two (as the dlrover-core side)."""
    import torch

    path = ckpt_dir / f"step_{step:08d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(ckpt_dir)
    _write_atomic(ckpt_dir / "latest", str(step).encode())
    _fsync_dir(ckpt_dir)
    for old in sorted(ckpt_dir.glob("step_*.pt"))[:-2]:
        old.unlink(missing_ok=True)


def load_checkpoint(ckpt_dir: Path):
    """``(step, state)`` of ``latest``, or ``None``."""
    import torch

    latest = ckpt_dir / "latest"
    if not latest.exists():
        return None
    step = int(latest.read_text())
    return step, torch.load(ckpt_dir / f"step_{step:08d}.pt", map_location="cpu", weights_only=True)


def main(argv=None) -> int:
    args = _parse(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / f"pid_rank{RANK}.json",
                  json.dumps({"pid": os.getpid(), "restart": RESTART, "t": T_PROC}).encode())
    log = _Log(out / f"rank{RANK}.jsonl")
    log.write(type="launch", restart=RESTART, pid=os.getpid(), t=T_PROC)

    import torch
    import torch.distributed as dist

    t_import = time.time()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "charlm"))
    from data import load_corpus, n_windows, val_batches, windows
    from model import CharLM, loss_fn

    world = int(os.environ.get("WORLD_SIZE", "1"))
    kwargs = {"timeout": datetime.timedelta(seconds=args.pg_timeout_s)} if args.pg_timeout_s > 0 else {}
    if args.store == "prefix":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=args.connect_timeout_s), use_libuv=True)
        store = dist.PrefixStore(f"attempt_{RESTART}", store)
        dist.init_process_group("gloo", store=store, rank=RANK, world_size=world, **kwargs)
    else:
        dist.init_process_group("gloo", init_method="env://", rank=RANK, world_size=world, **kwargs)
    log.write(type="start", restart=RESTART, pid=os.getpid(), t_proc=T_PROC, t_import=t_import, t_init=time.time())

    train_data, val_data = load_corpus(None, args.max_bytes)
    torch.manual_seed(args.seed)
    model = torch.nn.parallel.DistributedDataParallel(CharLM(block_size=args.block_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_factor, steps=args.steps, warmup_steps=args.warmup_steps))
    n = n_windows(train_data, args.block_size)
    val = val_batches(val_data, block_size=args.block_size, batch_size=args.batch_size, n_batches=args.eval_batches)
    torch.manual_seed(args.seed + 1 + RANK)

    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    start = 0
    t0 = time.monotonic()
    loaded = load_checkpoint(ckpt_dir)
    if loaded is not None:
        step, saved = loaded
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        start = step + 1
        log.write(type="restore", step=step, load_s=round(time.monotonic() - t0, 6), t=time.time(), restart=RESTART)
    else:
        log.write(type="fresh", t=time.time(), restart=RESTART)

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        for x, y in val[RANK::world]:
            total[0] += loss_fn(model(x), y).item()
            total[1] += 1
        dist.all_reduce(total)
        model.train()
        return float(total[0] / total[1])

    mark = time.monotonic()
    if start == 0:
        evaluate()  # train.py validates once at a fresh start (inside step 0's time, as there)
    for step in range(start, args.steps):
        x, y = windows(train_data, batch_ids(step, RANK, world, n=n, batch_size=args.batch_size, seed=args.seed),
                       args.block_size)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        loss_value = loss.item()
        last = step == args.steps - 1
        val_loss = evaluate() if (step + 1) % args.eval_every == 0 or last else None
        now = time.monotonic()
        log.write(type="step", step=step, dt=round(now - mark, 6), t=time.time(), restart=RESTART,
                  loss=round(loss_value, 4), **({"val_loss": round(val_loss, 5)} if val_loss is not None else {}))
        mark = now
        if RANK == 0 and (step % args.ckpt_every == 0 or last):
            save_checkpoint(ckpt_dir, step, {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                             "scheduler": scheduler.state_dict(), "step": step})
            now = time.monotonic()
            log.write(type="save", step=step, stall_s=round(now - mark, 6), t=time.time())
            mark = now
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
