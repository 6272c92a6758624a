"""RowBatch: a batch of complete rows (weights, optimizer state, metadata) as moved between tiers.

The one currency of snapshots, the spill tier, and slot copies (replication, failover, resharding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RowBatch:
    """n complete rows. Arrays are aligned on axis 0.

    ids:          (n,) int64
    weights:      (n, dim) float32 (widened from the table's storage dtype)
    state:        (n, state_width) float32 optimizer state (width 0 for SGD)
    update_count: (n,) int64 number of updates applied to the row
    last_step:    (n,) int64 table step of the last update
    last_time:    (n,) float64 unix time of the last update
    """

    ids: np.ndarray
    weights: np.ndarray
    state: np.ndarray
    update_count: np.ndarray
    last_step: np.ndarray
    last_time: np.ndarray

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @classmethod
    def empty(cls, dim: int, state_width: int) -> RowBatch:
        return cls(
            ids=np.empty(0, np.int64),
            weights=np.empty((0, dim), np.float32),
            state=np.empty((0, state_width), np.float32),
            update_count=np.empty(0, np.int64),
            last_step=np.empty(0, np.int64),
            last_time=np.empty(0, np.float64),
        )

    def take(self, index: np.ndarray) -> RowBatch:
        """Rows at ``index`` (an int array or a bool mask)."""
        return RowBatch(
            self.ids[index], self.weights[index], self.state[index],
            self.update_count[index], self.last_step[index], self.last_time[index],
        )

    @classmethod
    def concat(cls, batches: list[RowBatch]) -> RowBatch:
        return cls(*(np.concatenate([getattr(b, f) for b in batches]) for f in
                     ("ids", "weights", "state", "update_count", "last_step", "last_time")))
