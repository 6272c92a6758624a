"""The trainer's hot-row cache (``tigana.trainer.cache``) and its slot index, against simple reference models:
a copy is served only within the staleness bound (own pushes missed) and the age bound, always the copy last
inserted, and never more rows than the capacity; with room for every id it serves exactly what the
reference says may be served."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana import ps
from tigana.trainer.cache import RowCache
from tigana.trainer.slots import SlotIndex

DIM = 3


class _RefCache:
    """The obvious model: id -> (row, lag, born), no capacity."""

    def __init__(self, staleness: int, max_age: int | None) -> None:
        self.s, self.max_age = staleness, max_age
        self.clock = 0
        self.d: dict[int, tuple[np.ndarray, int, int]] = {}

    def insert(self, ids, rows, lags, born) -> None:
        if self.max_age is not None and self.clock - born > self.max_age:
            return
        for i, r, lag in zip(ids.tolist(), rows, lags.tolist(), strict=True):
            if lag <= self.s:
                self.d[i] = (r.copy(), lag, born)

    def pushed(self, ids) -> None:
        self.clock += 1
        for i in ids.tolist():
            if i in self.d:
                row, lag, born = self.d[i]
                self.d[i] = (row, lag + 1, born)

    def servable(self, i: int, pending: int, ahead: int) -> bool:
        if i not in self.d:
            return False
        _, lag, born = self.d[i]
        return lag + pending <= self.s and (self.max_age is None or self.clock + ahead - born <= self.max_age)


_ops = st.lists(st.tuples(st.sampled_from(["insert", "push", "lookup"]),
                          st.lists(st.integers(0, 11), min_size=0, max_size=8, unique=True),
                          st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=_ops, staleness=st.integers(0, 3), max_age=st.one_of(st.none(), st.integers(0, 4)),
       capacity=st.integers(1, 16), policy=st.sampled_from(["lfu", "lru"]))
def test_cache_serves_only_what_the_reference_allows(ops, staleness, max_age, capacity, policy) -> None:
    cache = RowCache(capacity, DIM, staleness, max_age=max_age, policy=policy, table="t")
    ref = _RefCache(staleness, max_age)
    version = 0
    inserted: set[int] = set()
    for op, ids_list, a, b in ops:
        ids = np.array(ids_list, np.int64)
        if op == "insert":
            version += 1
            rows = np.full((ids.size, DIM), float(version), np.float32) + ids[:, None]
            lags = (np.arange(ids.size) + a) % (staleness + 2)
            born = max(cache.clock - b, 0)
            cache.insert(ids, rows, lags, born=born)
            ref.insert(ids, rows, lags, born)
            inserted |= set(ids_list)
            assert len(cache) <= capacity
        elif op == "push":
            cache.pushed(ids)
            ref.pushed(ids)
        else:
            pending = np.full(ids.size, a, np.int64)
            slots = cache.lookup(ids, pending=pending, ahead=b)
            served = slots >= 0
            for i, ok in zip(ids.tolist(), served.tolist(), strict=True):
                if ok:  # sound: only copies the reference allows, and the copy inserted last
                    assert ref.servable(i, a, b), (i, ref.d.get(i))
                if len(inserted) <= capacity:  # nothing ever evicted: exactly the reference
                    assert ok == ref.servable(i, a, b)
            if served.any():
                rows = cache.read(slots[served])
                expect = np.stack([ref.d[i][0] for i in ids[served].tolist()])
                np.testing.assert_array_equal(rows, expect)
    assert cache.clock == ref.clock


def test_own_pushes_age_a_copy_out_at_the_bound() -> None:
    cache = RowCache(8, DIM, 2, table="t")
    ids = np.array([5, 9], np.int64)
    cache.insert(ids, np.ones((2, DIM), np.float32), np.array([0, 1]))
    assert (cache.lookup(ids) >= 0).all()
    cache.pushed(np.array([5, 9]))
    assert (cache.lookup(ids) >= 0).tolist() == [True, True]  # lags 1, 2
    assert (cache.lookup(ids, pending=np.array([1, 0])) >= 0).tolist() == [True, True]
    assert (cache.lookup(ids, pending=np.array([0, 1])) >= 0).tolist() == [True, False]
    cache.pushed(np.array([9]))
    assert (cache.lookup(ids) >= 0).tolist() == [True, False]
    cache.pushed(np.array([5]))
    cache.pushed(np.array([5]))
    assert (cache.lookup(ids) >= 0).tolist() == [False, False]
    # a fresh copy (pulled after those pushes) serves again
    cache.insert(np.array([5]), np.zeros((1, DIM), np.float32), 0)
    assert (cache.lookup(ids) >= 0).tolist() == [True, False]
    # staleness 0: a copy serves only until its row is pushed
    strict = RowCache(4, DIM, 0, table="t")
    strict.insert(ids, np.ones((2, DIM), np.float32), 0)
    strict.pushed(np.array([9]))
    assert (strict.lookup(ids) >= 0).tolist() == [True, False]


def test_max_age_bounds_how_long_a_copy_serves() -> None:
    cache = RowCache(8, DIM, 10, max_age=2, table="t")
    ids = np.array([1, 2], np.int64)
    cache.insert(ids, np.ones((2, DIM), np.float32), 0)
    cache.pushed(np.array([7]))
    cache.pushed(np.array([7]))
    assert (cache.lookup(ids) >= 0).all()
    assert not (cache.lookup(ids, ahead=1) >= 0).any()
    cache.pushed(np.array([7]))
    assert not (cache.lookup(ids) >= 0).any()
    # a copy pulled before the bound is not even cached
    assert cache.insert(np.array([3]), np.ones((1, DIM), np.float32), 0, born=0) == 0


@pytest.mark.parametrize("policy, victim", [("lfu", 2), ("lru", 1)])
def test_eviction_order_dead_first_then_policy_never_protected(policy, victim) -> None:
    cache = RowCache(3, DIM, 1, policy=policy, table="t")
    cache.insert(np.array([1, 2, 3]), np.ones((3, DIM), np.float32), 0)
    cache.read(cache.lookup(np.array([1, 3])))      # clock 0: 1 used twice, 3 once
    cache.read(cache.lookup(np.array([1])))
    cache.pushed(np.array([99]))
    cache.read(cache.lookup(np.array([2, 3])))      # clock 1: 2 and 3 (so 1 is the least recent, 2 the least used)
    cache.insert(np.array([4]), np.ones((1, DIM), np.float32), 0)
    held = set(cache.index.keys.tolist())
    assert held == {1, 2, 3, 4} - {victim} and cache.evictions == 1
    # a copy that can never serve again goes before any live one
    dead = next(iter(held - {4}))
    cache.pushed(np.array([dead]))
    cache.pushed(np.array([dead]))
    cache.insert(np.array([5]), np.ones((1, DIM), np.float32), 0)
    assert dead not in cache.index.keys.tolist() and 5 in cache.index.keys.tolist()
    # protected ids stay even when they are the only candidates
    keep = cache.index.keys.copy()
    assert cache.insert(np.array([6]), np.ones((1, DIM), np.float32), 0, protect=keep) == 0
    assert cache.index.keys.tolist() == keep.tolist()


def test_bad_settings_name_the_table_and_field() -> None:
    with pytest.raises(ps.InvalidArgument, match="table 'user'.*'cache_rows'"):
        RowCache(0, DIM, 1, table="user")
    with pytest.raises(ps.InvalidArgument, match="'staleness'"):
        RowCache(4, DIM, -1, table="user")
    with pytest.raises(ps.InvalidArgument, match="'cache_max_age'"):
        RowCache(4, DIM, 1, max_age=-2, table="user")
    with pytest.raises(ps.InvalidArgument, match="'cache_policy'"):
        RowCache(4, DIM, 1, policy="fifo", table="user")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(-(1 << 62), 1 << 62), max_size=6, unique=True)),
                max_size=30))
def test_slot_index_against_a_dict(ops) -> None:
    index = SlotIndex(10)
    ref: dict[int, int] = {}
    for add, ids in ops:
        if add:
            new = [i for i in ids if i not in ref][:index.free]
            slots = index.add(np.array(new, np.int64))
            ref.update(zip(new, slots.tolist(), strict=True))
        else:
            gone = [i for i in ids if i in ref]
            index.remove(np.array([ref.pop(i) for i in gone], np.int64))
        assert len(index) + index.free == 10 and len(index) == len(ref)
        assert index.keys.tolist() == sorted(ref)
        probe = np.array(list(ref) + [i for i in ids if i not in ref], np.int64)
        expect = [ref.get(i, -1) for i in probe.tolist()]
        assert index.find(probe).tolist() == expect
        assert len(set(ref.values())) == len(ref)
