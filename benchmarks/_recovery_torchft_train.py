"""The TorchFT side of ``recovery.py``: the char LM, DDP across replica groups with torchft.

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT python benchmarks/_recovery_torchft_train.py \\
        --replica-group G --num-replica-groups 2 --store-port P --steps S --ckpt-every K \\
        --ckpt-dir D --out-dir O

One process per replica group (TorchFT's "DDP across replica groups" with groups of one, as
in its ``train_ddp.py``), started (and restarted when it dies) by ``recovery.py``'s
supervisor, which also hosts each group's ``TCPStore`` (torchrun's agent does that under
TorchFT's own launcher) and the lighthouse. The configuration is torchft's documented one for
CPU (``train_ddp.py``, README): ``ProcessGroupGloo(timeout=5 s)``, ``PGTransport`` (the
live state goes to a recovering replica over the process group, 10 s timeout),
``Manager(min_replica_size=1, timeout=30 s)``, the default asynchronous quorum, torchft's
``DistributedDataParallel`` and ``Optimizer`` wrappers. ``init_sync=False`` because every
group builds the model from the same seed (the Manager's docstring recommends it then).

Same model, data order, optimizer, LR schedule, validation and checkpoint interval as the
other sides (helpers imported from ``_recovery_torchrun_train.py``). Data: replica group
``g`` trains at step ``s`` on the batch rank ``g`` of a 2-process DDP job gets at step ``s``
(the step is the data position, so a recovering group needs nothing but the step). While a
group is down its half of each step's batch is skipped — TorchFT's ``DistributedSampler`` is
"inherently lossy" the same way — and the survivor's gradient is the step's update (the
Manager averages over the participants). LR: set after each committed step for the next
one, so the optimizer state a recovering group receives carries the right one.

Checkpoints: the group of participating rank 0 saves ``{model, optimizer, torchft}`` (the
Manager's state, as its docstring asks) with ``torch.save`` + fsync every K steps; a starting
group loads ``latest`` first, then the quorum heals it from a live peer if one is ahead.

Every group appends JSON lines to ``<out-dir>/rank<g>.jsonl`` (``t``: ``time.time()``):

* ``launch``: ``restart``, ``pid``; ``start``: ``t_proc``, ``t_import`` (torch and torchft
  imported), ``t_init`` (Manager up);
* ``restore``: ``step`` loaded from disk, ``load_s``; ``fresh`` when there was nothing;
* ``step``: ``step`` (the Manager's step the update was for), ``committed``, ``dt``
  (productive: from the end of the previous step, save or restore, minus the time the main
  thread waited for the quorum — joining, re-forming, healing), ``blocked_s`` (that wait),
  ``participants``, ``replica_rank``, ``healed`` (this group received the live state in this
  step), ``t``, ``restart``, ``loss``; ``val_loss`` at a validation step;
* ``save``: ``step``, ``stall_s``; ``error``: an exception the Manager reported.

``<out-dir>/pid_rank<g>.json`` names the current process of each group (for the fault injector).
"""

import time

T_PROC = time.time()  # before the slow imports: part of a restart

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples" / "charlm"))

from _recovery_torchrun_train import (  # noqa: E402
    _Log,
    _write_atomic,
    add_training_args,
    batch_ids,
    load_checkpoint,
    lr_factor,
    save_checkpoint,
)

RESTART = int(os.environ.get("RECOVERY_RESTART", "0"))


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replica-group", type=int, required=True)
    p.add_argument("--num-replica-groups", type=int, default=2)
    p.add_argument("--store-port", type=int, required=True, help="this group's TCPStore (hosted by the supervisor)")
    p.add_argument("--lighthouse", default=None, help="default: $TORCHFT_LIGHTHOUSE")
    add_training_args(p)
    p.add_argument("--pg-timeout-s", type=float, default=5.0, help="ProcessGroupGloo timeout (train_ddp.py: 5 s)")
    p.add_argument("--transport-timeout-s", type=float, default=10.0, help="PGTransport timeout (train_ddp.py: 10 s)")
    p.add_argument("--manager-timeout-s", type=float, default=30.0, help="Manager timeout (train_ddp.py: 30 s)")
    p.add_argument("--quorum-timeout-s", type=float, default=60.0, help="Manager quorum_timeout (default 60 s)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    g, groups = args.replica_group, args.num_replica_groups
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / f"pid_rank{g}.json", json.dumps({"pid": os.getpid(), "restart": RESTART, "t": T_PROC}).encode())
    log = _Log(out / f"rank{g}.jsonl")
    log.write(type="launch", restart=RESTART, pid=os.getpid(), t=T_PROC)

    import torch
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    class FaultTolerantDDP(DistributedDataParallel):
        """torchft's DDP wrapper with its gradient hook fixed for gloo on CPU (torchft 0.2.0).

        When a peer dies, gloo's ``work.wait()`` raises at once; torchft's ``_ManagedWork``
        catches it and reports the error (the step will not commit, as designed), but its
        future is never set and the hook's ``assert fut._fut`` kills the survivor (and on
        later buckets, ``_DummyWork``'s plain future has no ``_fut``). Here the hook returns
        the bucket unchanged instead: the Manager already knows the step failed.
        """

        @staticmethod
        def _comm_hook(state, bucket):
            work = state.allreduce(bucket.buffer())
            work.wait()
            fut = work.get_future()
            inner = getattr(fut, "_fut", fut)
            if inner is None:
                inner = torch.futures.Future()
                inner.set_result(bucket.buffer())
            return inner

    t_import = time.time()
    from data import load_corpus, n_windows, val_batches, windows
    from model import CharLM, loss_fn

    train_data, val_data = load_corpus(None, args.max_bytes)
    n = n_windows(train_data, args.block_size)
    val = val_batches(val_data, block_size=args.block_size, batch_size=args.batch_size, n_batches=args.eval_batches)
    torch.manual_seed(args.seed)
    net = CharLM(block_size=args.block_size)

    model: torch.nn.Module | None = None
    optimizer: Optimizer | None = None

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s))
    transport = PGTransport(pg, timeout=timedelta(seconds=args.transport_timeout_s), device=torch.device("cpu"))
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"recovery_{g}", timeout=timedelta(seconds=args.manager_timeout_s),
        quorum_timeout=timedelta(seconds=args.quorum_timeout_s), checkpoint_transport=transport, init_sync=False,
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=args.store_port,
        lighthouse_addr=args.lighthouse or os.environ["TORCHFT_LIGHTHOUSE"],
    )
    blocked = [0.0]
    wait_quorum = manager.wait_quorum

    def timed_wait_quorum() -> None:  # the main thread's waits for the quorum (re-forming, healing)
        t = time.monotonic()
        try:
            wait_quorum()
        finally:
            blocked[0] += time.monotonic() - t

    manager.wait_quorum = timed_wait_quorum
    model = FaultTolerantDDP(manager, net)
    optimizer = Optimizer(manager, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01))
    log.write(type="start", restart=RESTART, pid=os.getpid(), t_proc=T_PROC, t_import=t_import, t_init=time.time())

    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    loaded = load_checkpoint(ckpt_dir)
    if loaded is not None:
        step, saved = loaded
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        manager.load_state_dict(saved["torchft"])
        log.write(type="restore", step=step, load_s=round(time.monotonic() - t0, 6), t=time.time(), restart=RESTART)
    else:
        log.write(type="fresh", t=time.time(), restart=RESTART)

    def set_lr() -> None:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(manager.current_step(), steps=args.steps, warmup_steps=args.warmup_steps)

    @torch.no_grad()
    def evaluate() -> float:  # the replicas hold the same model: each validates on its own
        model.eval()
        losses = [loss_fn(model(x), y).item() for x, y in val]
        model.train()
        return sum(losses) / len(losses)

    set_lr()
    torch.manual_seed(args.seed + 1 + g)  # dropout masks differ per group
    mark = time.monotonic()
    while manager.current_step() < args.steps:
        t_start = time.time()
        blocked[0] = 0.0
        step_at_start = manager.current_step()
        optimizer.zero_grad()  # starts the quorum (asynchronously)
        x, y = windows(train_data, batch_ids(step_at_start, g, groups, n=n, batch_size=args.batch_size, seed=args.seed),
                       args.block_size)
        loss = loss_fn(model(x), y)
        loss.backward()  # the all-reduce waits for the quorum
        participants = manager.num_participants()  # waits for it too (when the all-reduce was skipped)
        healing = manager._healing
        step = manager.current_step()  # a healed group jumped to its peers' step
        replica_rank = manager.participating_rank()
        optimizer.step()  # commits, or discards the step (a peer failed)
        committed = manager.current_step() == step + 1
        if manager.errored() is not None:
            log.write(type="error", step=step, error=str(manager.errored().original_exception)[:300], t=time.time())
        val_loss = None
        if committed:
            set_lr()
            last = step == args.steps - 1
            if (step + 1) % args.eval_every == 0 or last:
                val_loss = evaluate()
        now = time.monotonic()
        log.write(type="step", step=step, committed=committed, dt=round(now - mark - blocked[0], 6),
                  blocked_s=round(blocked[0], 6), participants=participants, replica_rank=replica_rank,
                  healed=bool(healing), t_start=t_start, t=time.time(), restart=RESTART, loss=round(loss.item(), 4),
                  **({"val_loss": round(val_loss, 5)} if val_loss is not None else {}))
        mark = now
        if committed and replica_rank == 0 and (step % args.ckpt_every == 0 or step == args.steps - 1):
            save_checkpoint(ckpt_dir, step, {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                             "torchft": manager.state_dict(), "step": step})
            now = time.monotonic()
            log.write(type="save", step=step, stall_s=round(now - mark, 6), t=time.time())
            mark = now
    log.write(type="done", step=manager.current_step(), t=time.time(), restart=RESTART)
    manager.shutdown(wait=False)
    sys.stdout.flush()
    os._exit(0)  # torchft's threads (quorum, transport) must not hold the exit up


if __name__ == "__main__":
    sys.exit(main())
