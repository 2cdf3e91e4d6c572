"""``python -m dlrover_plugin_k8s JOB_FILE --out DIR``: write a job's manifests for ``kubectl``.

JOB_FILE is a Python file defining ``job = Job(...)`` (as for ``dlrover submit``); its
scheduler is taken to be ``k8s``. Writes ``manifests.yaml`` (apply it with ``kubectl apply -f``),
``master-pod.yaml`` and ``worker-pod.yaml`` into DIR and prints the job id. Nothing is sent
to a cluster.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import attrs

from dlrover_core import DLRoverError, JobSpec
from dlrover_plugin_k8s._scheduler import K8sScheduler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlrover_plugin_k8s", description=__doc__.split("\n\n")[0])
    parser.add_argument("job_file", help="a Python file that defines `job = Job(...)`")
    parser.add_argument("--out", default=".", help="directory to write the manifests into (default: .)")
    args = parser.parse_args(argv)
    namespace = runpy.run_path(args.job_file, run_name="__dlrover_render__")
    job = namespace.get("job")
    if not isinstance(job, JobSpec):
        parser.error(f"{args.job_file} must define `job = Job(...)`")
    try:
        plan = K8sScheduler().dryrun(attrs.evolve(job, scheduler="k8s"))
    except DLRoverError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in plan.files.items():
        (out / name).write_text(text)
    print(plan.job_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
