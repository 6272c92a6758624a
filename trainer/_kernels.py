"""Compiled (numba) kernels of the trainer's step planning.

``group_ids`` replaces a sort (``np.argsort`` of every feature's values, the largest cost of planning a step)
with one hash pass and a counting sort: O(n), distinct ids in first-seen order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


@njit(nogil=True, cache=True)
def _group(ids, uniq, inverse, order, starts):
    n = ids.shape[0]
    cap = 16
    while cap < 2 * n:
        cap *= 2
    mask = np.uint64(cap - 1)
    keys = np.empty(cap, np.int64)
    slot_row = np.full(cap, -1, np.int64)
    u = 0
    for i in range(n):
        key = ids[i]
        z = np.uint64(key)
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        h = np.int64((z ^ (z >> np.uint64(31))) & mask)
        while True:
            r = slot_row[h]
            if r < 0:
                slot_row[h] = u
                keys[h] = key
                uniq[u] = key
                inverse[i] = u
                u += 1
                break
            if keys[h] == key:
                inverse[i] = r
                break
            h = (h + 1) & (cap - 1)
    counts = np.zeros(u + 1, np.int64)
    for i in range(n):
        counts[inverse[i] + 1] += 1
    for r in range(u):
        counts[r + 1] += counts[r]
    for r in range(u):
        starts[r] = counts[r]
    for i in range(n):  # stable: a row's values keep their batch order
        r = inverse[i]
        order[counts[r]] = i
        counts[r] += 1
    return u


def group_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(n,) int64 -> (distinct ids in first-seen order (U,), inverse (n,) with ids == uniq[inverse], order (n,)
    grouping equal ids (stable), start of each id's group in ``order`` (U,))."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    n = ids.shape[0]
    uniq = np.empty(n, np.int64)
    inverse = np.empty(n, np.int64)
    order = np.empty(n, np.int64)
    starts = np.empty(n, np.int64)
    u = _group(ids, uniq, inverse, order, starts)
    return uniq[:u], inverse, order, starts[:u]
