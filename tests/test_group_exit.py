"""A worker's process group is destroyed when its script returns, before the interpreter
tears down (a gloo group left to finalization can abort the process with exit code -6:
"terminate called without an active exception"), but not after an uncaught exception."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

#: the check is registered before ``train.init()``: atexit runs it after dlrover's hook
SCRIPT = textwrap.dedent("""
    import atexit, sys
    import torch.distributed as dist

    def check():
        print("initialized at exit:", dist.is_initialized(), flush=True)

    atexit.register(check)
    from dlrover_core import train
    train.init()
    assert dist.is_initialized()
    if sys.argv[1] == "raise":
        raise RuntimeError("boom")
""")


@pytest.mark.parametrize(("how", "initialized", "code"), [("return", False, 0), ("raise", True, 1)])
def test_the_group_is_destroyed_at_a_normal_exit_only(tmp_path, how, initialized, code):
    (tmp_path / "script.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "script.py", how], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert f"initialized at exit: {initialized}" in proc.stdout, proc.stdout + proc.stderr[-2000:]
