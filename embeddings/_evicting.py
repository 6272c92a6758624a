"""Eviction of a table's rows: TTL (steps or seconds since the last update) and capacity (``max_rows``, by LRU or
LFU), run cheaply after writes and fully by ``evict()``. Only the rows ``set_evictable`` allows are candidates
(a copy leaves the decision to the primary of the rows). Not thread-safe on its own: the table holds its lock.

A spill tier is never read whole under the lock: a pass reads one window of it (``SPILL_WINDOW`` records, or
the capacity victims it needs if more), from a cursor that goes round the spilled ids' index bucket by bucket.
Spilled rows are the least recently accessed, so LRU takes its victims there first; LFU and TTL judge the
window's rows. A TTL pass starts a sweep of the rest of the tier, ``SPILL_SWEEP`` records after each later
write, so every spilled row is judged within a round (but for the few a partition's growth or rehash moves back
across the cursor, which wait for a later round); at most one window's worth of disk reads ever happens under
the lock at once.
"""

from __future__ import annotations

import time

import numpy as np

from tigana.embeddings import eviction
from tigana.embeddings._fields import TableFields
from tigana.embeddings.partitioned import IndexView
from tigana.embeddings.rows import RowBatch

SPILL_WINDOW = 1 << 16  # spilled records one eviction pass reads (besides the capacity victims it needs)
SPILL_SWEEP = 1 << 12  # spilled records each write reads while a TTL sweep of the spill tier is under way


class Evicting(TableFields):
    """TTL and capacity eviction; see the module docstring."""

    def evict(self) -> int:
        """Run TTL and capacity eviction now over every resident row and a window of the spill tier (the
        writes after it sweep the rest: module docstring); returns rows evicted."""
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
        elif self._sweep_left > 0:  # the TTL sweep of the spill tier goes on, a window per write
            self._evict(ttl=True, resident=False)

    def _evict(self, *, ttl: bool, resident: bool = True) -> int:
        """TTL (when ``ttl``) and capacity eviction over the resident rows and a window of the spill tier
        (module docstring); ``resident=False``: TTL over the next window of the sweep alone. A spilled record
        that fails its checks is left where it is (counted in ``corrupt_rows``)."""
        ev = self.config.eviction
        now = time.time()
        if resident:
            if ttl:
                self._last_ttl_scan = (self._step, now)
            ids, positions = self._index.items()
        else:
            ids, positions = np.empty(0, np.int64), np.empty(0, np.int64)
        meta = {"last_step": self._slab.steps_of(positions), "last_time": self._slab.times_of(positions),
                "last_access": self._slab.access_of(positions),
                "update_count": self._slab.update_count[positions].astype(np.int64)}
        if len(self._spilled):  # spilled rows are candidates too; their metadata lives in the store
            need = len(self) - eviction.capacity_target(ev.max_rows) if resident and ev.max_rows is not None else 0
            sp, read = self._spill_window(max(SPILL_WINDOW if resident else SPILL_SWEEP, need))
            if resident and ttl and (ev.ttl_steps or ev.ttl_seconds):
                self._sweep_left = len(self._spilled) - read  # the rest of the tier, after later writes
            elif not resident:
                self._sweep_left -= max(read, 1)
            ids = np.concatenate([ids, sp.ids])
            meta["last_step"] = np.concatenate([meta["last_step"], sp.last_step])
            meta["last_time"] = np.concatenate([meta["last_time"], sp.last_time])
            meta["last_access"] = np.concatenate([meta["last_access"], np.full(len(sp), -1, np.int64)])
            meta["update_count"] = np.concatenate([meta["update_count"], sp.update_count])
        else:
            self._sweep_left = 0
        seen = ids.shape[0]
        unseen = len(self) - seen if resident else 0  # spilled rows outside this pass's window
        own_share = 1.0
        if self._evictable is not None:  # only rows this table decides for (the slots it leads)
            own = np.asarray(self._evictable(ids), bool)
            if own.shape != ids.shape:
                raise self._bad("evictable", f"must return a bool mask of shape {ids.shape}, got {own.shape}")
            own_share = float(own.mean()) if seen else 1.0
            if resident:  # the cap counts evictable rows only; the unseen ones as the window's share says
                self._protected = int(seen - own.sum()) + round(unseen * (1.0 - own_share))
            ids = ids[own]
            meta = {k: v[own] for k, v in meta.items()}
        victims = np.zeros(ids.shape[0], bool)
        if ttl and (ev.ttl_steps or ev.ttl_seconds):
            victims = eviction.expired(ev, self._step, now, meta["last_step"], meta["last_time"])
        alive = np.flatnonzero(~victims)
        evictable = alive.shape[0] + round(unseen * own_share)
        if resident and ev.max_rows is not None and evictable > ev.max_rows:
            k = evictable - eviction.capacity_target(ev.max_rows)  # taken among the candidates
            pick = eviction.over_capacity(ev, k, meta["last_access"][alive], meta["update_count"][alive])
            victims[alive[pick]] = True
        n = int(victims.sum())
        if n:
            self._remove(ids[victims], tombstone=True)
            self._counters["evictions"] += n
        return n

    # The cursor is a place in the hash, not a bucket number: partition p and the fraction f of its buckets before
    # it, as p + f. A partition that grows between two windows renumbers every bucket after it (and rescales its
    # own), and a cursor kept as a global bucket skipped rows: a TTL sweep left expired spilled rows for rounds.
    # Buckets are in order of their keys' homes, so the same fraction of a grown partition is the same place.
    @staticmethod
    def _cursor_place(view: IndexView, bucket: int) -> float:
        p = int(np.searchsorted(view.offsets, bucket, side="right")) - 1
        if p >= len(view.parts):
            return 0.0
        return p + (bucket - int(view.offsets[p])) / max(1, view.parts[p][0].shape[0])

    def _cursor_bucket(self, view: IndexView) -> int:
        p = int(self._spill_cursor)
        if not 0 <= p < len(view.parts):
            return 0
        cap = view.parts[p][0].shape[0]
        return int(view.offsets[p]) + min(cap - 1, int((self._spill_cursor - p) * cap)) if cap else 0

    def _spill_window(self, n: int) -> tuple[RowBatch, int]:
        """Up to ``n`` spilled rows from the cursor on, going round to the first bucket at the end (every
        spilled row when ``n`` covers the tier); (the rows whose records check out, records read)."""
        assert self._spill is not None
        if n >= len(self._spilled):
            rows = self._spill_rows(self._spilled.items()[0], skip_corrupt=True)
            return rows, len(self._spilled)
        view = self._spilled.view()  # global bucket numbers over the partitions
        buckets = view.size
        start = self._cursor_bucket(view)
        taken_keys: list[np.ndarray] = []
        taken_vals: list[np.ndarray] = []
        got, at, scanned = 0, start, 0
        while got < n and scanned < buckets:  # a few times n buckets at a time (the index is ~70% full)
            hi = min(view.segment_end(at), at + 2 * (n - got) + 64)
            keys, vals = view.slice(at, hi)
            live = np.flatnonzero(vals >= 0)[:n - got]
            taken_keys.append(keys[live])
            taken_vals.append(vals[live])
            got += live.shape[0]
            scanned += hi - at
            at = at + int(live[-1]) + 1 if got == n and live.size else hi
            if at >= buckets:
                at = 0
        self._spill_cursor = self._cursor_place(view, at)
        picked_keys = np.concatenate(taken_keys) if taken_keys else np.empty(0, np.uint64)
        picked_vals = np.concatenate(taken_vals) if taken_vals else np.empty(0, np.int32)
        corrupt: list[int] = []
        rows = self._spill.read(picked_vals, picked_keys.view(np.int64), corrupt=corrupt)
        self._note_corrupt(corrupt)
        return rows, int(picked_keys.shape[0])
