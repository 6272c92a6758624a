"""Cut: a consistent read of a whole table at one point in its write order, without holding the table's lock
for time proportional to the table (copy-on-write).

    open   (under the table's lock, O(1))   keep the bucket arrays of both hash indexes as they are (each
                                            partition's: ``IndexView``), the slab's
                                            high water, the step and the snapshot mark; allocate the cut's state
                                            arrays zero-filled (calloc: the OS zeroes the pages on first touch)
    writes (under the lock, O(batch), vectorized, before they change anything the cut has not read)
           update of a resident row         its row as of the open is saved once    (``where[p] = k + 1``)
           removal of a resident row        id and row move to the cut's removed rows (``where[p] = -1``)
           position allocated               never the cut's                          (``where[p] = -1``)
           spilled row leaving the tier     id and row move to the removed rows       (``spilled_done[b]``)
           id spilled                       its bucket is never the cut's             (``spilled_done[b]``)
    read   ``batches``: ``chunk`` buckets per short hold of the lock, first of the resident index (rows from
           the slab or saved), then of the spilled index (rows from the spill file), then the removed rows.

Why the rows read are exactly the rows at the open: a hash index changes a bucket in place only from live to
tombstone (a removal, seen by the hooks first) or from empty/tombstone to live (an insert, whose slab position or
spilled bucket is marked as not the cut's); a rehash builds new arrays and leaves the ones the cut holds as they
were. So the held arrays list every id stored at the open that was not removed since, beside ids stored since,
which the cut skips. A resident row stays at its slab position until removed, and its contents change only
through the hooks' callers, which save the row first; a spilled row's record changes only when it leaves
the tier. Each id stored at the open is thus read once: from its bucket, or from the removed rows.

Cost while a cut is open: per write, a gather of the cut's state at the batch's positions (and a probe of the
held spilled buckets for rows leaving the tier); the first update of a row the cut has not read copies that row
(~100 bytes at dim 16) into the cut. The saved rows are freed as the reader passes them, so a cut holds at most
one copy of the rows written while it is open. Reading a cut consumes it; ``close`` (or the end of ``batches``)
unregisters it, after which writes cost nothing more. Thread-safety: one reader per cut, any number of writers
(they hold the table's lock); the reader takes the lock only per chunk.

Example::

    with table.cut() as cut:               # O(1) under the lock: at this point in the write order
        for batch in cut.batches():        # RowBatch chunks, in no set order, while pushes go on
            ...
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from tigana.embeddings._checksum import row_digests
from tigana.embeddings._fields import TableFields
from tigana.embeddings.errors import CorruptStore
from tigana.embeddings.partitioned import PartitionedIndex
from tigana.embeddings.rows import RowBatch
from tigana.embeddings.slab import Slab

if TYPE_CHECKING:
    from tigana.embeddings.table import EmbeddingTable

__all__ = ["Cut", "checksum_text"]

CUT_BUCKETS = 1 << 14  # hash buckets read per hold of the table's lock (about 11k rows at the index's load)
ORDERED_ROWS = 1 << 14  # rows read by id per hold of the lock, in id order (``batches(in_order=True)``)


def checksum_text(dim: int, state_width: int, rows: int, digest_sum: int) -> str:
    """The table checksum (hex) from its row count and the wrapping uint64 sum of its row digests."""
    return hashlib.blake2b(f"{dim}:{state_width}:{rows}:{digest_sum}".encode(), digest_size=16).hexdigest()


class Cut:
    """The rows of one table as they were at one point in its write order; see the module docstring.

    ``step``: the table step at the cut; ``marks``: the snapshot marks (``Slab.dirty``) of the rows changed
    since the previous tracked snapshot. Open one with ``EmbeddingTable.cut()``; read it once."""

    def __init__(self, table: EmbeddingTable) -> None:  # the caller holds the table's lock
        self._table = table
        self.step = table._step
        self.marks: tuple[int, ...] = (table._slab.mark, *table._pending_marks)
        self.dim, self.state_width = table.dim, table.state_width
        self._res = table._index.view()  # the resident index's partitions, global bucket numbers
        self._high_water = table._slab.high_water
        self._where = np.zeros(self._high_water, np.int32)  # per slab position: 0, -1 or saved index + 1
        self._saved = Slab(table.dim, table.state_width, table.config.dtype)
        self._sp = table._spilled.view()  # the spilled index's partitions, global bucket numbers
        self._sp_done = np.zeros(self._sp.size, bool)
        self._removed: list[tuple[RowBatch, np.ndarray]] = []  # (rows, their marks) removed before read
        self._digest: tuple[int, int] | None = None  # (rows, digest sum) once a pass has run
        self._open = True

    # --- the reader ------------------------------------------------------------------------------------------
    def batches(self, chunk: int | None = None, *, dirty_only: bool = False, in_order: bool = False
                ) -> Iterator[RowBatch]:
        """The cut's rows as non-empty RowBatches, ``chunk`` hash buckets per short hold of the table's lock, in
        no set order; ``in_order``: ascending by id (one pass collects and sorts the ids, 8 bytes a row, then
        the rows are read ``ORDERED_ROWS`` ids per hold), except for the rows removed from the table before the
        cut read them, which come last (ascending among themselves). ``dirty_only``: only rows changed since
        the tracked snapshot before the cut. Consumes the cut and closes it (also when the generator is closed
        early). Raises ``InvalidArgument`` when the table is closed meanwhile and ``CorruptStore`` for a spilled
        record that fails its checks."""
        table = self._table
        chunk = chunk or CUT_BUCKETS
        try:
            yield from (self._ordered(chunk, dirty_only) if in_order else self._walk(chunk, dirty_only))
            with table._lock:
                self._check()
                removed, self._removed = self._removed, []
                self._close_locked()
            if dirty_only:
                removed = [(rows.take(np.isin(marks, self.marks)), marks) for rows, marks in removed]
            removed = [(rows, marks) for rows, marks in removed if len(rows)]
            if in_order and removed:
                rows = RowBatch.concat([r for r, _ in removed])
                removed = [(rows.take(np.argsort(rows.ids)), np.empty(0))]
            for rows, _ in removed:
                yield rows
        finally:
            self.close()

    def _segments(self) -> list[tuple[int, int, bool]]:
        """(first bucket, end, spilled) of each partition of the resident index, then of the spilled one (a
        chunk of buckets never crosses a partition)."""
        return [(off, off + keys.shape[0], spilled) for view, spilled in ((self._res, False), (self._sp, True))
                for off, keys, _ in view.segments()]

    def _walk(self, chunk: int, dirty_only: bool) -> Iterator[RowBatch]:
        for first, end, spilled in self._segments():
            read = self._spilled if spilled else self._resident
            for lo in range(first, end, chunk):
                with self._table._lock:
                    self._check()
                    batch = read(lo, min(lo + chunk, end), dirty_only)
                if batch is not None and len(batch):
                    yield batch

    def _ordered(self, chunk: int, dirty_only: bool) -> Iterator[RowBatch]:
        """Ids first (those not yet read nor removed), sorted; then their rows, found again by id: an id removed
        meanwhile is no longer found (its row is among the removed rows), one read is no longer the cut's."""
        table = self._table
        parts = []
        for first, end, spilled in self._segments():
            for lo in range(first, end, chunk):
                hi = min(lo + chunk, end)
                with table._lock:
                    self._check()
                    if spilled:
                        keys, v = self._sp.slice(lo, hi)
                        live = (v >= 0) & ~self._sp_done[lo:hi]
                    else:
                        keys, v = self._res.slice(lo, hi)
                        live = v >= 0
                        pos = v[live]
                        live[live] = pos < self._high_water
                        live[live] = self._where[v[live]] != -1
                    parts.append(keys[live].view(np.int64))
        ids = np.sort(np.concatenate(parts)) if parts else np.empty(0, np.int64)
        ids = ids[np.r_[True, ids[1:] != ids[:-1]]] if ids.size else ids  # (np.unique hashes: far slower here)
        for lo in range(0, ids.shape[0], ORDERED_ROWS):
            part = ids[lo:lo + ORDERED_ROWS]
            with table._lock:
                self._check()
                _, pos = self._res.positions(part)
                found = pos >= 0
                rows, marks = self._take(part[found], pos[found])
                if dirty_only:
                    rows = rows.take(np.isin(marks, self.marks))
                rest = part[~found]
                if rest.size and self._sp.size:
                    buckets, sp_vals = self._sp.positions(rest)
                    mine = buckets >= 0
                    mine[mine] = ~self._sp_done[buckets[mine]]
                    self._sp_done[buckets[mine]] = True
                    if dirty_only:
                        mine &= np.isin(table._spill_marks_of(sp_vals), self.marks)
                    if mine.any():
                        rows = RowBatch.concat([rows, self._read_spilled(rest[mine])])
            if len(rows):
                yield rows.take(np.argsort(rows.ids))

    def checksums_by(self, bucket_of: Callable[[np.ndarray], np.ndarray], num_buckets: int
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Order-independent digests of the cut's rows grouped by ``bucket_of(ids) -> (n,) int in [0,
        num_buckets)``: ((num_buckets,) uint64 digest sums, (num_buckets,) int64 row counts). Reads the cut."""
        sums = np.zeros(num_buckets, np.uint64)
        counts = np.zeros(num_buckets, np.int64)
        with self:
            for batch in self.batches():
                buckets = np.asarray(bucket_of(batch.ids))
                if buckets.shape != batch.ids.shape or buckets.dtype.kind not in "iu" or \
                        int(buckets.min()) < 0 or int(buckets.max()) >= num_buckets:
                    raise self._table._bad("bucket_of", f"must map ids to (n,) ints in [0, {num_buckets}), "
                                                        f"got {buckets.dtype} {buckets.shape}")
                buckets = buckets.astype(np.int64)
                with np.errstate(over="ignore"):
                    np.add.at(sums, buckets, row_digests(batch))
                counts += np.bincount(buckets, minlength=num_buckets)
        with np.errstate(over="ignore"):
            total = int(sums.sum(dtype=np.uint64))
        self._digest = (int(counts.sum()), total)
        return sums, counts

    def checksum(self) -> str:
        """Order-independent digest (hex) of the cut's rows (ids, weights, optimizer state): equal to
        ``EmbeddingTable.checksum()`` of a table holding the same rows. Reads the cut (or reuses the totals of a
        ``checksums_by`` already run on it)."""
        if self._digest is None:
            self.checksums_by(lambda ids: np.zeros(ids.shape[0], np.int64), 1)
        assert self._digest is not None
        return checksum_text(self.dim, self.state_width, *self._digest)

    def close(self) -> None:
        """Stop tracking writes (idempotent); the cut can no longer be read."""
        if self._open:
            with self._table._lock:
                self._close_locked()

    def __enter__(self) -> Cut:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_locked(self) -> None:
        if self._open:
            self._open = False
            cuts = self._table._cuts
            if self in cuts:
                cuts.remove(self)
            self._saved.clear()

    def _check(self) -> None:
        self._table._check_open()
        if not self._open:
            raise self._table._bad("cut", "is closed (a cut is read once)")

    def _resident(self, lo: int, hi: int, dirty_only: bool) -> RowBatch | None:
        keys, vals = self._res.slice(lo, hi)
        live = vals >= 0
        if not live.any():
            return None
        rows, marks = self._take(keys[live].view(np.int64), vals[live].astype(np.int64))
        return rows.take(np.isin(marks, self.marks)) if dirty_only else rows

    def _spilled(self, lo: int, hi: int, dirty_only: bool) -> RowBatch | None:
        keys, vals = self._sp.slice(lo, hi)
        live = (vals >= 0) & ~self._sp_done[lo:hi]
        self._sp_done[lo:hi] = True
        if dirty_only:
            live &= np.isin(self._table._spill_marks_of(vals), self.marks)
        if not live.any():
            return None
        return self._read_spilled(keys[live].view(np.int64))

    def _read_spilled(self, ids: np.ndarray) -> RowBatch:
        """Rows of spilled ``ids`` still the cut's: unmoved since the cut opened (a move tells the cut first)."""
        table = self._table
        rows = table._spill_rows(ids)
        if len(rows) != ids.shape[0]:
            assert table._spill is not None
            raise CorruptStore(f"table {table.name!r}: spilled ids missing from the spill tier "
                               f"{table._spill.file}: {ids[~np.isin(ids, rows.ids)][:5].tolist()}")
        return rows

    # --- what writes tell the cut (the table holds its lock) -------------------------------------------------
    def _take(self, ids: np.ndarray, positions: np.ndarray) -> tuple[RowBatch, np.ndarray]:
        """Rows as of the open (and their marks) of the resident ``positions`` still the cut's, which are no longer
        its afterwards (read, or removed from the table)."""
        inside = positions < self._high_water
        ids, positions = ids[inside], positions[inside]
        state = self._where[positions]
        mine = state != -1
        ids, positions, state = ids[mine], positions[mine], state[mine]
        self._where[positions] = -1
        slab = self._table._slab
        live = state == 0
        if live.all():
            return slab.read(ids, positions), slab.dirty[positions]
        k = state[~live].astype(np.int64) - 1
        saved, saved_marks = self._saved.read(ids[~live], k), self._saved.dirty[k].copy()
        self._saved.release(k)
        if not live.any():
            return saved, saved_marks
        return (RowBatch.concat([slab.read(ids[live], positions[live]), saved]),
                np.concatenate([slab.dirty[positions[live]], saved_marks]))

    def saving(self, positions: np.ndarray) -> None:
        """Resident rows at unique ``positions`` are about to change: keep those the cut has not read."""
        p = positions[positions < self._high_water]
        p = p[self._where[p] == 0]
        if p.size:
            slab = self._table._slab
            k = self._saved.allocate(p.size)
            self._saved.write(k, slab.read(p, p), access=0)
            self._saved.dirty[k] = slab.dirty[p]
            self._where[p] = k + 1

    def removing(self, ids: np.ndarray, positions: np.ndarray) -> None:
        """Resident rows (``ids`` at ``positions``) are leaving the slab: keep those the cut has not read."""
        rows, marks = self._take(ids, positions)
        if len(rows):
            self._removed.append((rows, marks))

    def allocated(self, positions: np.ndarray) -> None:
        """Slab ``positions`` were just handed out: whatever they hold now is not the cut's."""
        self._where[positions[positions < self._high_water]] = -1

    def spilled_unread(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Of unique spilled ``ids`` about to leave the tier, those the cut has not read: (buckets in the held
        spilled arrays, ids, marks). The caller keeps their rows (``keep_removed``) and marks the buckets done."""
        buckets, vals = self._sp.positions(ids)
        mine = buckets >= 0
        mine[mine] = ~self._sp_done[buckets[mine]]
        return buckets[mine], ids[mine], self._table._spill_marks_of(vals[mine])

    def keep_removed(self, buckets: np.ndarray, ids: np.ndarray, marks: np.ndarray, rows: RowBatch) -> None:
        """Keep ``rows`` (the rows of ``ids``, in any order) as removed before read; their buckets are done."""
        order = np.argsort(ids)
        at = order[np.searchsorted(ids, rows.ids, sorter=order)]
        self._removed.append((rows, marks[at]))
        self._sp_done[buckets] = True

    def spilled_inserted(self, index: PartitionedIndex, ids: np.ndarray) -> None:
        """``ids`` were just inserted into the spilled index: their buckets (in the partitions whose arrays are
        still the held ones) are not the cut's."""
        buckets, _ = self._sp.positions(ids, current=index)
        self._sp_done[buckets[buckets >= 0]] = True


class CutHooks(TableFields):
    """The table's side of cuts: opening one, and telling the open ones before a write changes rows."""

    def cut(self) -> Cut:
        """A consistent cut of every stored row (resident and spilled) at this point in the write order; O(1)
        under the table's lock. Read it once (``Cut.batches``, ``checksum``, ``checksums_by``) or ``close`` it:
        while open, each write preserves the rows it changes that the cut has not read."""
        with self._lock:
            self._check_open()
            cut = Cut(self)  # type: ignore[arg-type]
            self._cuts.append(cut)
            return cut

    def _cow_update(self, positions: np.ndarray) -> None:
        for cut in self._cuts:
            cut.saving(positions)

    def _cow_remove(self, ids: np.ndarray, positions: np.ndarray) -> None:
        for cut in self._cuts:
            cut.removing(ids, positions)

    def _cow_fresh(self, positions: np.ndarray) -> None:
        for cut in self._cuts:
            cut.allocated(positions)

    def _cow_unspill(self, ids: np.ndarray, rows: RowBatch | None = None) -> None:
        """Unique spilled ``ids`` are about to leave the tier; ``rows``: their rows when the caller has them
        (otherwise they are read from the spill file, before anything changes: a bad record raises here)."""
        for cut in self._cuts:
            buckets, need, marks = cut.spilled_unread(ids)
            if need.size:
                got = rows.take(np.isin(rows.ids, need)) if rows is not None else self._spill_rows(need)
                cut.keep_removed(buckets, need, marks, got)

    def _cow_spilled(self, ids: np.ndarray) -> None:
        for cut in self._cuts:
            cut.spilled_inserted(self._spilled, ids)
