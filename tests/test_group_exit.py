"""A worker's process group is destroyed when its script returns, before the interpreter
tears down (a gloo group left to finalization can abort the process with exit code -6:
"terminate called without an active exception"), but not after an uncaught exception.
Either way the objects alive then are frozen out of the collector's passes at exit (a
second or so of a torch worker's exit), and so are those alive when it joins its group (the
imports), unless ``DLROVER_GC_AT_EXIT=1``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

#: the check is registered before ``train.init()``: atexit runs it after dlrover's hook
SCRIPT = textwrap.dedent("""
    import atexit, gc, sys
    import torch.distributed as dist

    def check():
        print("initialized at exit:", dist.is_initialized(), flush=True)
        print("frozen at exit:", gc.get_freeze_count() > 10_000, flush=True)  # torch's objects

    atexit.register(check)
    from dlrover_core import train
    train.init()
    assert dist.is_initialized()
    print("frozen after init:", gc.get_freeze_count() > 10_000, flush=True)  # the imports
    if sys.argv[1] == "raise":
        raise RuntimeError("boom")
""")


@pytest.mark.parametrize(("how", "initialized", "code", "gc_at_exit"),
                         [("return", False, 0, ""), ("raise", True, 1, ""), ("return", False, 0, "1")])
def test_the_group_is_destroyed_at_a_normal_exit_only(tmp_path, how, initialized, code, gc_at_exit):
    import os

    (tmp_path / "script.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "script.py", how], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "DLROVER_GC_AT_EXIT": gc_at_exit})
    assert proc.returncode == code, proc.stderr[-2000:]
    assert f"initialized at exit: {initialized}" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert f"frozen at exit: {gc_at_exit != '1'}" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert f"frozen after init: {gc_at_exit != '1'}" in proc.stdout, proc.stdout + proc.stderr[-2000:]


#: two ranks of a DDP model that ``train.steps()`` would rebuild on each live generation
DDP_SCRIPT = textwrap.dedent("""
    import atexit, sys
    import torch

    def check():
        from dlrover_core.parallel.ddp import replicated_modules
        print("ddp held at exit:", [m._ddp is not None for m in replicated_modules()], flush=True)

    atexit.register(check)
    from dlrover_core import train
    from dlrover_core.parallel.ddp import replicate
    train.init()
    model = replicate(torch.nn.Linear(4, 1))
    assert model._ddp is not None  # a two-rank world: a real DDP
    model(torch.randn(2, 4)).sum().backward()
    keep = model  # a module global: still reachable when the interpreter exits
""")


def test_live_models_release_their_ddp_before_the_group_is_destroyed(tmp_path):
    """The DDP reducer holds the process group: left to interpreter finalization it can
    abort the process like the group itself. The exit hook drops the wrappers first."""
    import datetime
    import os

    import torch.distributed as dist

    (tmp_path / "script.py").write_text(DDP_SCRIPT)
    # the round's store, hosted as the agent (or torchrun) hosts it
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    port = store.port
    procs = [subprocess.Popen([sys.executable, "script.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                   "LOCAL_WORLD_SIZE": "2"})
             for rank in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        assert "ddp held at exit: [False]" in out, out + err[-2000:]
