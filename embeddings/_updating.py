"""A push's update before it reaches the rows: the table learns which ids' update would not be finite before it
changes anything, then applies the update where the rows live.

A finite gradient can still overflow: |g| = 2e19 squares past float32's largest value, so Adagrad's accumulator
or FTRL's ``n`` would become Inf (the row freezes, or its weights turn NaN at the next push), and a weight near
the top of the range can overflow under SGD. Such a push is refused as one holding NaN/Inf is, with nothing
applied (``nonfinite_grads="skip_rows"``: those ids are dropped). The numba backend runs its optimizer kernel
twice: once to check (reading the rows, writing nothing), once in place after the new ids are stored; the numpy
backend (and a float16/bfloat16 table) computes compact copies once, checks them and writes them back. Rows not
resident yet (spilled, or new ids the push will insert) are checked on compact copies of what they will hold.
Whole-batch array work throughout: one dedup pass, one kernel or numpy pass per step, no loop over ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tigana.embeddings import _gradients, _kernels, optimizers
from tigana.embeddings.config import Adam
from tigana.embeddings.errors import CorruptStore
from tigana.embeddings.slab import _gather, _scatter, from_float32, to_float32


@dataclass
class Update:
    """The update a push would make. Groups are the batch's distinct ids in first-seen order.

    keys:    (n,) per batch row: its slab position, or ``-2 - i`` for ``missing[i]`` (not resident)
    groups:  (k,) the distinct keys
    missing: (m,) sorted distinct ids of the batch that were not resident
    summed:  (k, dim) float32 gradient sums (in batch order)
    steps:   (k,) float64 the rows' update counts including this one (Adam), else None
    live:    (k,) bool: groups the push stores (not: new ids that a closed admission drops)
    bad:     (k,) bool: live groups whose weights or state would not be finite
    weights, state: (k, dim), (k, width) float32 updated rows (as the storage dtype rounds them) when computed
             on copies; None when the numba kernel applies the update in place
    """

    keys: np.ndarray
    groups: np.ndarray
    missing: np.ndarray
    summed: np.ndarray
    steps: np.ndarray | None
    live: np.ndarray
    bad: np.ndarray
    weights: np.ndarray | None = None
    state: np.ndarray | None = None

    def first_bad_row(self) -> int:
        """The batch row of the first id whose update would not be finite."""
        return int(np.argmax(self.keys == self.groups[int(np.argmax(self.bad))]))

    def without_bad(self) -> tuple[np.ndarray, Update]:
        """(batch rows to keep, the update without the bad groups)."""
        keep = ~np.isin(self.keys, self.groups[self.bad])
        good = ~self.bad
        return keep, Update(self.keys[keep], self.groups[good], self.missing, self.summed[good],
                            None if self.steps is None else self.steps[good], self.live[good], self.bad[good],
                            None if self.weights is None else self.weights[good],
                            None if self.state is None else self.state[good])


class Updating:
    """The push's check and write; see the module docstring. A mixin of ``EmbeddingTable``."""

    def _plan_update(self, ids: np.ndarray, positions: np.ndarray, grads: np.ndarray) -> Update:
        """What the optimizer would make of ``grads`` of ``ids`` (resident at ``positions``, -1 elsewhere), and
        which ids' rows it would make non-finite; the table is not changed. Duplicate ids are summed in batch
        order, as the update sums them."""
        keys = np.array(positions, np.int64)
        miss = np.flatnonzero(keys < 0)
        missing = np.empty(0, np.int64)
        if miss.size:
            missing, inverse = np.unique(ids[miss], return_inverse=True)
            keys[miss] = -2 - inverse
        if self._backend == "numba":
            groups, summed = _kernels.dedup_sum(keys, grads)
        else:
            groups, summed = _gradients.dedup_sum_numpy(keys, grads)
        slab, opt = self._slab, self.config.optimizer
        k = groups.shape[0]
        live = np.ones(k, bool)
        at, absent = np.flatnonzero(groups >= 0), np.flatnonzero(groups < 0)
        adam = isinstance(opt, Adam)
        # rows not resident: compact copies of what they will hold (their steps too)
        a_w, a_s, a_count = self._absent_rows(missing[-2 - groups[absent]], live, absent)
        steps = None
        if adam:
            count = np.zeros(k, np.int64)
            count[at] = slab.update_count[groups[at]]
            count[absent] = a_count
            steps = count.astype(np.float64) + 1.0
        if self._backend == "numba" and slab.storage_dtype == np.float32:  # check now, apply in place later
            bad = np.zeros(k, bool)
            if at.size == k:
                bad = optimizers.nonfinite_rows(opt, slab.weights, slab.state, groups, summed, steps)
            elif at.size:
                bad[at] = optimizers.nonfinite_rows(opt, slab.weights, slab.state, groups[at], summed[at],
                                                    None if steps is None else steps[at])
            if absent.size:
                bad[absent] = optimizers.nonfinite_rows(opt, a_w, a_s, np.arange(absent.size), summed[absent],
                                                        None if steps is None else steps[absent])
            return Update(keys, groups, missing, summed, steps, live, bad & live)
        weights = np.zeros((k, self.dim), np.float32)
        state = np.zeros((k, slab.state_width), np.float32)
        weights[at], state[at] = slab.read_weights(groups[at]), _gather(slab.state, groups[at])
        weights[absent], state[absent] = a_w, a_s
        if self._backend == "numba":  # a float16/bfloat16 table: the kernels on the widened copies
            with np.errstate(over="ignore", invalid="ignore"):
                optimizers.apply(opt, weights, state, np.arange(k), summed, steps, backend="numba")
        else:
            weights, state = optimizers.updated(opt, weights, state, np.arange(k), summed, steps)
        if slab.storage_dtype != np.float32:  # what the row will hold: float16 overflows at 65504
            weights = to_float32(from_float32(weights, slab.storage_dtype))
        bad = live & ~(np.isfinite(weights).all(axis=1) & np.isfinite(state).all(axis=1))
        return Update(keys, groups, missing, summed, steps, live, bad, weights, state)

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
        """Apply the update at slab positions ``rows`` (unique), those of the groups ``stored``."""
        every = bool(stored.all())
        if update.weights is None:
            summed = update.summed if every else update.summed[stored]
            steps = update.steps if every or update.steps is None else update.steps[stored]
            optimizers.apply(self.config.optimizer, self._slab.weights, self._slab.state, rows, summed, steps,
                             backend="numba")
            return
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
