"""A push's update before it reaches the rows: the optimizer computes the updated rows as compact copies, with a
flag per row for a NaN/Inf in them; the table refuses (or, with ``nonfinite_grads="skip_rows"``, drops) the ids
flagged before it changes anything, then stores the copies where the rows live.

A finite gradient can still overflow: |g| = 2e19 squares past float32's largest value, so Adagrad's accumulator
or FTRL's ``n`` would become Inf (the row freezes, or its weights turn NaN at the next push), and a weight near
the top of the range can overflow under SGD. Such a push is refused as one holding NaN/Inf is, with nothing
applied. The optimizer runs once: the numba kernels read the resident rows where they live and write the
results and flags in the same pass; rows not resident yet (spilled, or new ids the push will insert) are
computed from compact copies of what they will hold. Whole-batch array work throughout: one dedup pass, one
optimizer pass, one scatter; no loop over ids in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tigana.embeddings import _gradients, _kernels, optimizers
from tigana.embeddings.changes import sorted_unique
from tigana.embeddings.config import Adam
from tigana.embeddings.errors import CorruptStore
from tigana.embeddings.masks import all_set
from tigana.embeddings.rows import RowBatch
from tigana.embeddings.slab import _gather, _scatter, from_float32, to_float32

_SCRATCH_BYTES = 32 << 20  # the most result arrays a table keeps between pushes


@dataclass
class Update:
    """The update a push would make. Groups are the batch's distinct ids in first-seen order.

    keys:    (n,) per batch row: its slab position, or ``-2 - i`` for ``missing[i]`` (not resident)
    groups:  (k,) the distinct keys
    missing: (m,) sorted distinct ids of the batch that were not resident
    weights: (k, dim) float32 updated weights (as the storage dtype will round them)
    state:   (k, width) float32 updated optimizer state
    live:    (k,) bool: groups the push stores (not: new ids that a closed admission drops)
    bad:     (k,) bool: live groups whose weights or state would hold a NaN/Inf
    """

    keys: np.ndarray
    groups: np.ndarray
    missing: np.ndarray
    weights: np.ndarray
    state: np.ndarray
    live: np.ndarray
    bad: np.ndarray

    def first_bad_row(self) -> int:
        """The batch row of the first id whose update would not be finite."""
        return int(np.argmax(self.keys == self.groups[int(np.argmax(self.bad))]))

    def without_bad(self) -> tuple[np.ndarray, Update]:
        """(batch rows to keep, the update without the bad groups)."""
        keep = ~np.isin(self.keys, self.groups[self.bad])
        good = ~self.bad
        return keep, Update(self.keys[keep], self.groups[good], self.missing, self.weights[good], self.state[good],
                            self.live[good], self.bad[good])


class Updating:
    """The push's planning and writing; see the module docstring. A mixin of ``EmbeddingTable``."""

    def _plan_update(self, ids: np.ndarray, positions: np.ndarray, grads: np.ndarray) -> Update:
        """The rows the optimizer would make of ``grads`` of ``ids`` (resident at ``positions``, -1 elsewhere),
        and which would not be finite; the table is not changed. Duplicate ids are summed in batch order."""
        keys = np.array(positions, np.int64)
        miss = (keys < 0).nonzero()[0]  # 1-D: ``np.flatnonzero``'s ravel and wrappers cost more than a small batch
        missing = np.empty(0, np.int64)
        if miss.size:
            not_resident = ids[miss]
            missing = sorted_unique(not_resident)  # np.unique(..., return_inverse=True) by a sort and a search
            keys[miss] = -2 - np.searchsorted(missing, not_resident)
        if self._backend == "numba":
            groups, summed = _kernels.dedup_sum(keys, grads)
        else:
            groups, summed = _gradients.dedup_sum_numpy(keys, grads)
        slab, opt = self._slab, self.config.optimizer
        k = groups.shape[0]
        live = np.ones(k, bool)
        at, absent = (groups >= 0).nonzero()[0], (groups < 0).nonzero()[0]
        a_w, a_s, a_count = self._absent_rows(missing[-2 - groups[absent]], live, absent)
        steps = None
        if isinstance(opt, Adam):
            count = np.zeros(k, np.int64)
            count[at] = slab.update_count[groups[at]]
            count[absent] = a_count
            steps = count.astype(np.float64) + 1.0
        out = self._scratch(k)
        if slab.storage_dtype == np.float32:  # resident rows are read where they live
            w, s, rows = slab.weights, slab.state, groups[at]
        else:  # widened copies of float16/bfloat16 rows
            w, s, rows = slab.read_weights(groups[at]), _gather(slab.state, groups[at]), np.arange(at.size)
        if at.size:
            every = not absent.size
            optimizers.updated(opt, w, s, rows, summed if every else summed[at],
                               steps if steps is None or every else steps[at], backend=self._backend, out=out,
                               at=at)
        if absent.size:
            optimizers.updated(opt, a_w, a_s, np.arange(absent.size), summed[absent],
                               None if steps is None else steps[absent], backend=self._backend, out=out, at=absent)
        weights, state, bad = out
        if slab.storage_dtype != np.float32:  # what the row will hold: float16 overflows at 65504
            with np.errstate(over="ignore"):  # an overflow is what the check looks for
                weights = to_float32(from_float32(weights, slab.storage_dtype))
            bad |= ~np.isfinite(weights).all(axis=1)
        return Update(keys, groups, missing, weights, state, live, bad & live)

    def _scratch(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(k, dim) and (k, width) float32 and (k,) bool result arrays, reused from push to push (under the
        table's lock, and written out before the push returns): fresh multi-MiB arrays cost their page faults
        and zeroing on every push. A table keeps at most ``_SCRATCH_BYTES`` of them; larger batches allocate."""
        row_bytes = 4 * (self.dim + self._slab.state_width) + 1
        have = getattr(self, "_update_scratch", None)
        if have is None or have[0].shape[0] < k:
            n = min(max(k, 2 * (have[0].shape[0] if have is not None else 0)), _SCRATCH_BYTES // row_bytes)
            fresh = (np.empty((max(n, k), self.dim), np.float32),
                     np.empty((max(n, k), self._slab.state_width), np.float32), np.empty(max(n, k), bool))
            if n < k:
                return fresh  # past the cap: this push's own arrays
            have = self._update_scratch = fresh
        return have[0][:k], have[1][:k], have[2][:k]

    def _absent_rows(self, ids: np.ndarray, live: np.ndarray, where: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(weights, state, update counts) of ids not resident (float32 copies, as the push will find them):
        spilled ones as stored, new ones as they would be inserted (their initial row). ``live[where]`` is
        cleared for new ids a closed admission drops."""
        n, slab = ids.shape[0], self._slab
        weights = np.zeros((n, self.dim), np.float32)
        state = np.zeros((n, slab.state_width), np.float32)
        count = np.zeros(n, np.int64)
        if not n:
            return weights, state, count
        spilled = self._spilled.lookup(ids) >= 0 if len(self._spilled) else np.zeros(n, bool)
        if spilled.any():
            batch = self._spill_rows(ids[spilled])  # in the order asked, all found
            if not np.array_equal(batch.ids, ids[spilled]):
                raise CorruptStore(f"table {self.name!r}: spilled ids missing from the spill store")
            weights[spilled], state[spilled], count[spilled] = batch.weights, batch.state, batch.update_count
        new = ~spilled
        if not new.any():
            return weights, state, count
        if not self._open_admission:  # a push inserts nothing then: these ids are dropped
            live[where[new]] = False
            return weights, state, count
        initial = self._initial(ids[new])
        if slab.storage_dtype != np.float32:
            initial = to_float32(from_float32(initial, slab.storage_dtype))
        weights[new] = initial
        state[new] = optimizers.initial_state(self.config.optimizer, int(new.sum()), self.dim)
        return weights, state, count

    def _write_update(self, update: Update, rows: np.ndarray, stored: np.ndarray) -> None:
        """Store the updated rows of the groups ``stored`` at slab positions ``rows`` (unique)."""
        every = all_set(stored)
        weights = update.weights if every else update.weights[stored]
        state = update.state if every else update.state[stored]
        self._slab.write_weights(rows, weights)
        if state.shape[1]:
            _scatter(self._slab.state, rows, state)

    def _rows_of(self, update: Update) -> np.ndarray:
        """(k,) slab positions of the update's groups once the push stored its ids (-1: not stored)."""
        rows = update.groups.copy()
        absent = np.flatnonzero(rows < 0)
        if absent.size:
            rows[absent] = self._index.lookup(update.missing[-2 - rows[absent]])
        return rows

    def _exported(self, ids: np.ndarray, update: Update, rows: np.ndarray, stored: np.ndarray,
                  step_code: np.uint32, time_code: np.uint32) -> RowBatch | None:
        """The complete rows a push just stored (``rows``: the slab positions of the update's groups
        ``stored``), made from the update itself: its weights and state are what the slab now holds (the
        storage dtype's rounding included), the step and time are the push's codes read back, so replicating
        them needs no lookup or gather of what was just written. ``ids`` are the batch's (aligned with
        ``update.keys``): their first-seen distinct values are the groups' ids, as keys and ids correspond one
        to one (None if they do not: then the rows are read back)."""
        gids = _kernels.unique_first_seen(ids) if _kernels.AVAILABLE else _first_seen_numpy(ids)
        if gids.shape[0] != update.groups.shape[0]:  # not expected; the push stands, its rows are read back
            return None
        every = all_set(stored)
        # copies: the update's arrays are scratch that the next push writes over
        weights = update.weights.copy() if every else update.weights[stored]
        state = update.state.copy() if every else update.state[stored]
        slab, n = self._slab, rows.shape[0]
        # the stamps the push wrote, read back as ``steps_of`` and ``times_of`` read them
        return RowBatch(gids if every else gids[stored], weights, state, slab.update_count[rows].astype(np.int64),
                        np.full(n, slab.step_base + int(step_code), np.int64),
                        np.full(n, slab.time_of_code(time_code)))


def _first_seen_numpy(ids: np.ndarray) -> np.ndarray:
    """The distinct ``ids`` in first-seen order, without the compiled kernels."""
    _, first = np.unique(ids, return_index=True)
    return ids[np.sort(first)]
