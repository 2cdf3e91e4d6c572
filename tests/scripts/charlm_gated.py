"""examples/charlm/train.py, unchanged, paced by a test through a gate file.

The char LM's timing on two shared cores varies tenfold with the load; a test that cuts a
host mid-training needs the training to last until the host is back, and no longer. This
runs ``examples/charlm/train.py`` with its own arguments; the JSON file named by
``CHARLM_GATE`` (read after every step; absent: no gate) paces it:

* ``hold_at``: after reporting step ``hold_at``, wait until the file says otherwise;
* ``sleep_s``: sleep this long after each step;
* ``end_at``: the last step (as if ``--steps`` were ``end_at + 1``; every rank ends at the
  same step: the test writes it a few steps ahead of the furthest rank).

Only ``train.report`` and ``train.steps`` are wrapped (the script looks them up on the
module at each call); the model, data, DDP, checkpoints and live recovery are the script's.
``end_at`` lowers the bound of the live loop behind ``train.steps`` (its ``total``), so the
loop ends as it does after its last step.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

from dlrover_core import train
from dlrover_core.train import live

GATE = os.environ.get("CHARLM_GATE")
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "charlm" / "train.py"


def gate() -> dict:
    if not GATE:
        return {}
    try:
        return json.loads(Path(GATE).read_text())
    except (OSError, ValueError):
        return {}


_report = train.report


def report(step, **metrics):
    _report(step, **metrics)
    while True:
        g = gate()
        if g.get("hold_at") is None or step < g["hold_at"]:
            break
        time.sleep(0.05)
    if g.get("sleep_s"):
        time.sleep(g["sleep_s"])


def steps(total, state, *, start=0):
    loop = live._Loop(total, state, start)  # what train.steps() iterates
    for step in loop:
        yield step
        end_at = gate().get("end_at")
        if end_at is not None:
            loop.total = min(loop.total, int(end_at) + 1)


train.report = report
train.steps = steps
sys.argv = [str(SCRIPT), *sys.argv[1:]]
runpy.run_path(str(SCRIPT), run_name="__main__")
