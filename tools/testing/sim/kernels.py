"""Compiled (numba) kernels of the simulator's per-step checks (``exactness``, ``checkers``): each walks the
ledger's ids once and returns the first violation it finds, as a code and an index, for Python to word.

Why: the checks run after every step over a few hundred ids, where the cost is the number of numpy calls (1-2
us each), not their size; the numpy forms took about a quarter of a run's CPU. Each kernel computes exactly
what the numpy form it replaces computed, in the same precedence, and picks the same first index (the lowest,
as ``argmax`` of a mask did); ``tests/sim/test_check_kernels.py`` holds each against a numpy reference on random
arrays. Same conventions as ``tigana.ps._kernels``: ``nogil``, cached on disk (``cache=True``: a process
loads them, only a changed source compiles again), one signature each (C-contiguous arrays of fixed dtypes).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tigana.embeddings.mixing import slot_of_key  # also keys numba's cache by every kernel source

__all__ = ["COPY_CODES", "applied_in_doubt", "copy_verdict", "exact_verdict", "first_unchanged", "kept_in_doubt",
           "order_verdict", "rounded"]

# ``exact_verdict``'s codes, in the precedence the checks report them in (0: none)
LOW, HIGH, SWAP, LOOSE = 1, 2, 3, 4
COPY_CODES = (LOW, HIGH, SWAP, LOOSE)
_NO_POSITION = np.uint64(np.iinfo(np.uint64).max)  # a log position no item reached


@njit(nogil=True, cache=True)
def rounded(rows, cached, out):
    """out = rint(rows) as int64 ((ids, dim) float32 -> int64); returns whether ``out`` equals ``cached`` (an
    (ids, dim) int64 array, or one of another shape: never equal)."""
    same = cached.shape[0] == rows.shape[0] and cached.shape[1] == rows.shape[1]
    for i in range(rows.shape[0]):
        for j in range(rows.shape[1]):
            x = np.int64(np.rint(rows[i, j]))
            out[i, j] = x
            if same and cached[i, j] != x:
                same = False
    return same


@njit(nogil=True, cache=True)
def copy_verdict(v, sent, sent_w, acked, held, primary, leads, leads_valid, slots, losing, lost, sync, must):
    """One copy's bounds, per id ``k`` of ``v`` ((ids, 2) int64): (the first id above what was sent, in either
    column (S6), else -1; whether any id must be exact; the first id that is held in sync, lost with every copy
    of its slot and below what was acknowledged, else -1). Writes ``must`` (bool, per id): the ids the copy must
    hold exactly, ``held`` for a sync table, else led by this primary (``leads`` per slot, none where not
    ``leads_valid``) and not ``losing``, less the ``lost`` ids. Returns at the first id above what was sent."""
    any_must = False
    short = -1
    for k in range(v.shape[0]):
        if v[k, 0] > sent[k] or v[k, 1] > sent_w[k]:
            return k, False, -1
        if sync:
            m = held[k]
        else:
            m = primary[k] and leads_valid and leads[slots[k]] and not losing[k]
        m = m and not lost[k]
        must[k] = m
        any_must = any_must or m
        if short < 0 and held[k] and lost[k] and v[k, 0] < acked[k]:
            short = k
    return -1, any_must, short


@njit(nogil=True, cache=True)
def kept_in_doubt(pending, at, must):
    """Whether any id of the pushes in doubt (joined: ``at`` the id of each, ``pending`` not acknowledged yet)
    is still pending and one of ``must``."""
    for j in range(at.shape[0]):  # noqa: SIM110 - a generator in any() would compile to a slower loop
        if pending[j] and must[at[j]]:
            return True
    return False


@njit(nogil=True, cache=True)
def applied_in_doubt(owner, at, slot, pending, weight, must, applied, blind, untold, e0, e1, unknown):
    """Per id: (count ``e0``, rounded weight sum ``e1``) of the pending pushes in doubt its window records as
    applied for its slot, and ``unknown``: the ids of pushes the window cannot tell about (``untold``, per push,
    updated: a push with a pending id of ``must`` whose slot is blind and not recorded as applied is untold).
    Joined pushes: per id entry ``owner`` (push), ``at`` (id), ``slot``, ``pending``; per push ``weight``;
    ``applied``/``blind`` (pushes, nbytes) uint8 bitmaps, slot ``s`` at bit ``s & 7`` of byte ``s >> 3``. The
    weights add in entry order in float64, as ``np.bincount`` adds them."""
    for j in range(at.shape[0]):
        if pending[j] and must[at[j]]:
            b, s = slot[j] >> 3, np.uint8(slot[j] & 7)
            if not (applied[owner[j], b] >> s) & 1 and (blind[owner[j], b] >> s) & 1:
                untold[owner[j]] = True
    sums = np.zeros(e0.shape[0], np.float64)
    for j in range(at.shape[0]):
        if not (pending[j] and must[at[j]]):
            continue
        if untold[owner[j]]:
            unknown[at[j]] = True
        elif (applied[owner[j], slot[j] >> 3] >> np.uint8(slot[j] & 7)) & 1:
            e0[at[j]] += 1
            sums[at[j]] += weight[owner[j]]
    for i in range(e1.shape[0]):
        e1[i] = np.int64(np.rint(sums[i]))


@njit(nogil=True, cache=True)
def exact_verdict(v, must, e0, e1, unknown, acked, acked_w, allow, lost_ever, sync):
    """The first violation of a copy that must hold ``acked`` plus what its window applied in doubt (``e0``,
    ``e1``) exactly, as (code, id), code 0 where none: ``LOW`` an exact id below it (lost), else ``HIGH`` above
    it in count (applied twice), else ``SWAP`` its count right and weight not, else ``LOOSE`` an id that cannot
    be exact (``unknown``, or an async id that lost an acknowledged push: ``lost_ever``) below ``acked`` less
    what may have been lost (``allow``; nothing for a sync table). Each code's id is the lowest of its kind."""
    high = swap = loose = -1
    for k in range(v.shape[0]):
        if not must[k]:
            continue
        if not unknown[k] and (sync or not lost_ever[k]):
            r0 = v[k, 0] - acked[k]
            if r0 < e0[k]:
                return LOW, k
            if high < 0 and r0 > e0[k]:
                high = k
            if swap < 0 and v[k, 1] - acked_w[k] != e1[k]:
                swap = k
        elif loose < 0 and v[k, 0] < acked[k] - (0 if sync else allow[k]):
            loose = k
    if high >= 0:
        return HIGH, high
    if swap >= 0:
        return SWAP, swap
    if loose >= 0:
        return LOOSE, loose
    return 0, -1


@njit(nogil=True, cache=True)
def order_verdict(copies, states, in_sync, valid, positions, values, slots):
    """S5: the first (column, id) where a copy in column ``col`` >= 1 of ``copies`` (slots, columns) in state
    ``in_sync``, at its primary's log position (``positions``: (servers, slots, 2) uint64, both of them read:
    ``valid``, a position reached), holds other rows of the id than its primary (``values``: (servers, ids, 2));
    (-1, -1) where none. Columns in order, the lowest id of a column first."""
    num_slots = copies.shape[0]
    same = np.zeros(num_slots, np.bool_)
    for col in range(1, copies.shape[1]):
        found = False
        for s in range(num_slots):
            p, c = copies[s, 0], copies[s, col]
            ok = p >= 0 and c >= 0 and valid[p] and valid[c] and states[s, col] == in_sync
            if ok:
                for j in range(positions.shape[2]):
                    ok = ok and positions[p, s, j] == positions[c, s, j]
                ok = ok and positions[p, s, 0] != _NO_POSITION
            same[s] = ok
            found = found or ok
        if not found:
            continue
        for k in range(slots.shape[0]):
            s = slots[k]
            if same[s]:
                p, c = copies[s, 0], copies[s, col]
                for j in range(values.shape[2]):
                    if values[p, k, j] != values[c, k, j]:
                        return col, k
    return -1, -1


@njit(nogil=True, cache=True)
def first_unchanged(ids, n, leads, num_slots, now, before):
    """S8: the first of a push's ``ids`` below ``n`` whose slot (``routing.slot_of`` over ``num_slots``) its
    server still ``leads`` and whose count (column 0) did not grow from ``before`` to ``now``; -1 where none.
    A negative id reads the rows from the end, as numpy's indexing did."""
    slots = np.uint64(num_slots)
    for i in range(ids.shape[0]):
        x = ids[i]
        if x < n and leads[slot_of_key(x, slots)] and now[x, 0] <= before[x, 0]:
            return x
    return -1
