"""The passes over a table's ids by routing slot (``stored_ids_in_slots``, ``rows_per_slot``) hold the table's
lock per range of buckets, with writes between the ranges: every id stored when the pass begins and not removed
before it ends is listed, nothing listed was never stored, and only ids of the wanted slots (an id removed and
stored again meanwhile may be listed twice)."""

from __future__ import annotations

import tempfile
from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cut import apply, make_table
from test_cut import write_op_st as op_st

from tigana import embeddings as emb
from tigana.embeddings import _exporting
from tigana.embeddings.hashtable import HashIndex
from tigana.embeddings.mixing import slots_of_keys

NUM_SLOTS = 16
# ``op_st``: test_cut's writes, without eviction (an id evicted and pulled again was removed meanwhile, which the
# property leaves open) and without its cut reads


def stored(table: emb.EmbeddingTable) -> set[int]:
    return set(table.stored_ids().tolist())


@given(kind=st.sampled_from(["plain", "spill", "numpy", "adagrad"]), before=st.lists(op_st, max_size=8),
       during=st.lists(op_st, max_size=12), buckets=st.integers(1, 64),
       wanted=st.lists(st.booleans(), min_size=NUM_SLOTS, max_size=NUM_SLOTS), counts=st.booleans())
@settings(max_examples=150, deadline=None)
def test_a_pass_by_slot_between_writes_lists_every_id_kept(kind, before, during, buckets, wanted, counts) -> None:
    wanted = np.array(wanted, bool)
    with tempfile.TemporaryDirectory() as d:
        table = make_table(kind, d)
        try:
            for op, ids, arg in before:
                apply(table, op, ids, arg)
            at_start = stored(table)
            ever, removed = set(at_start), set()
            queue = list(during)
            visit = HashIndex.slot_counts if counts else HashIndex.keys_in_slots

            def between(index, *args):  # a write (under the same re-entrant lock) before each range is read
                if queue and args[-1] is not None:  # not in the pass under one hold (stop None)
                    op, ids, arg = queue.pop(0)
                    apply(table, op, ids, arg)
                    if op == "delete":
                        removed.update(ids)
                    ever.update(stored(table))
                return visit(index, *args)

            name = "slot_counts" if counts else "keys_in_slots"
            with mock.patch.object(_exporting, "SCAN_BUCKETS", buckets), mock.patch.object(HashIndex, name, between):
                got = table.rows_per_slot(NUM_SLOTS) if counts else table.stored_ids_in_slots(NUM_SLOTS, wanted)
            kept = np.array(sorted((at_start - removed) & stored(table)), np.int64)
            kept = kept[wanted[slots_of_keys(kept, NUM_SLOTS)]] if not counts else kept
            if counts:
                assert got.shape == (NUM_SLOTS,) and got.sum() <= len(ever)
                assert (got >= np.bincount(slots_of_keys(kept, NUM_SLOTS), minlength=NUM_SLOTS)).all()
            else:
                assert got.dtype == np.int64
                assert set(kept.tolist()) <= set(got.tolist()) <= ever
                assert wanted[slots_of_keys(got, NUM_SLOTS)].all()
        finally:
            table.close()


def test_a_pass_by_slot_holds_the_lock_per_range_of_buckets() -> None:
    """Writers get the lock between the ranges: a pass over 200k rows takes it once per ``SCAN_BUCKETS``
    buckets of each partition of the index (plus twice), not once for the whole table."""
    table = emb.EmbeddingTable(emb.TableConfig("t", dim=4))
    try:
        table.pull(np.arange(200_000, dtype=np.int64))
        holds = []
        real = HashIndex.keys_in_slots

        def visit(index, *args):
            holds.append(args[2:])
            return real(index, *args)

        with mock.patch.object(_exporting, "SCAN_BUCKETS", 1 << 14), mock.patch.object(HashIndex, "keys_in_slots",
                                                                                        visit):
            got = table.stored_ids_in_slots(NUM_SLOTS, np.ones(NUM_SLOTS, bool))
        assert sorted(got.tolist()) == list(range(200_000))
        assert holds == [(lo, lo + (1 << 14)) for part in table._index.partitions()  # each partition in turn
                         for lo in range(0, part.capacity, 1 << 14)]
    finally:
        table.close()
