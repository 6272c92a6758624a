"""The pull side of ``PSEmbeddingBags``: sending a plan's pulls (all but the rows the hot-row cache
will serve), collecting the rows at the forward (the cache's promised rows checked again), and feeding the
cache the pulled rows with the lag of the own pushes issued after each pull."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent import futures as cf
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tigana.trainer.cache import RowCache
from tigana.trainer.compression import AdaptiveCompressor
from tigana.trainer.embedding.plan import _Plan
from tigana.trainer.embedding.pushes import _PUSH_LOG
from tigana.trainer.types import SparseFeatures


@dataclass
class _Fetch:
    """One PS table's rows for one plan: which rows the cache serves at the forward, and the pull of the rest."""

    table: str                   # PS table
    ids: np.ndarray              # (U,) physical ids, in the plan's row order
    hit: np.ndarray | None       # (U,) bool rows to read from the cache (None: no cache, everything pulled)
    future: Any                  # rows of ids[~hit] (or of every id)
    push_no: int                 # this table's own pushes issued when the pull was sent
    absorbed: bool = False       # its pulled rows are in the cache


@dataclass
class _Prefetch:
    """A batch whose rows are being pulled ahead of its forward."""

    batch: SparseFeatures
    plan: _Plan
    fetches: list[_Fetch]
    steps: int                   # training forwards done when the pulls were sent
    insert: bool                 # training (inserting) pulls, or read-only (evaluation)


class _PullSide:
    """The pull half of ``PSEmbeddingBags`` (which sets every attribute annotated here and defines
    ``_ps_ids``, ``_options_of``, ``_set_codecs`` and ``_timed``)."""

    client: Any
    dim: int
    ps_tables: list[str]
    caches: dict[str, RowCache]
    compressors: dict[str, AdaptiveCompressor]
    observer: Callable[[str, float, int], None] | None
    pulled_rows: int
    cached_rows: int
    _push_no: dict[str, int]
    _push_log: dict[str, deque[tuple[int, np.ndarray]]]

    def _issue_pulls(self, plan: _Plan, insert: bool, pending: Sequence[_Prefetch] = ()) -> list[_Fetch]:
        """Send the pulls of ``plan``'s rows, except (training) the rows the cache will serve at a forward
        that runs after the forwards of ``pending`` (prefetched batches whose steps will push first)."""
        # The client holds each pull back (asynchronously) until the pushes the staleness bound needs are in.
        # ``insert=False`` (evaluation): ids the tables lack read as each table's ``unseen`` policy says (the
        # rows ``tigana serve`` gives them), stored nowhere and not counted toward admission, so held-out data
        # never grows the tables.
        # Every table in one call: the plan's distinct ids are handed down (``unique``), so the client groups
        # them by server in one pass without deduplicating again, and each server gets one message a step.
        start = time.perf_counter()
        hits, wanted = [], []
        for table, ids in zip(self.ps_tables, self._ps_ids(plan), strict=True):
            cache = self.caches.get(table) if insert else None
            hit = None
            if cache is not None:
                ahead = [p.fetches[self.ps_tables.index(table)].ids for p in pending if p.insert]
                touches = sum((np.isin(ids, a) for a in ahead), np.zeros(ids.shape[0], np.int64))
                hit = cache.lookup(ids, pending=touches, ahead=len(ahead)) >= 0
            hits.append(hit)
            wanted.append(ids if hit is None else ids[~hit])
            self._set_codecs(table)
        if insert:
            futs = self.client.pull_many(self.ps_tables, wanted, insert=True, unique=True)
        else:  # one call per distinct policy (one call in all, unless tables were given different ones)
            policies = [self._options_of(t).unseen for t in self.ps_tables]
            futs: list[Any] = [None] * len(policies)
            for policy in dict.fromkeys(policies):
                at = [i for i, p in enumerate(policies) if p == policy]
                got = self.client.pull_many([self.ps_tables[i] for i in at], [wanted[i] for i in at], insert=False,
                                            unique=True, unseen=policy)
                for i, fut in zip(at, got, strict=True):
                    futs[i] = fut
        return [_Fetch(table, ids, hit, self._timed("pull", fut, start, w.shape[0]), self._push_no[table])
                for table, ids, hit, fut, w in zip(self.ps_tables, self._ps_ids(plan), hits, futs, wanted,
                                                   strict=True)]


    def _collect(self, plan: _Plan, fetches: list[_Fetch], training: bool,
                 pending: Sequence[_Prefetch] = ()) -> torch.Tensor:
        """(U, dim) rows of the plan, stacked table after table: pulled rows, plus (training, with a cache)
        the rows the cache serves, checked again now; ``pending``: prefetches still ahead (their promised
        rows stay cached)."""
        if self.observer is not None:
            start = time.perf_counter()
            cf.wait([f.future for f in fetches])
            self.observer("pull_wait", time.perf_counter() - start, sum(u.shape[0] for u in plan.unique))
        blocks = [self._rows_of(f, training, pending) for f in fetches]
        return torch.from_numpy(blocks[0] if len(blocks) == 1 else np.concatenate(blocks))

    def _pulled(self, f: _Fetch) -> np.ndarray:
        """The rows ``f``'s pull returned, shape-checked (and seen by the table's compressor)."""
        n = f.ids.shape[0] if f.hit is None else int(f.hit.shape[0] - f.hit.sum())
        rows = np.asarray(f.future.result(), dtype=np.float32)
        if rows.shape != (n, self.dim):
            raise RuntimeError(f"table {f.table!r}: pulled rows of shape {rows.shape}, expected ({n}, {self.dim})")
        return rows

    def _rows_of(self, f: _Fetch, training: bool, pending: Sequence[_Prefetch]) -> np.ndarray:
        pulled = self._pulled(f)
        comp = self.compressors.get(f.table)
        if comp is not None:
            comp.observe_pull(pulled)
        self.pulled_rows += pulled.shape[0]
        cache = self.caches.get(f.table) if training else None
        if cache is None or f.hit is None:
            return pulled if pulled.flags.writeable else pulled.copy()
        rows = np.empty((f.ids.shape[0], self.dim), np.float32)
        miss = ~f.hit
        rows[miss] = pulled
        promised = np.flatnonzero(f.hit)
        late = promised[:0]
        if promised.shape[0]:
            # Checked again: this forward may come after more own pushes than the prefetch counted.
            slots = cache.lookup(f.ids[promised])
            ok = slots >= 0
            rows[promised[ok]] = cache.read(slots[ok])
            self.cached_rows += int(ok.sum())
            late = promised[~ok]
            if late.shape[0]:  # no longer servable: pull them now (they reflect every push issued so far)
                self._set_codecs(f.table)
                fresh = np.asarray(self.client.pull(f.table, f.ids[late]), np.float32)
                rows[late] = fresh
                self.pulled_rows += late.shape[0]
                if cache.staleness:  # (this step pushes them: at staleness 0 they would be dead at once)
                    cache.insert(f.ids[late], fresh, 0, protect=self._promised(f.table, pending))
        cache.miss(int(miss.sum()) + late.shape[0])
        self._absorb(f, pending, pulled)
        return rows

    def _promised(self, table: str, pending: Sequence[_Prefetch]) -> np.ndarray:
        """Ids of ``table`` that the pending prefetches will read from its cache (kept from eviction)."""
        i = self.ps_tables.index(table)
        parts = [p.fetches[i].ids[p.fetches[i].hit] for p in pending if p.insert and p.fetches[i].hit is not None]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def _absorb(self, f: _Fetch, pending: Sequence[_Prefetch], pulled: np.ndarray | None = None) -> None:
        """Put ``f``'s pulled rows into the table's cache (once), with the lag of the own pushes issued
        after the pull was sent."""
        cache = self.caches.get(f.table)
        if cache is None or f.hit is None or f.absorbed:
            return
        f.absorbed = True
        rows = self._pulled(f) if pulled is None else pulled
        ids = f.ids[~f.hit]
        lag = self._lag_since(f.table, ids, f.push_no)
        # Its step has not pushed yet and will push every one of these rows: a copy whose lag is already at the
        # bound would be dead after that push (at staleness 0, every copy), so it is not cached at all.
        live = lag < cache.staleness
        if not live.all():
            ids, rows, lag = ids[live], rows[live], lag[live]
        cache.insert(ids, rows, lag, born=f.push_no, protect=self._promised(f.table, pending))

    def _lag_since(self, table: str, ids: np.ndarray, push_no: int) -> np.ndarray:
        """(n,) how many of this trainer's pushes of ``table`` issued after push ``push_no`` touched each id
        (more than the staleness bound, so never cached, when the log does not reach that far back)."""
        lag = np.zeros(ids.shape[0], np.int64)
        if self._push_no[table] - push_no > _PUSH_LOG:
            lag += self.caches[table].staleness + 1
            return lag
        for no, pushed in self._push_log[table]:
            if no > push_no:
                pos = np.minimum(np.searchsorted(pushed, ids), max(pushed.shape[0] - 1, 0))
                if pushed.shape[0]:
                    lag += pushed[pos] == ids
        return lag
