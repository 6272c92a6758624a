"""What the storage engine offers replication, row by row: ``set_evictable`` (rows a replica must keep),
``checksums_by`` (per-bucket checksums to compare copies) and ``stored_ids`` (every id, spilled ones too)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from replication_tables import BACKENDS, DIM, EDGES, config, never, row_bytes, zeros

from tigana import embeddings as emb


# --- set_evictable ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_set_evictable_protects_rows_from_capacity_eviction(backend: str, policy: str) -> None:
    t = emb.EmbeddingTable(config(backend, eviction=emb.Eviction(max_rows=10, policy=policy)))
    t.set_evictable(lambda ids: ids % 2 == 0)
    protected = np.arange(1, 40, 2)  # 20 odd ids, more than max_rows on their own
    evictable = np.arange(0, 40, 2)
    t.push(protected, zeros(20))
    t.pull(np.array([1001]))  # odd: an insert past the cap scans, and may evict only even ids
    t.push(evictable, zeros(20))
    for i in range(100, 140, 2):
        t.pull(np.array([i]))
    t.evict()
    assert t.contains(protected).all() and t.contains(np.array([1001]))[0]
    kept_even = np.array([i for i in t.stored_ids().tolist() if i % 2 == 0])
    assert 0 < kept_even.size <= 10 and t.stats()["evictions"] > 0
    t.set_evictable(None)  # every row is evictable again
    t.evict()
    assert len(t) <= 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_set_evictable_protects_rows_from_ttl(backend: str) -> None:
    t = emb.EmbeddingTable(config(backend, eviction=emb.Eviction(ttl_steps=2)))
    t.set_evictable(lambda ids: ids >= 100)
    t.push(np.array([1, 2, 100, 101]), zeros(4))
    for _ in range(10):  # the automatic TTL pass runs on push
        t.push(np.array([500]), zeros(1))
    t.evict()
    assert sorted(t.stored_ids().tolist()) == [1, 2, 500]
    t.set_evictable(never)
    for _ in range(10):
        t.push(np.array([7]), zeros(1))
    t.evict()
    assert sorted(t.stored_ids().tolist()) == [1, 2, 7, 500]


@pytest.mark.parametrize("backend", BACKENDS)
def test_set_evictable_covers_spilled_rows(backend: str, tmp_path: Path) -> None:
    t = emb.EmbeddingTable(config(backend, eviction=emb.Eviction(ttl_steps=2), spill_dir=str(tmp_path),
                                  memory_budget=4 * row_bytes(backend)))
    t.set_evictable(lambda ids: ids >= 100)
    try:
        old = np.r_[np.arange(20), np.arange(100, 120)]
        t.push(old, zeros(40))
        for _ in range(6):
            t.push(np.array([500]), zeros(1))
        assert t.stats()["rows_spilled"] > 0
        t.evict()
        assert sorted(t.stored_ids().tolist()) == [*range(20), 500]
    finally:
        t.close()


# --- checksums_by ---------------------------------------------------------------------------------------
NB = 7


def bucket_of(ids: np.ndarray) -> np.ndarray:
    return ids % NB


@settings(max_examples=30, deadline=None)
@given(ids=st.lists(st.one_of(st.sampled_from(EDGES), st.integers(-10**6, 10**6)), min_size=0, max_size=40,
                    unique=True),
       seed=st.integers(0, 2**16), backend=st.sampled_from(BACKENDS))
def test_checksums_by_is_independent_of_insertion_order(ids, seed: int, backend: str) -> None:
    ids = np.array(ids, np.int64)
    a, b = emb.EmbeddingTable(config(backend)), emb.EmbeddingTable(config(backend))
    a.pull(ids)
    rng = np.random.default_rng(seed)
    rows = a.export_rows()
    perm = rng.permutation(len(rows))
    for part in np.array_split(perm, 3):  # b gets the same rows in another order, in pieces
        b.import_rows(rows.take(part))
    b.pull(np.array([10**9 + 1, 10**9 + 2]))  # and rows that come and go
    b.delete(np.array([10**9 + 1, 10**9 + 2]))
    sums_a, counts_a = a.checksums_by(bucket_of, NB)
    sums_b, counts_b = b.checksums_by(bucket_of, NB)
    assert sums_a.dtype == np.uint64 and counts_a.dtype == np.int64 and sums_a.shape == counts_a.shape == (NB,)
    assert np.array_equal(sums_a, sums_b) and np.array_equal(counts_a, counts_b)
    assert counts_a.sum() == len(a)
    assert np.array_equal(counts_a, np.bincount(bucket_of(ids), minlength=NB))


@pytest.mark.parametrize("backend", BACKENDS)
def test_checksums_by_changing_one_row_changes_only_its_bucket(backend: str) -> None:
    a, b = emb.EmbeddingTable(config(backend)), emb.EmbeddingTable(config(backend))
    ids = np.arange(-30, 30, dtype=np.int64)
    for t in (a, b):
        t.pull(ids)
    base_sums, base_counts = a.checksums_by(bucket_of, NB)
    for victim, change in ((11, "push"), (-4, "state"), (12, "delete"), (1000, "insert")):
        if change == "push":
            b.push(np.array([victim]), np.ones((1, DIM), np.float32))
        elif change == "state":  # same weights, other optimizer state
            row = b.export_rows(ids=np.array([victim]))
            row.state[:] += 1
            b.import_rows(row)
        elif change == "delete":
            b.delete(np.array([victim]))
        else:
            b.pull(np.array([victim]))
        sums, counts = b.checksums_by(bucket_of, NB)
        differs = np.flatnonzero(sums != base_sums)
        assert differs.tolist() == [victim % NB], change
        assert counts.sum() == len(b)
        count_delta = {"delete": -1, "insert": 1}.get(change, 0)
        assert (counts - base_counts).tolist() == [count_delta if k == victim % NB else 0 for k in range(NB)]
        a_sums, _ = a.checksums_by(bucket_of, NB)
        assert np.array_equal(a_sums, base_sums)
        # undo on b by copying a's rows back: the digests agree again
        b.delete(np.array([victim]))
        b.import_rows(a.export_rows(ids=np.array([victim])))
        assert np.array_equal(b.checksums_by(bucket_of, NB)[0], base_sums)


@pytest.mark.parametrize(("bucket_fn", "n"), [
    (lambda ids: ids % 7 - 1, 7),  # -1: would silently land in the last bucket
    (lambda ids: ids % 7, 6),  # 6 is out of range
    (lambda ids: (ids % 7).astype(np.float64), 7),
    (lambda ids: (ids % 7)[:-1], 7),
    (lambda ids: ids % 7, 0),
])
def test_checksums_by_rejects_bad_buckets(bucket_fn, n: int) -> None:
    t = emb.EmbeddingTable(config("auto"))
    t.pull(np.arange(20))
    with pytest.raises(emb.InvalidArgument, match="'clicks'"):
        t.checksums_by(bucket_fn, n)


def test_checksums_by_counts_spilled_rows_and_empty_tables(tmp_path: Path) -> None:
    plain = emb.EmbeddingTable(config("auto"))
    spilling = emb.EmbeddingTable(config("auto", memory_budget=5 * row_bytes("auto"), spill_dir=str(tmp_path)))
    try:
        sums, counts = plain.checksums_by(bucket_of, NB)
        assert not sums.any() and not counts.any()
        ids = np.arange(100, dtype=np.int64) * 13
        for t in (plain, spilling):
            t.pull(ids)
            t.push(ids[::3], np.ones((ids[::3].size, DIM), np.float32))
        assert spilling.stats()["rows_spilled"] > 50
        for x, y in zip(plain.checksums_by(bucket_of, NB), spilling.checksums_by(bucket_of, NB), strict=True):
            assert np.array_equal(x, y)
        assert spilling.checksums_by(bucket_of, NB)[1].sum() == len(spilling) == 100
    finally:
        spilling.close()


# --- stored_ids -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_stored_ids_includes_spilled_rows(backend: str, tmp_path: Path) -> None:
    t = emb.EmbeddingTable(config(backend, memory_budget=6 * row_bytes(backend), spill_dir=str(tmp_path)))
    try:
        assert t.stored_ids().dtype == np.int64 and t.stored_ids().size == 0
        ids = np.r_[np.arange(-100, 100), EDGES[2:]].astype(np.int64)
        t.pull(ids)
        s = t.stats()
        assert s["rows_spilled"] > 100 and s["rows_resident"] > 0
        assert np.array_equal(np.sort(t.stored_ids()), np.sort(ids))
        t.delete(ids[:50])
        t.pull(ids[150:160])  # brings some spilled rows back
        assert np.array_equal(np.sort(t.stored_ids()), np.sort(ids[50:]))
        assert np.array_equal(np.sort(t.stored_ids()), t.export_rows().ids)
    finally:
        t.close()
    with pytest.raises(emb.InvalidArgument, match="closed"):
        t.stored_ids()
