"""``python -m dlrover_core.train.call pkg.module:function ARGS...``: call a function entrypoint.

``sys.argv`` becomes ``["pkg.module:function", *ARGS]``; the function is called with no
arguments; an int it returns is the exit code.
"""

from __future__ import annotations

import importlib
import sys

from dlrover_core.train.progress import install_excepthook


def main() -> int:
    if len(sys.argv) < 2 or ":" not in sys.argv[1]:
        print("usage: python -m dlrover_core.train.call pkg.module:function [ARGS...]", file=sys.stderr)
        return 2
    install_excepthook()  # an exception at import of the module is recorded for the master too
    module_name, _, func_name = sys.argv[1].partition(":")
    sys.argv = sys.argv[1:]
    func = getattr(importlib.import_module(module_name), func_name)
    result = func()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
