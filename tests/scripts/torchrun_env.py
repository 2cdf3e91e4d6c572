"""Writes the environment a launcher gave this worker, for tests/test_torchrun_compat.py.

Usage: torchrun_env.py OUT_DIR [--init] [--fail-first] [ARG...]. Writes
OUT_DIR/rank_<RANK>_attempt_<TORCHELASTIC_RESTART_COUNT>.json: the torch elastic
variables (and every ROLE_*, MASTER_*, GROUP_*, TORCHELASTIC_* one), sys.argv, whether it
ran as __main__, the working directory; prints "worker-out local_rank=<N>" to stdout and
"worker-err local_rank=<N>" to stderr (console filtering). With --init, a gloo
init_process_group and an all_reduce (their sum goes in the file); with --fail-first, rank 1
exits 1 on attempt 0, once rank 0 has written its file.
Runs as a script, as ``python -m`` (copied into the working directory), or as an executable.
"""

import json
import os
import sys
import time

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
         "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
         "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS",
         "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_VISIBLE_DEVICES")
PREFIXES = ("ROLE_", "MASTER_", "GROUP_", "TORCHELASTIC_")


def main() -> None:
    out_dir = sys.argv[1]
    seen = {n: os.environ.get(n) for n in NAMES}
    seen.update({k: v for k, v in os.environ.items() if k.startswith(PREFIXES)})
    record = {"env": seen, "argv": sys.argv, "as_main": __name__ == "__main__", "cwd": os.getcwd()}
    local_rank = os.environ.get("LOCAL_RANK")
    print(f"worker-out local_rank={local_rank}", flush=True)
    print(f"worker-err local_rank={local_rank}", file=sys.stderr, flush=True)
    if "--init" in sys.argv:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        x = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(x)
        record["sum"] = x.item()
        dist.barrier()
        dist.destroy_process_group()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    path = os.path.join(out_dir, f"rank_{os.environ.get('RANK')}_attempt_{attempt}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
    if "--fail-first" in sys.argv and attempt == "0" and os.environ.get("RANK") == "1":
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(out_dir, "rank_0_attempt_0.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(1)


main()
