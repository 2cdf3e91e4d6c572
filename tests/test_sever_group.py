"""``process_group.sever_group`` on real gloo groups: a collective blocked on a silent peer
(a host cut off or frozen: no connection reset ever comes, and gloo's own timeout is the
collective timeout) fails as soon as the group's connections are shut down, and the round's
store connection stays (the live world re-forms over it). The job-level cut and thaw is
tests/test_hostrun.py; when the watch thread severs, tests/test_live_watch.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "sever_peer.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_a_collective_blocked_on_a_silent_peer_fails_when_the_group_is_severed():
    port, sever_after_s = _free_port(), 3.0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    peer = subprocess.Popen([sys.executable, str(SCRIPT), "1", str(port), str(sever_after_s)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = subprocess.run([sys.executable, str(SCRIPT), "0", str(port), str(sever_after_s)], env=env,
                             capture_output=True, text=True, timeout=90).stdout
    finally:
        os.kill(peer.pid, signal.SIGKILL)
        peer.wait()
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert "collective_failed_after_s" in lines, out
    failed_after_s = float(lines["collective_failed_after_s"].split()[0])
    # blocked until the sever (gloo alone would wait for its 60 s timeout), failed at once after it
    assert sever_after_s - 0.2 <= failed_after_s <= sever_after_s + 10, out
    assert int(lines["severed"]) >= 1, out
    assert lines["store_answers"] == "1", out
