"""HashIndex: an open-addressing hash map from int64 ids (the full signed range) to int32 values.

Layout: ``keys`` uint64[cap] holds the ids' bits, ``vals`` int32[cap] holds a value >= 0 or the bucket state
(EMPTY -1, TOMBSTONE -2), so no id value is reserved as a sentinel. The home bucket is fastrange of a
splitmix64 hash, probing is linear. Capacity is any integer (not a power of two), grown by 1.5x past a load of
0.8 (tombstones count as load and are dropped by the rehash): 12 bytes per bucket, 15-23 bytes per live key.
Linear probing stays short at 0.8 (a hit reads 3 buckets on average, a miss 13, in two or three cache lines).

``PartitionedIndex`` splits one map into ``PARTS`` such indexes that grow one at a time (the index of a table's
spilled ids, where a whole-index rehash would break the memory budget); ``IndexView`` numbers its buckets
globally for the readers that hold them (cuts, scans).

Every operation takes a whole batch (duplicates allowed) and runs either a numba kernel or a vectorized numpy
fallback (``backend="numpy"``, also used when numba is missing); both give identical results.
Not thread-safe on its own: the owning table holds its lock around every call.
"""

from __future__ import annotations

import mmap
from typing import Literal

import numpy as np

from tigana.embeddings import _kernels, _part_kernels
from tigana.embeddings._kernels import EMPTY, TOMBSTONE
from tigana.embeddings._part_kernels import _PART_SHIFT, PARTS
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
    keys = np.frombuffer(mmap.mmap(-1, keys_bytes), np.uint64)  # zero-filled by the kernel, page by page
    vals = np.frombuffer(mmap.mmap(-1, cap * 4), np.int32)
    vals.fill(EMPTY)
    return keys, vals


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


def _home_np(keys: np.ndarray, cap: int) -> np.ndarray:
    """Home bucket of each key: the top 32 bits of its mix scaled onto [0, cap) (as the numba ``_home``)."""
    with np.errstate(over="ignore"):
        return (((mix64(keys) >> np.uint64(32)) * np.uint64(cap)) >> np.uint64(32)).astype(np.int64)


class HashIndex:
    """Map of int64 id -> int32 value >= 0 for whole batches; see the module docstring."""

    def __init__(self, capacity: int = _MIN_CAPACITY, *, backend: Backend = "auto",
                 min_capacity: int = _MIN_CAPACITY) -> None:
        self.backend = resolve_backend(backend)
        self._min_capacity = max(2, int(min_capacity))  # it never shrinks below this
        cap = max(self._min_capacity, int(capacity))
        self._keys, self._vals = _bucket_arrays(cap)
        self._size = 0  # live keys
        self._used = 0  # live keys + tombstones

    @classmethod
    def over(cls, keys: np.ndarray, vals: np.ndarray, backend: Backend = "auto") -> HashIndex:
        """A read-only view for probing bucket arrays taken earlier with ``buckets`` (no copy)."""
        view = cls.__new__(cls)
        view.backend = resolve_backend(backend)
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
            _kernels.probe(self._keys, self._vals, q, pos, val)
            return pos, val
        pos.fill(-1)
        val.fill(-1)
        cap = self.capacity
        cur = _home_np(q, cap)
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
            used = int(_kernels.rehash(self._keys, self._vals, new_keys, new_vals))
        else:
            live = self._vals >= 0
            used = self._insert_raw(new_keys, new_vals, self._keys[live], self._vals[live])
        self._keys, self._vals, self._used = new_keys, new_vals, used

    def _insert_raw(self, keys: np.ndarray, vals: np.ndarray, q: np.ndarray, v: np.ndarray) -> int:
        if self.backend == "numba":
            return int(_kernels.insert(keys, vals, q, v))
        cap = keys.shape[0]
        cur = _home_np(q, cap)
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


# --- partitioned: an index whose growth never holds two copies of the whole ------------------------------------
_PART_MIN = 8  # buckets of an empty partition: an empty index takes 1.5 KB
_NO_OFFSETS = np.zeros(PARTS, np.int64)  # bucket numbers inside each partition (a lookup needs values only)


def parts_of(q: np.ndarray) -> np.ndarray:
    """The partition (uint8, in [0, PARTS)) of each uint64 key: bits 27-30 of its mix, which neither the home
    bucket inside a partition (the top 32 bits) nor a power-of-two routing slot (the low bits) reads."""
    return ((mix64(q) >> _PART_SHIFT) & np.uint64(PARTS - 1)).astype(np.uint8)


def _split(q: np.ndarray, backend: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, bounds, sorted keys): ``sorted[bounds[p]:bounds[p + 1]]`` are the keys of partition ``p``, and
    ``sorted == q[order]``."""
    if backend == "numba":
        n = q.shape[0]
        order, sq, bounds = np.empty(n, np.int64), np.empty(n, np.uint64), np.empty(PARTS + 1, np.int64)
        _part_kernels.split(q, order, sq, bounds)
        return order, bounds, sq
    parts = parts_of(q)
    order = np.argsort(parts, kind="stable")  # a radix sort for uint8
    bounds = np.zeros(PARTS + 1, np.int64)
    np.cumsum(np.bincount(parts, minlength=PARTS), out=bounds[1:])
    return order, bounds, q[order]


_Where = tuple[np.ndarray, np.ndarray, np.ndarray]  # partitions' keys and values addresses, capacities


def _where_of(parts: list[tuple[np.ndarray, np.ndarray]]) -> _Where:
    """What ``_part_kernels.probe`` reads the partitions by: valid while their arrays live."""
    return (_part_kernels.addresses([k for k, _ in parts]), _part_kernels.addresses([v for _, v in parts]),
            np.array([k.shape[0] for k, _ in parts], np.int64))


def _probe_parts(parts: list[tuple[np.ndarray, np.ndarray]], q: np.ndarray, backend: str,
                 offsets: np.ndarray | None = None, skip: np.ndarray | None = None, where: _Where | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(bucket positions, values), both int64, -1 where absent, of uint64 keys ``q`` in partitions' bucket arrays.
    ``offsets``: add the partition's first global bucket to its positions; ``skip`` (bool, one per partition):
    find nothing there; ``where``: ``_where_of(parts)`` when the caller keeps it."""
    n = q.shape[0]
    pos, val = np.empty(n, np.int64), np.empty(n, np.int64)
    if backend == "numba":  # one pass over the batch (``_part_kernels.probe``), the partitions' arrays held here
        keys_at, vals_at, caps = where if where is not None else _where_of(parts)
        _part_kernels.probe(keys_at, vals_at, caps, _NO_OFFSETS if offsets is None else offsets, q, pos, val)
        if skip is not None and skip.any():
            gone = skip[parts_of(q)]
            pos[gone], val[gone] = -1, -1
        return pos, val
    order, bounds, sq = _split(q, backend)
    for p, (keys, vals) in enumerate(parts):
        lo, hi = int(bounds[p]), int(bounds[p + 1])
        if lo == hi:
            continue
        if skip is not None and skip[p]:
            pos[lo:hi], val[lo:hi] = -1, -1
            continue
        pos[lo:hi], val[lo:hi] = HashIndex.over(keys, vals, backend)._probe(sq[lo:hi])
        if offsets is not None:
            at = pos[lo:hi]
            at[at >= 0] += offsets[p]
    out_pos, out_val = np.empty(n, np.int64), np.empty(n, np.int64)
    out_pos[order], out_val[order] = pos, val
    return out_pos, out_val


class PartitionedIndex:
    """A map of int64 id -> int32 value >= 0 as ``PARTS`` ``HashIndex`` partitions, each growing on its own.

    Why: a growing ``HashIndex`` holds its old and new arrays at once, 2.5x its bytes for the rehash. The index
    of a table's spilled ids is most of a spilling table's memory at scale (125 M spilled ids hold ~2.3 GB), and
    such a spike broke the table's memory budget. Here a growth rehashes one partition, so the spike is at most
    ``growth_bytes``: the new arrays of one partition (about 1.5/``PARTS`` of the index). Keys split by bits of
    their mix (``parts_of``), so the partitions fill evenly and a batch costs one mix and one radix sort more
    than a ``HashIndex`` call. Bucket numbers (``view``) are global: a partition's buckets follow those of the
    partitions before it. Not thread-safe on its own, as ``HashIndex``."""

    def __init__(self, *, backend: Backend = "auto") -> None:
        self.backend = resolve_backend(backend)
        self._parts = [HashIndex(_PART_MIN, backend=self.backend, min_capacity=_PART_MIN) for _ in range(PARTS)]
        # the partitions' addresses for probes, and the arrays they are of (a growth or a clear replaces them)
        self._where: tuple[list[np.ndarray], _Where] | None = None

    def __len__(self) -> int:
        return sum(len(p) for p in self._parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._parts)

    @property
    def growth_bytes(self) -> int:
        """The most bytes one growth allocates before it frees the arrays it replaces (a partition's next size)."""
        return max(_grown(p.capacity) * _BUCKET_BYTES for p in self._parts)

    def partitions(self) -> list[HashIndex]:
        """The partitions themselves (a full pass over the index under the owner's lock)."""
        return list(self._parts)

    def view(self) -> IndexView:
        """The partitions' bucket arrays as they are now (not copies; see ``HashIndex.buckets``)."""
        return IndexView([p.buckets() for p in self._parts], self.backend)

    @property
    def capacity(self) -> int:
        """Buckets in all partitions."""
        return sum(p.capacity for p in self._parts)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """(n,) ids -> (n,) int64 values, -1 where absent."""
        parts = [p.buckets() for p in self._parts]
        where = None
        if self.backend == "numba":
            arrays = [a for kv in parts for a in kv]
            if self._where is None or any(a is not b for a, b in zip(arrays, self._where[0], strict=True)):
                self._where = (arrays, _where_of(parts))
            where = self._where[1]
        return _probe_parts(parts, as_id_bits(ids), self.backend, where=where)[1]

    def values_at_least(self, threshold: int) -> tuple[np.ndarray, np.ndarray]:
        """(global buckets, values), both int64, of the live buckets whose value is ``threshold`` or more, in
        bucket order (``set_values`` then moves them)."""
        got, base = [], 0
        for part in self._parts:
            at, vals = part.values_at_least(threshold)
            got.append((at + base, vals))
            base += part.capacity
        return np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got])

    def set_values(self, buckets: np.ndarray, values: np.ndarray) -> None:
        """Overwrite the values of live buckets (global numbers, from ``values_at_least`` or ``view``)."""
        view = self.view()
        part = np.searchsorted(view.offsets, buckets, side="right") - 1
        for p, index in enumerate(self._parts):
            mine = part == p
            if mine.any():
                index.set_values(buckets[mine] - view.offsets[p], values[mine])

    def insert(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Insert ids that are unique and absent (the caller guarantees both) with values >= 0."""
        v = np.ascontiguousarray(values, dtype=np.int32)
        order, bounds, sq = _split(as_id_bits(ids), self.backend)
        for p, part in enumerate(self._parts):
            lo, hi = int(bounds[p]), int(bounds[p + 1])
            if lo < hi:
                part.insert(sq[lo:hi].view(np.int64), v[order[lo:hi]])

    def delete(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Remove ids (duplicates and absent ids allowed). Returns (removed ids, their values), unique."""
        _, bounds, sq = _split(as_id_bits(ids), self.backend)
        got = [part.delete(sq[bounds[p]:bounds[p + 1]].view(np.int64))
               for p, part in enumerate(self._parts) if bounds[p] < bounds[p + 1] and len(part)]
        if not got:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got])

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All live (ids int64, values int64), in bucket order."""
        got = [p.items() for p in self._parts]
        return np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got])

    def keys(self) -> np.ndarray:
        """All live ids (int64), in bucket order."""
        return np.concatenate([p.keys() for p in self._parts])

    def clear(self) -> None:
        for p in self._parts:
            p.clear()


class IndexView:
    """The bucket arrays of a ``PartitionedIndex`` at one moment, numbered globally (partition 0's buckets, then
    partition 1's, ...): what a cut or a scan holds to read the index as of that moment while writes go on."""

    def __init__(self, parts: list[tuple[np.ndarray, np.ndarray]], backend: Backend = "auto") -> None:
        self.parts = parts
        self.backend = resolve_backend(backend)
        self.offsets = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([k.shape[0] for k, _ in parts], out=self.offsets[1:])

    @property
    def size(self) -> int:
        """Buckets in all."""
        return int(self.offsets[-1])

    def segments(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(first global bucket, keys, values) of each partition."""
        return [(int(self.offsets[p]), k, v) for p, (k, v) in enumerate(self.parts)]

    def segment_end(self, bucket: int) -> int:
        """The global bucket just past the partition holding ``bucket``."""
        return int(self.offsets[np.searchsorted(self.offsets, bucket, side="right")])

    def slice(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) of global buckets [lo, hi), which lie in one partition."""
        p = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        off = int(self.offsets[p])
        assert hi <= self.offsets[p + 1], "a bucket range crosses partitions"
        keys, vals = self.parts[p]
        return keys[lo - off:hi - off], vals[lo - off:hi - off]

    def indexes(self) -> list[HashIndex]:
        """One read-only ``HashIndex`` over each partition's arrays (for ``keys_in_slots`` and ``slot_counts``)."""
        return [HashIndex.over(k, v, self.backend) for k, v in self.parts]

    def at(self, buckets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(keys uint64, values int32) of global ``buckets`` (int64, any order)."""
        keys, vals = np.empty(buckets.shape[0], np.uint64), np.empty(buckets.shape[0], np.int32)
        part = np.searchsorted(self.offsets, buckets, side="right") - 1
        for p, (k, v) in enumerate(self.parts):
            mine = np.flatnonzero(part == p)
            if mine.size:
                local = buckets[mine] - self.offsets[p]
                keys[mine], vals[mine] = k[local], v[local]
        return keys, vals

    def positions(self, ids: np.ndarray, current: PartitionedIndex | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
        """(n,) ids -> (global buckets, values), both int64, -1 where absent. ``current``: only in the partitions
        whose arrays are still that index's (an id inserted into a partition grown since is not in this view)."""
        skip = None
        if current is not None:
            skip = np.array([now.buckets()[0] is not keys for now, (keys, _) in zip(current._parts, self.parts,
                                                                                     strict=True)])
        return _probe_parts(self.parts, as_id_bits(ids), self.backend, self.offsets, skip)
