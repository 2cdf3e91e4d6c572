"""The torchrun side of ``benchmarks/sharded_recovery.py``: the same FSDP2 model, data,
optimizer and steps as ``tests/scripts/sharded_live_train.py``, written as a torchrun user
writes it (``init_process_group`` from the environment, ``fully_shard`` on a 1-D mesh),
joining through a per-attempt ``PrefixStore`` on torchrun's store (against the gloo restart
trap), checkpointed with ``torch.distributed.checkpoint`` every ``--ckpt-every`` steps at its
fastest documented setting — ``dcp.async_save`` of ``get_state_dict`` with a background
*process* (``AsyncCheckpointerType.PROCESS``) and the ``DefaultStager`` staging
asynchronously into shared memory (pinned memory where CUDA is): the step waits only for
the staging copy, before its optimizer step changes the state; one save in flight at a
time; on start the newest step whose ``.metadata`` DCP wrote (a whole save) is loaded
(torch's "Asynchronous Saving with Distributed Checkpoint" recipe; torchtitan's
``async_with_pinned_mem``).
``--sync-save``: plain ``dcp.save`` instead. A restart (``torchrun
--max-restarts``) restarts every worker, which loads the newest checkpoint.

Every applied step appends ``{"pid", "rank", "world_size", "step", "t"}`` to
``--out/steps_<pid>.jsonl``; rank 0 writes the full state's sha256 to ``--out/final.json``.
"""

import argparse
import datetime
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


def full_digest(tree) -> str:
    h = hashlib.sha256()

    def walk(node, path):
        if isinstance(node, dict):
            for k in sorted(node, key=str):
                walk(node[k], f"{path}/{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")
        elif isinstance(node, torch.Tensor):
            full = node.full_tensor() if isinstance(node, DTensor) else node
            h.update(path.encode())
            h.update(full.detach().contiguous().numpy().tobytes())

    walk(tree, "")
    return h.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sync-save", action="store_true")
    # (a "thread" save needs its own process group: its collectives would interleave with FSDP's)
    p.add_argument("--async-type", choices=("process", "thread"), default="process")
    a = p.parse_args()
    out, ckdir = Path(a.out), Path(a.ckpt_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckdir.mkdir(parents=True, exist_ok=True)
    # a store prefix per restart attempt: torchrun's store outlives the workers, and a restarted
    # gloo group that reads the dead attempt's keys can hang (the gloo restart trap, see
    # _recovery_torchrun_train.py); this is the peer's best configuration
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=60), use_libuv=True)
    store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, a.width), torch.nn.ReLU(), torch.nn.Linear(a.width, a.width),
                                torch.nn.ReLU(), torch.nn.Linear(a.width, 4))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    start = 0
    # the newest whole checkpoint: DCP writes a save's ``.metadata`` last (torchtitan's rule)
    saved = [int(d.name.removeprefix("step_")) for d in ckdir.glob("step_*") if (d / ".metadata").exists()]
    if saved:
        step = max(saved)
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(ckdir / f"step_{step}"))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        start = step + 1
    log = open(out / f"steps_{os.getpid()}.jsonl", "a", buffering=1)
    cuda = torch.cuda.is_available()
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True,
                                          use_non_blocking_copy=cuda))
    save_group = dist.new_group(backend="gloo") if a.async_type == "thread" else None
    staging = None  # the newest save's staging copy (the state may change once it is done)
    pending = None  # the upload future of the save in flight

    for step in range(start, a.steps):
        t0 = time.time()
        gen = torch.Generator().manual_seed(1000 + 10 * step + rank)
        x = torch.randn(4, 8, generator=gen)
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        time.sleep(a.step_sleep)
        if staging is not None:
            staging.result()
            staging = None
        opt.step()
        log.write(json.dumps({"pid": os.getpid(), "rank": rank, "world_size": world, "step": step,
                              "t0": t0, "t": time.time()}) + "\n")
        if (step + 1) % a.ckpt_every == 0 or step == a.steps - 1:
            msd, osd = get_state_dict(model, opt)
            if a.sync_save:
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckdir / f"step_{step}"))
                continue
            if pending is not None:  # one save in flight at a time, as torchtitan
                pending.result()
            response = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(ckdir / f"step_{step}"),
                                      async_checkpointer_type=AsyncCheckpointerType(a.async_type), async_stager=stager,
                                      process_group=save_group)
            if isinstance(response, AsyncSaveResponse):
                staging, upload = response.staging_completion, response.upload_completion
            else:
                upload = response
            pending = upload
    if pending is not None:
        pending.result()
    stager.close()
    msd, osd = get_state_dict(model, opt)
    digest = full_digest({"model": msd, "optim": osd})
    if rank == 0:
        (out / "final.json").write_text(json.dumps({"digest": digest}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
