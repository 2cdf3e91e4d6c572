"""Part ``charlm``: the char LM job on the GPU, with one worker SIGKILLed mid-run.

    python benchmarks/gpu/charlm_chaos.py --out charlm.json [--device cuda|cpu] [--steps 300]
                                          [--chaos-step N] [--no-chaos] [--restart-all] [--dryrun]

The job of ``examples/charlm/run.py`` (``Job(..., scheduler="local")``, Flash Checkpoint,
``train.steps()``), with ``accelerator="cuda"`` (``run.py --accelerator cuda`` does the same;
``train.py`` puts its model and batches on the device ``train.init()`` chose). One node with one worker (one GPU:
NCCL does not put two ranks of a group on one device), 300 steps; at step 150 the worker is
SIGKILLed (``dlrover_core.testing.kill_worker_at_step``, as ``run.py --chaos`` does). With no
survivor the agent turns its warm standby into the new worker, which restores the newest
snapshot from shared memory onto the GPU and trains on to the end.

JSON: ``job``: the ``JobResult`` (``to_dict()``: state, restarts, goodput and its parts,
failures with their recovery path and restore source); ``chaos``: rank, step and pid hit;
``log_dir``. ``figures``: ``state``, ``final_step``, ``restarts``, ``kill_step``,
``recovery`` (``restart_all`` / ``live``), ``restored_from`` (``memory`` / ``storage``),
``restored_step``, ``recomputed_steps``, ``goodput``, ``wall_time_s``, ``startup_s``,
``detection_s``, ``restart_s``, ``restore_s``, ``checkpoint_stall_s``, ``initial_val_loss``,
``final_val_loss``. Fails unless the job SUCCEEDED and, with chaos, the kill happened and
was recovered from.

``--dryrun`` plans the job (``Job.dryrun()``) and runs nothing: the part is then ``skipped``
with the plan in its JSON (``run.sh --cpu-tiny`` does this; the real run takes a minute).
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import _common as c


def _job(args: Any, ckpt_dir: str, log_dir: str) -> Any:
    from dlrover_core import Checkpoint, Failure, Job, Nodes

    train_args = ["--steps", str(args.steps), "--seed", "0", "--max-bytes", str(args.max_bytes),
                  "--eval-every", str(max(1, args.steps // 2)), "--log-every", str(max(1, args.steps // 10))]
    return Job(
        name="charlm-gpu",
        entrypoint=str(c.REPO / "examples" / "charlm" / "train.py"),
        args=train_args,
        nodes=Nodes(min=1, max=1, nproc_per_node=1),
        accelerator=args.device,
        scheduler="local",
        checkpoint=Checkpoint(dir=ckpt_dir, persist_every_steps=args.persist_every, keep_last=2),
        failure=Failure(max_restarts=2, live_recovery=not args.restart_all),
        log_dir=log_dir,
        workdir=str(c.REPO),
    )


def body(args: Any, result: dict[str, Any], deadline: c.Deadline) -> None:
    from dlrover_core.testing import kill_worker_at_step

    if args.steps is None:
        args.steps = 8 if args.tiny else 300
    chaos_step = None if args.no_chaos else (args.chaos_step if args.chaos_step is not None else args.steps // 2)
    log_dir = args.log_dir or (str(Path(args.out).resolve().parent / "charlm-runs") if args.out else "dlrover-runs")
    scratch = c.scratch_dir("charlm")
    result.update(steps=args.steps, chaos_step=chaos_step, restart_all=args.restart_all, entrypoint="examples/charlm/train.py")
    try:
        job = _job(args, str(scratch / "checkpoints"), log_dir)
        if args.dryrun:
            result["plan"] = str(job.dryrun())
            raise c.Skip("dry run (--dryrun): the job was planned, not run")
        run = job.submit()
        result["job_id"], result["log_dir"] = run.job_id, str(run.handle.log_dir)
        print(f"charlm: job {run.job_id} submitted; logs in {run.handle.log_dir}", flush=True)
        kill = None
        if chaos_step is not None:
            kill = kill_worker_at_step(run, step=chaos_step, rank=0, sig=signal.SIGKILL)
        left = deadline.left()
        job_result = run.wait(timeout_s=None if left == float("inf") else max(10.0, left - 10))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    # plain JSON values (the state is an enum)
    d = json.loads(json.dumps(job_result.to_dict(), default=lambda o: getattr(o, "value", str(o))))
    result["job"] = d
    result["chaos"] = None if kill is None else {"rank": kill.rank, "step": kill.step, "pid": kill.pid,
                                                  "signal": "SIGKILL"}
    failures = d.get("failures") or []
    first = failures[0] if failures else {}
    metrics = d.get("metrics") or {}
    result["figures"].update(
        state=d.get("state"), final_step=d.get("final_step"), restarts=d.get("restarts"),
        kill_step=None if kill is None else kill.step, recovery=first.get("recovery"),
        restored_from=first.get("restored_from"), restored_step=first.get("restored_step"),
        recomputed_steps=(None if kill is None or kill.step is None or first.get("restored_step") is None
                          else kill.step - first["restored_step"]),
        goodput=d.get("goodput"), wall_time_s=d.get("wall_time_s"), startup_s=d.get("startup_s"),
        detection_s=d.get("detection_s"), restart_s=d.get("restart_s"), restore_s=d.get("restore_s"),
        checkpoint_stall_s=d.get("checkpoint_stall_s"), initial_val_loss=metrics.get("initial_val_loss"),
        final_val_loss=metrics.get("final_val_loss"))
    problems = []
    if d.get("state") != "SUCCEEDED":
        problems.append(f"the job ended {d.get('state')}: {d.get('reason')}")
    if kill is not None:
        if kill.step is None:
            problems.append(f"the worker was never killed (the job did not reach step {chaos_step}?)")
        elif not failures:
            problems.append("the SIGKILL left no failure record")
    if problems:
        raise RuntimeError("; ".join(problems))


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__)
    p.add_argument("--steps", type=int, default=None, help="training steps (default 300; tiny 8)")
    p.add_argument("--chaos-step", type=int, default=None, help="SIGKILL the worker at this step (default steps/2)")
    p.add_argument("--no-chaos", action="store_true", help="kill nothing")
    p.add_argument("--restart-all", action="store_true", help="Failure(live_recovery=False)")
    p.add_argument("--persist-every", type=int, default=50, help="persist a checkpoint every N steps (default 50)")
    p.add_argument("--max-bytes", type=int, default=1_000_000, help="corpus size (default 1 MB of the stdlib)")
    p.add_argument("--log-dir", default=None, help="the job's log directory (default: OUT's folder/charlm-runs)")
    p.add_argument("--dryrun", action="store_true", help="plan the job, run nothing (the part is 'skipped')")
    return c.run("charlm", p.parse_args(argv), body)


if __name__ == "__main__":
    sys.exit(main())
