"""``python -m dlrover_core.schedulers.docker build-image [--tag T]``: make the default runtime
image from this host's files, offline."""

from __future__ import annotations

import argparse
import os
import sys

from dlrover_core.errors import SchedulerError
from dlrover_core.schedulers.docker._image import DEFAULT_IMAGE, build_image


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlrover_core.schedulers.docker")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build-image", help="make the default runtime image from this host's files, offline")
    build.add_argument("--tag", default=os.environ.get("DLROVER_DOCKER_IMAGE") or DEFAULT_IMAGE)
    args = parser.parse_args(argv)
    if args.command == "build-image":
        try:
            image_id = build_image(tag=args.tag)
        except SchedulerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{args.tag} {image_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
