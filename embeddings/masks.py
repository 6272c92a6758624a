"""Whether any, or every, element of a small array is set, in one C call each.

``ndarray.any()`` and ``ndarray.all()`` go through numpy's Python-level reduction wrappers (``_methods._any``):
about 2 us on the 16-slot masks of one push, three times ``np.count_nonzero``; the write and replication paths
test dozens of such masks per push. Same answers for any dtype and shape (nonzero is set, NaN included)."""

from __future__ import annotations

import numpy as np

__all__ = ["all_set", "any_set"]


def any_set(a: np.ndarray) -> bool:
    """``a.any()``: whether some element of ``a`` is nonzero."""
    return np.count_nonzero(a) > 0


def all_set(a: np.ndarray) -> bool:
    """``a.all()``: whether every element of ``a`` is nonzero (True when empty)."""
    return np.count_nonzero(a) == a.size
