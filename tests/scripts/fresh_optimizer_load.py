"""One rank of a 2-rank gloo world (env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): an
FSDP2 model and AdamW (two parameter groups) train 3 steps; their state, as a memory
snapshot holds it (local shards), is loaded into a fresh model and optimizer twice, once by
``restore_tree`` (its fast path for an optimizer without state) and once by torch's
``set_state_dict`` (the way it took before); both then train 2 more steps with the original.
Writes ``<out>/rank<r>.json``: whether the fast path was taken, and whether parameters and
optimizer state are bitwise equal to the original's, and the types of the state's values."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dlrover_core.checkpoint.state_format import flatten
from dlrover_core.train import ModelOptimizerState
from dlrover_core.train import restore as restore_mod


def build():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 4))
    for layer in (net[0], net[2], net[4]):
        fully_shard(layer)
    fully_shard(net)
    decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in net.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=0.01)
    return net, opt


def train(net, opt, steps, rank):
    for s in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * s + rank))
        opt.zero_grad(set_to_none=True)
        net(x).pow(2).mean().backward()
        opt.step()


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def leaves(state):
    _, flat = flatten({"s": state})
    return {k: local(v) for k, v in sorted(flat.items())}


def equal(a, b):
    la, lb = leaves(a), leaves(b)
    return la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)


def types(opt):
    return sorted({f"{k}:{type(v).__name__}" for s in opt.state.values() for k, v in s.items()})


def main() -> int:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net, opt = build()
    train(net, opt, range(3), rank)
    saved = ModelOptimizerState(net, opt).state_dict()
    tree, tensors = flatten({"state": {"train": saved}})
    snapshot = {k: local(v).clone() for k, v in tensors.items()}  # a snapshot holds local shards

    fast_net, fast_opt = build()
    taken = []
    original = restore_mod._load_fresh_optimizer
    restore_mod._load_fresh_optimizer = lambda t, v: taken.append(r := original(t, v)) or r
    restore_mod.restore_tree(tree, dict(snapshot), {"train": ModelOptimizerState(fast_net, fast_opt)}, copy=True)
    restore_mod._load_fresh_optimizer = original
    snapshot_after = {k: v.clone() for k, v in snapshot.items()}
    for v in snapshot.values():  # the snapshot's memory is reused by later saves: nothing may alias it
        v.fill_(7.0)

    ref_net, ref_opt = build()
    ref = ModelOptimizerState(ref_net, ref_opt)
    value = restore_mod.unflatten(tree, snapshot_after)["state"]["train"]
    ref.load_state_dict(restore_mod._as_dtensors(value, ref.state_dict()))

    loaded_equal = equal(ModelOptimizerState(fast_net, fast_opt).state_dict(), ref.state_dict())
    for n, o in ((net, opt), (fast_net, fast_opt), (ref_net, ref_opt)):
        train(n, o, range(3, 5), rank)
    result = {"fast_path": bool(taken and taken[0] is not None), "loaded_equal": loaded_equal,
              "trained_equal_fast": equal(ModelOptimizerState(fast_net, fast_opt).state_dict(),
                                          ModelOptimizerState(net, opt).state_dict()),
              "trained_equal_ref": equal(ModelOptimizerState(ref_net, ref_opt).state_dict(),
                                         ModelOptimizerState(net, opt).state_dict()),
              "types_fast": types(fast_opt), "types_ref": types(ref_opt),
              "groups_fast": [{k: v for k, v in g.items() if k != "params"} for g in fast_opt.param_groups],
              "groups_ref": [{k: v for k, v in g.items() if k != "params"} for g in ref_opt.param_groups]}
    (out / f"rank{rank}.json").write_text(json.dumps(result, default=str))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
