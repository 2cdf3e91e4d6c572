"""The contract every checkpoint storage meets, as tests a storage plugin inherits."""

from __future__ import annotations

import threading
from typing import Any

from dlrover_core.storage.base import LATEST_MARKER, CheckpointStorage

__all__ = ["StorageContract"]


class _Interrupted(Exception):
    """Raised inside ``open_write`` to stand for a crash in the middle of a write."""


def _raises(exc_type: type[BaseException], fn: Any, *args: Any) -> BaseException:
    try:
        fn(*args)
    except exc_type as exc:
        return exc
    raise AssertionError(f"{getattr(fn, '__qualname__', fn)}{args!r} did not raise {exc_type.__name__}")


class StorageContract:
    """Tests of the :class:`~dlrover_core.storage.CheckpointStorage` contract, the one the
    built-in ``posix`` storage meets. Subclass it in a test module and provide a
    ``storage`` fixture returning an empty storage; pytest runs every ``test_*`` here
    against it::

        import pytest
        from dlrover_core.testing import StorageContract

        class TestMyStorage(StorageContract):
            @pytest.fixture
            def storage(self, tmp_path):
                return MyStorage(f"mys://{tmp_path}")

    What is checked: round trips, ``FileNotFoundError`` for a missing file, sorted relative
    listings under a directory-like prefix, recursive idempotent deletes, refusal of paths
    that escape the root (``ValueError``), and atomicity — a file is invisible until its
    ``open_write`` block exits cleanly, an exception inside the block publishes nothing and
    leaves the previous version intact, so an interrupted commit leaves the previous
    ``latest`` step in place; a second instance built from the same ``url`` sees the same
    files (the master, agents and workers each build their own).
    """

    # a storage is built by the ``storage`` fixture of the subclass

    def test_storage_has_a_registered_name(self, storage: CheckpointStorage) -> None:
        assert isinstance(storage, CheckpointStorage)
        assert isinstance(type(storage).name, str) and type(storage).name

    def test_storage_write_then_read_round_trips(self, storage: CheckpointStorage) -> None:
        payload = bytes(range(256)) * 1000
        with storage.open_write("step_1/rank_0.bin") as f:
            for i in range(0, len(payload), 4096):  # written in chunks, as the saver does
                f.write(payload[i:i + 4096])
        assert storage.read("step_1/rank_0.bin") == payload
        assert storage.exists("step_1/rank_0.bin")
        storage.write_bytes("empty", b"")
        assert storage.read("empty") == b""

    def test_storage_missing_file_raises_file_not_found(self, storage: CheckpointStorage) -> None:
        _raises(FileNotFoundError, storage.read, "nope/never-written")
        assert not storage.exists("nope/never-written")

    def test_storage_overwrite_replaces_the_whole_file(self, storage: CheckpointStorage) -> None:
        storage.write_bytes("a/file", b"x" * 10_000)
        storage.write_bytes("a/file", b"short")
        assert storage.read("a/file") == b"short"

    def test_storage_file_is_invisible_until_the_write_completes(self, storage: CheckpointStorage) -> None:
        storage.write_bytes("d/old", b"old")
        with storage.open_write("d/new") as f:
            f.write(b"partial")
            assert not storage.exists("d/new")
            assert storage.list("d") == ["d/old"]
            f.write(b" and the rest")
        assert storage.read("d/new") == b"partial and the rest"
        assert storage.list("d") == ["d/new", "d/old"]

    def test_storage_interrupted_write_publishes_nothing(self, storage: CheckpointStorage) -> None:
        storage.write_bytes("d/file", b"version 1")
        for path in ("d/file", "d/other"):
            try:
                with storage.open_write(path) as f:
                    f.write(b"torn bytes of version 2")
                    raise _Interrupted
            except _Interrupted:
                pass
        assert storage.read("d/file") == b"version 1"
        assert not storage.exists("d/other")
        assert storage.list() == ["d/file"]  # no staging file is listed

    def test_storage_commit_marker_moves_forward(self, storage: CheckpointStorage) -> None:
        assert storage.latest_step() is None
        storage.commit(3)
        assert storage.latest_step() == 3
        storage.commit(10)
        assert storage.latest_step() == 10
        assert storage.read(LATEST_MARKER).decode().strip() == "10"

    def test_storage_interrupted_commit_keeps_the_previous_step(self, storage: CheckpointStorage) -> None:
        storage.write_bytes("step_0000000005/rank_00000.safetensors", b"five")
        storage.commit(5)
        storage.write_bytes("step_0000000010/rank_00000.safetensors", b"ten")  # shards done...
        try:  # ...and the process dies while the marker is being written
            with storage.open_write(LATEST_MARKER) as f:
                f.write(b"1")
                raise _Interrupted
        except _Interrupted:
            pass
        assert storage.latest_step() == 5

    def test_storage_list_is_sorted_relative_and_filtered_by_prefix(self, storage: CheckpointStorage) -> None:
        for path in ("step_2/b", "step_2/a", "step_10/a", "latest", "step_2x/c"):
            storage.write_bytes(path, path.encode())
        assert storage.list() == sorted(["step_2/b", "step_2/a", "step_10/a", "latest", "step_2x/c"])
        assert storage.list("step_2") == ["step_2/a", "step_2/b"]
        assert storage.list("step_2/") == ["step_2/a", "step_2/b"]
        assert storage.list("nothing-here") == []

    def test_storage_delete_removes_files_and_directories_idempotently(self, storage: CheckpointStorage) -> None:
        for path in ("step_1/a", "step_1/sub/b", "step_2/a", "latest"):
            storage.write_bytes(path, b"x")
        storage.delete("latest")
        storage.delete("step_1")
        assert storage.list() == ["step_2/a"]
        assert not storage.exists("step_1/sub/b")
        storage.delete("step_1")
        storage.delete("latest")
        assert storage.list() == ["step_2/a"]

    def test_storage_refuses_paths_outside_its_root(self, storage: CheckpointStorage) -> None:
        _raises(ValueError, storage.read, "../outside")
        _raises(ValueError, storage.write_bytes, "a/../../outside", b"x")

    def test_storage_instances_on_one_url_share_files(self, storage: CheckpointStorage) -> None:
        storage.write_bytes("shared/file", b"seen by all")
        storage.commit(7)
        other = type(storage)(storage.url)
        assert other.read("shared/file") == b"seen by all"
        assert other.latest_step() == 7
        other.delete("shared")
        assert not storage.exists("shared/file")

    def test_storage_concurrent_writers_of_one_file_never_tear_it(self, storage: CheckpointStorage) -> None:
        versions = [bytes([i]) * 50_000 for i in range(4)]

        def write(data: bytes) -> None:
            for _ in range(5):
                storage.write_bytes("hot/file", data)

        threads = [threading.Thread(target=write, args=(v,)) for v in versions]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert storage.read("hot/file") in versions
        assert storage.list() == ["hot/file"]
