"""The k8s backend against a real Kubernetes cluster: run only when one is given.

Environment:
    DLROVER_K8S_TEST_KUBECONFIG: a kubeconfig of a cluster the tests may create objects in
        (without it, every test here is skipped).
    DLROVER_K8S_TEST_NAMESPACE: the namespace to use (default ``default``).
    DLROVER_K8S_TEST_IMAGE: an image with python, torch (CPU), dlrover-core,
        dlrover-plugin-k8s and this repository at ``/workspace`` (or DLROVER_K8S_TEST_WORKDIR);
        without it only the server-side dry run runs.
    DLROVER_K8S_TEST_CHECKPOINT_PVC: a ReadWriteMany PersistentVolumeClaim of that namespace for
        the job's checkpoints; without it the job runs without checkpoints (the k8s backend
        refuses a checkpoint directory that the pods do not share).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from dlrover_core import Job
from dlrover_core.protocol import JobState
from dlrover_core.spec import Checkpoint
from dlrover_plugin_k8s import K8sConfig, K8sScheduler, worker_pod

ROOT = Path(__file__).resolve().parents[3]
KUBECONFIG = os.environ.get("DLROVER_K8S_TEST_KUBECONFIG", "")
NAMESPACE = os.environ.get("DLROVER_K8S_TEST_NAMESPACE", "default")
IMAGE = os.environ.get("DLROVER_K8S_TEST_IMAGE", "")
WORKDIR = os.environ.get("DLROVER_K8S_TEST_WORKDIR", "/workspace")
PVC = os.environ.get("DLROVER_K8S_TEST_CHECKPOINT_PVC", "")

pytestmark = pytest.mark.skipif(not KUBECONFIG, reason="no real Kubernetes cluster: set DLROVER_K8S_TEST_KUBECONFIG "
                                                       "to a kubeconfig to run these tests")


def _backend(image: str) -> K8sScheduler:
    return K8sScheduler(K8sConfig(image=image, namespace=NAMESPACE, workdir=WORKDIR, kubeconfig=KUBECONFIG,
                                  cpu_request="500m", memory_request="1Gi", checkpoint_pvc=PVC or None))


def _job(tmp_path, **kw) -> Job:
    if not PVC:  # nowhere shared to persist to: keep no checkpoints
        kw.setdefault("checkpoint", Checkpoint(memory_every_steps=0, persist_every_steps=0))
    return Job(name="dlrover-k8s-test", entrypoint="tests/scripts/tiny_train.py", accelerator="cpu", scheduler="k8s",
               workdir=str(ROOT), log_dir=str(tmp_path / "runs"), **kw)


@pytest.mark.timeout(120)
def test_real_api_server_admits_every_manifest(tmp_path):
    """The API server (schema, admission) accepts every object and a worker pod, in a
    server-side dry run that stores nothing."""
    backend = _backend(IMAGE or "registry.example.com/dlrover:0.1")
    plan = backend.dryrun(_job(tmp_path, nodes=2))
    docs = [d for d in yaml.safe_load_all(plan.files["manifests.yaml"]) if d]
    template = yaml.safe_load(docs[3]["data"]["worker-pod.yaml"])
    for doc in [*docs, worker_pod(template, node_id=1, attempt=0)]:
        backend.api.create(doc, dry_run=True)
    assert backend.api.list("Pod", NAMESPACE, {"dlrover.job-id": plan.job_id}) == []


@pytest.mark.timeout(900)
def test_real_cluster_runs_a_two_node_job_and_cancel_removes_it(tmp_path):
    """A two-node job runs to SUCCEEDED in pods the master creates; afterwards nothing with
    the job's label is left."""
    if not IMAGE:
        pytest.skip("no test image: set DLROVER_K8S_TEST_IMAGE to run a job on the cluster")
    backend = _backend(IMAGE)
    job = _job(tmp_path, nodes=2, args=["--steps", "30"])
    plan = backend.dryrun(job)
    handle = backend.submit(plan)
    try:
        from dlrover_core.runner import JobRun

        result = JobRun(backend=backend, plan=plan, handle=handle).wait(progress=False, timeout_s=720)
        assert result.state == JobState.SUCCEEDED, result.reason
        assert result.final_step >= 29
    finally:
        backend.cancel(handle)
    for kind in ("Pod", "Service", "ConfigMap", "Role", "RoleBinding", "ServiceAccount"):
        assert backend.api.list(kind, NAMESPACE, {"dlrover.job-id": handle.job_id}) == []
