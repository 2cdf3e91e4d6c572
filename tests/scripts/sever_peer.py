"""Two ranks on gloo for tests/test_sever_group.py: rank 1 stops itself (SIGSTOP, as a host
cut off: its connections stay open, no reset ever comes) after one all-reduce; rank 0 starts
a second all-reduce, blocked on the silent peer, and ``process_group.sever_group`` runs on a
timer thread after ``SEVER_AFTER_S``. Rank 0 prints how long the collective took to fail,
then that the round's store still answers. Args: RANK PORT SEVER_AFTER_S."""

import datetime
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from dlrover_core.train import process_group


def main() -> int:
    rank, port, sever_after_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=datetime.timedelta(seconds=30))
    before = process_group.socket_inodes()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    process_group.note_group_sockets(before)
    t = torch.ones(8)
    dist.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    timer = threading.Timer(sever_after_s, lambda: print("severed", process_group.sever_group(), flush=True))
    timer.start()
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)
        print("collective_succeeded", flush=True)
    except RuntimeError as exc:
        print(f"collective_failed_after_s {time.monotonic() - t0:.3f} {str(exc).splitlines()[0][:120]}", flush=True)
    store.set("after", "1")
    print("store_answers", store.get("after").decode(), flush=True)
    os._exit(0)  # (the group's destructor would wait on the stopped peer)


if __name__ == "__main__":
    raise SystemExit(main())
