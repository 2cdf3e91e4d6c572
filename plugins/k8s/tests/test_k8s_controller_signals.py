"""The controller process stops on SIGTERM at once, from any wait (its stop flag is set in
the handler without a lock: a ``threading.Event`` set there could deadlock the main thread
inside the event's own ``wait``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dlrover_core import Job

_KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:9"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_controller_waiting_for_its_master_exits_0_soon_after_a_signal(tmp_path, signum):
    (tmp_path / "kubeconfig").write_text(_KUBECONFIG)
    job = Job(name="t", entrypoint="train.py", nodes=2, scheduler="k8s")
    environ = dict(os.environ, DLROVER_JOB_SPEC=json.dumps(job.to_dict()), KUBECONFIG=str(tmp_path / "kubeconfig"))
    proc = subprocess.Popen([sys.executable, "-m", "dlrover_plugin_k8s.controller", "--job-id", "j1",
                             "--master-addr", "127.0.0.1:9", "--log-dir", str(tmp_path / "logs")],
                            env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        assert "controller_started" in proc.stdout.readline()  # now in its wait for the master
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=30)
        waited_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert waited_s < 10, f"the controller took {waited_s:.1f} s to stop"
