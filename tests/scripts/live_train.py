"""A small DDP job for the live-recovery tests: a linear model, an ElasticSampler, ``train.steps``.

Every applied step appends a JSON line to ``--out/steps_<pid>.jsonl``: the pid, the rank and
world size it held, the step, the sampler's position after it, this rank's sample ids and a
checksum of the parameters after the update. At the end each rank writes
``--out/final_<pid>.json`` with the final checksum. Args: --steps N, --samples N (dataset
size), --batch B (per rank at the start), --step-sleep S, --pace-file F (when F exists, its
number replaces --step-sleep: a test speeds up the steps it no longer watches; only the
sleep changes, never the steps, so ranks that read it at different steps stay in lockstep),
--probe (the state has a plain object that keeps the step it is at, ``self.step = step``, as
users write it: the repro live-grow-state), --ballast-mb N (the live state also holds N MiB
that is sent to a replacement, never saved: the send takes long enough to be interrupted;
each send writes ``--out/sending_<pid>``), --hold-load FILE (with a ballast: a replacement
that received the state writes ``--out/loading_<pid>`` and, while FILE exists (60 s at most),
waits before it loads it: a window in which it is in the middle of its join), --unsendable (the probe's state holds a
function, which cannot be sent).
"""

import argparse
import atexit
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from dlrover_core import train


def checksum(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def pace(path: str | None, default_s: float) -> float:
    try:
        return float(Path(path).read_text()) if path else default_s
    except (OSError, ValueError):  # not written yet (or being written)
        return default_s


class Probe:
    """Which step the state is at, kept as the loop gives it (a ``train.Step``)."""

    def __init__(self, hook=None) -> None:
        self.step = -1
        self.hook = hook

    def state_dict(self) -> dict:
        return {"step": self.step, **({"hook": self.hook} if self.hook else {})}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


class Ballast(torch.nn.Module):
    """``mb`` MiB of buffers in the live state; marks each send to a replacement."""

    def __init__(self, mb: int, out: Path, hold_load: str | None = None) -> None:
        super().__init__()
        self.out = out
        self.hold_load = Path(hold_load) if hold_load else None
        for i in range(max(1, mb // 4)):
            self.register_buffer(f"b{i}", torch.full((2**20,), float(i)))

    def state_dict(self, *args, **kw):
        frame = sys._getframe(1)
        if not args and "prefix" not in kw and f"train{os.sep}live" in frame.f_code.co_filename:
            (self.out / f"sending_{os.getpid()}").write_text(str(time.time()))
        return super().state_dict(*args, **kw)

    def load_state_dict(self, *args, **kw):  # only a replacement loads it: it is never saved
        if self.hold_load is not None:
            (self.out / f"loading_{os.getpid()}").write_text(str(time.time()))
            deadline = time.monotonic() + 60
            while self.hold_load.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().load_state_dict(*args, **kw)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--pace-file", default=None)
    p.add_argument("--abort-at-exit-once", default=None,
                   help="rank 0 aborts (SIGABRT) while exiting after its last step, unless this file exists "
                        "(it makes it): a native crash in interpreter teardown")
    p.add_argument("--probe", action="store_true")
    p.add_argument("--unsendable", action="store_true", help="the probe's state holds a function")
    p.add_argument("--ballast-mb", type=int, default=0)
    p.add_argument("--hold-load", default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    info = train.init()
    torch.manual_seed(0)
    model, opt = train.prepare(torch.nn.Linear(8, 1), lr=0.01)
    sampler = train.ElasticSampler(a.samples, a.batch, seed=7)
    data = torch.randn(a.samples, 8, generator=torch.Generator().manual_seed(3))
    ckpt = train.Checkpointer()
    state = {"model": model, "optimizer": opt, "sampler": sampler}
    probe = Probe(hook=(lambda: None) if a.unsendable else None)
    if a.probe or a.unsendable:
        state["probe"] = probe
    restored = ckpt.load(state)
    live_state = {"ballast": Ballast(a.ballast_mb, out, a.hold_load), **state} if a.ballast_mb else state
    log = open(out / f"steps_{os.getpid()}.jsonl", "a", buffering=1)
    for step in train.steps(a.steps, live_state, start=restored.step + 1 if restored else 0):
        with step:
            ids = sampler.next_batch()
            if ids is None:
                ids = sampler.next_batch()
            opt.zero_grad(set_to_none=True)
            x = data[ids] if ids else torch.zeros(0, 8)
            # a global-batch mean, whatever this rank's share
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).sum() * step.world_size / sampler.global_batch_size
            loss.backward()
            time.sleep(pace(a.pace_file, a.step_sleep))
            opt.step()
            probe.step = step
            log.write(json.dumps({"pid": os.getpid(), "rank": step.rank, "world_size": step.world_size,
                                  "step": int(step), "epoch": sampler.epoch, "consumed": sampler.consumed,
                                  "ids": ids, "params": checksum(model), "t": time.time()}) + "\n")
            train.report(step, loss=loss.item())
            ckpt.save(step, state, force=step == a.steps - 1)
    (out / f"final_{os.getpid()}.json").write_text(json.dumps({"params": checksum(model), "rank": info.rank,
                                                              "probe": int(probe.step)}))
    if a.abort_at_exit_once and info.rank == 0 and not os.path.exists(a.abort_at_exit_once):
        Path(a.abort_at_exit_once).touch()
        atexit.register(os.abort)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
