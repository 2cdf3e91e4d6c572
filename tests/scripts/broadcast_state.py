"""One rank of a 2-rank gloo world that sends (rank 0) or receives (rank 1) a live state with
``dlrover_core.train.live._broadcast_state``, as a re-formed world does for a replacement.

Args: STORE_PORT RANK CASE OUT. CASE ``ok``: the state is sendable; ``unsendable``: rank 0's
entry ``probe`` holds a lambda once training began. Writes ``OUT/rank<R>.json``: what the
broadcast did (``received`` with the weights' sum, or ``error`` with the message) and how
long it took.
"""

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dlrover_core.train.live import LiveRecoveryError, _broadcast_state

port, rank, case, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
store = dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True)
dist.init_process_group("gloo", store=dist.PrefixStore("t/", store), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=20))


class Probe:
    def __init__(self) -> None:
        self.hook = None
        self.step = 0

    def state_dict(self):
        return {"step": self.step, "hook": self.hook}

    def load_state_dict(self, sd):
        self.step = sd["step"]


model = torch.nn.Linear(4, 4)
if rank == 0:
    torch.nn.init.constant_(model.weight, 2.0)
probe = Probe()
if rank == 0 and case == "unsendable":
    probe.hook = lambda: None  # what a careless state_dict() can hold
probe.step = 7 if rank == 0 else 0
t0 = time.monotonic()
try:
    _broadcast_state({"model": model, "probe": probe}, source=0, rank=rank, receive=rank == 1)
    result = {"received": True, "sum": float(model.weight.sum()), "step": probe.step}
except LiveRecoveryError as exc:
    result = {"error": str(exc)}
result["took_s"] = time.monotonic() - t0
(out / f"rank{rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
