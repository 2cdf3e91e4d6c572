"""posix storage: atomic, durable writes and the commit marker."""

from __future__ import annotations

import pytest

from dlrover_core.storage.posix import PosixStorage


def test_write_read_list_delete(tmp_path):
    s = PosixStorage(str(tmp_path / "ck"))
    s.write_bytes("step_1/rank_0.bin", b"abc")
    assert s.read("step_1/rank_0.bin") == b"abc"
    assert s.list() == ["step_1/rank_0.bin"]
    s.delete("step_1")
    assert s.list() == [] and not s.exists("step_1/rank_0.bin")


def test_failed_write_leaves_nothing(tmp_path):
    """An exception inside open_write publishes nothing and leaves no staging file."""
    s = PosixStorage(str(tmp_path))
    s.write_bytes("f", b"old")
    with pytest.raises(RuntimeError), s.open_write("f") as f:
        f.write(b"new-but-torn")
        raise RuntimeError("crash mid-write")
    assert s.read("f") == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_commit_marker(tmp_path):
    s = PosixStorage(str(tmp_path))
    assert s.latest_step() is None
    s.commit(10)
    s.commit(20)
    assert s.latest_step() == 20


def test_paths_cannot_escape_root(tmp_path):
    s = PosixStorage(str(tmp_path / "root"))
    with pytest.raises(ValueError, match="escapes"):
        s.write_bytes("../evil", b"x")
