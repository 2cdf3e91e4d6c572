"""Reconfigurable process groups (``dlrover_core.train.reconfigurable``) with real gloo in
real processes: groups made by ``torch.distributed`` itself through the registered backend
(the default group, a ``new_group`` sub-group, a 2-D ``DeviceMesh``'s dimension groups, a
DDP model and an FSDP2 model on them) keep working after their connections are aborted and
reconnected for a new generation — the same Python objects, in place. A rank that dies is
replaced by a new process that joins the running generation, and the collectives of every
group give the right answers again."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent("""
    import json, os, sys, datetime
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from dlrover_core.train import reconfigurable

    rank, port, gen, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    if gen == 1:  # the replacement is up (as the master forms a generation only once it asked)
        store.set("joiner_ready", "1")
    reconfigurable.register("gloo", at_generation=gen)
    dist.init_process_group(reconfigurable.BACKEND, store=store, rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=20))
    sub = dist.new_group([0, 1, 2, 3])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2), init_sync=gen == 0)  # (a joiner: no first broadcast)
    fsdp = fully_shard(torch.nn.Linear(4, 8), mesh=mesh["data"])

    def check(tag):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        s = torch.tensor([1.0])
        dist.all_reduce(s, group=sub)
        d = torch.tensor([float(rank)])
        dist.all_reduce(d, group=mesh.get_group("data"))
        x = torch.full((2, 4), float(rank))
        ddp(x).sum().backward()
        fsdp(x).sum().backward()
        full = fsdp.weight.full_tensor()
        return {"tag": tag, "world": t.item(), "sub": s.item(), "data": d.item(),
                "ddp_grad": ddp.module.weight.grad.sum().item(), "fsdp_full": list(full.shape),
                "groups": len(reconfigurable.groups()), "generation": reconfigurable.generation()}

    results = [check("first")]
    if gen == 0 and rank == 3:
        os._exit(9)  # dies; a replacement joins generation 1 in its place
    if gen == 0:
        try:
            dist.all_reduce(torch.tensor([1.0]))  # rank 3 is gone: fails
            results.append({"tag": "no error"})
        except Exception as exc:
            results.append({"tag": "error", "error": type(exc).__name__})
        reconfigurable.abort()
        store.wait(["joiner_ready"], datetime.timedelta(seconds=80))
        reconfigurable.reconfigure(1)
        ddp.module.weight.grad = None
        # a fresh reducer, as the replacement's (DDP's first iterations rebuild buckets together)
        ddp = torch.nn.parallel.DistributedDataParallel(ddp.module, init_sync=False)
        results.append(check("after"))
    with open(out, "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.timeout(120)
def test_every_group_reconnects_in_place_and_a_replacement_joins(tmp_path):
    import torch.distributed as dist

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": ":".join(sys.path)}

    def start(rank: int, gen: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(rank), str(store.port), str(gen),
                                 str(tmp_path / f"r{rank}g{gen}.json")], env=env)

    procs = [start(r, 0) for r in range(4)]
    assert procs[3].wait(timeout=90) == 9
    joiner = start(3, 1)
    codes = [p.wait(timeout=90) for p in (*procs[:3], joiner)]
    assert codes == [0, 0, 0, 0]
    survivors = [json.loads((tmp_path / f"r{r}g0.json").read_text()) for r in range(3)]
    replacement = json.loads((tmp_path / "r3g1.json").read_text())
    for r, (first, error, after) in enumerate(survivors):
        assert first["world"] == after["world"] == 10.0  # 1 + 2 + 3 + 4
        assert first["sub"] == after["sub"] == 4.0
        assert first["data"] == after["data"] == {0: 2.0, 1: 4.0, 2: 2.0, 3: 4.0}[r]  # the mesh's data groups
        assert first["ddp_grad"] == after["ddp_grad"] and first["fsdp_full"] == after["fsdp_full"] == [8, 4]
        assert error == {"tag": "error", "error": error["error"]}
        assert after["generation"] == 1 and after["groups"] == first["groups"] >= 4
    (joined,) = replacement
    assert {k: joined[k] for k in ("world", "sub", "data", "fsdp_full", "generation")} == {
        "world": 10.0, "sub": 4.0, "data": 4.0, "fsdp_full": [8, 4], "generation": 1}
