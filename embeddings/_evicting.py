"""Eviction of a table's rows: TTL (steps or seconds since the last update) and capacity (``max_rows``, by LRU or
LFU), run cheaply after writes and fully by ``evict()``. Only the rows ``set_evictable`` allows are candidates
(a copy leaves the decision to the primary of the rows). Not thread-safe on its own: the table holds its lock.
"""

from __future__ import annotations

import time

import numpy as np

from tigana.embeddings import eviction
from tigana.embeddings._fields import TableFields


class Evicting(TableFields):
    """TTL and capacity eviction; see the module docstring."""

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
        accessed; their metadata is read back from the store, so with a spill tier this scans it. A spilled
        record that fails its checks is left where it is (counted in ``corrupt_rows``)."""
        ev = self.config.eviction
        now = time.time()
        if ttl:
            self._last_ttl_scan = (self._step, now)
        ids, positions = self._index.items()
        meta = {"last_step": self._slab.last_step[positions], "last_time": self._slab.last_time[positions],
                "last_access": self._slab.last_access[positions],
                "update_count": self._slab.update_count[positions].astype(np.int64)}
        if len(self._spilled):  # spilled rows are candidates too; their metadata lives in the store
            sp = self._spill_rows(self._spilled.items()[0], skip_corrupt=True)
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
