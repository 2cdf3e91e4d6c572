"""A whole job through the k8s backend: the emulated API server, and a stand-in kubelet that
runs each pod's containers as processes on this machine.

What is real: the manifests, every API call (over HTTP), the master pod's two containers
(``python -m dlrover_core.master`` and the controller), the controller creating worker pods
from the template, the agents and workers of each worker pod, the master relaunching
through the backend from its own process, the result read back from the controller's log.
What the stand-in does for the missing cluster: starts a pod's containers (with the
container's command, env and working directory; ``$(VAR)`` expanded, ``status.podIP`` =
127.0.0.1), plays cluster DNS (the master's Service name resolves to 127.0.0.1), gives the
"service account" as a kubeconfig, reports container exits as pod phases, serves pod logs,
the API server's service proxy to the master, and kills the processes of deleted pods.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from k8s_emulator import NAMESPACE

from dlrover_core import Job
from dlrover_core.checkpoint.shm import remove_segments
from dlrover_core.protocol import JobState
from dlrover_core.runner import JobRun
from dlrover_core.spec import Checkpoint, Failure
from dlrover_plugin_k8s import K8sConfig, K8sScheduler, Names

ROOT = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalKubelet:
    """Runs the emulated cluster's pods as local process groups (see the module docstring)."""

    def __init__(self, cluster, tmp: Path, *, master_port: int) -> None:
        self.cluster = cluster
        self.tmp = tmp
        self.master_port = master_port
        self.procs: dict[str, dict[str, subprocess.Popen]] = {}  # pod -> container -> process
        self.done: set[str] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        cluster.server["get", re.compile(r".*/pods/[^/]+/log")] << self._serve_log
        cluster.server[re.compile(r".*/services/[^/]+:http/proxy/.*")] << self._proxy
        self._thread = threading.Thread(target=self._loop, name="local-kubelet", daemon=True)
        self._thread.start()

    # ----- API server side ------------------------------------------------------------------

    def _log_path(self, pod: str, container: str) -> Path:
        return self.tmp / "pods" / f"{pod}.{container}.log"

    def _serve_log(self, request) -> bytes:
        pod = request.url.path.split("/")[-2]
        path = self._log_path(pod, request.params.get("container", ""))
        return path.read_bytes() if path.exists() else b""

    def _proxy(self, request) -> Any:
        path = request.url.path.split("/proxy/", 1)[1]
        url = f"http://127.0.0.1:{self.master_port}/{path}"
        try:
            if str(request.method).upper().endswith("POST"):
                return httpx.post(url, json={}, timeout=2.0).json()
            return httpx.get(url, timeout=2.0).json()
        except httpx.HTTPError as exc:
            # the API server's proxy answers 503 here; a kmock reaction that once sets a status
            # keeps it, so answer a Status body that the backend cannot read as the master's
            return {"kind": "Status", "code": 503, "message": f"no endpoint answered: {exc}"}

    # ----- node side ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self._sync()
            except Exception as exc:  # keep the kubelet alive; the test's timeout tells
                print(f"local kubelet: {type(exc).__name__}: {exc}", file=sys.stderr)

    def _sync(self) -> None:
        pods = {name: obj for (_, name), obj in self.cluster.objects("pods").items()}
        with self._lock:
            for name in list(self.procs):
                if name not in pods:  # deleted: stop its containers
                    self._kill(name, grace_s=2.0)
            for name, pod in pods.items():
                if name not in self.procs and name not in self.done:
                    self._start(name, pod)
                elif name in self.procs and name not in self.done:
                    codes = {c: p.poll() for c, p in self.procs[name].items()}
                    if all(code is not None for code in codes.values()):
                        self._finished(name, codes)

    def _env(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        fields = {"status.podIP": "127.0.0.1", "metadata.namespace": NAMESPACE, "metadata.name": pod["metadata"]["name"]}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DLROVER_", "KUBERNETES_"))}
        env["DLROVER_K8S_KUBECONFIG"] = str(self.cluster.kubeconfig)  # the pod's "service account"
        for e in container.get("env", []):
            if "valueFrom" in e:
                env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                env[e["name"]] = self._dns(e["value"])
        return env

    def _dns(self, text: str) -> str:
        return re.sub(r"[a-z0-9-]+\.[a-z0-9-]+\.svc\b", "127.0.0.1", text)

    @staticmethod
    def _expand(arg: str, env: dict[str, str]) -> str:
        """``$(VAR)`` in a container's command, as the kubelet expands it."""
        return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)

    def _start(self, name: str, pod: dict[str, Any]) -> None:
        self.procs[name] = {}
        (self.tmp / "pods").mkdir(exist_ok=True)
        for container in pod["spec"]["containers"]:
            env = self._env(pod, container)
            argv = [self._expand(self._dns(a), env) for a in container["command"]]
            argv[0] = sys.executable if argv[0] == "python" else argv[0]
            with open(self._log_path(name, container["name"]), "ab") as out:
                self.procs[name][container["name"]] = subprocess.Popen(
                    argv, env=env, cwd=container.get("workingDir"), stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True)
        self.cluster.set_status(name, {"phase": "Running", "podIP": "127.0.0.1", "containerStatuses": [
            {"name": c, "ready": True, "restartCount": 0, "image": "local", "imageID": "",
             "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}} for c in self.procs[name]]})

    def _finished(self, name: str, codes: dict[str, int]) -> None:
        self.done.add(name)
        statuses = []
        for c, code in codes.items():
            exit_code = 128 - code if code < 0 else code  # killed by a signal: 128 + n, as a container reports
            statuses.append({"name": c, "ready": False, "restartCount": 0, "image": "local", "imageID": "",
                             "state": {"terminated": {"exitCode": exit_code,
                                                      "reason": "Completed" if exit_code == 0 else "Error"}}})
        phase = "Succeeded" if all(c == 0 for c in codes.values()) else "Failed"
        try:
            self.cluster.set_status(name, {"phase": phase, "containerStatuses": statuses})
        except Exception:  # deleted meanwhile
            pass

    @staticmethod
    def _tree(procs) -> list[psutil.Process]:
        """Every process of the containers (a container's cgroup holds its whole tree)."""
        out = []
        for p in procs:
            try:
                root = psutil.Process(p.pid)
                out += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return out

    def _kill(self, name: str, grace_s: float) -> None:
        procs = self.procs.pop(name, {})
        tree = self._tree(procs.values())
        for p in tree:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(tree, timeout=grace_s)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        for p in procs.values():
            p.wait(timeout=5)
        self.done.discard(name)

    def kill_pod(self, name: str) -> None:
        """What a dying node does to a pod: SIGKILL to every process of its containers."""
        with self._lock:
            for p in self._tree(self.procs.get(name, {}).values()):
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            for name in list(self.procs):
                self._kill(name, grace_s=0.5)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_job_survives_a_killed_worker_pod(cluster, api, tmp_path):
    """A two-node job runs in "pods": the controller creates the workers, one worker pod is
    killed mid-run, the controller classifies and relaunches it, the job restarts and
    finishes SUCCEEDED; the result comes back from the cluster and nothing is left."""
    port = _free_port()
    # every "pod" runs on this machine, so the checkpoint directory is shared; the claim only
    # satisfies dryrun (the stand-in kubelet mounts no volumes)
    config = K8sConfig(image="local", namespace=NAMESPACE, workdir=str(ROOT), log_root=str(tmp_path / "podlogs"),
                       master_port=port, kubeconfig=str(cluster.kubeconfig), checkpoint_pvc="ckpt")
    backend = K8sScheduler(config, api=api, cancel_wait_s=10.0)
    job = Job(name="tiny", entrypoint="tests/scripts/tiny_train.py", args=["--steps", "40", "--step-sleep", "0.15"],
              nodes=2, accelerator="cpu", scheduler="k8s", workdir=str(ROOT), log_dir=str(tmp_path / "runs"),
              failure=Failure(max_restarts=3, heartbeat_timeout_s=20.0), checkpoint=Checkpoint(dir=str(tmp_path / "ckpt")),
              env={"OMP_NUM_THREADS": "1"})
    kubelet = LocalKubelet(cluster, tmp_path, master_port=port)
    plan = backend.dryrun(job)
    names = Names(plan.job_id)
    try:
        handle = backend.submit(plan)
        run = JobRun(backend=backend, plan=plan, handle=handle)
        deadline = time.monotonic() + 120
        while run.status().step < 5:
            assert time.monotonic() < deadline, f"no progress; status {run.status()}"
            time.sleep(0.3)
        kubelet.kill_pod(names.worker_pod(1, 0))
        result = run.wait(progress=False, timeout_s=120)
        assert result.state == JobState.SUCCEEDED, result.reason
        assert result.final_step == 39 and result.restarts >= 1
        pod_failures = [f for f in result.failures if f.kind == "pod_failed"]
        assert pod_failures and pod_failures[0].node_id == 1 and "exit code 137" in pod_failures[0].detail
        assert not cluster.objects()  # wait() cancels: everything deleted
        assert (Path(handle.log_dir) / "result.json").exists()
    finally:
        kubelet.close()
        remove_segments(f"dlrover-{plan.job_id}-")
    assert all(p.poll() is not None for procs in kubelet.procs.values() for p in procs.values())
