"""The memory ceiling: when the spill tier cannot take rows (its LMDB map capped by ``spill_max_bytes``), new
rows past 1.25x the budget are refused with ``StorageFull`` before anything changes; stored rows still
update; restoring with a larger cap (``configure``) lets inserts resume."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tigana import embeddings as emb


def test_inserts_past_the_ceiling_are_refused_and_change_nothing(tmp_path) -> None:
    cfg = emb.TableConfig(name="t", dim=16, optimizer=emb.Adagrad(lr=0.1), initializer=emb.Zeros(),
                          memory_budget=1 << 20, spill_dir=str(tmp_path / "spill"), spill_max_bytes=1 << 20)
    table = emb.EmbeddingTable(cfg)
    stored = 0
    with pytest.raises(emb.StorageFull, match="table 't'.*spill tier is full"):
        while True:
            table.pull(np.arange(stored, stored + 2000))
            stored += 2000
    before, rows = table.checksum(), len(table)
    assert rows == stored and table.stats()["refused_inserts"] >= 2000
    with pytest.raises(emb.StorageFull):
        table.push(np.arange(stored, stored + 2000), np.ones((2000, 16), np.float32))
    assert table.checksum() == before and len(table) == rows  # refused: nothing changed
    table.push(np.arange(100), np.ones((100, 16), np.float32))  # stored rows still update
    assert table.checksum() != before
    path = table.snapshot(tmp_path / "snap")
    table.close()

    bigger = emb.EmbeddingTable.restore(
        path, configure=lambda c: dataclasses.replace(c, spill_max_bytes=64 << 20, spill_dir=str(tmp_path / "s2")))
    assert len(bigger) == rows
    bigger.pull(np.arange(stored, stored + 2000))  # inserts resume
    assert len(bigger) == rows + 2000
    with pytest.raises(emb.InvalidArgument, match="may change only"):
        emb.EmbeddingTable.restore(path, configure=lambda c: dataclasses.replace(c, dim=8))
    bigger.close()


def test_making_room_never_spills_the_rows_of_the_batch_being_applied(tmp_path) -> None:
    """A batch that mixes stored ids with enough new ones to cross the ceiling makes room by spilling cold rows,
    never the batch's own (their slab positions are already resolved): each row gets exactly its own update."""
    cfg = emb.TableConfig(name="t", dim=4, optimizer=emb.SGD(lr=1.0), initializer=emb.Zeros(),
                          memory_budget=600, spill_dir=str(tmp_path / "spill"))
    table = emb.EmbeddingTable(cfg)
    budget_rows = table._budget_rows  # a handful of rows at this budget
    old = np.arange(budget_rows, dtype=np.int64)
    table.pull(old[:2])  # the coldest rows: the first a spill would take
    table.pull(old[2:])
    ids = np.concatenate([old[:2], np.arange(1000, 1000 + budget_rows // 2 + 2)])  # cold stored ids + new ones
    grads = (np.arange(len(ids), dtype=np.float32)[:, None] + 1) * np.ones((1, 4), np.float32)
    table.push(ids, grads)
    rows = table.export_rows()
    got = dict(zip(rows.ids.tolist(), rows.weights[:, 0].tolist(), strict=True))
    assert {i: got[i] for i in ids.tolist()} == {i: -float(k + 1) for k, i in enumerate(ids.tolist())}
    assert all(got[i] == 0.0 for i in old[2:].tolist())
    table.close()
