"""The spill tier of a table: resident rows past the memory budget move to a ``SpillFile`` on disk, coldest
(least recently accessed) first, down to 90% of the budget, and come back on access. The budget covers the
resident rows and the in-memory index of spilled ids, which grows with the tier; as the budget left for resident
rows shrinks, the slab gives back the positions it no longer needs (``_maybe_compact``).

``_spilled`` indexes the spilled ids; its value is the row's slot in the file (the index holds int32 values: up
to 2**31 spilled rows a table). It is partitioned (``PartitionedIndex``): at scale it is most of the table's
memory, and a growth of one ``HashIndex`` would hold its old and new arrays at once, 2.5x its bytes.
``_spill_marks[slot]`` keeps the row's dirty mark (``Slab.dirty``) from when it spilled, so a row changed since
the last snapshot stays in the next increment; a spilled row's slot and mark change only when it leaves the
tier, and every move tells the open cuts (``cut``) first, so a cut may read the marks of the rows still its own
at any time. Not thread-safe on its own: the table holds its lock around every call.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np

from tigana.embeddings._fields import TableFields
from tigana.embeddings.changes import sorted_unique
from tigana.embeddings.errors import CorruptStore, StorageFull
from tigana.embeddings.rows import RowBatch
from tigana.embeddings.slab import MIN_ROWS
from tigana.embeddings.spillfile import SpillFile

_log = logging.getLogger("tigana.embeddings.table")
_INDEX_BYTES_PER_ROW = 18  # a row's share of the hash index
_COLD_CHUNK = 1 << 20  # index buckets per step of the pass that picks the rows to spill
# rows spilled at a time: a spill copies its rows twice (read from the slab, encoded as records), ~200 bytes a
# row at dim 16; a spill of the coldest 10% of a 4 GiB budget at once held 0.8 GB beside the budget
_SPILL_CHUNK = 1 << 16


class SpillTier(TableFields):
    """Spilling and unspilling rows; see the module docstring."""

    def _open_spill(self) -> None:
        base = self.config.spill_dir
        if base is not None:
            Path(base).mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.name)[:40]
        self._spill_path = Path(tempfile.mkdtemp(prefix=f"tigana-spill-{safe}-", dir=base))
        self._spill = SpillFile(self._spill_path, table=self.name, dim=self.dim, state_width=self._width,
                                max_bytes=self.config.spill_max_bytes)
        self._finalizer = weakref.finalize(self, _close_spill, self._spill, self._spill_path)
        self._budget_bytes = int(self.config.memory_budget)
        self._budget_warned = False
        self._budget_rows = self._rows_in_budget()

    def _rows_in_budget(self) -> int:
        """Resident rows the budget holds: its bytes, less the index of spilled ids (it lives in RAM and grows
        with the tier), over a resident row's bytes: its slab columns and its share of the hash index, or what
        the index takes now where that is more (it grows by half at a time, and shrinks only when a rehash finds
        it mostly empty). Both indexes grow a partition at a time (a rehash also clears the tombstones spills
        leave): the budget keeps room for the new arrays of one partition (``growth_bytes``), which the growth
        holds beside the old ones (one index grows at a time: the table's lock)."""
        free = (self._budget_bytes - self._spilled.nbytes - self._spill_marks.nbytes - self._spill_pins.nbytes
                - self._cuts_nbytes() - max(self._spilled.growth_bytes, self._index.growth_bytes))
        row = self._slab.row_nbytes
        rows = int(min(free // (row + _INDEX_BYTES_PER_ROW), (free - self._index.nbytes) // row))
        if free < row + _INDEX_BYTES_PER_ROW and not self._budget_warned:
            self._budget_warned = True
            _log.warning("table %r: the index of its %d spilled ids (%d bytes) alone fills its memory budget (%d "
                         "bytes); every row spills (raise memory_budget)", self.name, len(self._spilled),
                         self._spilled.nbytes + self._spill_marks.nbytes, self._budget_bytes)
        return max(1, rows)

    def set_memory_budget(self, nbytes: int) -> None:
        """Change the resident-row budget (bytes) while serving: a daemon shares one budget among its tables and
        re-splits it as tables come and go. Rows past it spill to disk (the spill file, opened on first use)."""
        if nbytes < 1:
            raise self._bad("memory_budget", f"must be >= 1 byte, got {nbytes}")
        with self._lock:
            self._check_open()
            if self._spill is None:
                self.config = dataclasses.replace(self.config, memory_budget=int(nbytes))
                self._slab.track_access(self._clock)  # spilling picks the coldest rows by it
                self._open_spill()
            self._budget_bytes = int(nbytes)
            self._maybe_spill()

    def _maybe_spill(self) -> None:
        """Spill at the end of a call that already changed the table: a full disk must not turn that call
        into an error (it was applied), so the table stays over budget, counts it, and retries next call."""
        if self._spill is None:
            return
        for _ in range(3):  # a spill grows the index of spilled ids, which the budget covers: check again
            self._budget_rows = self._rows_in_budget()
            if len(self._index) <= self._budget_rows:
                break
            try:
                self._spill_coldest()
            except StorageFull as exc:
                self._counters["spill_failures"] += 1
                _log.warning("%s", exc)
                return
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Give the slab's memory back past what the budget now lets it hold (at the end of a call: no position
        is held; the open cuts write the moving rows they have not read to the spill file first, since a cut
        reads resident rows by the positions it saw). A budget shrinks as
        the index of spilled ids grows (``_rows_in_budget``), and a slab only grows: a 4 GiB daemon that spilled
        200 M rows held its 41 M-row high-water mark, 1.6x its budget in all. The rows past the target move
        to free positions below it (``Slab.compact``) and the index follows them."""
        slab, live = self._slab, len(self._index)
        # What is resident is the slab's high water (every position below it was written once; a spill frees
        # positions that later inserts take first), so that is what the budget's rows bound, with a little slack
        # against compacting at every call; the budget itself counts live rows (spills leave them at 90%).
        limit = self._budget_rows + min(self._budget_rows // 32, 1 << 16)
        target = max(live + live // 64 + 1, MIN_ROWS)
        if slab.high_water <= limit + MIN_ROWS or target >= slab.capacity:
            return
        buckets, moving = self._index.values_at_least(target)
        if self._cuts:  # they read rows by the positions they saw: those they have not read go to the file first
            self._cow_move(self._index.view().at(buckets)[0].view(np.int64), moving)
        moved = slab.compact(target, moving)
        self._cow_fresh(moved)
        self._index.set_values(buckets, moved)
        self._counters["compactions"] += 1

    def _spill_coldest(self, hold: np.ndarray | None = None) -> None:
        """Spill the least recently used rows down to 90% of the budget, never the positions in ``hold``."""
        assert self._spill is not None
        k = len(self._index) - max(1, int(0.9 * self._budget_rows))
        if k <= 0:
            return
        # the coldest rows come in the resident index's bucket order; the spilled ids' index has a salt of its own,
        # to which that order is random (a chunk of them piled into a few runs of buckets under one hash)
        coldest, where = self._coldest(k, hold[hold >= 0] if hold is not None else np.empty(0, np.int64))
        for lo in range(0, coldest.shape[0], _SPILL_CHUNK):  # each chunk whole: its rows, then the next
            ids, positions = coldest[lo:lo + _SPILL_CHUNK], where[lo:lo + _SPILL_CHUNK]
            batch = self._slab.read(ids, positions)
            dirty = self._slab.dirty[positions].astype(np.int64)
            slots = self._spill.write(batch)  # may raise StorageFull: nothing of this chunk has changed yet
            self._cow_spill(ids, positions, slots)  # open cuts read these rows from the file, from now on
            self._index.delete(ids)
            self._slab.release(positions)
            self._spilled.insert(ids, slots)
            self._set_spill_marks(slots, dirty)
            self._cow_spilled(ids)
            self._counters["spills"] += int(ids.shape[0])

    def _coldest(self, k: int, hold: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, positions) of the ``k`` resident rows least recently accessed (all when fewer), none of them at
        the positions in ``hold``. Two passes over the index, ``_COLD_CHUNK`` buckets at a time: a histogram of
        the access clocks (65,536 bins), then the rows in the bins below the bin of the (k + held)-th coldest
        row, and the coldest of that bin; the held ones leave last (they are among the candidates only when
        colder than the k-th other row, and a call holds the rows it just used: rarely). Listing every resident
        row at once instead (ids, positions, clocks and an argpartition: ~30 bytes a row) held a fifth of a 1 GiB
        budget beside it, at every spill."""
        view = self._index.view()  # global bucket numbers over the partitions
        shift = np.uint32(max(0, int(self._clock).bit_length() - 16))  # every clock <= self._clock
        want = k + hold.shape[0]

        def chunks():
            for first, _, vals in view.segments():
                for lo in range(0, vals.shape[0], _COLD_CHUNK):
                    at = np.flatnonzero(vals[lo:lo + _COLD_CHUNK] >= 0)
                    yield first + lo + at, self._slab.access_of(vals[lo + at].astype(np.int64)) >> shift

        counts = np.zeros(1 << 16, np.int64)
        for _, bins in chunks():
            counts += np.bincount(bins, minlength=1 << 16)
        below = np.cumsum(counts)
        edge = int(np.searchsorted(below, want))  # the bin of the want-th coldest row (past the end: all go)
        taken, edge_rows = [], []
        for buckets, bins in chunks():
            taken.append(buckets[bins < edge])
            edge_rows.append(buckets[bins == edge])
        rest = want - (int(below[edge - 1]) if edge else 0)
        edge_buckets = np.concatenate(edge_rows)
        if 0 < rest < edge_buckets.size:
            clocks = self._slab.access_of(view.at(edge_buckets)[1].astype(np.int64))
            edge_buckets = edge_buckets[np.argpartition(clocks, rest - 1)[:rest]]
        keys, vals = view.at(np.concatenate([*taken, edge_buckets]))
        positions = vals.astype(np.int64)
        if hold.size:
            keep = ~np.isin(positions, hold)
            keys, positions = keys[keep], positions[keep]
            if positions.shape[0] > k:
                coldest = np.argpartition(self._slab.access_of(positions), k - 1)[:k]
                keys, positions = keys[coldest], positions[coldest]
        return keys.view(np.int64), positions

    def _unspill(self, ids: np.ndarray) -> None:
        """Bring unique spilled ids back into memory (they keep their dirty mark)."""
        assert self._spill is not None
        vals = self._spilled.lookup(ids)
        if (vals < 0).any():
            raise CorruptStore(f"table {self.name!r}: ids not in the spill tier {self._spill.file}: "
                               f"{ids[vals < 0][:5].tolist()}")
        batch = self._spill.read(vals, ids)  # a bad record raises here: nothing has changed
        self._cow_unspill(ids)
        self._drop_spilled(ids, vals)
        positions = self._slab.allocate(len(batch))
        self._cow_fresh(positions)
        self._slab.write(positions, batch, access=self._clock)
        self._slab.dirty[positions] = self._spill_marks[vals]
        self._index.insert(batch.ids, positions)
        self._counters["unspills"] += len(batch)

    def _set_spill_marks(self, slots: np.ndarray, marks: np.ndarray) -> None:
        need = int(slots.max()) + 1 if slots.size else 0
        if need > self._spill_marks.shape[0]:
            grown = np.zeros(max(need, 2 * self._spill_marks.shape[0], 1024), np.uint8)
            grown[:self._spill_marks.shape[0]] = self._spill_marks
            self._spill_marks = grown
        self._spill_marks[slots] = marks

    def _spill_marks_of(self, vals: np.ndarray) -> np.ndarray:
        """The dirty marks of spilled rows by their values in the spilled index (-1 where a value is negative:
        not spilled)."""
        out = np.full(vals.shape[0], -1, np.int64)
        live = vals >= 0
        out[live] = self._spill_marks[vals[live]]
        return out

    def _drop_spilled(self, ids: np.ndarray, vals: np.ndarray | None = None) -> None:
        """Unique spilled ``ids`` leave the tier (``vals``: their index values when the caller has them); the
        open cuts were told first. Their slots go back to the file, but those an open cut still reads from
        (``SlotPins``): those go when the last such cut lets go."""
        assert self._spill is not None
        vals = self._spilled.lookup(ids) if vals is None else vals
        self._spilled.delete(ids)
        self._spill.free(self._spill_pins.free(vals.astype(np.int64)))

    def _spill_rows(self, ids: np.ndarray, *, skip_corrupt: bool = False) -> RowBatch:
        """Rows of the spilled ones of ``ids`` read from the file without bringing them back (in ``ids``
        order, ids not spilled left out). A record failing its checks raises ``CorruptStore``; with
        ``skip_corrupt`` it is left out, counted once in ``corrupt_rows`` and logged (it stays in the file:
        reading that id raises, and other copies of the row may be good)."""
        assert self._spill is not None
        vals = self._spilled.lookup(ids)
        found = vals >= 0
        if not found.all():
            ids, vals = ids[found], vals[found]
        if not skip_corrupt:
            return self._spill.read(vals, ids)
        corrupt: list[int] = []
        batch = self._spill.read(vals, ids, corrupt=corrupt)
        self._note_corrupt(corrupt)
        return batch

    def _note_corrupt(self, corrupt: list[int]) -> None:
        """Count and log, once each, spilled ids whose record failed its checks (left out of eviction)."""
        if not corrupt:
            return
        assert self._spill is not None
        bad = sorted_unique(np.array(corrupt, np.int64))
        new = bad[~np.isin(bad, self._corrupt)]
        if new.size:
            self._corrupt = np.union1d(self._corrupt, new)
            self._counters["corrupt_rows"] = int(self._corrupt.size)
            _log.error("table %r: %d spilled row(s) failed their checks in %s and are left out of eviction "
                       "(reading them raises CorruptStore): ids %s", self.name, new.size, self._spill.file,
                       new[:5].tolist())


def _close_spill(store: SpillFile, path: Path) -> None:
    store.close()
    shutil.rmtree(path, ignore_errors=True)
