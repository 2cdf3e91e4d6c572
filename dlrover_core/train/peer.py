"""A sharded world's members agree on the step they resume after, and a replacement whose
own memory lacks that step takes its shard from a live replica peer (docs/design.md §5a).

Where a mesh replicates its shards (HSDP: ``fsdp`` shards over the mesh's ``data``
dimension and replicates over ``replicate``), the members of one ``replicate`` group hold
the same shard: model parameters, optimizer state, and the job-wide data position. When a
rank dies and its node's snapshot of the step the others resume after is missing (it
snapshots every few steps, or its node was lost with ``Checkpoint(replicas=0)``), the
master lets the world resume at that step anyway (``master.live.resume_step``), and here a
member of the dead rank's group that holds the state sends it to the replacement: the
state as one dlrover state file (``checkpoint.layout.encode``: the same bytes a memory
snapshot holds, RNG states included), point to point over the generation's default group.
TorchFT recovers a replica group from a live peer the same way: a healthy replica sends
its state dict to the recovering one over a process group (github.com/meta-pytorch/torchft,
``torchft/checkpointing/pg_transport.py``, ``CheckpointTransport.send_checkpoint``).

Every member, the replacement too, calls :func:`agree` once per generation (the new
groups' first collective): one ``all_gather_object`` of ``(applied step, needs state)``,
then each needing rank's transfer from the lowest rank of its group that does not need it.

torch is imported inside the functions: only a worker needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dlrover_core.logging import get_logger
from dlrover_core.train.reform import LiveRecoveryError

__all__ = ["agree", "agreed", "sources"]

log = get_logger()

_agreed = -1  # the generation this process last agreed in


def agreed() -> int:
    """The generation whose :func:`agree` this process took part in last (``-1``: none)."""
    return _agreed


def sources(places: Sequence[tuple[int, bool]], groups: Sequence[Sequence[int]]) -> dict[int, int]:
    """``needing rank -> the rank that sends it the state``: for each rank whose place says
    it needs the state, the lowest other rank of its replica group that does not. Pure.

    Args:
        places: per rank, ``(applied step, needs the state)``.
        groups: the world's replica groups (``JobSpec.replica_groups``).

    Raises:
        LiveRecoveryError: a rank needs the state and no member of its group holds it
            (every member raises it alike: they share ``places``).
    """
    out: dict[int, int] = {}
    for rank, (_, needs) in enumerate(places):
        if not needs:
            continue
        group = next((list(g) for g in groups if rank in g), [rank])
        holders = [p for p in group if p != rank and 0 <= p < len(places) and not places[p][1]]
        if not holders:
            raise LiveRecoveryError(f"rank {rank} needs its shard from a replica peer, but no member of its replica "
                                    f"group {group} holds it")
        out[rank] = holders[0]
    return out


def agree(applied: int, *, rank: int, world_size: int, generation: int, needs_state: bool,
          groups: Sequence[Sequence[int]], encode_state: Callable[[], bytes] | None) -> Any:
    """Check that every member of the generation resumes after the same step, and move the
    state to each member that needs it from its replica peer; returns the state file this
    rank received (``needs_state``: a writable buffer, uint8, the file's bytes), else ``None``.

    Args:
        applied: the step this rank's state is at (a needing rank: the step it resumes after).
        rank, world_size, generation: this member's place.
        needs_state: this rank holds no state of ``applied`` (a replacement whose node's
            memory lacks it).
        groups: the world's replica groups (``JobSpec.replica_groups``).
        encode_state: this rank's state as a dlrover state file (called only when it sends).

    Raises:
        LiveRecoveryError: the members resume after different steps, or a needing rank has
            no holder in its group (on every member alike), or a sender holds no state.
        RuntimeError / DistBackendError: a member died meanwhile (the live loop re-forms).
    """
    import torch  # heavy: torch
    import torch.distributed as dist  # heavy: torch

    global _agreed
    places: list[Any] = [None] * world_size
    dist.all_gather_object(places, (int(applied), bool(needs_state)))
    steps = [p[0] for p in places]
    if len(set(steps)) != 1:
        raise LiveRecoveryError(f"the members of generation {generation} resume after different steps: {steps}")
    _agreed = generation
    received: Any = None
    for needing, source in sorted(sources(places, groups).items()):
        if rank == source:
            if encode_state is None:
                raise LiveRecoveryError(f"rank {rank} is to send its state to rank {needing}, but holds none")
            data = encode_state()
            size = torch.tensor([len(data)], dtype=torch.int64)
            dist.send(size, dst=needing)
            if data:
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=needing)
            log.info("live_state_sent", rank=rank, to_rank=needing, step=applied, size_bytes=len(data))
        elif rank == needing:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, src=source)
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
            if buf.numel():
                dist.recv(buf, src=source)
            received = buf.numpy()
            log.info("live_state_received", rank=rank, from_rank=source, step=applied, size_bytes=buf.numel())
    return received
