"""What the storage engine offers replication: ``Changes`` recorded by pull/push and replayed on a replica
with ``apply_changes``, ``set_evictable``, ``checksums_by``, ``stored_ids`` and snapshot ``extra_files``."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana import embeddings as emb
from tigana.embeddings import _kernels
from tigana.embeddings.snapshot import list_snapshots, read_extra

BACKENDS = ["numpy"] + (["numba"] if _kernels.AVAILABLE else [])
DIM = 4
EDGES = [0, -1, 2**63 - 1, -(2**63)]
ADMISSIONS = {"open": emb.Admission(), "min2": emb.Admission(min_count=2)}
EVICTIONS = {
    "cap_lru": emb.Eviction(max_rows=8),
    "cap_lfu": emb.Eviction(max_rows=8, policy="lfu"),
    "ttl": emb.Eviction(ttl_steps=3),
    "cap_ttl": emb.Eviction(max_rows=8, ttl_steps=3),
}


def never(ids: np.ndarray) -> np.ndarray:
    return np.zeros(len(ids), bool)


def config(backend: str, **kw) -> emb.TableConfig:
    kw.setdefault("optimizer", emb.Adagrad(lr=0.1))
    kw.setdefault("initializer", emb.Uniform(-1, 1))
    return emb.TableConfig("clicks", dim=DIM, backend=backend, **kw)


def row_bytes(backend: str, **kw) -> int:
    """Resident bytes of one row (slab columns + its share of the hash index)."""
    t = emb.EmbeddingTable(config(backend, **kw))
    try:
        return int(t.stats()["row_bytes"]) + 18
    finally:
        t.close()


def admission_counts(table: emb.EmbeddingTable) -> dict[int, int]:
    """The sighting counts of ids not yet admitted (the state a replica must mirror to fail over)."""
    ids, counts = table._admission._counts.items()
    return dict(zip(ids.tolist(), counts.tolist(), strict=True))


def rows_by_id(table: emb.EmbeddingTable) -> dict[int, tuple]:
    rows = table.export_rows()
    return {i: (rows.weights[k].tobytes(), rows.state[k].tobytes(), int(rows.update_count[k]),
                int(rows.last_step[k]), float(rows.last_time[k])) for k, i in enumerate(rows.ids.tolist())}


def replicate(primary: emb.EmbeddingTable, replica: emb.EmbeddingTable, changes: emb.Changes) -> None:
    """Ship what one call on ``primary`` changed to ``replica``, as tigana.ps does."""
    written = changes.written_ids()
    present = written[primary.contains(written)]
    deleted = changes.deleted_ids()
    deleted = deleted[~primary.contains(deleted)]
    replica.apply_changes(rows=primary.export_rows(ids=present), deleted=deleted,
                          sightings=changes.sighting_arrays(), step=primary.step)


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


# --- set_evictable ------------------------------------------------------------------------------------------
def zeros(n: int) -> np.ndarray:
    return np.zeros((n, DIM), np.float32)


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


# --- snapshot extra files ---------------------------------------------------------------------------------
def filled_table(backend: str = "auto") -> emb.EmbeddingTable:
    t = emb.EmbeddingTable(config(backend))
    t.pull(np.arange(20))
    t.push(np.arange(10), np.ones((10, DIM), np.float32))
    return t


def test_snapshot_extra_files_round_trip(tmp_path: Path) -> None:
    t = filled_table()
    blob = bytes(range(256)) * 5
    path = t.snapshot(tmp_path, extra_files={"dedup": blob, "empty.v1": b"", "A-b_c.9": b"x"})
    assert read_extra(path, "dedup") == blob
    assert read_extra(tmp_path, "dedup") == blob  # a root reads its latest snapshot
    assert read_extra(path, "empty.v1") == b""
    assert read_extra(path, "A-b_c.9") == b"x"
    assert read_extra(path, "missing") is None
    assert read_extra(path, "../manifest.json") is None
    assert emb.EmbeddingTable.restore(path).checksum() == t.checksum()
    plain = t.snapshot(tmp_path)  # a snapshot written without extra files has none
    assert read_extra(plain, "dedup") is None and read_extra(path, "dedup") == blob


@pytest.mark.parametrize("tamper", ["rewrite", "same_size", "truncate", "remove"])
def test_tampered_extra_file_raises_corrupt_store(tmp_path: Path, tamper: str) -> None:
    t = filled_table()
    path = t.snapshot(tmp_path, extra_files={"dedup": b"window-0123456789", "other": b"fine"})
    file = path / "extra" / "dedup"
    if tamper == "rewrite":
        file.write_bytes(b"forged")
    elif tamper == "same_size":
        file.write_bytes(b"window-0123456780")
    elif tamper == "truncate":
        file.write_bytes(b"")
    else:
        file.unlink()
    with pytest.raises(emb.CorruptStore, match="dedup"):
        read_extra(path, "dedup")
    assert read_extra(path, "other") == b"fine"
    with pytest.raises(emb.CorruptStore):  # restore verifies every file of the snapshot
        emb.EmbeddingTable.restore(path)


@pytest.mark.parametrize("name", ["", "a/b", "../x", "/abs", ".", "..", "dedup\n", "sp ace", "x" * 65,
                                  "ünï", "a\\b"])
def test_bad_extra_file_names_raise_and_write_nothing(tmp_path: Path, name: str) -> None:
    t = filled_table()
    t.snapshot(tmp_path)
    t.push(np.array([3]), np.ones((1, DIM), np.float32))
    for incremental in (False, True):
        with pytest.raises(emb.InvalidArgument, match="extra_files"):
            t.snapshot(tmp_path, incremental=incremental, extra_files={"ok": b"1", name: b"2"})
    assert len(list_snapshots(tmp_path)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [list_snapshots(tmp_path)[0].name]
    # the failed attempts left the table's changes pending: the next increment still holds row 3
    path = t.snapshot(tmp_path, incremental=True)
    assert path.name.endswith("-incr")
    assert emb.EmbeddingTable.restore(tmp_path).checksum() == t.checksum()


def test_extra_file_contents_must_be_bytes(tmp_path: Path) -> None:
    t = filled_table()
    with pytest.raises(emb.InvalidArgument, match="extra_files"):
        t.snapshot(tmp_path, extra_files={"dedup": "text, not bytes"})
    assert list_snapshots(tmp_path) == []
    path = t.snapshot(tmp_path, extra_files={"a": bytearray(b"ba"), "b": memoryview(b"mv")})
    assert read_extra(path, "a") == b"ba" and read_extra(path, "b") == b"mv"


def test_extra_files_in_incremental_snapshots(tmp_path: Path) -> None:
    t = filled_table()
    full = t.snapshot(tmp_path, extra_files={"dedup": b"v1"})
    t.push(np.array([1, 15]), np.ones((2, DIM), np.float32))
    t.delete(np.array([2]))
    incr = t.snapshot(tmp_path, incremental=True, extra_files={"dedup": b"v2", "more": b"m"})
    assert incr.name.endswith("-incr") and full.name.endswith("-full")
    assert read_extra(full, "dedup") == b"v1"
    assert read_extra(incr, "dedup") == b"v2" and read_extra(tmp_path, "dedup") == b"v2"
    assert read_extra(incr, "more") == b"m" and read_extra(full, "more") is None
    assert emb.EmbeddingTable.restore(tmp_path).checksum() == t.checksum()
    t.push(np.array([4]), np.ones((1, DIM), np.float32))
    bare = t.snapshot(tmp_path, incremental=True)  # extra files are per snapshot: not inherited
    assert read_extra(bare, "dedup") is None
    assert emb.EmbeddingTable.restore(tmp_path).checksum() == t.checksum()
    # a tampered extra file of a parent breaks the restore of the whole chain
    (incr / "extra" / "dedup").write_bytes(b"v3")
    with pytest.raises(emb.CorruptStore):
        emb.EmbeddingTable.restore(tmp_path)
    with pytest.raises(emb.CorruptStore):
        read_extra(incr, "dedup")
    assert read_extra(full, "dedup") == b"v1"
