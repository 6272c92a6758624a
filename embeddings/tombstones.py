"""Tombstones: the ids a table's eviction removed (TTL, capacity) and when, so that a delta export (serving)
can tell a reader to forget them. Without them a delta lists only the rows that are there, and a reader keeps
serving an evicted row until the next full export.

``Tombstones`` is a bounded log of (ids, time) batches, oldest first, holding at most ``limit`` ids; the log
is complete for every time after ``floor``. The floor starts when the log does (a table created or loaded by
this process knows nothing of removals before), rises when the oldest batches are dropped to stay under the
limit, and when rows arrive from another server (``unknown_before``: a copy of some slots begins, and their
removals there are not known here). A delta since a time at or below ``floor`` may miss tombstones, which the
caller learns from ``since`` (its reader then takes a full export instead). Rows moved to another server (a
slot handed over) are not evicted: no tombstone.

Not thread-safe on its own: the owning table holds its lock around every call.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from tigana.embeddings.changes import sorted_unique

LIMIT = 1 << 22  # ids kept (32 MiB of ids and times at most)


class Tombstones:
    """The removed ids of a table since ``floor`` (see the module docstring)."""

    def __init__(self, limit: int = LIMIT, since: float = float("-inf")) -> None:
        self.limit = int(limit)
        self.floor = float(since)  # every removal after this time is in the log
        self._batches: deque[tuple[np.ndarray, float]] = deque()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def record(self, ids: np.ndarray, when: float) -> None:
        """``ids`` were removed at ``when`` (the server's clock, the one rows' update times use)."""
        if not ids.size:
            return
        self._batches.append((np.array(ids, np.int64), float(when)))
        self._count += int(ids.size)
        while self._count > self.limit and len(self._batches) > 1:
            old, t = self._batches.popleft()
            self._count -= int(old.size)
            self.floor = max(self.floor, t)

    def unknown_before(self, when: float) -> None:
        """Removals up to ``when`` may be missing from the log (rows of some slots arrive from elsewhere)."""
        self.floor = max(self.floor, float(when))

    def since(self, when: float) -> tuple[np.ndarray, bool]:
        """(sorted unique ids removed at or after ``when``, whether the log is complete back to ``when``).
        Some may have been inserted again since: the caller leaves out the ids it holds."""
        parts = [ids for ids, t in self._batches if t >= when]
        ids = sorted_unique(np.concatenate(parts)) if parts else np.empty(0, np.int64)
        return ids, when > self.floor
