"""What the storage engine offers replication: ``Changes`` recorded by pull/push and replayed on a replica with
``apply_changes``, which validates a batch before it changes anything."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from replication_tables import (
    ADMISSIONS,
    BACKENDS,
    DIM,
    EDGES,
    EVICTIONS,
    admission_counts,
    config,
    never,
    replicate,
    row_bytes,
    rows_by_id,
    zeros,
)

from tigana import embeddings as emb

# --- Changes + apply_changes against a replica ---------------------------------------------------------------
ids_st = st.lists(st.one_of(st.sampled_from(EDGES), st.integers(0, 24)), min_size=0, max_size=12)
op_st = st.tuples(st.sampled_from(["pull", "pull", "push", "push", "peek"]), ids_st, st.integers(-3, 3))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("admission", sorted(ADMISSIONS))
@pytest.mark.parametrize("eviction", sorted(EVICTIONS))
@settings(max_examples=30, deadline=None)
@given(ops=st.lists(op_st, min_size=1, max_size=15))
def test_replica_fed_with_changes_matches_primary(backend: str, admission: str, eviction: str, ops) -> None:
    cfg = config(backend, admission=ADMISSIONS[admission], eviction=EVICTIONS[eviction])
    primary, replica = emb.EmbeddingTable(cfg), emb.EmbeddingTable(cfg)
    replica.set_evictable(never)
    for op, id_list, g in ops:
        ids = np.array(id_list, np.int64)
        before = rows_by_id(primary)
        changes = emb.Changes()
        if op == "pull":
            primary.pull(ids, changes=changes)
        elif op == "peek":
            primary.pull(ids, insert=False, changes=changes)
        else:
            grads = np.full((ids.size, DIM), g, np.float32) + np.arange(DIM, dtype=np.float32)
            primary.push(ids, grads, changes=changes)
        after = rows_by_id(primary)
        written, deleted = set(changes.written_ids().tolist()), set(changes.deleted_ids().tolist())
        seen_ids, seen_counts = changes.sighting_arrays()

        # what was recorded is complete: every row added or changed was written, every row gone was deleted
        assert set(after) - set(before) <= written
        assert set(before) - set(after) <= deleted
        assert {i for i in set(before) & set(after) if before[i][:3] != after[i][:3]} <= written
        # ...and no more than the call did
        assert written <= set(id_list)
        assert deleted <= set(before) | written
        if op == "peek":
            assert not changes
        if op != "pull" or admission == "open":
            assert seen_ids.size == 0
        else:  # a pull counts each id not stored yet, with its multiplicity in the batch
            expect = {i: id_list.count(i) for i in set(id_list) - set(before)}
            assert dict(zip(seen_ids.tolist(), seen_counts.tolist(), strict=True)) == expect

        replicate(primary, replica, changes)
        assert replica.checksum() == primary.checksum()
        assert np.array_equal(np.sort(replica.stored_ids()), np.sort(primary.stored_ids()))
        assert rows_by_id(replica) == after  # metadata too: update counts, steps, times
        assert replica.step == primary.step
        assert admission_counts(replica) == admission_counts(primary)

    # fail over: the replica admits exactly what the primary would for the same pull
    probe = np.array([0, 1, 1, 2, 3, 3, 3, 30, 31, 31, -1], np.int64)
    a, b = emb.Changes(), emb.Changes()
    primary.pull(probe, changes=a)
    replica.pull(probe, changes=b)
    assert np.array_equal(a.written_ids(), b.written_ids())
    for x, y in zip(a.sighting_arrays(), b.sighting_arrays(), strict=True):
        assert np.array_equal(x, y)
    primary.close()
    replica.close()


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(ops=st.lists(op_st, min_size=1, max_size=15))
def test_replica_of_a_spilling_table_matches_primary(backend: str, ops) -> None:
    with tempfile.TemporaryDirectory() as d:
        cfg = config(backend, admission=emb.Admission(min_count=2), eviction=emb.Eviction(max_rows=12),
                     memory_budget=4 * row_bytes(backend), spill_dir=d)
        primary, replica = emb.EmbeddingTable(cfg), emb.EmbeddingTable(cfg)
        replica.set_evictable(never)
        try:
            for op, id_list, g in ops:
                ids = np.array(id_list, np.int64)
                changes = emb.Changes()
                if op == "push":
                    grads = np.full((ids.size, DIM), g, np.float32) + np.arange(DIM, dtype=np.float32)
                    primary.push(ids, grads, changes=changes)
                else:
                    primary.pull(ids, insert=op == "pull", changes=changes)
                replicate(primary, replica, changes)
                assert replica.checksum() == primary.checksum()
                assert np.array_equal(np.sort(replica.stored_ids()), np.sort(primary.stored_ids()))
                assert admission_counts(replica) == admission_counts(primary)
        finally:
            primary.close()
            replica.close()


OPTIMIZERS = {"sgd": emb.SGD(lr=0.1), "adagrad": emb.Adagrad(lr=0.1), "rowwise": emb.RowWiseAdagrad(lr=0.1),
              "adam": emb.Adam(lr=0.01), "ftrl": emb.FTRL(alpha=0.1)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@settings(max_examples=12, deadline=None)
@given(writes=st.lists(st.tuples(st.sampled_from(["pull", "push"]), ids_st, st.integers(-3, 3),
                                 st.sampled_from([0.0, np.nan, 3e19])), min_size=1, max_size=6))
def test_a_write_exports_the_rows_it_wrote(backend: str, optimizer: str, dtype: str, writes) -> None:
    """A push, or a pull that inserts, records its rows as it wrote them (no read back): the same bits as the
    rows read back after it, whatever the optimizer, the storage dtype, new ids, duplicates, or rows a push
    dropped for a non-finite update."""
    cfg = config(backend, optimizer=OPTIMIZERS[optimizer], dtype=dtype, nonfinite_grads="skip_rows")
    primary, replica = emb.EmbeddingTable(cfg), emb.EmbeddingTable(cfg)
    for op, id_list, g, poison in writes:
        ids = np.array(id_list, np.int64)
        changes = emb.Changes()
        if op == "pull":
            primary.pull(ids, changes=changes)
        else:
            grads = np.full((ids.size, DIM), g, np.float32) + np.arange(DIM, dtype=np.float32)
            if poison and ids.size:  # NaN is screened out before the update, 3e19 overflows in it: skipped either way
                grads[0, 0] = poison
            primary.push(ids, grads, changes=changes)
        assert (changes.rows is not None) == bool(changes.written)
        replicate(primary, replica, changes)  # checks the export against the rows read back
        assert rows_by_id(replica) == rows_by_id(primary)
    primary.close()
    replica.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_changes_record_inserts_updates_evictions_and_sightings(backend: str) -> None:
    t = emb.EmbeddingTable(config(backend, admission=emb.Admission(min_count=2),
                                  eviction=emb.Eviction(max_rows=4)))
    c = emb.Changes()
    t.pull(np.array([1, 2, 2, 3]), changes=c)  # 2 is seen twice: admitted; 1 and 3 once: counted
    assert c.written_ids().tolist() == [2]
    assert c.deleted_ids().size == 0
    ids, counts = c.sighting_arrays()
    assert dict(zip(ids.tolist(), counts.tolist(), strict=True)) == {1: 1, 2: 2, 3: 1}
    assert ids.dtype == counts.dtype == np.int64

    c = emb.Changes()
    t.push(np.array([2, 2, 9]), np.ones((3, DIM), np.float32), changes=c)  # 9 is not admitted: dropped
    assert c.written_ids().tolist() == [2] and not c.deleted and not c.sightings

    t.pull(np.array([1, 3, 5, 5, 6, 6, 7, 7]))  # 1, 3 on their second sighting; 6 rows > max_rows 4
    assert len(t) == 4
    c = emb.Changes()
    t.pull(np.array([8, 8]), changes=c)  # an insert past the cap evicts at once
    assert c.written_ids().tolist() == [8]
    assert c.deleted_ids().size >= 1 and not t.contains(c.deleted_ids()).any()
    assert len(t) <= 4

    empty = emb.Changes()
    assert not empty and empty.written_ids().size == empty.deleted_ids().size == 0
    assert [a.size for a in empty.sighting_arrays()] == [0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ttl_evictions_on_push_are_recorded(backend: str) -> None:
    t = emb.EmbeddingTable(config(backend, eviction=emb.Eviction(ttl_steps=2)))
    t.push(np.array([1, 2]), np.ones((2, DIM), np.float32))
    gone: set[int] = set()
    for _ in range(6):
        c = emb.Changes()
        t.push(np.array([3]), np.ones((1, DIM), np.float32), changes=c)
        assert c.written_ids().tolist() == [3]
        gone |= set(c.deleted_ids().tolist())
    assert gone == {1, 2} and t.stored_ids().tolist() == [3]


# --- apply_changes validation ---------------------------------------------------------------------------
def batch(ids, *, dim: int = DIM, width: int = DIM, weights: np.ndarray | None = None) -> emb.RowBatch:
    ids = np.asarray(ids, np.int64)
    n = ids.size
    w = np.ones((n, dim), np.float32) if weights is None else weights
    return emb.RowBatch(ids, w, np.ones((n, width), np.float32), np.ones(n, np.int64),
                        np.full(n, 3, np.int64), np.zeros(n))


BAD_CHANGES = {
    "nan_weights": dict(rows=batch([100, 101], weights=np.array([[0, 0, 0, 0], [0, np.nan, 0, 0]], np.float32))),
    "inf_weights": dict(rows=batch([100], weights=np.full((1, DIM), np.inf, np.float32))),
    "wrong_dim": dict(rows=batch([100, 101], dim=DIM + 1)),
    "wrong_state_width": dict(rows=batch([100, 101], width=1)),
    "duplicate_ids": dict(rows=batch([100, 100])),
    "not_a_batch": dict(rows={"ids": [1]}),
    "negative_count": dict(sightings=(np.array([200, 201]), np.array([1, -1]))),
    "zero_count": dict(sightings=(np.array([200]), np.array([0]))),
    "float_counts": dict(sightings=(np.array([200]), np.array([1.0]))),
    "misaligned_sightings": dict(sightings=(np.array([200, 201]), np.array([1]))),
    "2d_sighting_ids": dict(sightings=(np.array([[200]]), np.array([[1]]))),
    "float_deleted": dict(deleted=np.array([0.5])),
    "2d_deleted": dict(deleted=np.array([[0, 1]])),
    "negative_step": dict(step=-1),
    "bad_step": dict(step="soon"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(BAD_CHANGES))
def test_apply_changes_validates_before_changing_anything(backend: str, case: str) -> None:
    t = emb.EmbeddingTable(config(backend, admission=emb.Admission(min_count=3)))
    t.import_rows(batch(np.arange(10)))
    t.pull(np.array([200, 201]))  # counted, not admitted
    before = (t.checksum(), sorted(t.stored_ids().tolist()), t.step, admission_counts(t))
    good = dict(rows=batch([100, 101]), deleted=np.array([0, 1]),
                sightings=(np.array([200, 201]), np.array([1, 1])), step=50)
    with pytest.raises(emb.InvalidArgument, match="'clicks'"):
        t.apply_changes(**{**good, **BAD_CHANGES[case]})
    assert (t.checksum(), sorted(t.stored_ids().tolist()), t.step, admission_counts(t)) == before
    t.apply_changes(**good)  # the good parts alone apply
    assert sorted(t.stored_ids().tolist()) == [*range(2, 10), 100, 101]
    assert t.step == 50 and admission_counts(t) == {200: 2, 201: 2}


def test_apply_changes_never_lowers_the_step_and_accepts_nothing() -> None:
    t = emb.EmbeddingTable(config("auto"))
    t.push(np.array([1]), zeros(1), step=20)
    before = t.checksum()
    t.apply_changes()
    t.apply_changes(rows=emb.RowBatch.empty(DIM, DIM), deleted=np.array([], np.int64),
                    sightings=(np.array([], np.int64), np.array([], np.int64)), step=5)
    assert t.step == 20 and t.checksum() == before


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-3, 3), max_size=200),
       dtype=st.sampled_from([np.int64, np.int32, np.uint64]))
def test_the_distinct_ids_match_numpy(values: list[int], dtype) -> None:
    """``sorted_unique`` (sort + one pass, not NumPy 2.4's slower hash path) is ``np.unique``; ``unique`` has the
    same ids in first-seen order."""
    from tigana.embeddings.changes import sorted_unique, unique

    info = np.iinfo(dtype)
    a = np.array([v for v in values if info.min <= v <= info.max], dtype)
    got = sorted_unique(a)
    assert got.dtype == a.dtype and got.tolist() == np.unique(a).tolist()
    ids = a.astype(np.int64) if dtype != np.uint64 else a.view(np.int64)
    first = unique(ids)
    assert sorted(first.tolist()) == np.unique(ids).tolist()
    assert first.tolist() == list(dict.fromkeys(ids.tolist()))


@settings(max_examples=200, deadline=None)
@given(table=st.sets(st.integers(-(2**63), 2**63 - 1) | st.integers(-3, 3), max_size=100),
       ids=st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-3, 3), max_size=100))
def test_find_sorted_is_the_index_of_each_id_or_minus_one(table: set[int], ids: list[int]) -> None:
    """``find_sorted`` (a binary search each; serving's lookups and a checkpoint chain's restore) against a dict."""
    from tigana.embeddings.changes import find_sorted

    sorted_ids = np.array(sorted(table), np.int64)
    where = {v: i for i, v in enumerate(sorted_ids.tolist())}
    got = find_sorted(sorted_ids, np.array(ids, np.int64))
    assert got.tolist() == [where.get(v, -1) for v in ids]
