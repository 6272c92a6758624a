"""Reading whole rows out of a table and writing them in: export (all, by ids, by predicate, since a time), the
rows a write touched, import (insert or overwrite complete rows), and the checksums that compare copies.

A read of every row goes through a ``Cut`` (``cut``), so it holds the table's lock only per chunk, not for the
whole table; reads by ids take the lock once (their cost follows the ids).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from tigana.embeddings._fields import TableFields
from tigana.embeddings.changes import sorted_unique
from tigana.embeddings.hashtable import HashIndex
from tigana.embeddings.masks import any_set
from tigana.embeddings.rows import RowBatch

_CHUNK = 1 << 16  # rows per chunk when reading rows by id
SCAN_BUCKETS = 1 << 19  # index buckets a pass over slots reads per hold of the lock (about 4 ms)


class Exporting(TableFields):
    """Export, import and checksums; see the module docstring."""

    def export_rows(self, predicate: Callable[[np.ndarray], np.ndarray] | None = None,
                    ids: np.ndarray | None = None, *, since: float | None = None) -> RowBatch:
        """Complete rows (resident and spilled), sorted by id: all of them, those whose id is in ``ids``
        (absent ids are skipped), or those for which ``predicate(ids) -> bool mask`` is true. ``since``: only
        rows updated (or inserted) at or after this unix time (a serving delta: the cost follows the rows
        selected, plus one pass over the resident rows' update times and a read of the spilled ones).
        All of them (no ``ids``, no ``since``) are read through a cut: the lock is held per chunk only."""
        if ids is not None:
            ids = self._check_ids(ids)
        if ids is None and since is None:
            chunks = []
            with self.cut() as cut:
                for batch in cut.batches():
                    if predicate is not None:
                        batch = batch.take(self._selected(predicate, batch.ids))
                    chunks.append(batch)
            rows = RowBatch.concat(chunks) if chunks else RowBatch.empty(self.dim, self._width)
            return rows.take(np.argsort(rows.ids, kind="stable"))
        with self._lock:
            self._check_open()
            if since is not None:
                recent = self._updated_since(float(since))
                ids = recent if ids is None else np.intersect1d(ids, recent)
            chunks = list(self._iter_sorted(ids, predicate))
            return RowBatch.concat(chunks) if chunks else RowBatch.empty(self.dim, self._width)

    def removed_since(self, since: float, predicate: Callable[[np.ndarray], np.ndarray] | None = None
                      ) -> tuple[np.ndarray, bool]:
        """Tombstones of a serving delta: (sorted ids eviction removed at or after ``since`` and the table does
        not hold now, whether that list is complete back to ``since``; ``tombstones``), those ``predicate``
        selects."""
        with self._lock:
            self._check_open()
            ids, complete = self._tombstones.since(float(since))
            if ids.size:
                held = self._index.lookup(ids) >= 0
                if len(self._spilled):
                    held |= self._spilled.lookup(ids) >= 0
                ids = ids[~held]
            if predicate is not None and ids.size:
                ids = ids[self._selected(predicate, ids)]
            return ids, complete

    def tombstones_unknown_before(self, when: float) -> None:
        """Rows of some slots arrive from another server from now on (a copy begins): their removals there
        before ``when`` are not known here, so a delta since then is not complete (``removed_since``)."""
        with self._lock:
            self._tombstones.unknown_before(when)

    def _selected(self, predicate: Callable[[np.ndarray], np.ndarray], ids: np.ndarray) -> np.ndarray:
        mask = np.asarray(predicate(ids))
        if mask.dtype != bool or mask.shape != ids.shape:
            raise self._bad("predicate", f"must return a bool mask of shape {ids.shape}, got {mask.dtype} "
                                         f"{mask.shape}")
        return mask

    def _updated_since(self, since: float) -> np.ndarray:
        """Ids of the stored rows whose last update is at or after ``since`` (under the lock)."""
        ids, positions = self._index.items()
        out = ids[self._slab.times_of(positions) >= since]  # times are rounded up to a tick: never a row missed
        if len(self._spilled):  # their update times live in the store
            sp = self._spill_rows(self._spilled.items()[0])
            out = np.concatenate([out, sp.ids[sp.last_time >= since]])
        return out

    def rows_of(self, ids: np.ndarray) -> RowBatch:
        """Complete rows of the stored ids among the unique ``ids``, in their order (absent ids skipped): the
        cheap export of what a write touched (no sort), e.g. to replicate it."""
        ids = self._check_ids(ids)
        with self._lock:
            self._check_open()
            positions = self._index.lookup(ids)
            have = positions >= 0
            batch = self._slab.read(ids[have], positions[have]) if not have.all() else self._slab.read(ids, positions)
            if len(self._spilled) and not have.all():
                rest = ids[~have]
                rest = rest[self._spilled.lookup(rest) >= 0]
                if rest.size:
                    batch = RowBatch.concat([batch, self._spill_rows(rest)])
            return batch

    def peek(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n,) ids (duplicates allowed) -> ((n, dim) float32 weights, (n,) bool stored), as stored now and
        changing nothing: no insert, no access stamp, no counter, no spilled row brought back (an inspector's
        read: ``pull(insert=False)`` counts a pull and stamps the rows it reads, which eviction orders by). Ids
        not stored read as zeros."""
        ids = self._check_ids(ids)
        with self._lock:
            self._check_open()
            positions = self._index.lookup(ids)
            have = positions >= 0
            out = np.zeros((ids.shape[0], self.dim), np.float32)
            out[have] = self._slab.read_weights(positions[have])
            if len(self._spilled) and not have.all():
                miss = (~have).nonzero()[0]
                rows = self._spill_rows(np.unique(ids[miss]))  # sorted, spilled ones only
                at = np.minimum(np.searchsorted(rows.ids, ids[miss]), max(rows.ids.size - 1, 0))
                found = rows.ids[at] == ids[miss] if rows.ids.size else np.zeros(miss.size, bool)
                out[miss[found]] = np.asarray(rows.weights, np.float32)[at[found]]
                have[miss[found]] = True
            return out, have

    def stored_ids(self) -> np.ndarray:
        """Every stored id (resident and spilled), (k,) int64 in no set order."""
        with self._lock:
            self._check_open()
            ids = self._index.keys()
            if len(self._spilled):
                ids = np.concatenate([ids, self._spilled.keys()])
            return ids

    def stored_ids_in_slots(self, num_slots: int, wanted: np.ndarray) -> np.ndarray:
        """The stored ids (resident and spilled, int64, in no set order) whose slot, ``mix64(id) % num_slots``
        (what ``tigana.ps.routing.slot_of`` routes by), is marked in ``wanted`` (bool, one per slot): one pass
        over the indexes, no list of every id, holding the lock per ``SCAN_BUCKETS`` buckets (``_scan``).
        Every id stored when the call begins and not removed before it returns is listed; an id stored or
        removed meanwhile may be listed or not, and one removed and stored again may be listed twice (a slot
        copy sends what changes after its listing began on its change lane anyway, and reads each listed id
        again when it sends its row)."""
        parts = self._scan(lambda index, lo, hi: index.keys_in_slots(num_slots, wanted, lo, hi))
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def rows_per_slot(self, num_slots: int) -> np.ndarray:
        """(num_slots,) int64: stored rows (resident and spilled) per slot, ``mix64(id) % num_slots``: one pass
        over the indexes holding the lock per ``SCAN_BUCKETS`` buckets (rows stored or removed meanwhile may be
        counted or not, as in ``stored_ids_in_slots``)."""
        counts = np.zeros(num_slots, np.int64)
        for part in self._scan(lambda index, lo, hi: index.slot_counts(num_slots, lo, hi)):
            counts += part
        return counts

    def _scan(self, visit: Callable[[HashIndex, int, int | None], np.ndarray]) -> list[np.ndarray]:
        """``visit(index, lo, hi)`` over the buckets of both indexes as they are at the call, ``SCAN_BUCKETS``
        per hold of the lock: a pass over a table of millions of rows under one hold had pushes waiting 0.1-0.3 s
        at a slot move's start (every source lists its copies' ids at once). Why an id stored at the start and
        not removed is seen: an index changes a bucket in place only from live to tombstone or from
        empty/tombstone to live, and a rehash builds new arrays and leaves the held ones as they were (``Cut``).
        A row moving between the tiers meanwhile (spilled or brought back) could leave a bucket not yet read
        for one already read: then the pass runs again under one hold."""
        with self._lock:
            self._check_open()
            moves = self._tier_moves()
            indexes = self._index.view().indexes()
            if len(self._spilled):
                indexes.extend(self._spilled.view().indexes())
        parts = []
        for index in indexes:
            for lo in range(0, index.capacity, SCAN_BUCKETS):
                with self._lock:
                    self._check_open()
                    parts.append(visit(index, lo, lo + SCAN_BUCKETS))
        with self._lock:
            self._check_open()
            if self._tier_moves() == moves:
                return parts
            return [visit(index, 0, None) for index in (*self._index.partitions(), *self._spilled.partitions())
                    if len(index)]

    def _tier_moves(self) -> int:
        """Rows spilled or brought back so far (under the lock)."""
        return self._counters["spills"] + self._counters["unspills"]

    def _iter_sorted(self, ids: np.ndarray, predicate: Callable[[np.ndarray], np.ndarray] | None = None,
                     chunk: int = _CHUNK) -> Iterator[RowBatch]:
        """Stored rows among ``ids`` in id order, ``chunk`` at a time; restricted to ``predicate``."""
        sel = sorted_unique(ids)
        if predicate is not None and sel.size:
            sel = sel[self._selected(predicate, sel)]
        for start in range(0, sel.shape[0], chunk):
            part = sel[start:start + chunk]
            positions = self._index.lookup(part)
            res = positions >= 0
            batch = self._slab.read(part[res], positions[res])
            if len(self._spilled) and not res.all():
                rest = part[~res]
                rest = rest[self._spilled.lookup(rest) >= 0]
                if rest.size:
                    batch = RowBatch.concat([batch, self._spill_rows(rest)])
                    batch = batch.take(np.argsort(batch.ids, kind="stable"))
            if len(batch):
                yield batch

    def import_rows(self, batch: RowBatch) -> None:
        """Insert or overwrite complete rows (weights, state, metadata), bypassing admission."""
        b = self._check_batch(batch)
        with self._lock:
            self._check_open()
            self._import(b)

    def _import(self, b: RowBatch) -> None:
        """Write checked rows; the caller holds the lock."""
        self._tick()
        if len(self._spilled):
            sp_ids = sorted_unique(b.ids[self._spilled.lookup(b.ids) >= 0])
            if sp_ids.size:
                self._cow_unspill(sp_ids)
                self._drop_spilled(sp_ids)
        positions = self._index.lookup(b.ids)
        new = positions < 0
        self._cow_update(positions[~new])
        if any_set(new):
            positions[new] = self._slab.allocate(int(new.sum()))
            self._cow_fresh(positions[new])
            self._index.insert(b.ids[new], positions[new])
            self._admission.forget(b.ids[new])
        self._slab.write(positions, b, access=self._clock)
        self._maybe_spill()

    def checksum(self) -> str:
        """Order-independent digest (hex) of every row's id, weights and optimizer state, read through a cut
        (the lock is held per chunk only)."""
        return self.cut().checksum()

    def checksums_by(self, bucket_of: Callable[[np.ndarray], np.ndarray], num_buckets: int) -> tuple[
            np.ndarray, np.ndarray]:
        """Order-independent digests of the rows grouped by ``bucket_of(ids) -> (n,) int in [0, num_buckets)``:
        ((num_buckets,) uint64 digest sums of id, weights and optimizer state; (num_buckets,) int64 row
        counts). Two tables with the same rows in a bucket have the same digest there. Read through a cut."""
        if not isinstance(num_buckets, (int, np.integer)) or isinstance(num_buckets, bool) or num_buckets < 1:
            raise self._bad("num_buckets", f"must be a positive int, got {num_buckets!r}")
        return self.cut().checksums_by(bucket_of, int(num_buckets))
