"""Writing a benchmark's result file: JSON with no path of the machine that ran it.

A result file is kept in the repository and read on other machines: the repository's own
paths become relative to its root, the temporary directory's ``$TMPDIR``, the home
directory ``~`` (in every string of the document, keys included).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["scrub_paths", "summary", "write_result"]


def _prefixes() -> list[tuple[str, str]]:
    out = [(str(ROOT) + os.sep, ""), (str(ROOT), "."), (tempfile.gettempdir().rstrip(os.sep) + os.sep, "$TMPDIR/")]
    home = os.path.expanduser("~")
    if home not in ("", os.sep):
        out.append((home.rstrip(os.sep) + os.sep, "~/"))
    return out


def scrub_paths(doc: Any) -> Any:
    """``doc`` with every absolute path of this machine made portable (see the module doc)."""
    prefixes = _prefixes()

    def scrub(value: Any) -> Any:
        if isinstance(value, str):
            for prefix, repl in prefixes:
                value = value.replace(prefix, repl)
            return value
        if isinstance(value, dict):
            return {scrub(k): scrub(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [scrub(v) for v in value]
        return value

    return scrub(doc)


def write_result(path: str | Path, doc: Any, **dumps: Any) -> None:
    """Write ``doc`` (paths scrubbed) as indented JSON to ``path``."""
    Path(path).write_text(json.dumps(scrub_paths(doc), indent=2, **dumps) + "\n")


def summary(values: list[float]) -> dict[str, float]:
    """Median, min and max of a side's samples (seconds), and how many."""
    return {"median_s": round(statistics.median(values), 3), "min_s": round(min(values), 3),
            "max_s": round(max(values), 3), "samples": len(values)}
