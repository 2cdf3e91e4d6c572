"""``python -m dlrover_plugin_k8s.controller``: the master pod's worker-pod controller
(see :mod:`dlrover_plugin_k8s._controller`)."""

import sys

from dlrover_plugin_k8s._controller import main

if __name__ == "__main__":
    sys.exit(main())
