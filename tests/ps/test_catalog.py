"""The data dir's own files: the table registry and the server id are checksummed (a flipped bit is caught,
not trusted), and a full disk while rewriting them is ``StorageFull`` that leaves the old file as it was."""

from __future__ import annotations

import os

import pytest

from tigana import embeddings as emb
from tigana.embeddings.files import temp_beside
from tigana.ps.routing import TableDef
from tigana.ps.shard.catalog import Catalog, write_atomic


def _tables() -> list[TableDef]:
    return [TableDef(emb.TableConfig(name="user_id", dim=8)), TableDef(emb.TableConfig(name="item", dim=4))]


def test_the_registry_round_trips_and_a_flipped_bit_is_caught(tmp_path) -> None:
    cat = Catalog(tmp_path)
    cat.save_tables(_tables(), 4096, None)
    tables, num_slots, _ = cat.load_tables()
    assert sorted(t.config.name for t in tables) == ["item", "user_id"] and num_slots == 4096
    raw = bytearray((tmp_path / "tables.json").read_bytes())
    at = raw.index(b'"dim": 8') + len(b'"dim": ')
    raw[at] = ord("9")  # still valid JSON, a different table
    (tmp_path / "tables.json").write_bytes(bytes(raw))
    with pytest.raises(emb.CorruptStore, match="tables.json"):
        cat.load_tables()
    moved = cat.quarantine(None)
    assert moved.exists() and not (tmp_path / "tables.json").exists()
    assert cat.load_tables() == ([], None, None)


def test_a_damaged_server_id_is_refused(tmp_path) -> None:
    cat = Catalog(tmp_path)
    sid = cat.server_id()
    assert Catalog(tmp_path).server_id() == sid
    (tmp_path / "server-id").write_text((tmp_path / "server-id").read_text().replace(sid[0], "z" if sid[0] != "z" else "y", 1))
    with pytest.raises(emb.CorruptStore, match="server id"):
        Catalog(tmp_path).server_id()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_while_rewriting_a_file_is_storage_full_and_keeps_the_old_one(tmp_path) -> None:
    target = tmp_path / "tables.json"
    write_atomic(target, "old")
    # the temp file write_atomic uses, made a link to /dev/full: every write to it fails with ENOSPC
    tmp = temp_beside(target)
    tmp.symlink_to("/dev/full")
    with pytest.raises(emb.StorageFull, match="disk full"):
        write_atomic(target, "new" * 100_000)
    assert target.read_text() == "old" and not tmp.exists()
