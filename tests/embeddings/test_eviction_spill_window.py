"""Eviction never reads a whole spill tier under the table's lock: a pass reads one window of it (or the capacity
victims it needs), and a TTL pass's sweep goes on a window per later write until every spilled row was judged.
The windows are shrunk here (``SPILL_WINDOW``, ``SPILL_SWEEP``) so that a small table has a tier many windows
long."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tigana import embeddings as emb
from tigana.embeddings import _evicting

DIM = 4
RESIDENT = 20  # rows the memory budget keeps in memory; the rest spill
INDEX = 12 * 97  # the budget also holds the index of spilled ids (97 buckets of 12 bytes hold 77)


def _table(tmp_path: Path, **eviction) -> emb.EmbeddingTable:
    config = emb.TableConfig("clicks", dim=DIM, optimizer=emb.SGD(lr=1.0), initializer=emb.Zeros(),
                             memory_budget=RESIDENT * (DIM * 4 + 17 + 18) + INDEX, spill_dir=str(tmp_path),
                             eviction=emb.Eviction(**eviction))
    return emb.EmbeddingTable(config)


def _count_reads(table: emb.EmbeddingTable, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records how many records each read of the spill tier asks for."""
    sizes: list[int] = []
    store = table._spill
    read = store.read

    def counted_read(slots, ids, **kw):
        sizes.append(len(ids))
        return read(slots, ids, **kw)

    monkeypatch.setattr(store, "read", counted_read)
    return sizes


@pytest.fixture
def small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_evicting, "SPILL_WINDOW", 8)
    monkeypatch.setattr(_evicting, "SPILL_SWEEP", 4)


def test_ttl_reads_the_spill_tier_a_window_at_a_time_and_sweeps_all_of_it(tmp_path, monkeypatch, small_windows):
    table = _table(tmp_path, ttl_steps=64)  # a TTL pass every 8 steps, the sweep on the writes between
    old = np.arange(100, dtype=np.int64)
    table.push(old, np.ones((100, DIM), np.float32))
    assert len(table._spilled) >= 10 * 8 and len(table._spilled) + len(table._index) == 100  # 10 windows long
    sizes = _count_reads(table, monkeypatch)
    # one new id a step: past step 65 the first 100 rows are expired; then ~5 rounds of the sweep (a round judges
    # every row but those a partition's growth moved back across the cursor: they wait for a later round; at 120
    # steps, ~2 rounds, 4 % of layouts still held one such row)
    for step in range(200):
        table.push(np.array([10_000 + step]), np.ones((1, DIM), np.float32))
    assert sizes and max(sizes) <= 8  # never the whole tier (a full scan read 80+ records at once before)
    assert not table.contains(old).any()  # yet every expired spilled row was judged, and evicted
    assert table.stats()["evictions"] >= 100
    table.close()


def test_lru_capacity_takes_spilled_rows_first_reading_only_the_victims_it_needs(tmp_path, monkeypatch,
                                                                                small_windows):
    table = _table(tmp_path, max_rows=150)
    table.push(np.arange(100, dtype=np.int64), np.ones((100, DIM), np.float32))
    sizes = _count_reads(table, monkeypatch)
    newest = np.arange(1000, 1100, dtype=np.int64)
    table.push(newest, np.ones((100, DIM), np.float32))  # 200 rows > 150: one pass evicts 52
    need = 200 - _evicting.eviction.capacity_target(150)
    assert table.stats()["evictions"] == need and len(table) == 200 - need
    assert sizes and max(sizes) <= need  # the victims' records, not the tier (180 records)
    resident, _ = table._index.items()
    assert table.contains(resident).all()  # the victims were spilled rows: every resident row stayed
    table.close()


def test_a_window_that_covers_the_tier_is_the_whole_tier_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(_evicting, "SPILL_WINDOW", 1000)
    table = _table(tmp_path, ttl_steps=8)
    table.push(np.arange(100, dtype=np.int64), np.ones((100, DIM), np.float32))
    for step in range(12):
        table.push(np.array([10_000 + step]), np.ones((1, DIM), np.float32))
    assert not table.contains(np.arange(100)).any()  # as before windows: exact TTL over the whole tier
    table.close()
