"""The k8s dry run refuses a checkpoint directory that the pods do not share.

Without a volume claim, ``Checkpoint(dir=...)`` of a filesystem storage lies on each pod's
own disk: ranks persist to different disks and a relaunched pod has nothing to restore from.
``dryrun`` (and so ``Job.dryrun()``, ``submit`` and ``python -m dlrover_plugin_k8s``) says so,
naming the field and the fix, instead of starting a job that can never restore from storage.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dlrover_core import Job, hookimpl
from dlrover_core.errors import JobSpecError
from dlrover_core.plugins import get_host, reset_host
from dlrover_core.spec import Checkpoint
from dlrover_core.storage.base import CheckpointStorage
from dlrover_core.storage.posix import PosixStorage
from dlrover_plugin_k8s import K8sConfig, K8sScheduler

ROOT = Path(__file__).resolve().parents[3]
IMAGE = "registry.example.com/dlrover:0.1"

pytestmark = pytest.mark.timeout(60)


def _job(tmp_path, **kw) -> Job:
    return Job(name="tiny", entrypoint="tests/scripts/tiny_train.py", scheduler="k8s", accelerator="cpu", nodes=2,
               workdir=str(ROOT), log_dir=str(tmp_path / "runs"), **kw)


class _ObjectStore(CheckpointStorage):
    """A storage addressed by URL (every pod reaches it): no claim needed."""

    name = "objstore"

    def open_write(self, path):  # pragma: no cover - never called: dryrun only
        raise NotImplementedError

    def read(self, path):  # pragma: no cover
        raise NotImplementedError

    def exists(self, path):  # pragma: no cover
        raise NotImplementedError

    def list(self, prefix=""):  # pragma: no cover
        raise NotImplementedError

    def delete(self, path):  # pragma: no cover
        raise NotImplementedError


class _TunedPosix(PosixStorage):
    """A filesystem storage extending posix: still a path inside the pod."""

    name = "tunedposix"


class _StoragesPlugin:
    @hookimpl
    def dlrover_register_storages(self, register):
        register(_ObjectStore)
        register(_TunedPosix)


@pytest.fixture
def storages():
    reset_host()
    get_host().register(_StoragesPlugin(), name="test-storages")
    yield
    reset_host()


def test_a_checkpoint_dir_without_a_claim_is_refused_with_the_fix(tmp_path, monkeypatch):
    """The default Checkpoint (posix, "checkpoints") and no claim: JobSpecError on
    ``checkpoint.dir`` that names the claim to set; Job.dryrun() says the same."""
    monkeypatch.delenv("DLROVER_K8S_CHECKPOINT_PVC", raising=False)
    with pytest.raises(JobSpecError) as info:
        K8sScheduler(K8sConfig(image=IMAGE)).dryrun(_job(tmp_path, checkpoint=Checkpoint(dir="/ckpt/run1")))
    err = info.value
    assert err.field == "checkpoint.dir" and err.value == "/ckpt/run1"
    assert "each pod's own disk" in str(err) and "scheduler_options['checkpoint_pvc']" in str(err)
    assert "DLROVER_K8S_CHECKPOINT_PVC" in str(err)
    assert "ReadWriteMany PersistentVolumeClaim" in str(err)
    monkeypatch.setenv("DLROVER_K8S_IMAGE", IMAGE)
    with pytest.raises(JobSpecError, match="DLROVER_K8S_CHECKPOINT_PVC"):
        _job(tmp_path).dryrun()  # through the runner and the registered backend
    assert not (tmp_path / "runs").exists()


def test_a_claim_makes_the_directory_shared_by_every_pod(tmp_path):
    """With ``checkpoint_pvc`` the claim is mounted at the checkpoint directory (relative to
    the workdir in the image) in the master and in every worker pod."""
    plan = K8sScheduler(K8sConfig(image=IMAGE, checkpoint_pvc="team-ckpt")).dryrun(
        _job(tmp_path, checkpoint=Checkpoint(dir="ckpt/run1")))
    master = yaml.safe_load(plan.files["master-pod.yaml"])
    worker = next(d for d in yaml.safe_load_all(plan.files["worker-pod.yaml"]) if d)
    for pod in (master, worker):
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]
                  if "persistentVolumeClaim" in v}
        assert claims == {"checkpoints": "team-ckpt"}
    mounts = {m["name"]: m["mountPath"] for m in worker["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["checkpoints"] == "/workspace/ckpt/run1"


def test_only_filesystem_storages_need_a_claim(tmp_path, storages):
    """A storage reached by URL needs no claim; one extending posix does; a job that keeps no
    checkpoints at all needs none either."""
    backend = K8sScheduler(K8sConfig(image=IMAGE))
    backend.dryrun(_job(tmp_path, checkpoint=Checkpoint(storage="objstore", dir="objstore://bucket/run1")))
    with pytest.raises(JobSpecError, match="storage 'tunedposix'"):
        backend.dryrun(_job(tmp_path, checkpoint=Checkpoint(storage="tunedposix", dir="/ckpt")))
    backend.dryrun(_job(tmp_path, checkpoint=Checkpoint(memory_every_steps=0, persist_every_steps=0)))
    with pytest.raises(JobSpecError, match="checkpoint.dir"):  # memory snapshots are persisted at breakpoints
        backend.dryrun(_job(tmp_path, checkpoint=Checkpoint(persist_every_steps=0)))


def test_rendering_for_kubectl_refuses_it_in_one_line(tmp_path):
    """``python -m dlrover_plugin_k8s`` exits 2 with the error, writing no manifests."""
    job_file = tmp_path / "job.py"
    job_file.write_text("from dlrover_core import Job\n"
                        "job = Job(name='tiny', entrypoint='tests/scripts/tiny_train.py', nodes=2, accelerator='cpu', "
                        f"workdir={str(ROOT)!r})\n")
    out = tmp_path / "k8s"
    render = subprocess.run([sys.executable, "-m", "dlrover_plugin_k8s", str(job_file), "--out", str(out)],
                            env={"DLROVER_K8S_IMAGE": IMAGE, "PATH": "/usr/bin:/bin"}, capture_output=True,
                            text=True, timeout=60)
    assert render.returncode == 2, render.stderr
    lines = render.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: invalid checkpoint.dir='checkpoints'"), render.stderr
    assert not out.exists()
