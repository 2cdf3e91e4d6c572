"""``python -m dlrover_core.agent.node_check``: one node's part of a node check.

Started by the agent with the torch environment of its check group (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) plus ``DLROVER_CHECK_PREFIX`` (the group's
namespace in the check round's store) and ``DLROVER_ACCELERATOR``. It joins the group, runs
the accelerator's ``node_check()`` (matmul and, in a group of two or more, all-reduce) and
prints one JSON line: a :class:`~dlrover_core.protocol.messages.NodeCheckResult`
(``local_ok``: this node's own part — the matmul — passed, whatever its partners did).

``DLROVER_NODE_CHECK_FAULT=1`` (or ``DLROVER_NODE_CHECK_FAULT_NODE=<node id>``, matching
``DLROVER_NODE_ID``) makes the check fail as a broken device would — for tests and drills,
like DLRover's ``MOCK_ERR_RANK``; ``DLROVER_NODE_CHECK_DELAY_S`` slows it down.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time

from dlrover_core.plugins import get_host
from dlrover_core.protocol.codec import encode
from dlrover_core.protocol.messages import NodeCheckResult


def main() -> int:
    t0 = time.perf_counter()
    local_ok = False
    try:
        import torch.distributed as dist  # heavy; inside the try: a broken torch install fails the check

        accelerator = get_host().create_accelerator(os.environ.get("DLROVER_ACCELERATOR", "auto"))
        world = int(os.environ["WORLD_SIZE"])
        group = None
        if world > 1:  # join the group first: a node failing its own part then fails its partners fast
            store = dist.PrefixStore(os.environ["DLROVER_CHECK_PREFIX"], dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                timeout=datetime.timedelta(seconds=60)))
            dist.init_process_group(accelerator.dist_backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=world, timeout=datetime.timedelta(seconds=60))
            group = dist.group.WORLD
        faulty_node = os.environ.get("DLROVER_NODE_CHECK_FAULT_NODE")
        if os.environ.get("DLROVER_NODE_CHECK_FAULT") == "1" or (
                faulty_node is not None and faulty_node == os.environ.get("DLROVER_NODE_ID")):
            raise RuntimeError("device check failed (DLROVER_NODE_CHECK_FAULT)")
        accelerator.node_check(group=None)  # this node alone: a failure here is its own
        local_ok = True
        delay = float(os.environ.get("DLROVER_NODE_CHECK_DELAY_S", "0") or 0)
        if delay:
            time.sleep(delay)
        result = accelerator.node_check(group=group)
        if group is not None:
            dist.destroy_process_group()
        out = NodeCheckResult(ok=True, local_ok=True, elapsed_s=time.perf_counter() - t0,
                              matmul_tflops=result.matmul_tflops, allreduce_gbps=result.allreduce_gbps)
    except Exception as exc:
        out = NodeCheckResult(ok=False, local_ok=local_ok, elapsed_s=time.perf_counter() - t0,
                              error=f"{type(exc).__name__}: {exc}")
    print(json.dumps(encode(out)), flush=True)
    gc.freeze()  # the result is out: skip the collector's passes over torch at exit (about a second)
    return 0 if out.ok else 1


if __name__ == "__main__":
    sys.exit(main())
