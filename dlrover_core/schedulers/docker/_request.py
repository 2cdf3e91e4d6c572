"""The docker backend's native request: the job's network and container specs, as frozen data.

``dryrun`` builds a :class:`DockerRequest`; ``submit`` creates exactly those containers;
``containers.json`` (the plan's file, kept in the run directory) is its JSON form, which
``relaunch_node`` reads back (from inside the master container) to start a replacement.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from dlrover_core.control_plane import for_node

__all__ = [
    "LABEL_ATTEMPT",
    "LABEL_JOB",
    "LABEL_NODE",
    "LABEL_ROLE",
    "ContainerSpec",
    "DockerRequest",
    "Mount",
    "NetworkSpec",
    "container_name",
    "network_name",
]

LABEL_JOB = "dlrover.job_id"
LABEL_ROLE = "dlrover.role"
LABEL_NODE = "dlrover.node_id"
LABEL_ATTEMPT = "dlrover.attempt"


def container_name(job_id: str, name: str) -> str:
    return f"dlrover-{job_id}-{name}"


def network_name(job_id: str) -> str:
    return f"dlrover-{job_id}"


@attrs.frozen(kw_only=True)
class Mount:
    """A bind mount: ``source`` on the host at ``target`` in the container."""

    source: str
    target: str
    read_only: bool
    type: str = "bind"

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "source": self.source, "target": self.target, "read_only": self.read_only}


@attrs.frozen(kw_only=True)
class ContainerSpec:
    """One container of the job, as the engine's create call takes it.

    Attributes:
        name: the container's name (``dlrover-<job_id>-<hostname>``).
        image: the image to run.
        command: the full command line.
        environment: its variables.
        hostname: ``master`` or ``node-<id>``, also its alias on the job's network.
        network: the job's network.
        aliases: names it answers to on that network.
        labels: ``dlrover.job_id``, ``dlrover.role``, ``dlrover.node_id`` (agents).
        user: ``uid:gid`` of the submitting user.
        working_dir: the job's workdir (bind-mounted at the same path).
        init: run a tiny init that reaps orphans (``docker run --init``).
        shm_size: /dev/shm size in bytes.
        restart_policy: the engine's restart policy (``no``: the master relaunches nodes).
        mounts: bind mounts.
        dns_opt: resolver options (the master's), or None.
        group_add: extra groups (the engine socket's, for a non-root master), or None.
    """

    name: str
    image: str
    command: tuple[str, ...] = attrs.field(converter=tuple)
    environment: dict[str, str]
    hostname: str
    network: str
    aliases: tuple[str, ...] = attrs.field(converter=tuple)
    labels: dict[str, str]
    user: str
    working_dir: str
    init: bool = True
    shm_size: int
    restart_policy: dict[str, str] = attrs.field(factory=lambda: {"Name": "no"})
    mounts: tuple[Mount, ...] = attrs.field(converter=tuple)
    dns_opt: tuple[str, ...] | None = None
    group_add: tuple[str, ...] | None = None

    @property
    def role(self) -> str:
        return self.labels.get(LABEL_ROLE, "")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "image": self.image, "command": list(self.command), "environment": dict(self.environment),
            "hostname": self.hostname, "network": self.network, "aliases": list(self.aliases),
            "labels": dict(self.labels), "user": self.user, "working_dir": self.working_dir, "init": self.init,
            "shm_size": self.shm_size, "restart_policy": dict(self.restart_policy),
            "mounts": [m.to_dict() for m in self.mounts],
        }
        if self.dns_opt is not None:
            out["dns_opt"] = list(self.dns_opt)
        if self.group_add is not None:
            out["group_add"] = list(self.group_add)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ContainerSpec:
        fields = dict(data)
        fields["mounts"] = tuple(Mount(**m) for m in data["mounts"])
        for key in ("dns_opt", "group_add"):
            if fields.get(key) is not None:
                fields[key] = tuple(fields[key])
        return cls(**fields)

    def as_node(self, job_id: str, node_id: int, attempt: int) -> ContainerSpec:
        """This agent's spec for ``node_id``'s ``attempt``-th container (0: the first)."""
        command = list(for_node(self.command, node_id))
        hostname = f"node-{node_id}"
        name = container_name(job_id, hostname)
        labels = {**self.labels, LABEL_NODE: str(node_id), LABEL_ATTEMPT: str(attempt)}
        return attrs.evolve(self, command=command, hostname=hostname, aliases=(hostname,), labels=labels,
                            name=f"{name}-{attempt}" if attempt else name)


@attrs.frozen(kw_only=True)
class NetworkSpec:
    """The job's own bridge network."""

    name: str
    driver: str = "bridge"
    labels: dict[str, str] = attrs.field(factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "driver": self.driver, "labels": dict(self.labels)}


@attrs.frozen(kw_only=True)
class DockerRequest:
    """Everything ``submit`` creates, in order: the network, the master, the agents.

    Attributes:
        docker_host: the engine (``DOCKER_HOST`` form), as resolved from the options.
        network: the job's network.
        containers: the master first, then one agent per node.
    """

    docker_host: str
    network: NetworkSpec
    containers: tuple[ContainerSpec, ...] = attrs.field(converter=tuple)

    @property
    def master(self) -> ContainerSpec:
        return next(c for c in self.containers if c.role == "master")

    @property
    def agents(self) -> tuple[ContainerSpec, ...]:
        return tuple(c for c in self.containers if c.role == "agent")

    def render(self) -> str:
        """``containers.json``: the network and the container specs."""
        return json.dumps({"network": self.network.to_dict(), "containers": [c.to_dict() for c in self.containers]},
                          indent=2) + "\n"

    @classmethod
    def parse(cls, text: str, *, docker_host: str = "") -> DockerRequest:
        """Read ``containers.json`` back (``relaunch_node``, in another process)."""
        doc = json.loads(text)
        return cls(docker_host=docker_host, network=NetworkSpec(**doc["network"]),
                   containers=tuple(ContainerSpec.from_dict(c) for c in doc["containers"]))
