"""What ``dryrun`` renders for the k8s scheduler: manifests that the Kubernetes OpenAPI
schema accepts, equal to the golden files, with the resources, volumes and labels the
design asks for; and the pure helpers (worker pods from the template, the /dev/shm rule,
failure classification, configuration from the environment)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from dlrover_core import Job, hookimpl
from dlrover_core.accelerators.base import Accelerator, DeviceReport
from dlrover_core.errors import JobSpecError, SchedulerError
from dlrover_core.master.failures import describe
from dlrover_core.plugins import get_host, reset_host
from dlrover_core.protocol import WorkerFailure
from dlrover_core.spec import Checkpoint, Nodes
from dlrover_plugin_k8s import K8sConfig, K8sScheduler, classify, shm_size_mb, worker_pod

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed: pip install -e 'plugins/k8s[test]'")

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = Path(__file__).resolve().parent / "golden"
#: The Kubernetes version whose OpenAPI schema every manifest is checked against.
K8S_VERSION = "1.30.0"
IMAGE = "registry.example.com/dlrover:0.1"
#: The ReadWriteMany claim the tests' jobs checkpoint to (every pod must share the directory).
PVC = "ckpt"

pytestmark = pytest.mark.timeout(60)


class _TestGpu(Accelerator):
    """An accelerator with a Kubernetes extended resource, absent from this machine: dryrun
    must not probe it (the devices are on the cluster's nodes)."""

    name = "testgpu"
    torch_device_type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    k8s_resource = "example.com/gpu"

    def probe(self) -> DeviceReport:
        raise AssertionError("dryrun probed the accelerator")

    def worker_env(self, local_rank: int, local_world_size: int) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": str(local_rank)}

    def node_check(self, *, group=None):  # pragma: no cover - never called here
        raise NotImplementedError


class _TestGpuPlugin:
    @hookimpl
    def dlrover_register_accelerators(self, register):
        register(_TestGpu)


@pytest.fixture
def testgpu():
    reset_host()
    get_host().register(_TestGpuPlugin(), name="testgpu")
    yield
    reset_host()


def _job(tmp_path, **kw) -> Job:
    kw.setdefault("nodes", 2)
    kw.setdefault("accelerator", "cpu")
    return Job(name="tiny", entrypoint="tests/scripts/tiny_train.py", scheduler="k8s", workdir=str(ROOT),
               log_dir=str(tmp_path / "runs"), **kw)


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def _normalised(plan) -> dict[str, str]:
    return {name: text.replace(plan.job_id, "<job-id>") for name, text in plan.files.items()}


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DLROVER_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run with DLROVER_UPDATE_GOLDEN=1 to write it"
    assert text == path.read_text(), f"{name} differs from {path}; if intended, rerun with DLROVER_UPDATE_GOLDEN=1"


def _validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


# ----- schema and golden files --------------------------------------------------------------


def test_cpu_job_manifests_match_the_schema_and_golden_files(tmp_path):
    """Every object of manifests.yaml, the master pod and the worker template validate
    against the Kubernetes 1.30 schema (strict: no unknown field) and equal the golden files."""
    plan = K8sScheduler(K8sConfig(image=IMAGE, namespace="ml", checkpoint_pvc=PVC)).dryrun(_job(tmp_path))
    assert set(plan.files) == {"manifests.yaml", "master-pod.yaml", "worker-pod.yaml"}
    docs = _docs(plan.files["manifests.yaml"])
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Pod"]
    template = yaml.safe_load(docs[3]["data"]["worker-pod.yaml"])
    for doc in [*docs, template, *_docs(plan.files["master-pod.yaml"]), *_docs(plan.files["worker-pod.yaml"])]:
        _validate(doc)
    for name, text in _normalised(plan).items():
        _check_golden(f"cpu-{name}", text)


def test_gpu_job_requests_devices_resources_and_shared_checkpoints(tmp_path, testgpu):
    """An accelerator with a k8s_resource: each worker pod requests (and limits) nproc of it;
    cpu and memory requests, the memory limit, pull secrets and the checkpoint PVC come from
    the configuration; /dev/shm is a memory emptyDir sized by the rule."""
    config = K8sConfig(image=IMAGE, namespace="ml", cpu_request="32", memory_request="256Gi", memory_limit="300Gi",
                       checkpoint_mb=4096, checkpoint_pvc="ckpt", image_pull_secrets=("regcred",))
    job = _job(tmp_path, accelerator="testgpu", nodes=Nodes(min=2, max=4, nproc_per_node=8),
               checkpoint=Checkpoint(dir="/mnt/ckpt/run1"))
    plan = K8sScheduler(config).dryrun(job)
    docs = _docs(plan.files["manifests.yaml"])
    template = yaml.safe_load(docs[3]["data"]["worker-pod.yaml"])
    for doc in [*docs, template]:
        _validate(doc)
    agent = template["spec"]["containers"][0]
    assert agent["resources"] == {
        "requests": {"cpu": "32", "memory": "256Gi", "example.com/gpu": "8"},
        "limits": {"memory": "300Gi", "example.com/gpu": "8"},
    }
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["DLROVER_ACCELERATOR"] == "testgpu"
    assert env["OMP_NUM_THREADS"] == "4"  # 32 cpus / 8 workers
    shm = next(v for v in template["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{8 * 2 * (4096 + 16) + 1024}Mi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in agent["volumeMounts"]
    assert {"name": "checkpoints", "mountPath": "/mnt/ckpt/run1"} in agent["volumeMounts"]
    master = docs[5]
    assert {"name": "checkpoints", "mountPath": "/mnt/ckpt/run1"} in master["spec"]["containers"][0]["volumeMounts"]
    assert master["spec"]["imagePullSecrets"] == template["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert len(plan.workers) == 4 * 8 and plan.workers[9].env["CUDA_VISIBLE_DEVICES"] == "1"
    for name, text in _normalised(plan).items():
        if name == "manifests.yaml":
            _check_golden(f"gpu-{name}", text)


def test_master_pod_runs_the_master_with_rbac_to_manage_its_pods(tmp_path):
    """The master pod runs ``python -m dlrover_core.master`` (store on its pod IP) beside the
    controller, under a ServiceAccount whose Role may create, list and delete pods of its
    namespace only; the Service selects the master pod; workers reach it by DNS."""
    plan = K8sScheduler(K8sConfig(image=IMAGE, namespace="ml", checkpoint_pvc=PVC)).dryrun(_job(tmp_path))
    sa, role, binding, cm, svc, master = _docs(plan.files["manifests.yaml"])
    assert sa["metadata"]["name"] == master["spec"]["serviceAccountName"] == binding["subjects"][0]["name"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    pods_rule = role["rules"][0]
    assert pods_rule["resources"] == ["pods"] and {"create", "list", "delete", "get"} <= set(pods_rule["verbs"])
    assert role["rules"][1] == {"apiGroups": [""], "resources": ["configmaps"],
                                "resourceNames": [cm["metadata"]["name"]], "verbs": ["get"]}
    assert svc["spec"]["selector"] == {"dlrover.job-id": plan.job_id, "dlrover.role": "master"}
    containers = {c["name"]: c for c in master["spec"]["containers"]}
    argv = containers["master"]["command"]
    assert argv[1:3] == ["-m", "dlrover_core.master"] and argv[argv.index("--store-host") + 1] == "$(DLROVER_POD_IP)"
    assert containers["controller"]["command"][1:3] == ["-m", "dlrover_plugin_k8s.controller"]
    template = yaml.safe_load(cm["data"]["worker-pod.yaml"])
    agent_env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
    assert agent_env["DLROVER_MASTER_ADDR"] == f"{svc['metadata']['name']}.ml.svc:50001"
    assert json.loads(agent_env["DLROVER_JOB_SPEC"])["workdir"] == "/workspace"
    assert "resources" not in template["spec"]["containers"][0]  # cpu job, nothing configured
    assert template["spec"]["restartPolicy"] == "Never"
    assert template["metadata"]["labels"] == {
        "dlrover.job-id": plan.job_id, "app.kubernetes.io/managed-by": "dlrover", "dlrover.role": "worker",
        "dlrover.node-id": "0", "dlrover.attempt": "0"}


def test_worker_pod_for_a_node_and_attempt_validates(tmp_path):
    """The pod of node 3's second relaunch: renamed, relabelled, --node-id set, owned by
    the master pod."""
    plan = K8sScheduler(K8sConfig(image=IMAGE, namespace="ml", checkpoint_pvc=PVC)).dryrun(_job(tmp_path))
    template = _docs(plan.files["worker-pod.yaml"])[0]
    pod = worker_pod(template, node_id=3, attempt=2, owner={"name": "m", "uid": "1234"},
                     annotations={"dlrover/relaunch-kind": "evicted"})
    _validate(pod)
    assert pod["metadata"]["name"] == f"{plan.job_id}-node-3-2"
    assert (pod["metadata"]["labels"]["dlrover.node-id"], pod["metadata"]["labels"]["dlrover.attempt"]) == ("3", "2")
    argv = pod["spec"]["containers"][0]["command"]
    assert argv[argv.index("--node-id") + 1] == "3"
    assert pod["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "m", "uid": "1234", "controller": True}]
    assert template["metadata"]["name"] == f"{plan.job_id}-node-0-0"  # the template is untouched


def test_service_name_is_a_dns_label_when_the_job_name_starts_with_a_digit(tmp_path):
    plan = K8sScheduler(K8sConfig(image=IMAGE, checkpoint_pvc=PVC)).dryrun(
        Job(name="7b-llm", entrypoint="tests/scripts/tiny_train.py", scheduler="k8s", accelerator="cpu",
            workdir=str(ROOT), log_dir=str(tmp_path)))
    svc = _docs(plan.files["manifests.yaml"])[4]
    _validate(svc)
    assert svc["metadata"]["name"] == f"j{plan.job_id}" and len(svc["metadata"]["name"]) <= 63


# ----- dryrun's contract ----------------------------------------------------------------------


def test_dryrun_is_pure(tmp_path):
    """dryrun builds no API client and writes nothing."""
    backend = K8sScheduler(K8sConfig(image=IMAGE, kubeconfig=str(tmp_path / "missing"), checkpoint_pvc=PVC))
    plan = backend.dryrun(_job(tmp_path))
    assert backend._api is None
    assert not (tmp_path / "runs").exists()
    assert plan.processes == () and plan.log_dir == str(tmp_path / "runs" / plan.job_id)


def test_dryrun_refuses_what_it_cannot_render(tmp_path, testgpu):
    """No image, accelerator "auto", or a device count of "auto": errors that say what to set."""
    with pytest.raises(SchedulerError, match="DLROVER_K8S_IMAGE"):
        K8sScheduler(K8sConfig()).dryrun(_job(tmp_path))
    with pytest.raises(JobSpecError, match="accelerator"):
        K8sScheduler(K8sConfig(image=IMAGE)).dryrun(_job(tmp_path, accelerator="auto"))
    with pytest.raises(JobSpecError, match="nproc_per_node"):
        K8sScheduler(K8sConfig(image=IMAGE, checkpoint_pvc=PVC)).dryrun(
            _job(tmp_path, accelerator="testgpu", nodes=Nodes(min=1, nproc_per_node="auto")))


def test_config_from_the_environment():
    config = K8sConfig.from_env({"DLROVER_K8S_IMAGE": "img:1", "DLROVER_K8S_NAMESPACE": "team",
                                 "DLROVER_K8S_CHECKPOINT_MB": "2048", "DLROVER_K8S_IMAGE_PULL_SECRETS": "a, b",
                                 "DLROVER_K8S_CPU": ""})
    assert (config.image, config.namespace, config.checkpoint_mb, config.image_pull_secrets, config.cpu_request) == (
        "img:1", "team", 2048, ("a", "b"), None)
    with pytest.raises(ValueError, match="DLROVER_K8S_SHM_SIZE_MB"):
        K8sConfig.from_env({"DLROVER_K8S_SHM_SIZE_MB": "1Gi"})


def test_shm_size_rule(tmp_path):
    """Two slots per rank of the checkpointed state plus overhead, and 1 GiB of headroom;
    no slots without memory snapshots; an explicit size wins."""
    job = _job(tmp_path)
    assert shm_size_mb(job, 4, K8sConfig(checkpoint_mb=1000)) == 4 * 2 * 1016 + 1024
    no_snapshots = _job(tmp_path, checkpoint=Checkpoint(memory_every_steps=0))
    assert shm_size_mb(no_snapshots, 4, K8sConfig()) == 1024
    assert shm_size_mb(job, 4, K8sConfig(shm_size_mb=777)) == 777


# ----- failure classification -----------------------------------------------------------------


def _pod(phase, *, reason=None, message=None, terminated=None):
    status = {"phase": phase}
    if reason:
        status["reason"] = reason
    if message:
        status["message"] = message
    if terminated is not None:
        status["containerStatuses"] = [{"name": "agent", "state": {"terminated": terminated}}]
    return {"metadata": {"name": "p", "labels": {}}, "status": status}


def test_classify_failed_evicted_and_oom_killed_pods():
    evicted = classify(_pod("Failed", reason="Evicted", message="The node was low on resource: ephemeral-storage."))
    assert (evicted.kind, evicted.detail) == ("evicted", "pod evicted: The node was low on resource: ephemeral-storage.")
    oom = classify(_pod("Failed", terminated={"exitCode": 137, "reason": "OOMKilled"}))
    assert (oom.kind, oom.exit_code) == ("oom_killed", 137) and "OOMKilled" in oom.detail
    failed = classify(_pod("Failed", terminated={"exitCode": 2, "reason": "Error", "message": "boom"}))
    assert (failed.kind, failed.detail) == ("pod_failed", "container agent terminated: Error (exit code 2): boom")
    lost = classify(_pod("Failed", reason="NodeLost", message="node n1 is unreachable"))
    assert (lost.kind, lost.detail) == ("pod_failed", "pod failed: NodeLost: node n1 is unreachable")
    for phase in ("Pending", "Running", "Succeeded"):
        assert classify(_pod(phase)) is None
    assert classify(_pod("Succeeded", terminated={"exitCode": 0, "reason": "Completed"})) is None


def test_the_master_describes_a_scheduler_classified_failure():
    """The master's failure record keeps the classification's detail (core ``describe``)."""
    assert describe(WorkerFailure(kind="evicted", detail="pod evicted: low memory")) == "evicted (pod evicted: low memory)"
    assert describe(WorkerFailure(kind="exit", exit_code=3)) == "exit code 3"
