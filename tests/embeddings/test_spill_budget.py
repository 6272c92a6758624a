"""The memory budget covers the resident rows and the in-memory index of spilled ids: as the spill tier grows,
fewer rows stay resident, and the slab gives back the positions a smaller budget no longer needs, so the
engine's memory stays within the budget however many rows spill."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from replication_tables import rows_by_id

from tigana import embeddings as emb
from tigana.embeddings import _spilling, slab
from tigana.embeddings._spilling import _INDEX_BYTES_PER_ROW


def test_the_index_of_spilled_ids_counts_against_the_budget(tmp_path: Path) -> None:
    budget = 8 << 20
    t = emb.EmbeddingTable(emb.TableConfig("t", dim=8, optimizer=emb.RowWiseAdagrad(), initializer=emb.Zeros(),
                                           memory_budget=budget, spill_dir=str(tmp_path)))
    try:
        per_row = t._slab.row_nbytes + _INDEX_BYTES_PER_ROW
        for start in range(0, 200_000, 4096):
            t.pull(np.arange(start, start + 4096))
            resident = len(t._index) * per_row + t._spilled.nbytes
            assert resident <= budget, (start, resident)
        st = t.stats()
        assert st["rows_spilled"] > 100_000 and st["rows_resident"] < budget // per_row
        assert st["rows"] == 49 * 4096
        np.testing.assert_array_equal(t.pull(np.arange(10), insert=False), np.zeros((10, 8), np.float32))
    finally:
        t.close()


def _rows(table: emb.EmbeddingTable) -> dict[int, tuple]:
    """Each stored row's weights, state, update count and step (not its time: twins stamp their own clocks)."""
    return {i: row[:4] for i, row in rows_by_id(table).items()}


def _check_slab(table: emb.EmbeddingTable) -> None:
    """Every resident id points at its own position inside the slab, none at a free one."""
    _, positions = table._index.items()
    slab = table._slab
    assert positions.size == np.unique(positions).size
    assert positions.size == 0 or positions.max() < min(slab.capacity, slab.high_water)
    free = slab._free[:slab._n_free]
    assert not np.isin(positions, free).any() and free.size == np.unique(free).size


op_st = st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 3000), st.integers(1, 1500)),
    st.tuples(st.just("push"), st.lists(st.integers(0, 4500), min_size=1, max_size=40), st.integers(-3, 3)),
    st.tuples(st.just("budget"), st.sampled_from([2, 8, 64, 700, 3000]), st.just(0)),
)


@contextlib.contextmanager
def _chunks(n: int | None):
    """The spill's, the coldest-row pass's and the compaction's steps at ``n`` rows/buckets (None: as shipped),
    so that small tables take several steps too."""
    if n is None:
        yield
        return
    with mock.patch.object(_spilling, "_SPILL_CHUNK", n), mock.patch.object(_spilling, "_COLD_CHUNK", n), \
            mock.patch.object(slab, "_MOVE_CHUNK", n):
        yield


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(op_st, min_size=1, max_size=12), chunk=st.sampled_from([None, 7, 100]))
def test_a_slab_compacted_as_its_budget_shrinks_keeps_every_row(ops, chunk, tmp_path_factory) -> None:
    """Rows spill and come back, the budget grows and shrinks, and a slab whose capacity the budget no longer
    needs gives it back (``Slab.compact``): every row reads as in a twin that never spills. Spills, the pass
    that picks the coldest rows and compactions work a chunk at a time (``chunk``: smaller than shipped)."""
    with _chunks(chunk):
        _compacted_twins(ops, tmp_path_factory)


def _compacted_twins(ops, tmp_path_factory) -> None:
    cfg = emb.TableConfig("t", dim=4, optimizer=emb.Adagrad(lr=0.1), initializer=emb.Uniform(-1, 1))
    twin = emb.EmbeddingTable(cfg)
    tiered = emb.EmbeddingTable(dataclasses.replace(cfg, memory_budget=3000 * 80,
                                                    spill_dir=str(tmp_path_factory.mktemp("spill"))))
    row = tiered._slab.row_nbytes + _INDEX_BYTES_PER_ROW
    try:
        for op, a, b in ops:
            if op == "insert":
                ids = np.arange(a, a + b, dtype=np.int64)
                np.testing.assert_array_equal(tiered.pull(ids), twin.pull(ids))
            elif op == "push":
                ids = np.array(a, np.int64)
                grads = np.full((ids.size, 4), b, np.float32) + np.arange(4, dtype=np.float32)
                tiered.push(ids, grads)
                twin.push(ids, grads)
            else:
                tiered.set_memory_budget(a * row + tiered._spilled.nbytes + tiered._spill_marks.nbytes)
            _check_slab(tiered)
            assert _rows(tiered) == _rows(twin)
    finally:
        tiered.close()
        twin.close()


@pytest.mark.parametrize("chunk", [None, 1000])
def test_a_shrinking_budget_gives_the_slab_memory_back(chunk: int | None, tmp_path: Path) -> None:
    """A table that held 200 k rows in RAM and is then given a budget of 2 k keeps about 2 k positions, not its
    high-water mark; its rows are unchanged (also when the spill and the compaction take many chunks)."""
    with _chunks(chunk):
        _shrunk(tmp_path)


def _shrunk(tmp_path: Path) -> None:
    cfg = emb.TableConfig("t", dim=8, optimizer=emb.RowWiseAdagrad(), initializer=emb.Normal(std=0.1))
    twin = emb.EmbeddingTable(cfg)
    t = emb.EmbeddingTable(dataclasses.replace(cfg, memory_budget=64 << 20, spill_dir=str(tmp_path)))
    try:
        ids = np.arange(200_000, dtype=np.int64) * 7919
        t.pull(ids)
        twin.pull(ids)
        assert t._slab.capacity >= 200_000
        t.set_memory_budget(2_000 * (t._slab.row_nbytes + _INDEX_BYTES_PER_ROW) + t._spilled.nbytes + (1 << 20))
        t.pull(ids[:10])  # a call after the budget changed (the spill moved most rows to disk)
        st_ = t.stats()
        assert st_["compactions"] >= 1 and st_["rows_spilled"] > 150_000
        assert t._slab.capacity < 4 * max(len(t._index), 2_000)
        _check_slab(t)
        np.testing.assert_array_equal(t.pull(ids, insert=False), twin.pull(ids, insert=False))
        assert _rows(t) == _rows(twin)
    finally:
        t.close()
        twin.close()


@settings(max_examples=40, deadline=None)
@given(calls=st.lists(st.lists(st.integers(0, 400), min_size=1, max_size=60), min_size=1, max_size=12),
       k=st.integers(1, 500), held=st.integers(0, 80), chunk=st.sampled_from([None, 5, 64]),
       clock=st.sampled_from([0, 1 << 20, 1 << 28]))
def test_the_rows_a_spill_picks_are_the_coldest_not_held(calls, k, held, chunk, clock, tmp_path_factory) -> None:
    """``_coldest`` against a sort of every resident row by its access clock: the same clocks (ties may pick
    either row), none of the held positions, ids and positions that belong together; also with a clock past
    2**16, where a histogram bin holds many clocks."""
    t = emb.EmbeddingTable(emb.TableConfig("t", dim=2, optimizer=emb.SGD(), memory_budget=1 << 30,
                                           spill_dir=str(tmp_path_factory.mktemp("spill"))))
    t._clock = clock
    try:
        for ids in calls:  # each call stamps its rows with the next clock
            t.pull(np.array(ids, np.int64))
        ids, positions = t._index.items()
        clocks = t._slab.access_of(positions)
        hold = positions[np.random.default_rng(k).permutation(positions.size)[:held]]
        with _chunks(chunk):
            got_ids, got_pos = t._coldest(k, hold)
        free = ~np.isin(positions, hold)
        expect = np.sort(clocks[free])[:k]
        assert got_pos.size == min(k, int(free.sum())) == np.unique(got_pos).size
        assert not np.isin(got_pos, hold).any()
        np.testing.assert_array_equal(np.sort(t._slab.access_of(got_pos)), expect)
        np.testing.assert_array_equal(t._index.lookup(got_ids), got_pos)
    finally:
        t.close()
