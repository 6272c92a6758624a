"""Gradient batches before they reach the rows: the NaN/Inf screen (including sums of duplicate ids that
overflow float32) and the numpy twin of the compiled duplicate-id sum. Pure functions, thread-safe."""

from __future__ import annotations

import numpy as np

from tigana.embeddings import _kernels
from tigana.embeddings.errors import InvalidArgument


def screen(ids: np.ndarray, grads: np.ndarray, *, policy: str, backend: str, table: str
           ) -> tuple[np.ndarray, np.ndarray, int]:
    """(n,) int64 ids, (n, dim) float32 grads -> (ids, grads, rows skipped) with no row whose gradient, or
    whose id's summed gradient, is NaN/Inf. ``policy`` "reject" raises ``InvalidArgument`` instead (naming
    the first bad row); "skip_rows" drops those rows."""
    if backend == "numba":
        bad_row, top = _kernels.first_nonfinite_row(grads.view(np.uint32))
        bad_row = int(bad_row)
    else:
        bad = ~np.isfinite(grads).all(axis=1)
        bad_row = int(np.argmax(bad)) if bad.any() else -1
        top = np.bitwise_and(grads.view(np.uint32), np.uint32(0x7F800000)).max() if grads.size else 0
    overflow = ""
    if bad_row < 0 and sum_may_overflow(int(top), ids.shape[0]):
        # finite gradients so large that the sum of an id's duplicates can reach Inf (a rare, exact check)
        over = overflowing_rows(ids, grads)
        if over.any():
            bad_row, overflow = int(np.argmax(over)), " in the sum of its duplicate ids"
    if bad_row < 0:
        return ids, grads, 0
    if policy == "reject":
        raise InvalidArgument(f"table {table!r}: field 'grads' has NaN/Inf{overflow} (first in row {bad_row}, "
                              f"id {int(ids[bad_row])}); batch rejected")
    keep = np.isfinite(grads).all(axis=1)
    kept = np.flatnonzero(keep)
    keep[kept[overflowing_rows(ids[kept], grads[kept])]] = False
    return ids[keep], np.ascontiguousarray(grads[keep]), int((~keep).sum())


def sum_may_overflow(top_exponent_bits: int, n: int) -> bool:
    """Whether a sum of up to ``n`` float32 values, each below 2**(e - 126) for the exponent field e in
    ``top_exponent_bits``, could exceed float32's largest finite value (just under 2**128)."""
    return n > 1 and (top_exponent_bits >> 23) - 126 + n.bit_length() > 127


def overflowing_rows(ids: np.ndarray, grads: np.ndarray) -> np.ndarray:
    """(n,) bool: rows whose id's float32 gradient sum over the batch is not finite."""
    if ids.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    uniq, inverse = np.unique(ids, return_inverse=True)
    sums = np.zeros((uniq.shape[0], grads.shape[1]), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        np.add.at(sums, inverse, grads)
    return ~np.isfinite(sums).all(axis=1)[inverse]


def dedup_sum_numpy(positions: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
