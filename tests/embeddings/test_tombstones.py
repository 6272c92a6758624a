"""Tombstones: the bounded log of evicted ids (against a reference model of every removal), and a table's
``removed_since``: evictions recorded, re-inserted and moved-away rows not, what a copy applies kept too."""

from __future__ import annotations

import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.embeddings import SGD, EmbeddingTable, TableConfig, Zeros
from tigana.embeddings.config import Eviction
from tigana.embeddings.tombstones import Tombstones

DIM = 2


@settings(max_examples=200, deadline=None)
@given(batches=st.lists(st.lists(st.integers(-50, 50), min_size=0, max_size=12), min_size=0, max_size=20),
       limit=st.integers(1, 30), query=st.integers(-1, 21))
def test_the_log_holds_every_removal_since_its_floor(batches: list[list[int]], limit: int, query: int) -> None:
    log = Tombstones(limit)
    removed: list[tuple[int, float]] = []  # the reference: every removal ever recorded
    for t, ids in enumerate(batches):
        log.record(np.array(ids, np.int64), float(t))
        removed += [(i, float(t)) for i in ids]
    got, complete = log.since(float(query))
    want = sorted({i for i, t in removed if t >= query})
    assert set(got.tolist()) <= set(want) and list(got) == sorted(set(got.tolist()))  # sorted, unique, true
    assert complete == (query > log.floor)
    if complete:
        assert got.tolist() == want  # complete: nothing is missing
    assert len(log) <= max(limit, max((len(b) for b in batches), default=0))  # the newest batch always stays


def test_a_table_records_its_evictions_not_moves_and_forgets_rows_inserted_again() -> None:
    table = EmbeddingTable(TableConfig("t", dim=DIM, optimizer=SGD(lr=1.0), initializer=Zeros(),
                                       eviction=Eviction(max_rows=100)))
    try:
        before = time.time()
        table.push(np.arange(300), np.ones((300, DIM), np.float32))  # the cap evicts the least recent rows
        table.evict()
        gone, complete = table.removed_since(before)
        assert complete and gone.size == 300 - len(table)
        held = table.export_rows().ids
        assert not np.isin(gone, held).any()
        # an evicted id written again is no tombstone (its row is in the delta instead)
        again = gone[:5]
        table.push(again, np.ones((5, DIM), np.float32))
        assert not np.isin(again, table.removed_since(before)[0]).any()
        # a delete that is a move (a slot handed over) leaves no tombstone; a copy applying its primary's
        # eviction keeps one
        held = table.export_rows().ids
        t = time.time()
        table.delete(held[:3])
        assert table.removed_since(t)[0].size == 0
        table.apply_changes(deleted=held[3:6])
        np.testing.assert_array_equal(table.removed_since(t)[0], np.sort(held[3:6]))
        # a predicate selects (the slots a server exports)
        odd, _ = table.removed_since(before, lambda ids: ids % 2 == 1)
        assert (odd % 2 == 1).all() and odd.size
    finally:
        table.close()


def test_removals_before_the_table_or_a_copy_of_some_slots_are_unknown() -> None:
    before = time.time()
    time.sleep(0.01)
    table = EmbeddingTable(TableConfig("t", dim=DIM, optimizer=SGD(lr=1.0), initializer=Zeros()))
    try:
        assert not table.removed_since(before)[1]  # a table this process made (or loaded) knows nothing earlier
        created = time.time()
        assert table.removed_since(created)[1]
        time.sleep(0.01)
        copied = time.time()
        table.tombstones_unknown_before(copied)  # rows of some slots now come from another server
        assert not table.removed_since(created)[1] and table.removed_since(copied + 1e-3)[1]
    finally:
        table.close()
