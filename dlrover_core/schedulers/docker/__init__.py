"""The built-in ``docker`` scheduler: the master and one agent per node, each in its own container.

A job gets its own user-defined bridge network ``dlrover-<job_id>``; on it the master
container answers as ``master`` (HTTP API on port 29400, rendezvous stores on fresh ports) and
each agent container as ``node-<id>``. Containers carry the labels ``dlrover.job_id``,
``dlrover.role`` (``master`` | ``agent``) and ``dlrover.node_id``, run with restart policy
``no`` and a tiny init (``docker run --init``) that reaps orphans; the master relaunches a lost
node itself, from inside its container, through the Docker socket that is bind-mounted into it
(whoever controls the master container therefore controls the engine, as with any container
that is given the socket).

It needs the docker SDK, an optional extra: ``pip install 'dlrover-core[docker]'`` (without
it, using the scheduler raises :class:`~dlrover_core.errors.SchedulerError` saying so).

Options (``Job(scheduler_options={...})``; each falls back to its environment variable, read
on the submitting machine by ``dryrun``; ``dlrover plugins list`` shows them):

    image        DLROVER_DOCKER_IMAGE     image to run (default :data:`DEFAULT_IMAGE`, built on demand)
    python       DLROVER_DOCKER_PYTHON    the interpreter inside a custom image (e.g. ``python3``); when
                                          set, the host's runtime is not mounted and the image must have
                                          dlrover-core installed
    shm_size     DLROVER_DOCKER_SHM_SIZE  /dev/shm of agent containers (``8g``, ``512m``, bytes)
    state_mb     DLROVER_DOCKER_STATE_MB  checkpoint state per rank in MiB, the hint for the shm rule
    mounts       DLROVER_DOCKER_MOUNTS    extra bind mounts, ``PATH`` or ``PATH:ro`` (comma-separated in
                                          the variable)
    docker_host  DOCKER_HOST              the engine (the SDK's other variables, e.g. TLS, still apply)

The modules, one concept each:

* :mod:`~dlrover_core.schedulers.docker._request` — the native request: network and container
  specs (``containers.json``);
* :mod:`~dlrover_core.schedulers.docker._mounts` — what is bind-mounted: the host's Python runtime
  read-only (so the containers run the very interpreter, venv and dlrover installation that
  submitted the job), the workdir, the run directory, a local checkpoint directory, the
  directory of an absolute entrypoint, absolute paths among ``Job.args``, and ``mounts``;
* :mod:`~dlrover_core.schedulers.docker._shm` — the size of /dev/shm (never Docker's 64 MB default);
* :mod:`~dlrover_core.schedulers.docker._image` — the default image, a root-filesystem skeleton
  made from nothing (no registry; ``python -m dlrover_core.schedulers.docker build-image``);
* :mod:`~dlrover_core.schedulers.docker._engine` — the SDK, a client, bounded retries;
* :mod:`~dlrover_core.schedulers.docker._logs` — the containers' output, live or saved;
* :mod:`~dlrover_core.schedulers.docker._scheduler` — the backend.

Files ``submit`` writes into the run's log directory:

    plan.txt          the dry-run plan           containers.json  the container specs (the plan's file)
    docker.json       engine, network, master restarts
    events.jsonl / result.json / goodput.json (by the master)
    master.log, node_<i>.log[.<n>]  each container's output, saved by ``cancel`` before it removes them
"""

from dlrover_core.markers import hookimpl
from dlrover_core.schedulers.docker._engine import INSTALL_HINT, docker_retrying
from dlrover_core.schedulers.docker._image import DEFAULT_IMAGE, build_image
from dlrover_core.schedulers.docker._mounts import runtime_mounts
from dlrover_core.schedulers.docker._request import (
    LABEL_JOB,
    LABEL_NODE,
    LABEL_ROLE,
    ContainerSpec,
    DockerRequest,
    Mount,
    NetworkSpec,
)
from dlrover_core.schedulers.docker._scheduler import OPTIONS, DockerScheduler
from dlrover_core.schedulers.docker._shm import MIN_SHM_BYTES, parse_size, shm_size_bytes

__all__ = [
    "DEFAULT_IMAGE",
    "INSTALL_HINT",
    "LABEL_JOB",
    "LABEL_NODE",
    "LABEL_ROLE",
    "MIN_SHM_BYTES",
    "OPTIONS",
    "ContainerSpec",
    "DockerRequest",
    "DockerScheduler",
    "Mount",
    "NetworkSpec",
    "build_image",
    "dlrover_register_schedulers",
    "docker_retrying",
    "parse_size",
    "runtime_mounts",
    "shm_size_bytes",
]


@hookimpl
def dlrover_register_schedulers(register):
    register(DockerScheduler)
