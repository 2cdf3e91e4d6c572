"""The main job: train the byte-level GPT on 2 nodes with DDP, optionally killing a worker.

    python examples/charlm/run.py --steps 300 --chaos --result-json results/demo.json --plot results/demo.png

builds ``Job(..., nodes=2, nproc_per_node=1, scheduler="local")`` (``--scheduler docker``: in
containers), runs it, prints the JobResult and the validation loss at the start and the end
(``--plot``: and draws the job, as ``dlrover plot JOB_ID`` does). With ``--chaos`` one worker is
SIGKILLed at a random step: the surviving worker keeps training in a smaller world, and the
replacement rejoins with its live state (``--restart-all``: every worker restarts and resumes
from the last committed checkpoint instead).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from dlrover_core import Checkpoint, Failure, Job, Nodes, jobplot
from dlrover_core.runner import exit_code
from dlrover_core.testing import kill_worker_at_step

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="training seed (same seed, same final parameters)")
    p.add_argument("--chaos", action="store_true", help="SIGKILL one worker at a random step")
    p.add_argument("--chaos-seed", type=int, default=None, help="seed choosing the victim and step (default: random)")
    p.add_argument("--chaos-step", type=int, default=None, help="kill at this step instead of a random one")
    p.add_argument("--persist-every", type=int, default=25, help="persist a checkpoint every N steps")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--restart-all", action="store_true",
                   help="on a failure, restart every worker from the last checkpoint (Failure(live_recovery=False)) "
                        "instead of letting the survivors go on while the failed worker is replaced")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (default: a fresh temporary one)")
    p.add_argument("--data", default=None, help="a text file to train on (default: Python's standard library)")
    p.add_argument("--log-dir", default="dlrover-runs")
    p.add_argument("--accelerator", default="cpu",
                   help="cpu (gloo), cuda (nccl: one GPU per worker), auto, or an installed plugin's name")
    p.add_argument("--scheduler", default="local", help="where nodes run: local (processes), docker (containers), ...")
    p.add_argument("--result-json", default=None, help="write the JobResult plus validation losses here")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="draw the job (steps, failures, world size, loss, goodput) into this PNG; needs matplotlib: "
                        "pip install 'dlrover-core[plot]' (the same as `dlrover plot JOB_ID -o PATH` afterwards)")
    p.add_argument("train_args", nargs="*", help="extra arguments for train.py (after --)")
    a = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="charlm-"))
    ckpt_dir = a.ckpt_dir or str(tmp / "checkpoints")
    hash_file = tmp / "params.sha256"
    args = ["--steps", str(a.steps), "--seed", str(a.seed), "--params-hash-file", str(hash_file), *a.train_args]
    if a.data:
        args += ["--data", str(Path(a.data).resolve())]
    job = Job(
        name="charlm",
        entrypoint=str(HERE / "train.py"),
        args=args,
        nodes=Nodes(min=a.nodes, max=a.nodes, nproc_per_node=a.nproc_per_node),
        accelerator=a.accelerator,
        scheduler=a.scheduler,
        checkpoint=Checkpoint(dir=ckpt_dir, persist_every_steps=a.persist_every, keep_last=2),
        failure=Failure(max_restarts=a.max_restarts, live_recovery=not a.restart_all),
        log_dir=a.log_dir,
    )
    try:
        run = job.submit()
        print(f"job {run.job_id} submitted; logs in {run.handle.log_dir}", flush=True)
        kill = None
        if a.chaos:
            rng = random.Random(a.chaos_seed)
            world_size = a.nodes * a.nproc_per_node
            step = a.chaos_step if a.chaos_step is not None else rng.randint(a.steps // 4, 3 * a.steps // 4)
            rank = rng.randrange(world_size)
            print(f"chaos: will SIGKILL rank {rank} at step {step}", flush=True)
            kill = kill_worker_at_step(run, step=step, rank=rank, sig=signal.SIGKILL)
        result = run.wait()
        params_hash = hash_file.read_text().strip() if hash_file.exists() else None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    initial, final = result.metrics.get("initial_val_loss"), result.metrics.get("final_val_loss")
    if initial is not None and final is not None:
        print(f"validation loss: {initial:.4f} at the start → {final:.4f} at the end")
    if kill is not None and kill.step is not None:
        print(f"chaos: SIGKILLed rank {kill.rank} (pid {kill.pid}) at step {kill.step}")
    if a.result_json:
        out = {
            **result.to_dict(),
            "initial_val_loss": initial,
            "final_val_loss": final,
            "final_params_sha256": params_hash,
            "chaos": None if kill is None else {"rank": kill.rank, "step": kill.step, "signal": "SIGKILL"},
        }
        Path(a.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.result_json).write_text(json.dumps(out, indent=2))
    if a.plot:
        try:
            drawn = jobplot.render(jobplot.read_job(result.log_dir), a.plot)
        except jobplot.JobPlotError as exc:
            print(f"plot: {exc}", file=sys.stderr)
            return 1
        print(f"plot: wrote {drawn.path} ({drawn.markers['failure']} failure(s), {drawn.markers['commit']} commit(s))")
    return exit_code(result, run.stop_signal)  # 0, 1, or 130 / 143 after Ctrl-C / SIGTERM (README: exit codes)


if __name__ == "__main__":
    sys.exit(main())
