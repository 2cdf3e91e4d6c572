"""Hook implementations, found through the entry point ``example`` of group ``dlrover``.

Keep this module cheap to import: dlrover imports it in the job master, every agent and
every worker. Import heavy or vendor libraries inside the functions that need them.
"""

from dlrover_core import hookimpl


@hookimpl
def dlrover_register_optimizers(register):
    """Register ``signsgd``. ``register`` may be called several times, once per backend."""
    from dlrover_plugin_example._optimizer import SignSGD

    register(SignSGD, name="signsgd")
