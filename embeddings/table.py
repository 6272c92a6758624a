"""EmbeddingTable: a growable sparse table of rows keyed by arbitrary int64 ids.

    ids ──HashIndex──► position ──Slab──► weights, optimizer state, metadata    (resident rows)
     └──────────────── spilled ids ──► LMDB RowStore                             (past the memory budget)

``pull`` gathers rows (inserting missing ids, subject to admission, with their deterministic initial row);
``push`` validates a gradient batch, sums duplicate ids and applies the optimizer where the rows live.
Eviction (TTL, capacity) runs cheaply on push and fully on ``evict()``; cold rows spill to LMDB past
``TableConfig.memory_budget`` and come back on access; ``snapshot``/``restore`` write and read LMDB snapshots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from tigana.embeddings import _kernels, admission, eviction, optimizers
from tigana.embeddings import snapshot as _snapshot
from tigana.embeddings._checksum import crc32_rows
from tigana.embeddings.changes import Changes, unique
from tigana.embeddings.config import Adam, TableConfig
from tigana.embeddings.errors import (
    CorruptStore,
    InvalidArgument,
    SnapshotNotFound,
    StorageError,
    StorageFull,
)
from tigana.embeddings.hashtable import HashIndex, resolve_backend
from tigana.embeddings.initializers import initial_rows
from tigana.embeddings.lmdbstore import RowStore
from tigana.embeddings.mixing import mix64
from tigana.embeddings.rows import RowBatch
from tigana.embeddings.slab import Slab

_log = logging.getLogger(__name__)
_INT64_MAX = np.iinfo(np.int64).max
_CHUNK = 1 << 16  # rows per chunk when streaming the whole table (export, checksum, snapshot, spill)


_LOCAL_SETTINGS = ("memory_budget", "spill_dir", "spill_max_bytes", "backend")


class EmbeddingTable:
    """One table: rows, optimizer state, metadata; hash index; admission, eviction, LMDB spill, snapshots.

    Thread-safety: every public method takes the table's lock; the numeric kernels release the GIL, so
    threads working on different tables run in parallel.

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
        self._width = optimizers.state_width(config.optimizer, config.dim)
        self._index = HashIndex(backend=self._backend)
        self._slab = Slab(config.dim, self._width, config.dtype)
        self._admission = admission.AdmissionFilter(config.admission, config.seed, backend=self._backend)
        self._open_admission = admission.is_open(config.admission)
        self._step = 0
        self._clock = 0  # access clock: +1 per pull/push, stamped into last_access
        self._deleted: list[np.ndarray] = []  # ids deleted or evicted since the last snapshot
        self._spill = None  # set by _open_spill when a memory budget is configured
        self._spilled = HashIndex(backend=self._backend)  # ids living only in the spill store
        self._last_snapshot: Path | None = None
        self._finalizer: weakref.finalize | None = None
        self._last_ttl_scan = (0, time.time())
        self._closed = False
        self._changes: Changes | None = None  # set for the duration of a pull/push given ``changes``
        self._evictable: Callable[[np.ndarray], np.ndarray] | None = None
        self._protected = 0  # rows the evictable predicate excluded at the last eviction pass
        self._counters = dict.fromkeys(("pulls", "pushes", "lookups", "hits", "inserts", "admissions",
                                        "rejected_admissions", "evictions", "spills", "unspills",
                                        "rows_updated", "nonfinite_rows_skipped", "spill_failures",
                                        "refused_inserts", "corrupt_rows", "upkeep_failures"), 0)
        self._corrupt = np.empty(0, np.int64)  # spilled ids whose record failed its checks (sorted)
        if config.memory_budget is not None:
            self._open_spill()

    # --- properties ----------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.config.name

    @property
    def dim(self) -> int:
        return self.config.dim

    @property
    def state_width(self) -> int:
        return self._width

    @property
    def backend(self) -> str:
        """'numba' or 'numpy': which kernels this table runs."""
        return self._backend

    @property
    def step(self) -> int:
        """Table step: +1 per push, or the ``step=`` a push gave."""
        return self._step

    # --- validation ----------------------------------------------------------------------------------------
    def _bad(self, field: str, why: str) -> InvalidArgument:
        return InvalidArgument(f"table {self.name!r}: field {field!r} {why}")

    def _check_ids(self, ids: object, field: str = "ids") -> np.ndarray:
        try:
            a = np.asarray(ids)
        except Exception as exc:  # ragged lists and the like
            raise self._bad(field, f"is not an array of ids: {exc}") from None
        if a.ndim != 1:
            raise self._bad(field, f"must be 1-D, got shape {a.shape}")
        if a.size == 0:
            return np.empty(0, np.int64)
        if a.dtype.kind == "i":
            return np.ascontiguousarray(a, np.int64)
        if a.dtype.kind == "u":
            if a.dtype.itemsize == 8 and int(a.max()) > _INT64_MAX:
                raise self._bad(field, f"has values above 2**63-1 (max {int(a.max())})")
            return np.ascontiguousarray(a, np.int64)
        raise self._bad(field, f"must be int64 (any integer dtype), got {a.dtype}")

    def _check_grads(self, grads: object, n: int, field: str = "grads") -> np.ndarray:
        try:
            g = np.asarray(grads)
        except Exception as exc:
            raise self._bad(field, f"is not an array: {exc}") from None
        if g.dtype.kind != "f":
            raise self._bad(field, f"must be float32, got {g.dtype}")
        if g.shape != (n, self.dim):
            if g.ndim == 2 and g.shape[0] == n:
                raise self._bad(field, f"has dim {g.shape[1]} but the table's dim is {self.dim}")
            raise self._bad(field, f"must have shape ({n}, {self.dim}) to match ids, got {g.shape}")
        with np.errstate(over="ignore"):  # float64 beyond float32 becomes Inf, which push then rejects
            return np.ascontiguousarray(g, np.float32)

    # --- pull / push ---------------------------------------------------------------------------------------
    def pull(self, ids: np.ndarray, *, insert: bool = True, changes: Changes | None = None) -> np.ndarray:
        """(n,) int64 ids (any values, duplicates allowed) -> (n, dim) float32 rows in the order of ids.

        Missing ids are inserted (subject to admission) with their deterministic initial row; with
        ``insert=False``, or when not admitted, they read as that row without being stored (and without
        counting a sighting). ``changes`` records what the call changed (inserts, sightings, evictions)."""
        ids = self._check_ids(ids)
        with self._lock, self._recording(changes):
            self._check_open()
            self._clock += 1
            self._counters["pulls"] += 1
            n = ids.shape[0]
            out = np.empty((n, self.dim), np.float32)
            positions = np.empty(n, np.int64)
            if self._backend == "numba" and self._slab.storage_dtype == np.float32:
                misses = int(_kernels.lookup_gather(self._index._keys, self._index._vals, self._slab.weights,
                                                    self._slab.last_access, self._clock, ids.view(np.uint64),
                                                    out, positions))
                gathered = True
            else:
                positions = self._index.lookup(ids)
                misses = int(np.count_nonzero(positions < 0))
                gathered = False
            self._counters["lookups"] += n
            self._counters["hits"] += n - misses
            if misses:
                miss = np.flatnonzero(positions < 0)
                positions[miss] = self._materialize(ids[miss], insert=insert, count=True, hold=positions)
                if gathered:  # fill in what the fused kernel could not
                    got = miss[positions[miss] >= 0]
                    out[got] = self._slab.read_weights(positions[got])
                    self._slab.last_access[positions[got]] = self._clock
                    none = miss[positions[miss] < 0]
                    out[none] = self._initial(ids[none])
            if not gathered:
                have = positions >= 0
                out[have] = self._slab.read_weights(positions[have])
                self._slab.last_access[positions[have]] = self._clock
                if misses:
                    none = ~have
                    out[none] = self._initial(ids[none])
            cap = self.config.eviction.max_rows
            if misses and cap is not None and len(self) - self._protected > cap:  # inserts may pass the cap
                self._upkeep(lambda: self._evict(ttl=False))
            self._upkeep(self._maybe_spill)
            return out

    def push(self, ids: np.ndarray, grads: np.ndarray, *, step: int | None = None,
             changes: Changes | None = None) -> int:
        """Sum grads of duplicate ids, apply the optimizer to those rows; returns unique rows updated.

        ``grads`` (n, dim) float; validates everything (dtype, shape, dim, NaN/Inf) before changing
        anything. Ids not in the table are inserted when admission is open and dropped otherwise (admission
        is decided on pull). ``step`` sets the table step stamped on the rows (default: step + 1).
        ``changes`` records the ids updated and any evicted by the call."""
        ids = self._check_ids(ids)
        grads = self._check_grads(grads, ids.shape[0])
        if step is not None and (not isinstance(step, (int, np.integer)) or step < 0):
            raise self._bad("step", f"must be a non-negative int, got {step!r}")
        if self._backend == "numba":
            bad_row, top = _kernels.first_nonfinite_row(grads.view(np.uint32))
            bad_row = int(bad_row)
        else:
            bad = ~np.isfinite(grads).all(axis=1)
            bad_row = int(np.argmax(bad)) if bad.any() else -1
            top = np.bitwise_and(grads.view(np.uint32), np.uint32(0x7F800000)).max() if grads.size else 0
        overflow = ""
        if bad_row < 0 and _sum_may_overflow(int(top), ids.shape[0]):
            # finite gradients so large that the sum of an id's duplicates can reach Inf (a rare, exact check)
            over = _overflowing_rows(ids, grads)
            if over.any():
                bad_row, overflow = int(np.argmax(over)), " in the sum of its duplicate ids"
        skipped = 0
        if bad_row >= 0:
            if self.config.nonfinite_grads == "reject":
                raise self._bad("grads", f"has NaN/Inf{overflow} (first in row {bad_row}, id {int(ids[bad_row])}); "
                                         "batch rejected")
            keep = np.isfinite(grads).all(axis=1)
            kept = np.flatnonzero(keep)
            keep[kept[_overflowing_rows(ids[kept], grads[kept])]] = False
            skipped = int((~keep).sum())
            ids, grads = ids[keep], np.ascontiguousarray(grads[keep])
        with self._lock, self._recording(changes):
            self._check_open()
            self._counters["nonfinite_rows_skipped"] += skipped
            self._clock += 1
            self._counters["pushes"] += 1
            positions = self._index.lookup(ids)
            miss = np.flatnonzero(positions < 0)
            if miss.size:
                positions[miss] = self._materialize(ids[miss], insert=self._open_admission, count=False,
                                                    hold=positions)
            keep = positions >= 0
            if not keep.all():
                positions, grads = positions[keep], grads[keep]
            if self._changes is not None:
                self._changes.written.append(ids[keep] if not keep.all() else ids)
            if self._backend == "numba":
                rows, summed = _kernels.dedup_sum(np.ascontiguousarray(positions), grads)
            else:
                rows, summed = _dedup_sum_numpy(positions, grads)
            self._step = self._step + 1 if step is None else int(step)
            slab = self._slab
            if self._backend == "numba":
                _kernels.touch(rows, slab.update_count, slab.last_step, slab.last_time, slab.last_access,
                               slab.dirty, self._step, time.time(), self._clock)
            else:
                slab.update_count[rows] += np.uint32(1)
                slab.last_step[rows] = self._step
                slab.last_time[rows] = time.time()
                slab.last_access[rows] = self._clock
                slab.dirty[rows] = 1
            self._apply(rows, summed)
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

    def _apply(self, rows: np.ndarray, summed: np.ndarray) -> None:
        slab, opt = self._slab, self.config.optimizer
        steps = slab.update_count[rows].astype(np.float64) if isinstance(opt, Adam) else None
        if slab.storage_dtype == np.float32:
            optimizers.apply(opt, slab.weights, slab.state, rows, summed, steps, backend=self._backend)
        else:  # widen the touched rows, update a compact float32 copy, round back
            w = slab.read_weights(rows)
            s = np.ascontiguousarray(slab.state[rows])
            optimizers.apply(opt, w, s, np.arange(rows.shape[0]), summed, steps, backend=self._backend)
            slab.write_weights(rows, w)
            slab.state[rows] = s

    def _materialize(self, ids: np.ndarray, *, insert: bool, count: bool, hold: np.ndarray) -> np.ndarray:
        """Slab positions for ids missing from the index: bring spilled rows back, insert admitted new ids.

        ``hold``: the slab positions the caller already resolved for this batch (-1 entries ignored); they
        must stay where they are, so the memory ceiling never spills them to make room.
        Returns (len(ids),) positions, -1 for ids left unstored."""
        uniq, sightings = np.unique(ids, return_counts=True)
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
        """The memory ceiling: a table with a budget may run past it by a quarter while its spill tier works;
        when spilling fails (disk or LMDB map full), inserting ``k`` new rows past that ceiling is refused
        with ``StorageFull`` before anything changed. Updates of stored rows go on; inserts resume once
        space is freed and a spill succeeds."""
        if self._spill is None or len(self._index) + k <= self._budget_rows + self._budget_rows // 4:
            return
        if len(self._index) <= max(1, int(0.9 * self._budget_rows)):
            return  # nothing to spill: one batch larger than the budget (bounded by the request limits)
        try:
            self._spill_coldest(hold)
        except StorageFull as exc:
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
        rows = self._initial(ids)
        batch = RowBatch(ids, rows, optimizers.initial_state(self.config.optimizer, k, self.dim),
                         np.zeros(k, np.int64), np.full(k, self._step, np.int64), np.full(k, time.time()))
        self._slab.write(positions, batch, access=self._clock)
        self._index.insert(ids, positions)
        if self._changes is not None:
            self._changes.written.append(ids)
        self._counters["inserts"] += k
        self._counters["admissions"] += k

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

    def delete(self, ids: np.ndarray) -> int:
        """Remove ids (duplicates and absent ids allowed); returns how many stored rows were removed."""
        ids = self._check_ids(ids)
        with self._lock:
            self._check_open()
            return self._remove(ids)

    def _remove(self, ids: np.ndarray) -> int:
        gone = []
        if len(self._spilled):  # the store first: if LMDB fails, nothing in memory has changed yet
            spilled = np.unique(ids[self._spilled.lookup(ids) >= 0])
            if spilled.size:
                self._spill.delete(spilled)
                self._spilled.delete(spilled)
            gone.append(spilled)
        removed_ids, positions = self._index.delete(ids)
        self._slab.release(positions)
        gone_ids = np.concatenate([removed_ids, *gone])
        if self._changes is not None and gone_ids.size:
            self._changes.deleted.append(gone_ids)
        if gone_ids.size and self._last_snapshot is not None:  # only increments need them
            self._deleted.append(gone_ids)
            if len(self._deleted) > 64:
                self._deleted = [np.unique(np.concatenate(self._deleted))]
        return int(gone_ids.shape[0])

    # --- eviction ------------------------------------------------------------------------------------------
    def evict(self) -> int:
        """Run TTL and capacity eviction over every row now; returns rows evicted."""
        with self._lock:
            self._check_open()
            return self._evict(ttl=True)

    def _maybe_evict(self) -> None:
        ev = self.config.eviction
        if ev.max_rows is None and not ev.ttl_steps and not ev.ttl_seconds:
            return
        now = time.time()
        scan_ttl = (bool(ev.ttl_steps) and self._step - self._last_ttl_scan[0] >= max(1, ev.ttl_steps // 8)) or \
                   (bool(ev.ttl_seconds) and now - self._last_ttl_scan[1] >= ev.ttl_seconds / 8)
        over = ev.max_rows is not None and len(self) - self._protected > ev.max_rows
        if scan_ttl or over:
            self._evict(ttl=scan_ttl)

    def _evict(self, *, ttl: bool) -> int:
        """TTL (when ``ttl``) and capacity eviction over all rows. Spilled rows count as the least recently
        accessed; their metadata is read back from the store, so with a spill tier this scans it."""
        ev = self.config.eviction
        now = time.time()
        if ttl:
            self._last_ttl_scan = (self._step, now)
        ids, positions = self._index.items()
        meta = {"last_step": self._slab.last_step[positions], "last_time": self._slab.last_time[positions],
                "last_access": self._slab.last_access[positions],
                "update_count": self._slab.update_count[positions].astype(np.int64)}
        if len(self._spilled):  # spilled rows are candidates too; their metadata lives in the store
            sp = self._spill_rows(self._spilled.items()[0], skip_corrupt=True)  # a bad record stays put
            ids = np.concatenate([ids, sp.ids])
            meta["last_step"] = np.concatenate([meta["last_step"], sp.last_step])
            meta["last_time"] = np.concatenate([meta["last_time"], sp.last_time])
            meta["last_access"] = np.concatenate([meta["last_access"], np.full(len(sp), -1, np.int64)])
            meta["update_count"] = np.concatenate([meta["update_count"], sp.update_count])
        if self._evictable is not None:  # only rows this table decides for (the slots it leads)
            own = np.asarray(self._evictable(ids), bool)
            if own.shape != ids.shape:
                raise self._bad("evictable", f"must return a bool mask of shape {ids.shape}, got {own.shape}")
            self._protected = int(ids.shape[0] - own.sum())  # the cap counts evictable rows only
            ids = ids[own]
            meta = {k: v[own] for k, v in meta.items()}
        victims = np.zeros(ids.shape[0], bool)
        if ttl and (ev.ttl_steps or ev.ttl_seconds):
            victims = eviction.expired(ev, self._step, now, meta["last_step"], meta["last_time"])
        alive = np.flatnonzero(~victims)
        if ev.max_rows is not None and alive.shape[0] > ev.max_rows:
            k = alive.shape[0] - eviction.capacity_target(ev.max_rows)
            pick = eviction.over_capacity(ev, k, meta["last_access"][alive], meta["update_count"][alive])
            victims[alive[pick]] = True
        n = int(victims.sum())
        if n:
            self._remove(ids[victims])
            self._counters["evictions"] += n
        return n

    # --- export / import / checksum ------------------------------------------------------------------------
    def export_rows(self, predicate: Callable[[np.ndarray], np.ndarray] | None = None,
                    ids: np.ndarray | None = None, *, since: float | None = None) -> RowBatch:
        """Complete rows (resident and spilled), sorted by id: all of them, those whose id is in ``ids``
        (absent ids are skipped), or those for which ``predicate(ids) -> bool mask`` is true. ``since``: only
        rows updated (or inserted) at or after this unix time (a serving delta: the cost follows the rows
        selected, plus one pass over the resident rows' update times and a read of the spilled ones)."""
        if ids is not None:
            ids = self._check_ids(ids)
        with self._lock:
            self._check_open()
            if since is not None:
                recent = self._updated_since(float(since))
                ids = recent if ids is None else np.intersect1d(ids, recent)
            chunks = list(self._iter_sorted(ids, predicate))
            return RowBatch.concat(chunks) if chunks else RowBatch.empty(self.dim, self._width)

    def _updated_since(self, since: float) -> np.ndarray:
        """Ids of the stored rows whose last update is at or after ``since`` (under the lock)."""
        ids, positions = self._index.items()
        out = ids[self._slab.last_time[positions] >= since]
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

    def _all_ids(self) -> np.ndarray:
        ids = self._index.items()[0]
        if len(self._spilled):
            ids = np.concatenate([ids, self._spilled.items()[0]])
        return ids

    def _iter_sorted(self, ids: np.ndarray | None = None,
                     predicate: Callable[[np.ndarray], np.ndarray] | None = None,
                     chunk: int = _CHUNK) -> Iterator[RowBatch]:
        """Stored rows in id order, ``chunk`` at a time; restricted to ``ids`` and/or ``predicate``."""
        if ids is None:
            sel = np.sort(self._all_ids())
        else:
            sel = np.unique(ids)
        if predicate is not None and sel.size:
            mask = np.asarray(predicate(sel))
            if mask.dtype != bool or mask.shape != sel.shape:
                raise self._bad("predicate", f"must return a bool mask of shape {sel.shape}, got "
                                             f"{mask.dtype} {mask.shape}")
            sel = sel[mask]
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
        self._clock += 1
        if len(self._spilled):
            sp_ids, _ = self._spilled.delete(b.ids)
            if sp_ids.size:
                self._spill.delete(sp_ids)
        positions = self._index.lookup(b.ids)
        new = positions < 0
        if new.any():
            positions[new] = self._slab.allocate(int(new.sum()))
            self._index.insert(b.ids[new], positions[new])
            self._admission.forget(b.ids[new])
        self._slab.write(positions, b, access=self._clock)
        self._maybe_spill()

    def _check_batch(self, batch: RowBatch, *, check_values: bool = True) -> RowBatch:
        if not isinstance(batch, RowBatch):
            raise self._bad("batch", f"must be a RowBatch, got {type(batch).__name__}")
        ids = self._check_ids(batch.ids, "batch.ids")
        n = ids.shape[0]
        if unique(ids).shape[0] != n:
            raise self._bad("batch.ids", "must be unique")
        weights = self._check_grads(batch.weights, n, "batch.weights")
        if check_values and not np.isfinite(weights).all():
            raise self._bad("batch.weights", "has NaN/Inf")
        state = np.asarray(batch.state)
        if state.shape != (n, self._width) or state.dtype.kind != "f":
            raise self._bad("batch.state", f"must be float of shape ({n}, {self._width}), got {state.dtype} "
                                           f"{state.shape}")
        out = [ids, weights, np.ascontiguousarray(state, np.float32)]
        for field, dt in (("update_count", np.int64), ("last_step", np.int64), ("last_time", np.float64)):
            a = np.asarray(getattr(batch, field))
            if a.shape != (n,) or a.dtype.kind not in ("i", "u", "f"):
                raise self._bad(f"batch.{field}", f"must be numeric of shape ({n},), got {a.dtype} {a.shape}")
            out.append(a.astype(dt))
        return RowBatch(*out)

    def checksum(self) -> str:
        """Order-independent digest (hex) of every row's id, weights and optimizer state."""
        with self._lock:
            h = hashlib.blake2b(digest_size=16)
            h.update(f"{self.dim}:{self._width}".encode())
            for batch in self._iter_sorted():
                h.update(batch.ids.tobytes())
                h.update(np.ascontiguousarray(batch.weights).tobytes())
                h.update(np.ascontiguousarray(batch.state).tobytes())
            return h.hexdigest()

    def stats(self) -> dict[str, float]:
        """Counters and sizes: rows_resident, rows_spilled, bytes_per_row, admissions, evictions, hit_rate..."""
        with self._lock:
            resident = len(self._index)
            nbytes = self._slab.nbytes + self._index.nbytes + self._spilled.nbytes + self._admission.nbytes
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

    # --- spill tier (LMDB) ---------------------------------------------------------------------------------
    # Resident rows past the budget spill, coldest (least recently accessed) first, down to 90% of it.
    # ``_spilled`` indexes the spilled ids; its value is 1 when the row changed since the last snapshot.
    def _open_spill(self) -> None:
        base = self.config.spill_dir
        if base is not None:
            Path(base).mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.name)[:40]
        self._spill_path = Path(tempfile.mkdtemp(prefix=f"tigana-spill-{safe}-", dir=base))
        cap = self.config.spill_max_bytes
        self._spill = RowStore(self._spill_path, table=self.name, dim=self.dim, state_width=self._width,
                               map_size=min(1 << 26, cap or 1 << 26), max_map_size=cap)
        self._finalizer = weakref.finalize(self, _close_spill, self._spill, self._spill_path)
        per_row = self._slab.row_nbytes + 18  # + the row's share of the hash index
        self._budget_rows = max(1, int(self.config.memory_budget // per_row))

    def set_memory_budget(self, nbytes: int) -> None:
        """Change the resident-row budget (bytes) while serving: a daemon shares one budget among its tables and
        re-splits it as tables come and go. Rows past it spill to the LMDB tier (opened on first use)."""
        if nbytes < 1:
            raise self._bad("memory_budget", f"must be >= 1 byte, got {nbytes}")
        with self._lock:
            self._check_open()
            if self._spill is None:
                self.config = dataclasses.replace(self.config, memory_budget=int(nbytes))
                self._open_spill()
            per_row = self._slab.row_nbytes + 18
            self._budget_rows = max(1, int(nbytes // per_row))
            self._maybe_spill()

    def _maybe_spill(self) -> None:
        """Spill at the end of a call that already changed the table: a full disk must not turn that call
        into an error (it was applied), so the table stays over budget, counts it, and retries next call."""
        if self._spill is None or len(self._index) <= self._budget_rows:
            return
        try:
            self._spill_coldest()
        except StorageFull as exc:
            self._counters["spill_failures"] += 1
            _log.warning("%s", exc)

    def _spill_coldest(self, hold: np.ndarray | None = None) -> None:
        """Spill the least recently used rows down to 90% of the budget, never the positions in ``hold``."""
        k = len(self._index) - max(1, int(0.9 * self._budget_rows))
        ids, positions = self._index.items()
        if hold is not None and hold.size:
            free = ~np.isin(positions, hold[hold >= 0])
            ids, positions = ids[free], positions[free]
        if k <= 0 or not ids.size:
            return
        cold = np.argpartition(self._slab.last_access[positions], k - 1)[:k] if k < ids.shape[0] else \
            np.arange(ids.shape[0])
        ids, positions = ids[cold], positions[cold]
        batch = self._slab.read(ids, positions)
        dirty = self._slab.dirty[positions].astype(np.int64)
        self._spill.put(batch)  # may raise StorageFull: nothing has changed yet
        self._index.delete(ids)
        self._slab.release(positions)
        self._spilled.insert(ids, dirty)
        self._counters["spills"] += int(ids.shape[0])

    def _unspill(self, ids: np.ndarray) -> None:
        """Bring unique spilled ids back into memory (they keep their dirty state)."""
        found, batch = self._spill.pop(ids)
        if not found.all():
            raise CorruptStore(f"table {self.name!r}: spilled ids missing from the spill store "
                               f"{self._spill.file}: {ids[~found][:5].tolist()}")
        flags = self._spilled.lookup(batch.ids)
        self._spilled.delete(batch.ids)
        positions = self._slab.allocate(len(batch))
        self._slab.write(positions, batch, access=self._clock)
        self._slab.dirty[positions] = (flags > 0).astype(np.uint8)
        self._index.insert(batch.ids, positions)
        self._counters["unspills"] += len(batch)

    def _spill_rows(self, ids: np.ndarray, *, skip_corrupt: bool = False) -> RowBatch:
        """Rows of spilled ids read from the store without bringing them back (ids[found] order). A record
        failing its checks raises ``CorruptStore``; with ``skip_corrupt`` it is left out, counted once in
        ``corrupt_rows`` and logged (it stays in the store: reading that id raises, and other copies of the
        row may be good)."""
        if not skip_corrupt:
            return self._spill.get(ids)[1]
        corrupt: list[int] = []
        _, batch = self._spill.get(ids, corrupt=corrupt)
        if corrupt:
            bad = np.unique(np.array(corrupt, np.int64))
            new = bad[~np.isin(bad, self._corrupt)]
            if new.size:
                self._corrupt = np.union1d(self._corrupt, new)
                self._counters["corrupt_rows"] = int(self._corrupt.size)
                _log.error("table %r: %d spilled row(s) failed their checks in %s and are left out of eviction "
                           "(reading them raises CorruptStore): ids %s", self.name, new.size, self._spill.file,
                           new[:5].tolist())
        return batch

    # --- snapshots -----------------------------------------------------------------------------------------
    def snapshot(self, directory: str | Path, *, incremental: bool = False,
                 extra_files: dict[str, bytes] | None = None, track: bool = True) -> Path:
        """Write a snapshot under ``directory`` atomically; returns its path.

        Full: every row (resident and spilled), optimizer state, metadata, the config and the step.
        Incremental: the rows changed and the ids deleted since this table's previous snapshot, which must
        be the latest one in ``directory``; otherwise a full snapshot is written instead. ``extra_files``
        ({name: bytes}) are stored in the snapshot (``snapshot.read_extra``), atomically with its rows.
        ``track=False`` (a one-off copy, e.g. a checkpoint cut) leaves the incremental chain as it was."""
        root = Path(directory)
        with self._lock:
            self._check_open()
            previous = self._last_snapshot
            chained = incremental and previous is not None and _snapshot.latest_snapshot(root) == previous
            common = {"table": self.name, "config": _snapshot.config_to_dict(self.config),
                      "meta": {"step": self._step}, "state_width": self._width, "extra_files": extra_files}
            if chained:
                deleted = np.unique(np.concatenate(self._deleted)) if self._deleted else np.empty(0, np.int64)
                path = _snapshot.write_snapshot(root, rows=self._iter_dirty(), deleted_ids=deleted,
                                                incremental=True, **common)
            else:
                path = _snapshot.write_snapshot(root, rows=self._iter_sorted(), incremental=False, **common)
            if track:
                self._mark_clean(path)
            return path

    def _iter_dirty(self) -> Iterator[RowBatch]:
        ids, positions = self._index.items()
        dirty = self._slab.dirty[positions] != 0
        ids, positions = ids[dirty], positions[dirty]
        for start in range(0, ids.shape[0], _CHUNK):
            yield self._slab.read(ids[start:start + _CHUNK], positions[start:start + _CHUNK])
        if len(self._spilled):
            sp_ids, flags = self._spilled.items()
            sp_ids = sp_ids[flags > 0]
            for start in range(0, sp_ids.shape[0], _CHUNK):
                yield self._spill_rows(sp_ids[start:start + _CHUNK])

    def _mark_clean(self, path: Path) -> None:
        self._slab.dirty[:] = 0
        self._spilled.fill_values(0)
        self._deleted = []
        self._last_snapshot = path

    @classmethod
    def restore(cls, path: str | Path, *, configure: Callable[[TableConfig], TableConfig] | None = None
                ) -> EmbeddingTable:
        """A new table from the snapshot at ``path`` (or the latest one under the root ``path``), with its
        chain of increments applied, its config, and its step. The table's next incremental snapshot
        chains onto it. ``configure`` maps the stored config to the one to run with: it may change only the
        settings of this process (memory budget, spill tier, backend), not what defines the rows."""
        snap = Path(path)
        if not (snap / _snapshot.MANIFEST).is_file():
            latest = _snapshot.latest_snapshot(snap)
            if latest is None:
                raise SnapshotNotFound(f"no snapshot at {snap}")
            snap = latest
        manifest = _snapshot.read_manifest(snap)
        config = _snapshot.config_from_dict(manifest["config"])
        if configure is not None:
            local = configure(config)
            if dataclasses.replace(local, **{f: getattr(config, f) for f in _LOCAL_SETTINGS}) != config:
                raise InvalidArgument(f"table {config.name!r}: restoring may change only {list(_LOCAL_SETTINGS)}")
            config = local
        table = cls(config)
        try:
            for batch in _snapshot.iter_snapshot_rows(snap):
                table.import_rows(batch)
        except BaseException:
            table.close()
            raise
        with table._lock:
            table._step = int(manifest.get("meta", {}).get("step", 0))
            table._mark_clean(snap)
        return table

    # --- replication -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _recording(self, changes: Changes | None) -> Iterator[None]:
        """Record into ``changes`` for the duration of one call (the caller holds the table lock)."""
        if changes is None:
            yield
            return
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

    def stored_ids(self) -> np.ndarray:
        """Every stored id (resident and spilled), (k,) int64 in no set order."""
        with self._lock:
            self._check_open()
            return self._all_ids()

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
            if gone.size:
                self._remove(gone)
            if step is not None and int(step) > self._step:
                self._step = int(step)

    def checksums_by(self, bucket_of: Callable[[np.ndarray], np.ndarray], num_buckets: int) -> tuple[
            np.ndarray, np.ndarray]:
        """Order-independent digests of the rows grouped by ``bucket_of(ids) -> (n,) int in [0, num_buckets)``:
        ((num_buckets,) uint64 digest sums of id, weights and optimizer state; (num_buckets,) int64 row
        counts). Two tables with the same rows in a bucket have the same digest there."""
        if not isinstance(num_buckets, (int, np.integer)) or isinstance(num_buckets, bool) or num_buckets < 1:
            raise self._bad("num_buckets", f"must be a positive int, got {num_buckets!r}")
        sums = np.zeros(num_buckets, np.uint64)
        counts = np.zeros(num_buckets, np.int64)
        with self._lock:
            self._check_open()
            for batch in self._iter_sorted():
                buckets = np.asarray(bucket_of(batch.ids))
                if buckets.shape != batch.ids.shape or buckets.dtype.kind not in "iu" or \
                        int(buckets.min()) < 0 or int(buckets.max()) >= num_buckets:
                    raise self._bad("bucket_of", f"must map ids to (n,) ints in [0, {num_buckets}), got "
                                                 f"{buckets.dtype} {buckets.shape}")
                buckets = buckets.astype(np.int64)
                digest = _row_digests(batch)
                order = np.argsort(buckets, kind="stable")
                b = buckets[order]
                starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
                with np.errstate(over="ignore"):
                    sums[b[starts]] += np.add.reduceat(digest[order], starts)
                counts[b[starts]] += np.diff(np.r_[starts, b.shape[0]])
        return sums, counts

    # --- lifecycle -----------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(f"table {self.name!r}: closed")

    def close(self) -> None:
        """Release memory and the spill tier; the table is unusable afterwards. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._finalizer is not None:
                self._finalizer()  # closes the spill store and removes its directory
                self._spill = None
            self._index.clear()
            self._spilled.clear()
            self._slab.clear()

    def __enter__(self) -> EmbeddingTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EmbeddingTable({self.name!r}, dim={self.dim}, rows={len(self)}, step={self._step})"


def _row_digests(batch: RowBatch) -> np.ndarray:
    """(n,) uint64 digest of each row's id, float32 weights and optimizer state."""
    n = len(batch)
    if n == 0:
        return np.zeros(0, np.uint64)
    w = crc32_rows(np.ascontiguousarray(batch.weights, np.float32).view(np.uint8).reshape(n, -1))
    if batch.state.shape[1]:
        st = crc32_rows(np.ascontiguousarray(batch.state, np.float32).view(np.uint8).reshape(n, -1))
    else:
        st = np.zeros(n, np.uint32)
    with np.errstate(over="ignore"):
        payload = (w.astype(np.uint64) << np.uint64(32)) | st.astype(np.uint64)
        return mix64(mix64(batch.ids) + payload)


def _sum_may_overflow(top_exponent_bits: int, n: int) -> bool:
    """Whether a sum of up to ``n`` float32 values, each below 2**(e - 126) for the exponent field e in
    ``top_exponent_bits``, could exceed float32's largest finite value (just under 2**128)."""
    return n > 1 and (top_exponent_bits >> 23) - 126 + n.bit_length() > 127


def _overflowing_rows(ids: np.ndarray, grads: np.ndarray) -> np.ndarray:
    """(n,) bool: rows whose id's float32 gradient sum over the batch is not finite."""
    if ids.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    uniq, inverse = np.unique(ids, return_inverse=True)
    sums = np.zeros((uniq.shape[0], grads.shape[1]), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        np.add.at(sums, inverse, grads)
    return ~np.isfinite(sums).all(axis=1)[inverse]


def _dedup_sum_numpy(positions: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique slab positions (first-seen order) and the float32 sums of their grads; numpy twin of the numba
    kernel."""
    if positions.shape[0] == 0:
        return positions.astype(np.int64), grads[:0]
    order = np.argsort(positions, kind="stable")
    s = positions[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    sums = np.add.reduceat(grads[order], starts, axis=0)
    first_seen = order[starts]
    perm = np.argsort(first_seen, kind="stable")
    return s[starts][perm].astype(np.int64), np.ascontiguousarray(sums[perm], np.float32)


def _close_spill(store: RowStore, path: Path) -> None:
    store.close()
    shutil.rmtree(path, ignore_errors=True)


__all__ = ["EmbeddingTable"]
