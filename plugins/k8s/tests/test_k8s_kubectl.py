"""The path without ``Job.run()``: render the manifests with ``python -m dlrover_plugin_k8s``,
``kubectl apply -f`` them (to the emulated API server), and the master pod's controller and
the backend's cancel take it from there."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from k8s_emulator import IMAGE, NAMESPACE

from dlrover_core import Job
from dlrover_core.scheduler_backend import JobHandle
from dlrover_plugin_k8s import K8sConfig, K8sScheduler, Names, PodController

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(120)
def test_rendered_manifests_apply_with_kubectl_and_run(cluster, api, tmp_path, monkeypatch):
    """``kubectl apply -f manifests.yaml`` creates the job's six objects; the controller then
    creates its worker pods; cancel with only the job id removes everything."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    job_file = tmp_path / "job.py"
    job_file.write_text(
        "from dlrover_core import Job\n"
        f"job = Job(name='tiny', entrypoint='tests/scripts/tiny_train.py', nodes=2, accelerator='cpu', "
        f"workdir={str(ROOT)!r})\n")
    env = {"DLROVER_K8S_IMAGE": IMAGE, "DLROVER_K8S_NAMESPACE": NAMESPACE, "DLROVER_K8S_CHECKPOINT_PVC": "ckpt",
           "PATH": "/usr/bin:/bin"}
    out = tmp_path / "k8s"
    render = subprocess.run([sys.executable, "-m", "dlrover_plugin_k8s", str(job_file), "--out", str(out)],
                            env=env, capture_output=True, text=True, timeout=60)
    assert render.returncode == 0, render.stderr
    job_id = render.stdout.strip()
    assert sorted(p.name for p in out.iterdir()) == ["manifests.yaml", "master-pod.yaml", "worker-pod.yaml"]
    # the emulator serves no OpenAPI document for kubectl's validation: test_k8s_manifests checks the schema
    applied = subprocess.run([kubectl, "--kubeconfig", str(cluster.kubeconfig), "apply", "--validate=false",
                              "-f", str(out / "manifests.yaml")], capture_output=True, text=True, timeout=60)
    assert applied.returncode == 0, applied.stderr
    names = Names(job_id)
    assert sorted(cluster.objects()) == sorted([
        ("serviceaccounts", names.account), ("roles", names.account), ("rolebindings", names.account),
        ("configmaps", names.template), ("services", names.service), ("pods", names.master_pod)])
    job = Job(name="tiny", entrypoint="tests/scripts/tiny_train.py", nodes=2, accelerator="cpu", scheduler="k8s",
              workdir=str(ROOT))
    PodController(api=api, namespace=NAMESPACE, job_id=job_id, job=job, master=None).ensure_workers()
    assert len(cluster.pods(dlrover_role="worker")) == 2
    backend = K8sScheduler(K8sConfig(image=IMAGE, namespace=NAMESPACE), api=api, cancel_wait_s=2.0)
    backend.cancel(JobHandle(scheduler="k8s", job_id=job_id, log_dir=str(tmp_path / "runs" / job_id)))
    assert not cluster.objects()
