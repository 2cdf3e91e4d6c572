"""Flash Checkpoint: snapshots in shared memory, persisted in the background, restored from
memory after a worker restart.

This package is the engine; its users sit above it. Worker side: :class:`Checkpointer`
(:mod:`dlrover_core.train.checkpointer`, exported by :mod:`dlrover_core.train`). Agent side:
:class:`~dlrover_core.checkpoint.saver.CheckpointSaver`. Master side:
:class:`~dlrover_core.master.checkpoints.CheckpointCoordinator`, committing through
:mod:`~dlrover_core.checkpoint.commit`. On disk each rank's shard is a safetensors file
(:mod:`~dlrover_core.checkpoint.layout`); :func:`read_shard` opens one without a job.
"""

from dlrover_core.checkpoint.layout import decode as _decode


def read_shard(path: str) -> tuple[dict, dict]:
    """``(state, metadata)`` of one persisted shard file (``step_*/rank_*.safetensors``).

    Tensors are CPU copies; nothing is unpickled. Raises CheckpointError for anything but a
    complete dlrover shard.
    """
    with open(path, "rb") as f:
        return _decode(f.read())


__all__ = ["read_shard"]
