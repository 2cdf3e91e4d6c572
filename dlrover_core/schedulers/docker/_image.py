"""The default runtime image: a root-filesystem skeleton for the host's bind-mounted runtime,
made offline (``docker import`` of a generated tar, no registry)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

from dlrover_core.errors import SchedulerError
from dlrover_core.logging import get_logger
from dlrover_core.schedulers.docker._engine import call, connect, sdk
from dlrover_core.schedulers.docker._mounts import SYSTEM_DIRS

if TYPE_CHECKING:
    import docker

__all__ = ["DEFAULT_IMAGE", "LABEL_IMAGE", "PATH", "build_image", "ensure_image"]

log = get_logger()

#: The image ``build_image`` makes: a root-filesystem skeleton for the host's bind-mounted runtime.
DEFAULT_IMAGE = "dlrover-runtime:2"
#: Label of images made by :func:`build_image`.
LABEL_IMAGE = "dlrover.image"
#: PATH inside the containers (the interpreter's directory goes first).
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _skeleton_tar(uid: int, gid: int) -> bytes:
    """A root filesystem for the bind-mounted host runtime: the host's links into /usr
    (``bin -> usr/bin``...), empty mount points, /tmp, and /etc with just what glibc needs."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        def add_file(name: str, text: str) -> None:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))

        for name in ("usr", "sbin", "etc", "proc", "sys", "dev", "root", "home", "run", "var", "opt"):
            add_dir(name)
        add_dir("tmp", 0o1777)
        add_dir("var/tmp", 0o1777)
        for name in SYSTEM_DIRS:
            p = Path("/") / name
            if p.is_symlink():
                info = tarfile.TarInfo(name)
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(p)
                tar.addfile(info)
        users = "root:x:0:0:root:/root:/bin/sh\n"
        groups = "root:x:0:\n"
        if uid != 0:
            users += f"dlrover:x:{uid}:{gid}:dlrover:/tmp:/bin/sh\n"
        if gid != 0:
            groups += f"dlrover:x:{gid}:\n"
        add_file("etc/passwd", users)
        add_file("etc/group", groups)
        add_file("etc/nsswitch.conf", "passwd: files\ngroup: files\nhosts: files dns\n")
    return buf.getvalue()


def build_image(client: docker.DockerClient | None = None, tag: str = DEFAULT_IMAGE) -> str:
    """Make ``tag`` from this host's files, offline (``docker import`` of a generated root
    filesystem skeleton, no registry); return the image id. Replaces an older ``tag``."""
    client = client or connect()
    data = _skeleton_tar(os.getuid(), os.getgid())
    repository, _, version = tag.rpartition(":") if ":" in tag.rsplit("/", 1)[-1] else (tag, "", "latest")
    changes = [f"ENV PATH={PATH}", f"LABEL {LABEL_IMAGE}=runtime", 'CMD ["/bin/sh"]']
    call(lambda: client.api.import_image_from_data(data, repository=repository, tag=version, changes=changes),
         f"import image {tag}")
    image = call(lambda: client.images.get(tag), f"inspect image {tag}")
    log.info("docker_image_built", image=tag, id=image.id)
    return image.id


def ensure_image(client: docker.DockerClient, tag: str) -> None:
    """Make sure ``tag`` is on the engine: build the default image if it is missing.

    Raises:
        SchedulerError: another image is missing (it must be built or pulled first).
    """
    not_found = sdk().errors.ImageNotFound
    try:
        call(lambda: client.images.get(tag), f"inspect image {tag}", passthrough=(not_found,))
    except not_found:
        if tag != DEFAULT_IMAGE:
            raise SchedulerError(f"docker image {tag!r} (scheduler option 'image') is not on the engine; build or "
                                 "pull it") from None
        build_image(client, tag)
