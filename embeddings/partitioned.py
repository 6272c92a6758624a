"""PartitionedIndex: one map of int64 id -> int32 value as ``PARTS`` ``HashIndex`` partitions that grow one at a
time, and ``IndexView``, its bucket arrays at one moment numbered globally (partition 0's buckets, then partition
1's, ...) for the readers that hold them while writes go on (cuts, scans).

A table keeps its resident ids and its spilled ids in one each. A growing ``HashIndex`` holds its old and new
arrays at once, 2.5x its bytes for the rehash, and a spilling table's budget could not hold such a spike; here a
growth rehashes one partition. A key's partition is bits 27-30 of its salted mix (``parts_of``), so the
partitions fill evenly; probes read every partition in one pass (``_part_kernels.probe``), inserts and deletes
split the batch by partition first (a counting sort) and reserve room partition by partition.
"""

from __future__ import annotations

import numpy as np

from tigana.embeddings import _part_kernels
from tigana.embeddings._part_kernels import _PART_SHIFT, PARTS
from tigana.embeddings.hashtable import (
    _BUCKET_BYTES,
    Backend,
    HashIndex,
    _grown,
    as_id_bits,
    new_salt,
    resolve_backend,
)
from tigana.embeddings.mixing import mix64

__all__ = ["PARTS", "IndexView", "PartitionedIndex", "parts_of"]

_PART_MIN = 8  # buckets of an empty partition: an empty index takes 1.5 KB
_NO_OFFSETS = np.zeros(PARTS, np.int64)  # bucket numbers inside each partition (a lookup needs values only)


def parts_of(q: np.ndarray, salt: np.uint64) -> np.ndarray:
    """The partition (uint8, in [0, PARTS)) of each uint64 key in an index salted with ``salt``: bits 27-30 of its
    salted mix, which the home bucket inside a partition (the top 32 bits) does not read."""
    return ((mix64(q ^ salt) >> _PART_SHIFT) & np.uint64(PARTS - 1)).astype(np.uint8)


def _split(q: np.ndarray, backend: str, salt: np.uint64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, bounds, sorted keys): ``sorted[bounds[p]:bounds[p + 1]]`` are the keys of partition ``p``, and
    ``sorted == q[order]``."""
    if backend == "numba":
        n = q.shape[0]
        order, sq, bounds = np.empty(n, np.int64), np.empty(n, np.uint64), np.empty(PARTS + 1, np.int64)
        _part_kernels.split(q, order, sq, bounds, salt)
        return order, bounds, sq
    parts = parts_of(q, salt)
    order = np.argsort(parts, kind="stable")  # a radix sort for uint8
    bounds = np.zeros(PARTS + 1, np.int64)
    np.cumsum(np.bincount(parts, minlength=PARTS), out=bounds[1:])
    return order, bounds, q[order]


_Where = tuple[np.ndarray, np.ndarray, np.ndarray]  # partitions' keys and values addresses, capacities


def _where_of(parts: list[tuple[np.ndarray, np.ndarray]]) -> _Where:
    """What ``_part_kernels.probe`` reads the partitions by: valid while their arrays live."""
    return (_part_kernels.addresses([k for k, _ in parts]), _part_kernels.addresses([v for _, v in parts]),
            np.array([k.shape[0] for k, _ in parts], np.int64))


def _probe_parts(parts: list[tuple[np.ndarray, np.ndarray]], q: np.ndarray, backend: str, salt: np.uint64,
                 offsets: np.ndarray | None = None, skip: np.ndarray | None = None, where: _Where | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(bucket positions, values), both int64, -1 where absent, of uint64 keys ``q`` in partitions' bucket arrays
    (of an index salted with ``salt``).
    ``offsets``: add the partition's first global bucket to its positions; ``skip`` (bool, one per partition):
    find nothing there; ``where``: ``_where_of(parts)`` when the caller keeps it."""
    n = q.shape[0]
    pos, val = np.empty(n, np.int64), np.empty(n, np.int64)
    if backend == "numba":  # one pass over the batch (``_part_kernels.probe``), the partitions' arrays held here
        keys_at, vals_at, caps = where if where is not None else _where_of(parts)
        _part_kernels.probe(keys_at, vals_at, caps, _NO_OFFSETS if offsets is None else offsets, q, pos, val,
                            salt)
        if skip is not None and skip.any():
            gone = skip[parts_of(q, salt)]
            pos[gone], val[gone] = -1, -1
        return pos, val
    order, bounds, sq = _split(q, backend, salt)
    for p, (keys, vals) in enumerate(parts):
        lo, hi = int(bounds[p]), int(bounds[p + 1])
        if lo == hi:
            continue
        if skip is not None and skip[p]:
            pos[lo:hi], val[lo:hi] = -1, -1
            continue
        pos[lo:hi], val[lo:hi] = HashIndex.over(keys, vals, salt, backend)._probe(sq[lo:hi])
        if offsets is not None:
            at = pos[lo:hi]
            at[at >= 0] += offsets[p]
    out_pos, out_val = np.empty(n, np.int64), np.empty(n, np.int64)
    out_pos[order], out_val[order] = pos, val
    return out_pos, out_val


class PartitionedIndex:
    """A map of int64 id -> int32 value >= 0 as ``PARTS`` ``HashIndex`` partitions, each growing on its own.

    Why: a growing ``HashIndex`` holds its old and new arrays at once, 2.5x its bytes for the rehash. A table's
    two indexes are much of a spilling table's memory (125 M spilled ids hold ~2.3 GB), and such a spike broke
    its memory budget. Here a growth rehashes one partition, so the spike is at most ``growth_bytes``: the new
    arrays of one partition (about 1.5/``PARTS`` of the index). Keys split by bits of their salted mix
    (``parts_of``), so the partitions fill evenly; a lookup costs what a ``HashIndex`` lookup does (one pass, no
    split), an insert or a delete one counting sort more. Bucket numbers (``view``) are global: a partition's
    buckets follow those of the partitions before it. Not thread-safe on its own, as ``HashIndex``."""

    def __init__(self, *, backend: Backend = "auto") -> None:
        self.backend = resolve_backend(backend)
        self.salt = new_salt()  # one for all partitions: it also picks a key's partition
        self._parts = [HashIndex(_PART_MIN, backend=self.backend, min_capacity=_PART_MIN, salt=self.salt)
                       for _ in range(PARTS)]
        # the partitions' addresses for probes, dropped by the two calls that replace a partition's arrays (an
        # insert that grows it, ``clear``): holding the arrays themselves kept every partition's old arrays alive
        # after a growth until the next lookup, the whole index twice over (a 1 GiB spilling daemon peaked
        # 0.15 GiB higher); checking weak references to them at each lookup cost a small pull a fifth of its time
        self._where: _Where | None = None
        self._size = 0  # live keys in all partitions (a table asks at every call whether it spilled any)

    def __len__(self) -> int:
        return self._size

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
        return IndexView([p.buckets() for p in self._parts], self.salt, self.backend)

    @property
    def capacity(self) -> int:
        """Buckets in all partitions."""
        return sum(p.capacity for p in self._parts)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """(n,) ids -> (n,) int64 values, -1 where absent."""
        if self.backend != "numba":
            return _probe_parts([p.buckets() for p in self._parts], as_id_bits(ids), self.backend, self.salt)[1]
        if self._where is None:
            self._where = _where_of([p.buckets() for p in self._parts])
        return _probe_parts([], as_id_bits(ids), self.backend, self.salt, where=self._where)[1]

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
        order, bounds, sq = _split(as_id_bits(ids), self.backend, self.salt)
        for p, part in enumerate(self._parts):
            lo, hi = int(bounds[p]), int(bounds[p + 1])
            if lo < hi:
                keys, before = part.buckets()[0], len(part)
                part.insert(sq[lo:hi].view(np.int64), v[order[lo:hi]])
                self._size += len(part) - before
                if part.buckets()[0] is not keys:  # it grew: new arrays, the old ones freed (no probe may read them)
                    self._where = None

    def delete(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Remove ids (duplicates and absent ids allowed). Returns (removed ids, their values), unique."""
        _, bounds, sq = _split(as_id_bits(ids), self.backend, self.salt)
        got = [part.delete(sq[bounds[p]:bounds[p + 1]].view(np.int64))
               for p, part in enumerate(self._parts) if bounds[p] < bounds[p + 1] and len(part)]
        if not got:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        self._size -= sum(g[0].shape[0] for g in got)
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
        self._where = None
        self._size = 0


class IndexView:
    """The bucket arrays of a ``PartitionedIndex`` at one moment, numbered globally (partition 0's buckets, then
    partition 1's, ...): what a cut or a scan holds to read the index as of that moment while writes go on."""

    def __init__(self, parts: list[tuple[np.ndarray, np.ndarray]], salt: np.uint64, backend: Backend = "auto"
                 ) -> None:
        self.parts = parts
        self.salt = salt
        self.backend = resolve_backend(backend)
        self.offsets = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([k.shape[0] for k, _ in parts], out=self.offsets[1:])
        self._where: _Where | None = None  # the held arrays' addresses, once a probe needs them (they live here)

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
        return [HashIndex.over(k, v, self.salt, self.backend) for k, v in self.parts]

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
        if self.backend == "numba" and self._where is None:
            self._where = _where_of(self.parts)
        return _probe_parts(self.parts, as_id_bits(ids), self.backend, self.salt, self.offsets, skip, self._where)
