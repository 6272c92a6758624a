"""Cuts of a table past its memory budget: a row that spills, or leaves the spill tier, while a cut is open is
read by the cut from the spill file (its parked slot), not kept in RAM, and the cut still yields the rows of
the table at its opening, bit for bit; the slots it read go back to the file."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from test_cut import assert_same, rows_held, sorted_rows, state_of

from tigana import embeddings as emb
from tigana.embeddings import _cutorder, cut

DIM = 8


def make_table(tmp_path: Path, budget: int) -> emb.EmbeddingTable:
    """A table whose memory budget (bytes) holds ``budget`` bytes: 160 KiB hold about 1,200 of its first 3,000
    rows, 1 MiB about 4,000 of 23,000 (the index of spilled ids shares the budget)."""
    return emb.EmbeddingTable(emb.TableConfig("t", dim=DIM, optimizer=emb.RowWiseAdagrad(lr=0.5), seed=5,
                                              initializer=emb.Normal(std=0.1), memory_budget=budget,
                                              spill_dir=str(tmp_path)))


def grads(n: int, value: float) -> np.ndarray:
    return np.full((n, DIM), value, np.float32)


@pytest.mark.parametrize("in_order", [False, True])
def test_rows_spilled_while_a_cut_is_open_are_read_from_the_file_not_kept_in_ram(tmp_path: Path,
                                                                                  in_order: bool) -> None:
    table = make_table(tmp_path, 160 << 10)
    try:
        table.pull(np.arange(3000))
        table.push(np.arange(0, 3000, 3), grads(1000, 0.5))
        assert 500 < table.stats()["rows_resident"] < 2500  # the cut opens on rows in RAM and on disk
        want, resident = state_of(table), table._index.items()[0].view(np.int64)
        c = table.cut()
        table.set_memory_budget(1 << 20)
        table.push(resident[:50], grads(50, 1.0))  # saved copies: the rows as of the cut, changed after
        assert rows_held(c) == 50
        table.pull(np.arange(3000, 23_000))  # new rows push every row of the cut out to the spill file
        assert not np.isin(resident, table._index.items()[0].view(np.int64)).any()
        table.pull(np.arange(0, 3000, 7))  # spilled rows of the cut come back to RAM ...
        table.delete(np.arange(1, 3000, 11))  # ... or leave the table
        assert rows_held(c) == 0  # every row of the cut is on disk: none of them in RAM
        got = list(c.batches(in_order=in_order))
        assert_same(sorted_rows(got, DIM, table.state_width), want)
        assert all((np.diff(b.ids) > 0).all() for b in got) or not in_order
    finally:
        table.close()


def test_the_slots_a_cut_reads_from_stay_until_it_has_read_them_then_go_back(tmp_path: Path) -> None:
    table = make_table(tmp_path, 160 << 10)
    try:
        table.pull(np.arange(2000))
        want = state_of(table)
        c = table.cut()
        table.pull(np.arange(2000, 6000))
        table.delete(np.arange(0, 2000, 2))  # their slots are the cut's: not written over by the inserts below
        table.pull(np.arange(6000, 9000))
        assert table._spill_pins._pinned > 0
        assert len(table._spill) > len(table._spilled)  # the records the cut reads, beside the table's
        assert_same(sorted_rows(list(c.batches(chunk=64)), DIM, table.state_width), want)
        assert table._spill_pins._pinned == 0 and table._spill_pins.nbytes == 0
        assert len(table._spill) == len(table._spilled)  # every slot the cut held is free again
        np.testing.assert_array_equal(table.rows_of(np.arange(1, 2000, 2)).weights,
                                      want.take(np.arange(1, 2000, 2)).weights)
    finally:
        table.close()


def test_a_cut_closed_before_reading_its_parked_rows_lets_go_of_their_slots(tmp_path: Path) -> None:
    table = make_table(tmp_path, 160 << 10)
    try:
        table.pull(np.arange(2000))
        first, second = table.cut(), table.cut()
        table.pull(np.arange(2000, 6000))
        table.delete(np.arange(0, 2000, 3))
        assert table._spill_pins._pinned > 0
        first.close()
        want = state_of(table)
        assert len(table._spill) > len(table._spilled)  # the second cut still holds its slots
        second.close()
        assert table._spill_pins._pinned == 0 and len(table._spill) == len(table._spilled)
        assert_same(state_of(table), want)
    finally:
        table.close()


def test_an_ordered_read_in_ranges_of_ids_holds_the_table_at_its_opening(tmp_path: Path) -> None:
    """A large ordered read collects one range of ids at a time; writes between the ranges (spills, pulls back,
    deletes, updates) leave the rows read those of the cut, in ascending order up to the rows parked."""
    table = make_table(tmp_path, 256 << 10)
    try:
        table.pull(np.arange(5000) * 7919)
        want = state_of(table)
        c = table.cut()
        reader = c.batches(chunk=256, in_order=True)
        got: list[emb.RowBatch] = []
        rng = np.random.default_rng(1)
        with mock.patch.object(_cutorder, "ORDERED_IDS", 600), mock.patch.object(cut, "ORDERED_ROWS", 100):
            assert len(_cutorder.id_ranges(c, 256)) > 4
            for step, batch in enumerate(reader):
                got.append(batch)
                some = rng.choice(5000, 40, replace=False) * 7919
                if step % 3 == 0:
                    table.push(some, grads(40, 0.25))
                elif step % 3 == 1:
                    table.delete(some[:5])
                else:
                    table.pull(np.arange(100) + 10_000_000 + 100 * step)
        assert_same(sorted_rows(got, DIM, table.state_width), want)
        assert len(got) > 10 and all((np.diff(b.ids) > 0).all() for b in got)
    finally:
        table.close()


def test_the_slab_gives_memory_back_while_a_cut_is_open_and_the_cut_reads_the_moved_rows_as_of_its_opening(
        tmp_path: Path) -> None:
    """A shrinking budget compacts the slab (rows past the new capacity move below it) even while a cut is open:
    the cut first writes the moving rows it has not read (as of its opening) to the spill file for itself."""
    table = make_table(tmp_path, 2 << 20)
    try:
        table.pull(np.arange(20_000))
        assert table.stats()["rows_spilled"] == 0
        want = state_of(table)
        c = table.cut()
        table.push(np.arange(0, 20_000, 5), grads(4000, 1.0))  # saved copies of some of them
        compactions, high = table._counters["compactions"], table._slab.high_water
        table.set_memory_budget(300 << 10)
        assert table._counters["compactions"] > compactions and table._slab.high_water < high // 2
        assert rows_held(c) <= len(table._index)
        table.push(np.arange(1, 20_000, 5), grads(4000, 2.0))
        assert_same(sorted_rows(list(c.batches(chunk=128)), DIM, table.state_width), want)
        assert table._spill_pins._pinned == 0 and len(table._spill) == len(table._spilled)
    finally:
        table.close()
