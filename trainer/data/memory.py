"""A CTR data set held in numpy arrays, cut into ``Batch`` objects per rank.

Small sets (MovieLens-100K, a synthetic set for the demo) live here whole; every rank loads the same
arrays and keeps every ``world_size``-th row of one permutation that all ranks draw from the same seed,
so the ranks' parts are disjoint and together cover every row exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tigana.trainer.types import Batch, SparseFeatures

__all__ = ["InMemoryDataset", "gather_bags", "rank_rows"]


def rank_rows(num_rows: int, rank: int = 0, world_size: int = 1, *, shuffle: bool = False, seed: int = 0,
              epoch: int = 0) -> np.ndarray:
    """(≈num_rows / world_size,) int64 row indices of ``rank``'s part.

    The rows are permuted with ``seed`` and ``epoch`` (identically on every rank) when ``shuffle``, then
    rank r takes positions r, r + world_size, ...: parts differ in size by at most one row.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(num_rows).astype(np.int64)
    else:
        order = np.arange(num_rows, dtype=np.int64)
    return order[rank::world_size]


def gather_bags(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bags ``rows`` of a CSR feature (values, offsets (N+1,)) -> (values of those bags in row order, lengths).

    Vectorized: one repeat + arange over the selected ids, no loop over rows.
    """
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    total = int(lengths.sum())
    out_starts = np.cumsum(lengths) - lengths
    positions = np.repeat(starts - out_starts, lengths) + np.arange(total, dtype=np.int64)
    return values[positions], lengths


@dataclass
class InMemoryDataset:
    """N labelled rows: dense floats, F sparse features (single- or multi-hot), labels.

    feature_names: F names, in the order batches list them
    dense:   (N, num_dense) float32
    labels:  (N,) float32 in {0, 1}
    values:  per feature, (n_f,) int64 ids of all rows, row after row
    offsets: per feature, (N+1,) int64 start of each row's bag in ``values`` (single-hot: arange(N+1))

    Read-only after construction; safe to share between threads that only read.
    """

    feature_names: list[str]
    dense: np.ndarray
    labels: np.ndarray
    values: list[np.ndarray]
    offsets: list[np.ndarray]

    def __post_init__(self) -> None:
        n = self.labels.shape[0]
        if self.dense.ndim != 2 or self.dense.shape[0] != n:
            raise ValueError(f"dense has shape {self.dense.shape}, expected ({n}, num_dense)")
        if not (len(self.feature_names) == len(self.values) == len(self.offsets)):
            raise ValueError("feature_names, values and offsets must have one entry per feature")
        for name, vals, offs in zip(self.feature_names, self.values, self.offsets, strict=True):
            if offs.shape != (n + 1,) or int(offs[0]) != 0 or int(offs[-1]) != vals.shape[0]:
                raise ValueError(f"feature {name!r}: offsets must be ({n + 1},) from 0 to {vals.shape[0]}")
        self.dense = np.ascontiguousarray(self.dense, dtype=np.float32)
        self.labels = np.ascontiguousarray(self.labels, dtype=np.float32)
        self.values = [np.ascontiguousarray(v, dtype=np.int64) for v in self.values]
        self.offsets = [np.ascontiguousarray(o, dtype=np.int64) for o in self.offsets]
        self._single_hot = [v.shape[0] == n and bool(np.all(np.diff(o) == 1))
                            for v, o in zip(self.values, self.offsets, strict=True)]

    @classmethod
    def single_hot(cls, feature_names: Sequence[str], dense: np.ndarray, ids: np.ndarray,
                   labels: np.ndarray) -> InMemoryDataset:
        """From an (N, F) int64 id matrix (one id per feature and row)."""
        n = ids.shape[0]
        offsets = np.arange(n + 1, dtype=np.int64)
        return cls(list(feature_names), dense, labels, [np.ascontiguousarray(ids[:, f]) for f in range(ids.shape[1])],
                   [offsets] * ids.shape[1])

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_dense(self) -> int:
        return int(self.dense.shape[1])

    @property
    def positive_rate(self) -> float:
        return float(self.labels.mean()) if len(self) else 0.0

    def take(self, rows: np.ndarray) -> Batch:
        """The rows ``rows`` (int64 indices) as one Batch, in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        vals, lens = [], []
        for single, v, o in zip(self._single_hot, self.values, self.offsets, strict=True):
            if single:
                vals.append(v[rows])
                lens.append(np.ones(rows.shape[0], dtype=np.int64))
            else:
                bag_values, bag_lengths = gather_bags(v, o, rows)
                vals.append(bag_values)
                lens.append(bag_lengths)
        sparse = SparseFeatures(keys=list(self.feature_names),
                                values=torch.from_numpy(np.concatenate(vals) if vals else np.zeros(0, np.int64)),
                                lengths=torch.from_numpy(np.concatenate(lens) if lens else np.zeros(0, np.int64)))
        return Batch(dense=torch.from_numpy(self.dense[rows]), sparse=sparse,
                     labels=torch.from_numpy(self.labels[rows]))

    def subset(self, rows: np.ndarray) -> InMemoryDataset:
        """A new data set of the given rows (e.g. a train/validation split)."""
        rows = np.asarray(rows, dtype=np.int64)
        values, offsets = [], []
        for v, o in zip(self.values, self.offsets, strict=True):
            bag_values, bag_lengths = gather_bags(v, o, rows)
            values.append(bag_values)
            offsets.append(np.concatenate([[0], np.cumsum(bag_lengths)]).astype(np.int64))
        return InMemoryDataset(list(self.feature_names), self.dense[rows], self.labels[rows], values, offsets)

    def num_batches(self, batch_size: int, rank: int = 0, world_size: int = 1, *, drop_last: bool = False) -> int:
        """How many batches ``batches`` yields to ``rank`` (ranks differ by at most one)."""
        n = rank_rows(len(self), rank, world_size).shape[0]
        return n // batch_size if drop_last else -(-n // batch_size)

    def batches(self, batch_size: int, *, rank: int = 0, world_size: int = 1, shuffle: bool = False,
                seed: int = 0, epoch: int = 0, drop_last: bool = False) -> Iterator[Batch]:
        """Batches of ``rank``'s part (see ``rank_rows``); the last one is short unless ``drop_last``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        rows = rank_rows(len(self), rank, world_size, shuffle=shuffle, seed=seed, epoch=epoch)
        stop = rows.shape[0] - (rows.shape[0] % batch_size if drop_last else 0)
        for start in range(0, stop, batch_size):
            yield self.take(rows[start:start + batch_size])
