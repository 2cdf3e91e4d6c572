"""The built-in scheduler backends, each a plugin module registered like any other:
``local`` (processes on this machine, :mod:`.local`) and ``docker`` (containers through the
docker SDK, :mod:`.docker`). The interface they implement is
:mod:`dlrover_core.scheduler_backend` (for plugin authors: :mod:`dlrover_core.backend`)."""
