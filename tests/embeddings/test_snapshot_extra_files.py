"""What the storage engine offers replication in a snapshot: ``extra_files`` written with it, checked on read
(tampering raises ``CorruptStore``), in full and incremental snapshots."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from replication_tables import DIM, config

from tigana import embeddings as emb
from tigana.embeddings.snapshot import list_snapshots, read_extra


# --- snapshot extra files ---------------------------------------------------------------------------------
def filled_table(backend: str = "auto") -> emb.EmbeddingTable:
    t = emb.EmbeddingTable(config(backend))
    t.pull(np.arange(20))
    t.push(np.arange(10), np.ones((10, DIM), np.float32))
    return t


def test_snapshot_extra_files_round_trip(tmp_path: Path) -> None:
    t = filled_table()
    blob = bytes(range(256)) * 5
    path = t.snapshot(tmp_path, extra_files={"dedup": blob, "empty.v1": b"", "A-b_c.9": b"x"})
    assert read_extra(path, "dedup") == blob
    assert read_extra(tmp_path, "dedup") == blob  # a root reads its latest snapshot
    assert read_extra(path, "empty.v1") == b""
    assert read_extra(path, "A-b_c.9") == b"x"
    assert read_extra(path, "missing") is None
    assert read_extra(path, "../manifest.json") is None
    assert emb.EmbeddingTable.restore(path).checksum() == t.checksum()
    plain = t.snapshot(tmp_path)  # a snapshot written without extra files has none
    assert read_extra(plain, "dedup") is None and read_extra(path, "dedup") == blob


@pytest.mark.parametrize("tamper", ["rewrite", "same_size", "truncate", "remove"])
def test_tampered_extra_file_raises_corrupt_store(tmp_path: Path, tamper: str) -> None:
    t = filled_table()
    path = t.snapshot(tmp_path, extra_files={"dedup": b"window-0123456789", "other": b"fine"})
    file = path / "extra" / "dedup"
    if tamper == "rewrite":
        file.write_bytes(b"forged")
    elif tamper == "same_size":
        file.write_bytes(b"window-0123456780")
    elif tamper == "truncate":
        file.write_bytes(b"")
    else:
        file.unlink()
    with pytest.raises(emb.CorruptStore, match="dedup"):
        read_extra(path, "dedup")
    assert read_extra(path, "other") == b"fine"
    with pytest.raises(emb.CorruptStore):  # restore verifies every file of the snapshot
        emb.EmbeddingTable.restore(path)


@pytest.mark.parametrize("name", ["", "a/b", "../x", "/abs", ".", "..", "dedup\n", "sp ace", "x" * 65,
                                  "ünï", "a\\b"])
def test_bad_extra_file_names_raise_and_write_nothing(tmp_path: Path, name: str) -> None:
    t = filled_table()
    t.snapshot(tmp_path)
    t.push(np.array([3]), np.ones((1, DIM), np.float32))
    for incremental in (False, True):
        with pytest.raises(emb.InvalidArgument, match="extra_files"):
            t.snapshot(tmp_path, incremental=incremental, extra_files={"ok": b"1", name: b"2"})
    assert len(list_snapshots(tmp_path)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [list_snapshots(tmp_path)[0].name]
    # the failed attempts left the table's changes pending: the next increment still holds row 3
    path = t.snapshot(tmp_path, incremental=True)
    assert path.name.endswith("-incr")
    assert emb.EmbeddingTable.restore(tmp_path).checksum() == t.checksum()


def test_extra_file_contents_must_be_bytes(tmp_path: Path) -> None:
    t = filled_table()
    with pytest.raises(emb.InvalidArgument, match="extra_files"):
        t.snapshot(tmp_path, extra_files={"dedup": "text, not bytes"})
    assert list_snapshots(tmp_path) == []
    path = t.snapshot(tmp_path, extra_files={"a": bytearray(b"ba"), "b": memoryview(b"mv")})
    assert read_extra(path, "a") == b"ba" and read_extra(path, "b") == b"mv"


def test_extra_files_in_incremental_snapshots(tmp_path: Path) -> None:
    t = filled_table()
    full = t.snapshot(tmp_path, extra_files={"dedup": b"v1"})
    t.push(np.array([1, 15]), np.ones((2, DIM), np.float32))
    t.delete(np.array([2]))
    incr = t.snapshot(tmp_path, incremental=True, extra_files={"dedup": b"v2", "more": b"m"})
    assert incr.name.endswith("-incr") and full.name.endswith("-full")
    assert read_extra(full, "dedup") == b"v1"
    assert read_extra(incr, "dedup") == b"v2" and read_extra(tmp_path, "dedup") == b"v2"
    assert read_extra(incr, "more") == b"m" and read_extra(full, "more") is None
    assert emb.EmbeddingTable.restore(tmp_path).checksum() == t.checksum()
    t.push(np.array([4]), np.ones((1, DIM), np.float32))
    bare = t.snapshot(tmp_path, incremental=True)  # extra files are per snapshot: not inherited
    assert read_extra(bare, "dedup") is None
    assert emb.EmbeddingTable.restore(tmp_path).checksum() == t.checksum()
    # a tampered extra file of a parent breaks the restore of the whole chain
    (incr / "extra" / "dedup").write_bytes(b"v3")
    with pytest.raises(emb.CorruptStore):
        emb.EmbeddingTable.restore(tmp_path)
    with pytest.raises(emb.CorruptStore):
        read_extra(incr, "dedup")
    assert read_extra(full, "dedup") == b"v1"
