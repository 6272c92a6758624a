"""Compiled (numba) kernels of the trainer's step planning.

``group_ids`` replaces a sort (``np.argsort`` of every feature's values, the largest cost of planning a step)
with one hash pass and a counting sort: O(n), distinct ids in first-seen order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tigana.ps.routing import mix64_scalar  # the one splitmix64 of the project


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
        h = np.int64(mix64_scalar(key) & mask)
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


@njit(nogil=True, cache=True)
def _group_segments(values, bounds, uniq, index, order, row_starts, counts):
    """``_group`` of every segment [bounds[t], bounds[t + 1]) of ``values`` on its own, written one after the
    other: rows numbered across segments, positions global."""
    rows_before = 0
    for t in range(bounds.shape[0] - 1):
        lo, hi = bounds[t], bounds[t + 1]
        seg = values[lo:hi]
        u = _group(seg, uniq[rows_before:], index[lo:hi], order[lo:hi], row_starts[rows_before:])
        for i in range(lo, hi):
            index[i] += rows_before
            order[i] += lo
        for r in range(rows_before, rows_before + u):
            row_starts[r] += lo
        counts[t] = u
        rows_before += u
    return rows_before


def group_segments(values: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                                     np.ndarray]:
    """Every segment of ``values`` (a table's values, tables one after the other; ``bounds`` (T+1,)) grouped as
    ``group_ids`` does, in one call: (distinct ids of every segment, stacked (U,); row of each value, counting
    across segments (N,); positions grouped by row (N,); start of each row's group (U,); rows per segment (T,))."""
    values = np.ascontiguousarray(values, dtype=np.int64)
    bounds = np.ascontiguousarray(bounds, dtype=np.int64)
    n = values.shape[0]
    uniq = np.empty(n, np.int64)
    index = np.empty(n, np.int64)
    order = np.empty(n, np.int64)
    row_starts = np.empty(n, np.int64)
    counts = np.empty(bounds.shape[0] - 1, np.int64)
    u = _group_segments(values, bounds, uniq, index, order, row_starts, counts)
    return uniq[:u], index, order, row_starts[:u], counts
