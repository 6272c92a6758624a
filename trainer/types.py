"""The batch types every part of the trainer speaks: readers produce them, embedding collections and models eat them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch


@dataclass
class SparseFeatures:
    """Multi-hot ids of F features for B samples, feature-major like TorchRec's KeyedJaggedTensor.

    keys:    F feature names
    values:  (N,) int64 ids, feature 0's ids for samples 0..B-1 first, then feature 1's, ...
    lengths: (F*B,) int64 number of ids per (feature, sample); single-hot features have all lengths 1
    weights: (N,) float32 per-id weights, applied to each row before pooling (and to its gradient), or None
    """

    keys: list[str]
    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.lengths.numel() // max(len(self.keys), 1))

    def offsets(self) -> torch.Tensor:
        """(F*B+1,) int64 start of each (feature, sample) bag in ``values``."""
        return torch.cat([self.lengths.new_zeros(1), torch.cumsum(self.lengths, 0)])

    def feature(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, offsets) of one feature: offsets is (B,) bag starts relative to the returned values,
        the form ``nn.EmbeddingBag`` takes."""
        b = self.batch_size
        offsets = self.offsets()
        start, stop = int(offsets[index * b]), int(offsets[(index + 1) * b])
        return self.values[start:stop], offsets[index * b:(index + 1) * b] - start


@dataclass
class Batch:
    """One training batch.

    dense:  (B, num_dense) float32
    sparse: the categorical features
    labels: (B,) float32 in {0, 1}
    """

    dense: torch.Tensor
    sparse: SparseFeatures
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class FeatureSpec:
    """A sparse feature and the table it reads (features may share a table)."""

    name: str
    table: str | None = None  # default: a table of its own, named like the feature
    pooling: Literal["sum", "mean"] = "sum"

    @property
    def table_name(self) -> str:
        return self.table or self.name


class EmbeddingCollection(Protocol):
    """What models take for their sparse part: a module mapping SparseFeatures to pooled rows.

    ``forward(sparse) -> (B, F, dim)`` float32, features in ``feature_names`` order.
    Implemented locally (``nn.EmbeddingBag``) and by the parameter server (``PSEmbeddingBags``).
    """

    feature_names: list[str]
    dim: int

    def __call__(self, sparse: SparseFeatures) -> torch.Tensor: ...
