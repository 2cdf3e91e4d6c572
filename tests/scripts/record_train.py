"""A plain torchrun script whose ``main`` is decorated with torch's ``@record``: rank 1 raises
``ValueError`` at step 3; rank 0, waiting for it in the all-reduce, fails then with gloo's
error (a consequence). Each writes its exception into ``TORCHELASTIC_ERROR_FILE``.
Args: STEPS (default 6)."""

import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1)
    for step in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
        if rank == 1 and step == 3:
            raise ValueError(f"boom on rank 1 at step {step}")
        dist.all_reduce(t)
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
