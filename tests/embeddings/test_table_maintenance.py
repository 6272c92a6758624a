"""A push or pull applies wholly or raises having changed nothing: the upkeep that runs after an apply
(eviction, spilling) never turns an applied call into an error. A bad spilled record met by an eviction pass
is counted, logged and left in place (reads of that id raise ``CorruptStore`` and change nothing)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from spill_records import corrupt_spilled

from tigana import embeddings as emb

DIM = 4


def _table(tmp_path: Path, **eviction) -> emb.EmbeddingTable:
    config = emb.TableConfig("clicks", dim=DIM, optimizer=emb.SGD(lr=1.0), initializer=emb.Zeros(),
                             memory_budget=20 * (DIM * 4 + 29 + 18), spill_dir=str(tmp_path),
                             eviction=emb.Eviction(**eviction))
    return emb.EmbeddingTable(config)


def _corrupt_one_spilled(table: emb.EmbeddingTable) -> int:
    """Flip bits inside one spilled record (its CRC then fails); returns its id."""
    return corrupt_spilled(table)


def test_push_that_meets_a_bad_spilled_record_while_evicting_applies_and_returns(tmp_path: Path) -> None:
    table = _table(tmp_path, max_rows=150)
    first = np.arange(100, dtype=np.int64)
    table.push(first, np.ones((100, DIM), np.float32))
    victim = _corrupt_one_spilled(table)
    fresh = np.arange(1000, 1100, dtype=np.int64)  # 200 rows > max_rows: the push's eviction pass scans the tier
    changes = emb.Changes()
    applied = table.push(fresh, np.full((100, DIM), 2.0, np.float32), changes=changes)
    assert applied == 100
    stats = table.stats()
    assert stats["corrupt_rows"] == 1 and stats["evictions"] > 0
    assert table.contains(np.array([victim]))[0]  # kept where it is: copies may still hold a good one
    alive = fresh[table.contains(fresh)]
    assert alive.size and np.array_equal(table.pull(alive), np.full((alive.size, DIM), -2.0, np.float32))
    assert set(changes.written_ids().tolist()) == set(fresh.tolist())
    before = len(table)
    with pytest.raises(emb.CorruptStore):  # reading the bad row still raises, and changes nothing
        table.pull(np.array([victim, 5000]))
    assert len(table) == before and not table.contains(np.array([5000]))[0]
    table.push(np.array([2000]), np.ones((1, DIM), np.float32))  # the next pass counts it once, not again
    assert table.stats()["corrupt_rows"] == 1
    table.close()


def test_pull_that_meets_a_bad_spilled_record_while_evicting_applies_and_returns(tmp_path: Path) -> None:
    table = _table(tmp_path, max_rows=150)
    table.pull(np.arange(100, dtype=np.int64))
    _corrupt_one_spilled(table)
    rows = table.pull(np.arange(1000, 1100, dtype=np.int64))
    assert rows.shape == (100, DIM) and not rows.any()
    assert table.stats()["corrupt_rows"] == 1 and len(table) <= 151
    table.close()


def test_ttl_scan_that_meets_a_bad_spilled_record_still_expires_the_rest(tmp_path: Path) -> None:
    table = _table(tmp_path, ttl_steps=8)
    table.push(np.arange(100, dtype=np.int64), np.ones((100, DIM), np.float32))
    victim = _corrupt_one_spilled(table)
    for step in range(12):
        table.push(np.array([10_000 + step]), np.ones((1, DIM), np.float32))
    assert table.stats()["corrupt_rows"] == 1
    assert table.contains(np.array([victim]))[0] and not table.contains(np.arange(100)).sum() > 1
    table.close()


def test_failing_upkeep_is_counted_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = _table(tmp_path)
    table.push(np.arange(100, dtype=np.int64), np.ones((100, DIM), np.float32))

    def broken(*args, **kwargs):
        raise emb.CorruptStore("spill file is corrupt")

    monkeypatch.setattr(table._spill, "write", broken)
    assert table.push(np.arange(200, 260, dtype=np.int64), np.ones((60, DIM), np.float32)) == 60
    assert table.stats()["upkeep_failures"] >= 1
    table.close()
