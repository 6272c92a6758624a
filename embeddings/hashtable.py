"""HashIndex: an open-addressing hash map from int64 ids (the full signed range) to int32 values.

Layout: ``keys`` uint64[cap] holds the ids' bits, ``vals`` int32[cap] holds a value >= 0 or the bucket state
(EMPTY -1, TOMBSTONE -2), so no id value is reserved as a sentinel. The home bucket is fastrange of a
splitmix64 hash of the id xor the index's salt, probing is linear. Capacity is any integer (not a power of two),
grown by 1.5x past a load of 0.8 (tombstones count as load and are dropped by the rehash): 12 bytes per bucket,
15-23 bytes per live key. Linear probing stays short at 0.8 (a hit reads 3 buckets on average, a miss 13, in
two or three cache lines).

Why a salt, random per index: ids listed in one index's bucket order (a cut's batches, ``keys()``, a spill's
coldest rows) are sorted by their home; inserted a chunk at a time into another index of the same hash, each
chunk piled into a narrow run of buckets and its probes grew with the chunk (4 M rows imported from a cut in
16 k-bucket chunks: 349 s, against 5 s shuffled). Under its own salt an index sees any other's bucket order as
random.

``partitioned.PartitionedIndex`` splits one map into such indexes that grow one at a time.

Every operation takes a whole batch (duplicates allowed) and runs either a numba kernel or a vectorized numpy
fallback (``backend="numpy"``, also used when numba is missing); both give identical results.
Not thread-safe on its own: the owning table holds its lock around every call.
"""

from __future__ import annotations

import mmap
import os
from typing import Literal

import numpy as np

from tigana.embeddings import _kernels
from tigana.embeddings._kernels import EMPTY, TOMBSTONE
from tigana.embeddings.mixing import mix64, slots_of_keys

Backend = Literal["auto", "numba", "numpy"]

_MAX_LOAD = 0.8
_GROWTH = 1.5
_MIN_CAPACITY = 64
_BUCKET_BYTES = 12  # a key (uint64) and a value (int32)
_MAPPED_BYTES = 1 << 20  # bucket arrays from this size up are mappings of their own (``_bucket_arrays``)


def _grown(cap: int) -> int:
    """The capacity one growth step makes from ``cap``."""
    return int(cap * _GROWTH) + 1


def _bucket_arrays(cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Empty bucket arrays (keys, values all EMPTY) of ``cap`` buckets. From ``_MAPPED_BYTES`` up, each array is
    a mapping of its own, given back to the kernel the moment it is freed: a daemon sets glibc to serve blocks
    under 32 MiB from its heap (``tigana.ps.allocator``, for message buffers), where the arrays a rehash
    replaces stayed resident until the next trim. A spilling 1 GiB daemon whose index partitions (10-30 MiB)
    came from the heap peaked at 1.5x its budget, its heap holding 0.7-0.9 GiB."""
    keys_bytes = cap * 8
    if keys_bytes < _MAPPED_BYTES:
        return np.zeros(cap, np.uint64), np.full(cap, EMPTY, np.int32)
    keys = np.frombuffer(_private_map(keys_bytes), np.uint64)  # zero-filled by the kernel, page by page
    vals = np.frombuffer(_private_map(cap * 4), np.int32)
    vals.fill(EMPTY)
    return keys, vals


def _private_map(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping (``mmap``'s default is a shared one: shmem pages, counted apart from the
    process's anonymous memory and slower to fault in)."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def resolve_backend(backend: Backend) -> Literal["numba", "numpy"]:
    """'auto' means numba when it imports, else numpy."""
    if backend == "auto":
        return "numba" if _kernels.AVAILABLE else "numpy"
    if backend == "numba" and not _kernels.AVAILABLE:
        raise RuntimeError("backend 'numba' requested but numba is not importable")
    if backend not in ("numba", "numpy"):
        raise ValueError(f"unknown backend {backend!r}")
    return backend


def as_id_bits(ids: np.ndarray) -> np.ndarray:
    """int64 ids -> their uint64 bit pattern (a view when possible)."""
    return np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64)


def new_salt() -> np.uint64:
    """A fresh random salt for an index's hash (``HashIndex``, ``PartitionedIndex``)."""
    return np.uint64(int.from_bytes(os.urandom(8), "little"))


def _home_np(keys: np.ndarray, cap: int, salt: np.uint64) -> np.ndarray:
    """Home bucket of each key: the top 32 bits of its salted mix scaled onto [0, cap) (as the numba ``_home``)."""
    with np.errstate(over="ignore"):
        return (((mix64(keys ^ salt) >> np.uint64(32)) * np.uint64(cap)) >> np.uint64(32)).astype(np.int64)


class HashIndex:
    """Map of int64 id -> int32 value >= 0 for whole batches; see the module docstring."""

    def __init__(self, capacity: int = _MIN_CAPACITY, *, backend: Backend = "auto",
                 min_capacity: int = _MIN_CAPACITY, salt: np.uint64 | None = None) -> None:
        self.backend = resolve_backend(backend)
        self.salt = new_salt() if salt is None else np.uint64(salt)  # fixed for the index's life
        self._min_capacity = max(2, int(min_capacity))  # it never shrinks below this
        cap = max(self._min_capacity, int(capacity))
        self._keys, self._vals = _bucket_arrays(cap)
        self._size = 0  # live keys
        self._used = 0  # live keys + tombstones

    @classmethod
    def over(cls, keys: np.ndarray, vals: np.ndarray, salt: np.uint64, backend: Backend = "auto") -> HashIndex:
        """A read-only view for probing bucket arrays taken earlier with ``buckets`` (no copy), of an index
        salted with ``salt``."""
        view = cls.__new__(cls)
        view.backend = resolve_backend(backend)
        view.salt = np.uint64(salt)
        view._keys, view._vals = keys, vals
        view._size = view._used = -1  # a view is for ``lookup``/``positions`` only
        return view

    def __len__(self) -> int:
        return self._size

    def buckets(self) -> tuple[np.ndarray, np.ndarray]:
        """The bucket arrays themselves (keys uint64, values int32), not copies: a bucket changes in place only
        from live to tombstone (delete) or from empty/tombstone to live (insert); growth or a rehash replaces
        both arrays and leaves these as they were. (``Cut`` holds them to read the table as of one moment.)"""
        return self._keys, self._vals

    @property
    def capacity(self) -> int:
        return int(self._keys.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self._keys.nbytes + self._vals.nbytes)

    # --- queries ------------------------------------------------------------------------------------------
    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """(n,) ids -> (n,) int64 values, -1 where absent."""
        return self._probe(as_id_bits(ids))[1]

    def positions(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n,) ids -> (bucket positions, values), both int64, -1 where absent. Positions stay valid until
        the next insert (which may rehash)."""
        return self._probe(as_id_bits(ids))

    def _probe(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = q.shape[0]
        pos = np.empty(n, np.int64)
        val = np.empty(n, np.int64)
        if self.backend == "numba":
            _kernels.probe(self._keys, self._vals, q, pos, val, self.salt)
            return pos, val
        pos.fill(-1)
        val.fill(-1)
        cap = self.capacity
        cur = _home_np(q, cap, self.salt)
        active = np.arange(n)
        while active.size:
            p = cur[active]
            v = self._vals[p]
            hit = (v >= 0) & (self._keys[p] == q[active])
            pos[active[hit]] = p[hit]
            val[active[hit]] = v[hit]
            cont = (v != EMPTY) & ~hit
            active = active[cont]
            nxt = p[cont] + 1
            nxt[nxt == cap] = 0
            cur[active] = nxt
        return pos, val

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All live (ids int64, values int64), in bucket order."""
        live = self._vals >= 0
        return self._keys[live].view(np.int64), self._vals[live].astype(np.int64)

    def keys(self) -> np.ndarray:
        """All live ids (int64), in bucket order: ``items()[0]`` at half its cost."""
        return self._keys[self._vals >= 0].view(np.int64)

    def keys_in_slots(self, num_slots: int, wanted: np.ndarray, start: int = 0, stop: int | None = None
                      ) -> np.ndarray:
        """Live ids (int64, bucket order) of buckets [start, stop) (all by default) whose slot,
        ``mix64(id) % num_slots`` (``tigana.ps.routing.slot_of``), is marked in ``wanted`` (bool, one per slot):
        one pass over the buckets, without listing every id first (a slot copy lists its ids while pushes go on:
        the table reads a range of buckets per hold of its lock)."""
        wanted = np.ascontiguousarray(wanted, bool)
        start, stop = self._bucket_range(start, stop)
        if self.backend == "numba":
            room = stop - start if self._size < 0 else min(stop - start, self._size)  # a view does not know its size
            out = np.empty(room, np.uint64)  # its pages are touched only where written
            k = int(_kernels.keys_in_slots(self._keys, self._vals, num_slots, wanted, out, start, stop))
            out.resize(k, refcheck=False)
            return out.view(np.int64)
        keys = self._keys[start:stop][self._vals[start:stop] >= 0].view(np.int64)
        return keys[wanted[slots_of_keys(keys, num_slots)]]

    def slot_counts(self, num_slots: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """(num_slots,) int64: live ids per slot (as ``keys_in_slots``) among buckets [start, stop) (all by
        default), in one pass over them."""
        start, stop = self._bucket_range(start, stop)
        if self.backend == "numba":
            counts = np.zeros(num_slots, np.int64)
            _kernels.count_slots(self._keys, self._vals, num_slots, counts, start, stop)
            return counts
        keys = self._keys[start:stop][self._vals[start:stop] >= 0].view(np.int64)
        return np.bincount(slots_of_keys(keys, num_slots), minlength=num_slots)

    def _bucket_range(self, start: int, stop: int | None) -> tuple[int, int]:
        cap = self.capacity
        stop = cap if stop is None else min(int(stop), cap)
        return min(max(0, int(start)), stop), stop

    # --- updates ------------------------------------------------------------------------------------------
    def insert(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Insert ids that are unique and absent (the caller guarantees both) with values >= 0."""
        q = as_id_bits(ids)
        v = np.ascontiguousarray(values, dtype=np.int32)
        if q.shape[0] == 0:
            return
        self._reserve(q.shape[0])
        self._used += self._insert_raw(self._keys, self._vals, q, v)
        self._size += q.shape[0]

    def set_values(self, positions: np.ndarray, values: np.ndarray) -> None:
        """Overwrite the values of live buckets at ``positions`` (from ``positions()``)."""
        self._vals[positions] = values

    def values_at_least(self, threshold: int) -> tuple[np.ndarray, np.ndarray]:
        """(bucket positions, values), both int64, of the live buckets whose value is ``threshold`` or more: one
        pass over the buckets (``set_values`` then moves them)."""
        at = np.flatnonzero(self._vals >= threshold)
        return at, self._vals[at].astype(np.int64)

    def fill_values(self, value: int) -> None:
        """Set the value of every live key."""
        self._vals[self._vals >= 0] = value

    def delete(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Remove ids (duplicates and absent ids allowed). Returns (removed ids, their values), unique."""
        pos, val = self._probe(as_id_bits(ids))
        found = pos >= 0
        upos, first = np.unique(pos[found], return_index=True)
        removed_ids = np.ascontiguousarray(ids, dtype=np.int64)[found][first]
        removed_vals = val[found][first]
        self._vals[upos] = TOMBSTONE
        self._size -= upos.shape[0]
        return removed_ids, removed_vals

    def clear(self) -> None:
        self._keys, self._vals = _bucket_arrays(self._min_capacity)
        self._size = self._used = 0

    def _reserve(self, n_new: int) -> None:
        if self._used + n_new <= _MAX_LOAD * self.capacity:
            return
        need = self._size + n_new
        cap = self.capacity
        while need > _MAX_LOAD * cap:
            cap = _grown(cap)
        if need <= 0.5 * _MAX_LOAD * cap and cap > self._min_capacity:  # mostly tombstones: stay small
            cap = max(self._min_capacity, int(need / (0.5 * _MAX_LOAD)) + 1)
        new_keys, new_vals = _bucket_arrays(cap)
        if self.backend == "numba":
            used = int(_kernels.rehash(self._keys, self._vals, new_keys, new_vals, self.salt))
        else:
            live = self._vals >= 0
            used = self._insert_raw(new_keys, new_vals, self._keys[live], self._vals[live])
        self._keys, self._vals, self._used = new_keys, new_vals, used

    def _insert_raw(self, keys: np.ndarray, vals: np.ndarray, q: np.ndarray, v: np.ndarray) -> int:
        if self.backend == "numba":
            return int(_kernels.insert(keys, vals, q, v, self.salt))
        cap = keys.shape[0]
        cur = _home_np(q, cap, self.salt)
        active = np.arange(q.shape[0])
        consumed = 0
        while active.size:
            p = cur[active]
            state = vals[p]
            free = state < 0
            claim_pos, first = np.unique(p[free], return_index=True)
            winners = active[free][first]
            consumed += int(np.count_nonzero(state[free][first] == EMPTY))
            keys[claim_pos] = q[winners]
            vals[claim_pos] = v[winners]
            won = np.zeros(active.shape[0], bool)
            won[np.flatnonzero(free)[first]] = True
            active = active[~won]
            nxt = p[~won] + 1
            nxt[nxt == cap] = 0
            cur[active] = nxt
        return consumed
