"""The suite's own scheduling: ``make test`` spreads tests over pytest-xdist workers with
``--dist loadgroup`` and relies on its groups (conftest.py): a file's shared fixture starts
once, the Slurm files (fixed ports) never run at the same time. A pytest or pytest-xdist
release under which the groups silently stop holding (pytest-dev/pytest-xdist#1386: pytest
9.2's structured node ids) fails here instead of making the suite slow and racy."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_loadgroup_keeps_a_files_shared_fixture_and_a_named_group_on_one_worker(tmp_path):
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_grouped.py").write_text(
        "import pytest, time\n"
        "@pytest.fixture(scope='module')\n"
        "def shared():\n"
        "    return 1\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "def test_shares(i, shared):\n"
        "    time.sleep(0.2)\n"
        "@pytest.mark.xdist_group('named')\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "def test_named(i):\n"
        "    time.sleep(0.2)\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "def test_free(i):\n"
        "    time.sleep(0.2)\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers: dict[str, set[str]] = {}
    for worker, test in re.findall(r"\[(gw\d+)\] .*?PASSED \S*::(test_\w+)", proc.stdout):
        workers.setdefault(test, set()).add(worker)
    assert set(workers) == {"test_shares", "test_named", "test_free"}, proc.stdout[-3000:]
    assert len(workers["test_shares"]) == 1 and len(workers["test_named"]) == 1, workers
