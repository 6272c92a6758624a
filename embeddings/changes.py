"""Changes: what calls on a table changed, captured for replication.

A caller passes a ``Changes`` to ``EmbeddingTable.pull``/``push``; the table records the ids it wrote
(inserted or updated), the ids it removed (eviction) and the admission sightings it counted, in the order it
did them. ``tigana.ps`` ships the rows of those ids as they are after the call, the removals and the
sightings to the other copies of the rows, which apply them with ``EmbeddingTable.apply_changes``.
Not thread-safe: filled under the table's lock by the one call it was passed to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tigana.embeddings import _kernels
from tigana.embeddings.rows import RowBatch

__all__ = ["Changes", "find_sorted", "sorted_unique", "sorted_unique_counts", "unique"]


def unique(ids: np.ndarray) -> np.ndarray:
    """The distinct int64 ``ids``: first-seen order with the compiled hash pass, sorted without it."""
    if _kernels.AVAILABLE:
        return _kernels.unique_first_seen(ids)
    return sorted_unique(ids)


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """The distinct values of an array, ascending (flattened): a sort and one comparison pass. NumPy 2.4's
    ``np.unique`` without ``return_*`` arguments takes a hash path that ran 4-18x slower on random int64 (26 k
    ids: 4.0 ms against 1.1; 1.7 M, a slot copy's listing: 1.76 s against 0.10, holding the GIL: a sync push
    waited a second on a replica behind it)."""
    s = np.sort(values, axis=None)
    if s.size < 2:
        return s
    keep = np.empty(s.size, bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def sorted_unique_counts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_counts=True)`` of a 1-D array: the distinct values ascending and how often each
    occurs (int64), by one sort and one comparison pass (``np.unique``'s Python-level path cost a push's few ids
    twice as much)."""
    s = np.sort(values)
    edge = np.ones(s.size + 1, bool)
    np.not_equal(s[1:], s[:-1], out=edge[1:-1])
    at = np.flatnonzero(edge)
    return s[at[:-1]], np.diff(at)


def find_sorted(sorted_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The index of each of ``ids`` in ``sorted_ids`` (ascending, distinct), -1 where absent: a binary search
    each, O(n log m). (``np.isin`` sorts both arrays on every call: 12x this for 65,536 ids against 900 k.)"""
    if not sorted_ids.size:
        return np.full(ids.size, -1, np.int64)
    pos = np.searchsorted(sorted_ids, ids)
    np.minimum(pos, sorted_ids.size - 1, out=pos)
    return np.where(sorted_ids[pos] == ids, pos, -1)



@dataclass
class Changes:
    """Ids written and removed, and admission sightings ((ids, counts) in the order counted).

    ``rows``: the complete rows of every id written so far, as the call left them, when the call exported them
    itself (a push: the optimizer's output rows; a pull's inserts: the rows it stored), so nothing is looked up
    and gathered again to replicate them; None once a write they do not cover is recorded."""

    written: list[np.ndarray] = field(default_factory=list)
    deleted: list[np.ndarray] = field(default_factory=list)
    sightings: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    rows: RowBatch | None = None

    def __bool__(self) -> bool:
        return bool(self.written or self.deleted or self.sightings)

    def wrote(self, ids: np.ndarray, rows: RowBatch | None = None) -> None:
        """Record ``ids`` written; ``rows``, when given, are the complete rows of these ids as the call leaves
        them and cover every id recorded before them (a push's rows include the ids it inserted)."""
        self.written.append(ids)
        self.rows = rows

    def written_rows(self, read: Callable[[np.ndarray], RowBatch]) -> RowBatch | None:
        """The complete rows of the ids written, as the call left them: the call's own export when it made one
        (``rows``), else ``read(written_ids())`` (which skips ids no longer stored). None: nothing written."""
        if not self.written:
            return None
        if self.rows is not None:
            return self.rows
        ids = self.written_ids()
        return read(ids) if ids.size else None

    def written_ids(self) -> np.ndarray:
        """Unique ids written, (k,) int64 (first-seen order)."""
        if not self.written:
            return np.empty(0, np.int64)
        ids = self.written[0] if len(self.written) == 1 else np.concatenate(self.written)
        return unique(np.ascontiguousarray(ids, np.int64))

    def deleted_ids(self) -> np.ndarray:
        """Unique ids removed, (k,) int64 sorted (some may have been written again after)."""
        return sorted_unique(np.concatenate(self.deleted)) if self.deleted else np.empty(0, np.int64)

    def sighting_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The sightings as two aligned (j,) int64 arrays, in the order counted."""
        if not self.sightings:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return (np.concatenate([i for i, _ in self.sightings]).astype(np.int64),
                np.concatenate([c for _, c in self.sightings]).astype(np.int64))
