"""What a training script imports: ``init``, ``prepare``, ``report``, ``Checkpointer``.

::

    from dlrover_core import train

    info = train.init()                       # process group through this round's store
    model, opt = train.prepare(model)         # parallel strategies + the Job's optimizer
    ckpt = train.Checkpointer()
    state = {"model": model, "optimizer": opt}
    restored = ckpt.load(state)
    for step in train.steps(total, state, start=restored.step + 1 if restored else 0):
        with step:                            # a peer's death: the survivors go on (docs/design.md §5a)
            ...
            train.report(step, loss=loss)
            ckpt.save(step, state)
"""

from dlrover_core.train.checkpointer import Checkpointer, Restored
from dlrover_core.train.context import WorkerInfo, worker_info
from dlrover_core.train.live import LiveRecoveryError, Step, steps
from dlrover_core.train.prepare import prepare
from dlrover_core.train.process_group import init
from dlrover_core.train.progress import report
from dlrover_core.train.sampler import ElasticSampler, accumulation_steps
from dlrover_core.train.state import ModelOptimizerState

__all__ = [
    "Checkpointer",
    "ElasticSampler",
    "LiveRecoveryError",
    "ModelOptimizerState",
    "Restored",
    "Step",
    "WorkerInfo",
    "accumulation_steps",
    "init",
    "prepare",
    "report",
    "steps",
    "worker_info",
]
