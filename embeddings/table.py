"""EmbeddingTable: a growable sparse table of rows keyed by arbitrary int64 ids.

    ids ──PartitionedIndex──► position ──Slab──► weights, optimizer state, metadata    (resident rows)
     └──────────────── spilled ids ──► slot ──SpillFile──► records on disk      (past the memory budget)

``pull`` gathers rows (inserting missing ids, subject to admission, with their deterministic initial row);
``push`` validates a gradient batch, sums duplicate ids and applies the optimizer where the rows live.
A call either applies wholly and returns, or raises having changed nothing: the upkeep after an apply
(eviction, spilling) counts and logs its failures instead of raising them.

The class is assembled from one room per concept: this module (pull, push, insert, delete, replication
support, stats), ``_spilling`` (the disk tier past ``TableConfig.memory_budget``), ``_evicting`` (TTL and
capacity), ``_exporting`` (export, import, checksums), ``_persisting`` (snapshots and restore) and ``cut``
(consistent reads of the whole table without holding its lock for O(table) time).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from tigana.embeddings import _gradients, _kernels, _part_kernels, admission, optimizers
from tigana.embeddings._evicting import Evicting
from tigana.embeddings._exporting import Exporting
from tigana.embeddings._persisting import Persisting
from tigana.embeddings._slotpins import SlotPins
from tigana.embeddings._spilling import SpillTier
from tigana.embeddings._updating import Updating
from tigana.embeddings.changes import Changes, sorted_unique, sorted_unique_counts
from tigana.embeddings.config import TableConfig
from tigana.embeddings.cut import CutHooks
from tigana.embeddings.errors import InvalidArgument, StorageError, StorageFull
from tigana.embeddings.hashtable import resolve_backend
from tigana.embeddings.initializers import initial_rows
from tigana.embeddings.masks import all_set, any_set
from tigana.embeddings.partitioned import PartitionedIndex
from tigana.embeddings.rows import RowBatch
from tigana.embeddings.slab import Slab, from_float32, to_float32
from tigana.embeddings.tombstones import Tombstones
from tigana.embeddings.unseen import Unseen

_log = logging.getLogger(__name__)
_NOT_RECORDING = contextlib.nullcontext()  # reentrant and stateless: one for every call


def _wall_time() -> float:
    """``time.time()``, looked up at each call (so that a patched ``time.time`` is seen)."""
    return time.time()


class EmbeddingTable(CutHooks, Persisting, Exporting, Evicting, SpillTier, Updating):
    """One table: rows, optimizer state, metadata; hash index; admission, eviction, spill to disk, snapshots.

    Thread-safety: every public method takes the table's lock; the numeric kernels release the GIL, so
    threads working on different tables run in parallel. Whole-table reads (snapshot, full export,
    checksums) go through a ``Cut`` and hold the lock per chunk only.

    Example::

        table = EmbeddingTable(TableConfig("user_id", dim=16, optimizer=RowWiseAdagrad(lr=0.05)))
        rows = table.pull(np.array([7, -3, 7]))                 # (3, 16) float32
        table.push(np.array([7, 7]), np.ones((2, 16), np.float32))  # sums the two grads of id 7 -> 1 row
    """

    def __init__(self, config: TableConfig) -> None:
        if not isinstance(config, TableConfig):
            raise InvalidArgument(f"EmbeddingTable needs a TableConfig, got {type(config).__name__}")
        self.config = config
        self._backend = resolve_backend(config.backend)
        self._lock = threading.RLock()
        self._snapshot_turn = threading.RLock()
        self._width = optimizers.state_width(config.optimizer, config.dim)
        self._index = PartitionedIndex(backend=self._backend)
        self._slab = Slab(config.dim, self._width, config.dtype,
                          track_access=config.memory_budget is not None or config.eviction.max_rows is not None)
        self._admission = admission.AdmissionFilter(config.admission, config.seed, backend=self._backend)
        self._open_admission = admission.is_open(config.admission)
        self._step = 0
        self._clock = 0
        self._deleted = []
        self._pending_marks = ()
        self._spill = None  # set by _open_spill when a memory budget is configured
        self._spilled = PartitionedIndex(backend=self._backend)
        self._spill_marks = np.zeros(0, np.uint8)
        self._spill_pins = SlotPins()
        self._last_snapshot = None
        self._finalizer = None
        self._last_ttl_scan = (0, time.time())
        self._closed = False
        self._changes = None  # set for the duration of a pull/push given ``changes``
        self._evictable = None
        self._protected = 0  # rows the evictable predicate excluded at the last eviction pass
        self._spill_cursor = 0.0  # where in the spilled index the eviction's next window starts (``_evicting``)
        self._sweep_left = 0  # spilled records the TTL sweep under way still has to read (a window per write)
        self._cuts = []
        self._tombstones = Tombstones(since=time.time())  # removals before this process held it: unknown
        self.wall_clock: Callable[[], float] = _wall_time  # rows' update times, removals (a test may skew it)
        self._counters = dict.fromkeys(("pulls", "pushes", "lookups", "hits", "inserts", "admissions",
                                        "rejected_admissions", "evictions", "spills", "unspills",
                                        "rows_updated", "nonfinite_rows_skipped", "spill_failures",
                                        "refused_inserts", "corrupt_rows", "upkeep_failures", "compactions"), 0)
        self._corrupt = np.empty(0, np.int64)  # spilled ids whose record failed its checks (sorted)
        if config.memory_budget is not None:
            self._open_spill()

    # --- pull / push ---------------------------------------------------------------------------------------
    def pull(self, ids: np.ndarray, *, insert: bool = True, changes: Changes | None = None,
             unseen: Unseen | None = None) -> np.ndarray:
        """(n,) int64 ids (any values, duplicates allowed) -> (n, dim) float32 rows in the order of ids.

        Missing ids are inserted (subject to admission) with their deterministic initial row; when not
        admitted they read as that row without being stored. With ``insert=False`` (a read-only pull) they
        are not stored and count no sighting, and read as ``unseen`` says (``tigana.embeddings.unseen``;
        None: their initial row). ``changes`` records what the call changed (inserts, sightings, evictions)."""
        absent = self._initial if insert or unseen is None else \
            (lambda missing: unseen.rows(missing, self.dim, self._initial))
        ids = self._check_ids(ids)
        with self._lock, self._recording(changes):
            self._check_open()
            self._tick()
            self._counters["pulls"] += 1
            n = ids.shape[0]
            out = np.empty((n, self.dim), np.float32)
            positions = self._index.lookup(ids)
            misses = int(np.count_nonzero(positions < 0))
            gathered = self._backend == "numba" and self._slab.storage_dtype == np.float32
            if gathered:  # the hits' rows in one pass (and their access clock)
                _part_kernels.gather_hits(self._slab.weights, self._slab.last_access, self._clock, positions, out)
            self._counters["lookups"] += n
            self._counters["hits"] += n - misses
            if misses:
                miss = (positions < 0).nonzero()[0]
                # a read-only pull with nothing spilled stores nor brings back any row: its misses stay misses
                brings = insert or len(self._spilled)
                if brings:
                    positions[miss] = self._materialize(ids[miss], insert=insert, count=True, hold=positions)
                if gathered:  # fill in what the gather could not
                    none = miss
                    if brings:
                        got = miss[positions[miss] >= 0]
                        out[got] = self._slab.read_weights(positions[got])
                        self._slab.stamp_access(positions[got], self._clock)
                        none = miss[positions[miss] < 0]
                    out[none] = absent(ids[none])
            if not gathered:
                have = positions >= 0
                out[have] = self._slab.read_weights(positions[have])
                self._slab.stamp_access(positions[have], self._clock)
                if misses:
                    none = ~have
                    out[none] = absent(ids[none])
            cap = self.config.eviction.max_rows
            if misses and cap is not None and len(self) - self._protected > cap:  # inserts may pass the cap
                self._upkeep(lambda: self._evict(ttl=False))
            self._upkeep(self._maybe_spill)
            return out

    def push(self, ids: np.ndarray, grads: np.ndarray, *, step: int | None = None,
             changes: Changes | None = None) -> int:
        """Sum grads of duplicate ids, apply the optimizer to those rows; returns unique rows updated.

        ``grads`` (n, dim) float; validates everything (dtype, shape, dim, NaN/Inf, and an update that would
        leave a row's weights or optimizer state NaN/Inf: ``_updating``) before changing anything. Ids not in the table are inserted when admission is open and dropped otherwise (admission
        is decided on pull). ``step`` sets the table step stamped on the rows (default: step + 1).
        ``changes`` records the ids updated and any evicted by the call."""
        ids = self._check_ids(ids)
        grads = self._check_grads(grads, ids.shape[0])
        if step is not None and (not isinstance(step, (int, np.integer)) or step < 0):
            raise self._bad("step", f"must be a non-negative int, got {step!r}")
        ids, grads, skipped = _gradients.screen(ids, grads, policy=self.config.nonfinite_grads,
                                                backend=self._backend, table=self.name)
        with self._lock, self._recording(changes):
            self._check_open()
            positions = self._index.lookup(ids)
            update = self._plan_update(ids, positions, grads)  # on copies: nothing has changed yet
            if any_set(update.bad):
                if self.config.nonfinite_grads == "reject":
                    row = update.first_bad_row()
                    raise InvalidArgument(f"table {self.name!r}: field 'grads' would make the row of id "
                                          f"{int(ids[row])} non-finite (first in row {row}, largest |g| "
                                          f"{float(np.abs(grads).max()):.3g}); batch rejected")
                keep, update = update.without_bad()
                ids, positions, skipped = ids[keep], positions[keep], skipped + int((~keep).sum())
            self._counters["nonfinite_rows_skipped"] += skipped
            self._tick()
            self._counters["pushes"] += 1
            miss = np.flatnonzero(positions < 0)
            if miss.size:
                positions[miss] = self._materialize(ids[miss], insert=self._open_admission, count=False,
                                                    hold=positions)
            rows = self._rows_of(update)
            stored = rows >= 0
            if not all_set(stored):
                rows = rows[stored]
            self._step = self._step + 1 if step is None else int(step)
            self._cow_update(rows)  # open cuts keep the rows as they were, before the first change
            slab = self._slab
            step_code, time_code = np.uint32(slab.step_code(self._step)), np.uint32(slab.time_code(self.wall_clock()))
            if self._backend == "numba":
                _kernels.touch(rows, slab.update_count, slab.last_step, slab.last_time, slab.last_access,
                               slab.dirty, step_code, time_code, self._clock, slab.mark)
            else:
                slab.update_count[rows] += np.uint32(1)
                slab.last_step[rows] = step_code
                slab.last_time[rows] = time_code
                slab.stamp_access(rows, self._clock)
                slab.dirty[rows] = slab.mark
            self._write_update(update, rows, stored)
            if self._changes is not None:  # the rows as written, from the update itself: nothing read back
                exported = self._exported(ids, update, rows, stored, step_code, time_code)
                self._changes.wrote(ids[positions >= 0], exported)
            self._counters["rows_updated"] += int(rows.shape[0])
            self._upkeep(self._maybe_evict)
            self._upkeep(self._maybe_spill)
            return int(rows.shape[0])

    def _upkeep(self, work: Callable[[], object]) -> None:
        """Run eviction or spilling at the end of a call that already changed the table. The call was applied
        (a server records and replicates it once it returns), so a failure here must not turn it into an
        error: the table counts it (``upkeep_failures``), logs it, and the next call tries again."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - the apply stands whatever upkeep meets
            self._counters["upkeep_failures"] += 1
            if isinstance(exc, StorageError):
                _log.warning("table %r: upkeep after an applied call failed: %s", self.name, exc)
            else:
                _log.exception("table %r: upkeep after an applied call failed", self.name)

    def _materialize(self, ids: np.ndarray, *, insert: bool, count: bool, hold: np.ndarray) -> np.ndarray:
        """Slab positions for ids missing from the index: bring spilled rows back, insert admitted new ids.

        ``hold``: the slab positions the caller already resolved for this batch (-1 entries ignored); they
        must stay where they are, so the memory ceiling never spills them to make room.
        Returns (len(ids),) positions, -1 for ids left unstored."""
        if not insert and not len(self._spilled):  # nothing to bring back, nothing to store (a read-only pull)
            return np.full(ids.shape[0], -1, np.int64)
        uniq, sightings = sorted_unique_counts(ids)
        if len(self._spilled):
            spilled = self._spilled.lookup(uniq) >= 0
            if spilled.any():
                self._unspill(uniq[spilled])
                hold = np.concatenate([hold, self._index.lookup(uniq[spilled])])
                uniq, sightings = uniq[~spilled], sightings[~spilled]
        if insert and uniq.size:
            self._check_room(uniq.size, hold)  # before admission counts a sighting: a refusal changes nothing
            if self._open_admission:
                admitted = uniq
            elif count:
                mask = self._admission.admit(uniq, sightings)
                if self._changes is not None:
                    self._changes.sightings.append((uniq, sightings))
                admitted = uniq[mask]
                self._counters["rejected_admissions"] += int((~mask).sum())
            else:
                admitted = uniq[:0]
            if admitted.size:
                self._insert_new(admitted)
        return self._index.lookup(ids)

    def _check_room(self, k: int, hold: np.ndarray) -> None:
        """Room for ``k`` new rows within the budget: cold rows spill before the inserts would pass it (down to
        90% of it, so spills come in batches). The memory ceiling: when spilling fails (disk full, or the spill
        file at its cap), a table may still run past its budget by a quarter; inserting past that ceiling is
        refused with ``StorageFull`` before anything changed. Updates of stored rows go on; inserts resume once
        space is freed and a spill succeeds."""
        if self._spill is None or len(self._index) + k <= self._budget_rows:
            return
        if len(self._index) <= max(1, int(0.9 * self._budget_rows)):
            return  # nothing to spill: one batch larger than the budget (bounded by the request limits)
        try:
            self._spill_coldest(hold)
        except StorageFull as exc:
            if len(self._index) + k <= self._budget_rows + self._budget_rows // 4:
                return  # within the ceiling: the call goes on, and its end spills again (counted, logged there)
            self._counters["spill_failures"] += 1
            self._counters["refused_inserts"] += k
            raise StorageFull(f"table {self.name!r}: {len(self._index)} rows in memory, past its memory budget "
                              f"of {self._budget_rows} rows, and the spill tier is full ({exc}); {k} new rows "
                              "refused (rows already stored still update)") from None

    def _initial(self, ids: np.ndarray) -> np.ndarray:
        return initial_rows(self.config.initializer, self.config.seed, ids, self.dim, backend=self._backend)

    def _insert_new(self, ids: np.ndarray) -> None:
        """Store unique absent ids with their initial rows."""
        k = ids.shape[0]
        positions = self._slab.allocate(k)
        self._cow_fresh(positions)
        rows = self._initial(ids)
        batch = RowBatch(ids, rows, optimizers.initial_state(self.config.optimizer, k, self.dim),
                         np.zeros(k, np.int64), np.full(k, self._step, np.int64), np.full(k, self.wall_clock()))
        self._slab.write(positions, batch, access=self._clock)
        self._index.insert(ids, positions)
        if self._changes is not None:  # the first write of the call: its rows, as stored, are all it wrote
            self._changes.wrote(ids, None if self._changes.written else self._as_stored(batch, positions))
        self._counters["inserts"] += k
        self._counters["admissions"] += k

    def _as_stored(self, batch: RowBatch, positions: np.ndarray) -> RowBatch:
        """``batch`` as the slab holds it once written at ``positions``: the weights rounded to the storage
        dtype, the step and time read back from their codes (no gather of the weights and state)."""
        slab = self._slab
        weights = batch.weights if slab.storage_dtype == np.float32 else \
            to_float32(from_float32(batch.weights, slab.storage_dtype))
        return RowBatch(batch.ids, weights, batch.state, batch.update_count, slab.steps_of(positions),
                        slab.times_of(positions))

    # --- membership, delete --------------------------------------------------------------------------------
    def contains(self, ids: np.ndarray) -> np.ndarray:
        """(n,) ids -> (n,) bool: stored (resident or spilled)."""
        ids = self._check_ids(ids)
        with self._lock:
            found = self._index.lookup(ids) >= 0
            if len(self._spilled):
                found |= self._spilled.lookup(ids) >= 0
            return found

    def __len__(self) -> int:
        with self._lock:
            return len(self._index) + len(self._spilled)

    @property
    def rows_spilled(self) -> int:
        """Rows that live only in the spill tier (0 without one)."""
        with self._lock:
            return len(self._spilled)

    def delete(self, ids: np.ndarray, *, tombstone: bool = False) -> int:
        """Remove ids (duplicates and absent ids allowed); returns how many stored rows were removed.
        ``tombstone``: the rows are gone from the table for good (an eviction on the rows' primary, applied
        here by a copy), so a serving delta must tell readers to forget them; rows that moved to another
        server (a slot handed over) are not."""
        ids = self._check_ids(ids)
        with self._lock:
            self._check_open()
            return self._remove(ids, tombstone=tombstone)

    def _remove(self, ids: np.ndarray, *, tombstone: bool = False) -> int:
        gone = []
        if len(self._spilled):
            spilled = sorted_unique(ids[self._spilled.lookup(ids) >= 0])
            if spilled.size:
                self._cow_unspill(spilled)  # open cuts that have not read them will read them from their slots
                self._drop_spilled(spilled)
            gone.append(spilled)
        removed_ids, positions = self._index.delete(ids)
        self._cow_remove(removed_ids, positions)
        self._slab.release(positions)
        gone_ids = np.concatenate([removed_ids, *gone])
        if tombstone:
            self._tombstones.record(gone_ids, self.wall_clock())
        if self._changes is not None and gone_ids.size:
            self._changes.deleted.append(gone_ids)
        if gone_ids.size and self._last_snapshot is not None:  # only increments need them
            self._deleted.append(gone_ids)
            if len(self._deleted) > 64:
                self._deleted = [sorted_unique(np.concatenate(self._deleted))]
        return int(gone_ids.shape[0])

    def stats(self) -> dict[str, float]:
        """Counters and sizes: rows_resident, rows_spilled, bytes_per_row, admissions, evictions, hit_rate..."""
        with self._lock:
            resident = len(self._index)
            nbytes = (self._slab.nbytes + self._index.nbytes + self._spilled.nbytes + self._spill_marks.nbytes
                      + self._spill_pins.nbytes + self._admission.nbytes)
            lookups = self._counters["lookups"]
            out: dict[str, float] = {k: float(v) for k, v in self._counters.items()}
            out.update(
                rows=float(resident + len(self._spilled)), rows_resident=float(resident),
                rows_spilled=float(len(self._spilled)), bytes_resident=float(nbytes),
                bytes_per_row=float(nbytes / resident) if resident else 0.0,
                row_bytes=float(self._slab.row_nbytes),
                slot_bytes=float(self._slab.row_nbytes),  # the old name of row_bytes, still read by tools/bench
                hit_rate=float(self._counters["hits"] / lookups) if lookups else 0.0,
                step=float(self._step), admission_tracked=float(len(self._admission)),
            )
            return out

    # --- replication support -----------------------------------------------------------------------------------------
    def _recording(self, changes: Changes | None) -> contextlib.AbstractContextManager[None]:
        """Record into ``changes`` for the duration of one call (the caller holds the table lock); nothing to
        record: a shared no-op context (a generator-based one cost each call almost a microsecond)."""
        return _NOT_RECORDING if changes is None else self._recording_into(changes)

    @contextlib.contextmanager
    def _recording_into(self, changes: Changes) -> Iterator[None]:
        self._changes = changes
        try:
            yield
        finally:
            self._changes = None

    def set_evictable(self, evictable: Callable[[np.ndarray], np.ndarray] | None) -> None:
        """Restrict eviction to rows for which ``evictable(ids) -> bool mask`` is true (None: every row).

        A server that holds copies of rows it does not lead lets only the leading copy decide evictions;
        the others apply them as replicated removals, so every copy holds the same rows."""
        with self._lock:
            self._evictable = evictable
            self._protected = 0  # recounted by the next eviction pass

    def apply_changes(self, rows: RowBatch | None = None, deleted: np.ndarray | None = None,
                      sightings: tuple[np.ndarray, np.ndarray] | None = None, step: int | None = None,
                      *, check_values: bool = True) -> None:
        """Apply what another copy's call changed: admission sightings (counted as that copy counted them),
        complete rows written (inserted or overwritten), ids removed, and the table step (raised to
        ``step``). Validates everything before changing anything; ``check_values=False`` skips the NaN/Inf
        scan of the rows (they are a copy's, already checked where they were written)."""
        batch = self._check_batch(rows, check_values=check_values) if rows is not None and (
            not isinstance(rows, RowBatch) or len(rows)) else None
        gone = self._check_ids(deleted if deleted is not None else np.empty(0, np.int64), "deleted")
        if step is not None and (not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0):
            raise self._bad("step", f"must be a non-negative int, got {step!r}")
        if sightings is not None:
            seen_ids = self._check_ids(sightings[0], "sighting_ids")
            counts = np.asarray(sightings[1])
            if counts.shape != seen_ids.shape or (counts.size and (counts.dtype.kind not in "iu"
                                                                   or counts.min() < 1)):
                raise self._bad("sighting_counts", f"must be positive integers aligned with sighting_ids, got "
                                                   f"{counts.dtype} {counts.shape}")
        with self._lock:
            self._check_open()
            if sightings is not None and seen_ids.size and not self._open_admission:
                self._admission.admit(seen_ids, counts.astype(np.int64))
            if batch is not None and len(batch):
                self._import(batch)
            if gone.size:  # the primary's evictions: tombstones here too, so a failover keeps them
                self._remove(gone, tombstone=True)
            if step is not None and int(step) > self._step:
                self._step = int(step)

    # --- lifecycle -----------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether ``close`` ran: the table serves no read or write any more."""
        return self._closed

    def close(self) -> None:
        """Release memory and the spill tier; the table is unusable afterwards. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cuts = []
            if self._finalizer is not None:
                self._finalizer()  # closes the spill store and removes its directory
                self._spill = None
            self._index.clear()
            self._spilled.clear()
            self._spill_marks = np.zeros(0, np.uint8)
            self._spill_pins = SlotPins()
            self._slab.clear()

    def __enter__(self) -> EmbeddingTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EmbeddingTable({self.name!r}, dim={self.dim}, rows={len(self)}, step={self._step})"



__all__ = ["EmbeddingTable"]
