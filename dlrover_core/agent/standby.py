"""``python -m dlrover_core.agent.standby``: a warm spare worker.

The agent keeps standby processes that have already imported what workers need (torch,
numpy, safetensors, ``dlrover_core.train``, the plugin host). When workers (re)start, a standby receives one
line of JSON on stdin — ``{"argv": [...], "env": {...}, "cwd": "..."}``, the exact command
and environment a cold worker would get — takes that environment and working directory, and
runs the entrypoint in-process as ``python`` would (``runpy``, ``__main__``, ``sys.argv``,
``sys.path[0]``). The replacement worker so skips starting Python and importing torch
(about a second on this kind of machine).

Caveats: variables read when a library is imported (OpenMP's ``OMP_NUM_THREADS``) take the
standby's value, which the agent sets to the workers' one; the process title stays this
module's.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import dlrover_core.train  # noqa: F401  (what workers import, before they are needed)
from dlrover_core.env import STANDBY_READY_FD
from dlrover_core.plugins import get_host, reset_host
from dlrover_core.train.progress import install_excepthook

#: The variables the plugin host reads when it loads (``dlrover_core.plugins.PluginHost``).
_HOST_VARIABLES = ("DLROVER_PLUGINS", "DLROVER_DISABLE_PLUGINS")


def _preload() -> None:
    """Import the heavy modules workers need (the point of a standby: this runs while it waits)."""
    import numpy  # noqa: F401  (heavy)
    import safetensors.torch  # noqa: F401  (heavy)
    import torch  # noqa: F401  (heavy)
    import torch.distributed  # noqa: F401  (heavy)

    get_host()  # plugin discovery (entry points, plugin imports): about a second, done while waiting
    # what a worker's first step loads on first use (autograd, the optimizers' torch._dynamo
    # and sympy imports): about 3 s here, that a replacement would pay before it can join
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 2)).sum().backward()
    optimizer.step()


def _run(argv: list[str]) -> None:
    args = argv[1:]  # drop the interpreter
    while args and args[0] == "-u":
        args = args[1:]
    if args and args[0] == "-m":
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, rest = args[0], args[1:]
        sys.argv = [script, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def _say_ready() -> None:
    """One byte on the agent's pipe: warm now (the agent prefers a fresh process before)."""
    fd = int(os.environ.pop(STANDBY_READY_FD, "-1"))
    if fd >= 0:
        try:
            os.write(fd, b"1")
        except OSError:
            pass
        finally:
            os.close(fd)


def main() -> None:
    _preload()
    _say_ready()
    line = sys.stdin.readline()
    if not line:  # the agent closed the pipe without a job: not needed any more
        return
    spec = json.loads(line)
    if any(os.environ.get(k) != spec["env"].get(k) for k in _HOST_VARIABLES):
        reset_host()  # the worker selects other plugins than this standby loaded
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["cwd"])
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        import torch  # heavy (imported by _preload already)

        torch.set_num_threads(int(threads))
    install_excepthook()  # an exception at import of the entrypoint is recorded for the master too
    _run(spec["argv"])


if __name__ == "__main__":
    main()
