"""Cut: a consistent read of a whole table at one point in its write order, without holding the table's lock
for time proportional to the table (copy-on-write).

    open   (under the table's lock, O(1))   keep the bucket arrays of both hash indexes as they are (each
                                            partition's: ``IndexView``), the slab's
                                            high water, the step and the snapshot mark; allocate the cut's state
                                            arrays zero-filled (calloc: the OS zeroes the pages on first touch)
    writes (under the lock, O(batch), vectorized, before they change anything the cut has not read)
           update of a resident row         its row as of the open is saved once    (``where[p] = k + 1``)
           removal of a resident row        id and row move to the cut's removed rows (``where[p] = -1``)
           spill of a resident row          the cut parks the slot of its record     (``where[p] = -1``)
                                            (a row changed since the open: its saved row is written to the
                                            file for the cut alone, and that slot parked)
           position allocated               never the cut's                          (``where[p] = -1``)
           spilled row leaving the tier     the cut parks its slot                    (``spilled_done[b]``)
           id spilled                       its bucket is never the cut's             (``spilled_done[b]``)
    read   ``batches``: ``chunk`` buckets per short hold of the lock, first of the resident index (rows from
           the slab or saved), then of the spilled index (rows from the spill file), then the parked slots in
           file order (rows from the spill file), then the removed rows.

Why the rows read are exactly the rows at the open: a hash index changes a bucket in place only from live to
tombstone (a removal, seen by the hooks first) or from empty/tombstone to live (an insert, whose slab position or
spilled bucket is marked as not the cut's); a rehash builds new arrays and leaves the ones the cut holds as they
were. So the held arrays list every id stored at the open that was not removed since, beside ids stored since,
which the cut skips. A resident row stays at its slab position until removed, and its contents change only
through the hooks' callers, which save the row first; a spilled row's record changes only when it leaves
the tier. Each id stored at the open is thus read once: from its bucket, from a parked slot, or from the
removed rows.

Parked slots: a record in the spill file holds its row as of the cut when the row spilled unchanged since the
open (or was written from the cut's saved row), or was spilled at the open and leaves the tier. The cut pins
the slot (``SlotPins``): the file does not write another row there until every cut holding it has read it or
closed, even when the table lets go of the row. So a row on disk stays on disk: the cut holds 4 bytes for it, not
the row, and a snapshot of a table past its memory budget keeps to that budget.

Cost while a cut is open: per write, a gather of the cut's state at the batch's positions (and a probe of the
held spilled buckets for rows leaving the tier); the first update of a row the cut has not read copies that row
(~100 bytes at dim 16) into the cut, until the row is read or spills. The saved rows are freed as the reader
passes them, so a cut holds at most one copy of the resident rows written while it is open. Reading a cut
consumes it; ``close`` (or the end of ``batches``) unregisters it and lets go of its parked slots, after which
writes cost nothing more. Thread-safety: one reader per cut, any number of writers (they hold the table's lock);
the reader takes the lock only per chunk.

Example::

    with table.cut() as cut:               # O(1) under the table's lock: at this point in the write order
        for batch in cut.batches():        # RowBatch chunks, in no set order, while pushes go on
            ...
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from tigana.embeddings import _cutorder
from tigana.embeddings._checksum import row_digests
from tigana.embeddings._fields import TableFields
from tigana.embeddings._slotpins import MAX_CUTS
from tigana.embeddings.errors import CorruptStore, StorageFull
from tigana.embeddings.partitioned import PartitionedIndex
from tigana.embeddings.rows import RowBatch
from tigana.embeddings.slab import Slab

if TYPE_CHECKING:
    from tigana.embeddings.table import EmbeddingTable

__all__ = ["Cut", "checksum_text"]

CUT_BUCKETS = 1 << 14  # hash buckets read per hold of the table's lock (about 11k rows at the index's load)
ORDERED_ROWS = 1 << 14  # rows read by id per hold of the lock, in id order (``batches(in_order=True)``)
PARKED_ROWS = 1 << 15  # parked rows read from the spill file per hold of the lock


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
        self._parked: list[np.ndarray] = []  # int32 spill slots the cut reads its rows from, pinned (``_park``)
        self._reading = np.empty(0, np.int32)  # parked slots taken for reading, ascending; pinned until read
        self._rows = len(table._index) + len(table._spilled)  # rows at the open (sizes the ordered read's ranges)
        self._range_nbytes = 0  # the sorted ids of the ordered read's current range
        self._digest: tuple[int, int] | None = None  # (rows, digest sum) once a pass has run
        self._open = True

    # --- the reader ------------------------------------------------------------------------------------------
    def batches(self, chunk: int | None = None, *, dirty_only: bool = False, in_order: bool = False
                ) -> Iterator[RowBatch]:
        """The cut's rows as non-empty RowBatches, ``chunk`` hash buckets per short hold of the table's lock, in
        no set order; ``in_order``: ascending by id (range by range of ids, a pass collects and sorts a range's
        ids, 8 bytes an id, then its rows are read ``ORDERED_ROWS`` ids per hold), except for the rows that left
        where the cut would have read them, which come last: those that spilled or left the spill tier meanwhile
        (read in the spill file's order, each batch ascending), then those removed from the table (ascending
        among themselves). ``dirty_only``: only rows changed since
        the tracked snapshot before the cut. Consumes the cut and closes it (also when the generator is closed
        early). Raises ``InvalidArgument`` when the table is closed meanwhile and ``CorruptStore`` for a spilled
        record that fails its checks."""
        table = self._table
        chunk = chunk or CUT_BUCKETS
        try:
            yield from (self._ordered(chunk, dirty_only) if in_order else self._walk(chunk, dirty_only))
            yield from self._read_parked(dirty_only, in_order)
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
        """Range by range of ids (``_id_ranges``): the range's ids not yet read nor removed (those ``dirty_only``
        keeps), sorted; then their rows, found again by id: an id removed meanwhile is no longer found (its row is
        parked or among the removed rows), one read is no longer the cut's."""
        table = self._table
        for lo_id, hi_id in _cutorder.id_ranges(self, chunk):
            ids = _cutorder.collect_ids(self, chunk, dirty_only, lo_id, hi_id)
            self._range_nbytes = ids.nbytes
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

    def _read_parked(self, dirty_only: bool, in_order: bool) -> Iterator[RowBatch]:
        """The rows at the parked slots, ``PARKED_ROWS`` per hold of the lock, in the file's order (ascending
        slots: the reads run through the file once); each slot is let go of once read."""
        table = self._table
        while True:
            with table._lock:
                self._check()
                if not self._reading.size:
                    if not self._parked:
                        return
                    self._reading = np.sort(np.concatenate(self._parked))
                    self._parked = []
                slots = self._reading[:PARKED_ROWS].astype(np.int64)
                assert table._spill is not None
                rows = table._spill.read_slots(slots)  # a bad record raises: the slots stay pinned until close
                marks = table._spill_marks[slots]
                self._reading = self._reading[PARKED_ROWS:]
                table._spill.free(table._spill_pins.release(slots))
            if dirty_only:
                rows = rows.take(np.isin(marks, self.marks))
            if in_order:
                rows = rows.take(np.argsort(rows.ids))
            if len(rows):
                yield rows

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

    @property
    def nbytes(self) -> int:
        """Bytes the cut holds beside the table (under the table's lock): its state arrays (counted whole, though
        zero pages cost nothing until touched), saved and removed rows, parked slots, the ids of the ordered
        read's range, and the bucket arrays it holds that the table has replaced since (a partition that grew or
        was rehashed: the cut keeps the old arrays alive until it is read)."""
        removed = sum(r.weights.nbytes + r.state.nbytes + 32 * len(r) for r, _ in self._removed)
        parked = sum(p.nbytes for p in self._parked) + self._reading.nbytes
        table = self._table
        replaced = 0
        for held, index in ((self._res, table._index), (self._sp, table._spilled)):
            current = {id(keys) for keys, _ in index.view().parts}
            replaced += sum(keys.nbytes + vals.nbytes for keys, vals in held.parts if id(keys) not in current)
        return (self._where.nbytes + self._sp_done.nbytes + self._saved.nbytes + removed + parked
                + self._range_nbytes + replaced)

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
            held = np.concatenate([self._reading, *self._parked]).astype(np.int64)
            self._reading, self._parked = np.empty(0, np.int32), []
            table = self._table
            if held.size and table._spill is not None and not table._closed:
                table._spill.free(table._spill_pins.release(held))

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

    def spilling(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        """Resident rows (``ids`` at ``positions``) were just written to the spill file at ``slots`` (aligned) and
        leave the slab: the cut reads those it has not read from the file. A row unchanged since the open: its
        slot is parked. A changed one: its saved row is written to the file for the cut alone, and that slot
        parked (when the file cannot grow, the saved row stays in RAM among the removed rows instead)."""
        inside = positions < self._high_water
        ids, positions, slots = ids[inside], positions[inside], slots[inside]
        state = self._where[positions]
        mine = state != -1
        self._where[positions[mine]] = -1
        self._park(slots[mine & (state == 0)])
        changed = mine & (state > 0)
        if not changed.any():
            return
        k = state[changed].astype(np.int64) - 1
        rows, marks = self._saved.read(ids[changed], k), self._saved.dirty[k].copy()
        self._saved.release(k)
        self._write_own(rows, marks)

    def moving(self, ids: np.ndarray, positions: np.ndarray) -> None:
        """Resident rows (``ids`` at ``positions``) are about to move to other slab positions (a compaction): the
        cut writes those it has not read, as of the open, to the spill file for itself and parks them (the new
        positions are then ``allocated``: not the cut's). ``PARKED_ROWS`` rows at a time: a compaction may move
        many, and each chunk is copied twice (read from the slab, encoded as records)."""
        for lo in range(0, ids.shape[0], PARKED_ROWS):
            rows, marks = self._take(ids[lo:lo + PARKED_ROWS], positions[lo:lo + PARKED_ROWS])
            if len(rows):
                self._write_own(rows, marks)

    def _write_own(self, rows: RowBatch, marks: np.ndarray) -> None:
        """Write ``rows`` (as of the open, with their ``marks``) to the spill file for the cut alone and park their
        slots; when the file cannot grow, keep them in RAM among the removed rows instead."""
        table = self._table
        assert table._spill is not None
        try:
            own = table._spill.write(rows)
        except StorageFull:
            self._removed.append((rows, marks))
            return
        table._set_spill_marks(own, marks)
        table._spill_pins.pin(own)
        table._spill_pins.free(own)  # the table never holds these records: they go once the cuts have read them
        self._parked.append(own.astype(np.int32))

    def unspilling(self, ids: np.ndarray) -> None:
        """Unique spilled ``ids`` are about to leave the tier: the cut parks the slots of those it has not read
        (their records hold the rows as of the open: a spilled row's record does not change while it stays)."""
        buckets, vals = self._sp.positions(ids)
        mine = buckets >= 0
        mine[mine] = ~self._sp_done[buckets[mine]]
        self._sp_done[buckets[mine]] = True
        self._park(vals[mine])

    def _park(self, slots: np.ndarray) -> None:
        """The rows at spill ``slots`` (unique) are the cut's, to be read from the file: pin the slots."""
        if slots.size:
            self._table._spill_pins.pin(slots.astype(np.int64))
            self._parked.append(slots.astype(np.int32))

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
            if len(self._cuts) >= MAX_CUTS:
                raise self._bad("cut", f"at most {MAX_CUTS} cuts of one table may be open at once (read or close "
                                       "one first)")
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

    def _cow_move(self, ids: np.ndarray, positions: np.ndarray) -> None:
        for cut in self._cuts:
            cut.moving(ids, positions)

    def _cuts_nbytes(self) -> int:
        """Bytes the open cuts hold beside the table (the budget covers them)."""
        return sum(cut.nbytes for cut in self._cuts)

    def _cow_spill(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        for cut in self._cuts:
            cut.spilling(ids, positions, slots)

    def _cow_unspill(self, ids: np.ndarray) -> None:
        """Unique spilled ``ids`` are about to leave the tier (their slots are freed after: ``_drop_spilled``)."""
        for cut in self._cuts:
            cut.unspilling(ids)

    def _cow_spilled(self, ids: np.ndarray) -> None:
        for cut in self._cuts:
            cut.spilled_inserted(self._spilled, ids)
