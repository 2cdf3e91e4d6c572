"""A training script whose import fails on every rank: an error of the script, not of a node."""

import dlrover_test_no_such_module  # noqa: F401

from dlrover_core import train

train.init()
