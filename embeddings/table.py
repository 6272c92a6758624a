"""EmbeddingTable: a growable sparse table of rows keyed by arbitrary int64 ids. (CONTRACT STUB: being built.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from tigana.embeddings.config import TableConfig
from tigana.embeddings.rows import RowBatch


class EmbeddingTable:
    """One table: rows, optimizer state, metadata; hash index; admission, eviction, LMDB spill, snapshots.

    Thread-safety: every public method takes the table's lock; the numeric kernels release the GIL.
    """

    def __init__(self, config: TableConfig) -> None:
        self.config = config
        raise NotImplementedError

    # properties: name, dim, state_width, step
    def pull(self, ids: np.ndarray, *, insert: bool = True) -> np.ndarray:
        """(n,) int64 ids (any values, duplicates allowed) -> (n, dim) float32 rows in the order of ids.

        Missing ids are inserted (subject to admission) with their deterministic initial row."""
        raise NotImplementedError

    def push(self, ids: np.ndarray, grads: np.ndarray, *, step: int | None = None) -> int:
        """Sum grads of duplicate ids, apply the optimizer to those rows; returns unique rows updated.

        Validates everything (dtype, shape, dim, NaN/Inf) before changing anything."""
        raise NotImplementedError

    def delete(self, ids: np.ndarray) -> int:
        raise NotImplementedError

    def contains(self, ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def export_rows(self, predicate: Callable[[np.ndarray], np.ndarray] | None = None,
                    ids: np.ndarray | None = None) -> RowBatch:
        raise NotImplementedError

    def import_rows(self, batch: RowBatch) -> None:
        raise NotImplementedError

    def checksum(self) -> str:
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        raise NotImplementedError

    def snapshot(self, directory: str | Path, *, incremental: bool = False) -> Path:
        raise NotImplementedError

    @classmethod
    def restore(cls, path: str | Path) -> EmbeddingTable:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
