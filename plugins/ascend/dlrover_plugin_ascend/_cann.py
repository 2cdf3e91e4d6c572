"""Finding the CANN (Compute Architecture for Neural Networks) version: the Ascend runtime's
counterpart of the CUDA version."""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["cann_version"]

#: Environment variables CANN's ``set_env.sh`` sets to the toolkit's install directory.
TOOLKIT_HOME_VARS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")

_VERSION_LINE = re.compile(r"^\s*version\s*=\s*(\S+)\s*$", re.IGNORECASE | re.MULTILINE)


def _from_torch_npu(torch_npu: Any) -> str | None:
    # torch_npu.utils.get_cann_version(module="CANN"); it returns "" before CANN 8.1.RC1 and for
    # unknown modules (torch_npu API reference,
    # https://gitcode.com/Ascend/op-plugin/blob/7.3.0/docs/context/torch_npu-utils-get_cann_version.md).
    get = getattr(getattr(torch_npu, "utils", None), "get_cann_version", None)
    if not callable(get):
        return None
    try:
        version = get(module="CANN")
    except Exception:  # a version lookup never fails a probe
        return None
    if not isinstance(version, str):
        return None
    return version.strip() or None


def _install_info_files(home: Path) -> list[Path]:
    # CANN install guide, "Querying the Software Package Version": the toolkit's version is the
    # ``version=`` line of <toolkit>/<arch>-linux/ascend_toolkit_install.info
    # (https://www.hiascend.com/document/detail/en/canncommercial/800/softwareinst/instg/instg_0064.html).
    preferred = home / f"{platform.machine()}-linux" / "ascend_toolkit_install.info"
    others = sorted(home.glob("*-linux/ascend_toolkit_install.info"))
    return [preferred, *[p for p in others if p != preferred], home / "ascend_toolkit_install.info"]


def _from_install_info(environ: Mapping[str, str]) -> str | None:
    for var in TOOLKIT_HOME_VARS:
        home = environ.get(var)
        if not home:
            continue
        for path in _install_info_files(Path(home)):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            m = _VERSION_LINE.search(text)
            if m:
                return m.group(1)
    return None


def cann_version(torch_npu: Any = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The CANN version, e.g. ``"8.1.RC1"``, or ``None`` when it cannot be found. Never raises.

    Looked up, in order: ``torch_npu.utils.get_cann_version(module="CANN")`` (when
    ``torch_npu`` is given and the CANN is 8.1.RC1 or newer), then the ``version=`` line of
    ``ascend_toolkit_install.info`` under ``$ASCEND_TOOLKIT_HOME`` or ``$ASCEND_HOME_PATH``
    (both set by CANN's ``set_env.sh``).

    Args:
        torch_npu: the imported ``torch_npu`` module, if any.
        environ: where to read the variables (default ``os.environ``).
    """
    version = _from_torch_npu(torch_npu) if torch_npu is not None else None
    return version or _from_install_info(os.environ if environ is None else environ)
