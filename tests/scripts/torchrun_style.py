"""A plain torch.distributed script with no dlrover imports, as written for torchrun.

Initialises with env:// (MASTER_ADDR/MASTER_PORT), all-reduces, writes the torch elastic
environment it saw to OUT_DIR/rank_<RANK>_attempt_<TORCHELASTIC_RESTART_COUNT>.json; with
--fail-first, rank 1 exits 1 on the first attempt after the collective.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

NAMES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
         "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
         "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS"]

p = argparse.ArgumentParser()
p.add_argument("out_dir")
p.add_argument("--fail-first", action="store_true")
a = p.parse_args()
dist.init_process_group("gloo")
x = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(x)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(a.out_dir, f"rank_{dist.get_rank()}_attempt_{attempt}.json"), "w") as f:
    json.dump({"env": {n: os.environ.get(n) for n in NAMES}, "sum": x.item()}, f)
if a.fail_first and attempt == "0" and dist.get_rank() == 1:
    sys.exit(1)
dist.barrier()
dist.destroy_process_group()
