"""What one replica pull costs: a rank's memory snapshot moved from its node's shared memory
into a buddy's slot over HTTP (``dlrover_core.agent.replicas``), against the floor of one
plain memory copy of the same bytes, in one run.

    python benchmarks/replica_transfer.py [--mib 256] [--pulls 6] [--json PATH]

A :class:`~dlrover_core.checkpoint.memory.MemorySnapshots` of one rank holds a ``--mib`` MiB
float32 tensor; a :class:`~dlrover_core.agent.replicas.ReplicaServer` serves it and a
:class:`~dlrover_core.agent.replicas.ReplicaPuller` pulls it into a
:class:`~dlrover_core.agent.replicas.ReplicaStore` (loopback, no bandwidth budget, both in
this process: the CPU time counted is both agents' part). A new snapshot is saved before
every pull; the first two pulls (the slots' first touch) are not counted. The floor is
``bytearray.__setitem__`` of the same bytes between two warm buffers (one copy, no checksum):
``cpu_per_pull_vs_memcpy`` says how many such copies a pull costs (the frame is copied by the
kernel twice, socket in and out, and checksummed twice, CRC32 both sides).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import write_result  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--pulls", type=int, default=6)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "replica_transfer.json"))
    a = p.parse_args()
    import torch

    from dlrover_core.agent.replicas import ReplicaPuller, ReplicaServer, ReplicaStore
    from dlrover_core.checkpoint.layout import build_layout
    from dlrover_core.checkpoint.memory import MemorySnapshots
    from dlrover_core.checkpoint.shm import remove_segments

    job = f"bench-replica-{uuid.uuid4().hex[:6]}"
    n = a.mib * 2**20 // 4
    state = {"w": torch.randn(n)}
    mem = MemorySnapshots(job_id=job, node_id=0, rank=0, agent=1)
    server = ReplicaServer(job_id=job, node_id=0, agent=1, store=ReplicaStore(job_id=job, node_id=0, agent=1))
    store = ReplicaStore(job_id=job, node_id=1, agent=2)
    puller = ReplicaPuller(store, source_node=0, source_address=server.address, ranks=[0], timeout_s=60)
    cpu, wall = [], []
    try:
        for step in range(a.pulls + 2):
            mem.save(build_layout(state, step=step, rank=0, world_size=1), step=step, world_size=1, persist=False)
            c0, t0 = time.process_time(), time.perf_counter()
            if puller.pull_once() != 1:
                raise RuntimeError(f"pull {step} stored nothing (torn {puller.torn}, refused {puller.refused})")
            if step >= 2:
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - t0)
    finally:
        puller.stop()
        server.close()
        store.close()
        remove_segments(f"dlrover-{job}-")
    src, dst = bytearray(n * 4), bytearray(n * 4)
    dst[:] = src  # both warm
    copies = []
    for _ in range(3):
        t0 = time.perf_counter()
        dst[:] = src
        copies.append(time.perf_counter() - t0)
    medians = {"cpu_s_per_pull": round(statistics.median(cpu), 4), "wall_s_per_pull": round(statistics.median(wall), 4),
               "memcpy_s": round(statistics.median(copies), 4)}
    ratios = {"cpu_per_pull_vs_memcpy": round(medians["cpu_s_per_pull"] / medians["memcpy_s"], 2),
              "pull_gb_per_s": round(n * 4 / 1e9 / medians["wall_s_per_pull"], 2)}
    doc = {"benchmark": "replica_transfer", "config": {**vars(a), "cpus": os.cpu_count()},
           "medians": medians, "ratios": ratios, "runs": {"cpu_s": cpu, "wall_s": wall, "memcpy_s": copies}}
    write_result(a.json, doc)
    print(doc["medians"], doc["ratios"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
