"""TorchRec's batch and table types, our own: what a TorchRec model feeds an ``EmbeddingBagCollection`` and
gets back, without TorchRec installed (``PSEmbeddingBagCollection`` takes TorchRec's own types just as well).

    EmbeddingBagConfig  a pooled table: name, embedding_dim, num_embeddings, feature_names, pooling
    EmbeddingConfig     an unpooled table (``EmbeddingCollection``): the same fields, no pooling
    KeyedJaggedTensor   F features x B samples of multi-hot ids, feature-major:
                        keys [f0, f1], lengths (F*B,), values (sum(lengths),), optional weights (like values)
    KeyedTensor         pooled rows of every feature side by side: values (B, sum of dims), keys, length_per_key
    JaggedTensor        one feature's unpooled rows: values (sum(lengths), dim), lengths (B,)

Example::

    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["user", "item"], values=torch.tensor([7, 8, 9]),
                                              lengths=torch.tensor([1, 1, 0, 1]))  # B = 2
    kt = ebc(kjt)            # KeyedTensor, values (2, D_user + D_item)
    kt.to_dict()["item"]     # (2, D_item)

The method names are TorchRec's (``keys()``, ``values()``, ``lengths()``, ``to_dict()``, ``length_per_key()``,
``from_lengths_sync``), so model code written against TorchRec runs on these unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from tigana.trainer.types import SparseFeatures

__all__ = ["EmbeddingBagConfig", "EmbeddingConfig", "JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "PoolingType"]


class PoolingType(Enum):
    """How a bag of rows becomes one row (TorchRec's names)."""

    SUM = "SUM"
    MEAN = "MEAN"


@dataclass
class EmbeddingConfig:
    """One unpooled table: ``num_embeddings`` rows of ``embedding_dim`` floats, read by ``feature_names``
    (TorchRec's fields; empty ``feature_names``: the feature named after the table, filled in by the collection,
    as TorchRec does). ``num_embeddings`` bounds the ids of a local table and sizes a state dict's tensor; a PS
    table takes any int64 id."""

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    feature_names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.embedding_dim < 1:
            raise ValueError(f"table {self.name!r}: embedding_dim must be >= 1, got {self.embedding_dim}")


@dataclass
class EmbeddingBagConfig(EmbeddingConfig):
    """One pooled table: an ``EmbeddingConfig`` with its ``pooling`` (SUM or MEAN)."""

    pooling: PoolingType = PoolingType.SUM


class _Weighted:
    """The accessors TorchRec's jagged types share: ``values``, ``lengths`` and the optional ``weights``."""

    _values: torch.Tensor
    _lengths: torch.Tensor
    _weights: torch.Tensor | None

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError(f"this {type(self).__name__} has no weights")
        return self._weights


class KeyedJaggedTensor(_Weighted):
    """Multi-hot ids of F features for B samples, feature-major (TorchRec's layout).

    keys:    F feature names
    values:  (N,) int64 ids: feature 0's ids for samples 0..B-1, then feature 1's, ...
    lengths: (F*B,) int64 ids per (feature, sample)
    weights: (N,) float32 per-id weights (a weighted ``EmbeddingBagCollection`` scales each row by its weight
             before pooling), or None
    """

    def __init__(self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor,
                 weights: torch.Tensor | None = None) -> None:
        if lengths.numel() % max(len(keys), 1):
            raise ValueError(f"lengths has {lengths.numel()} entries, not a multiple of the {len(keys)} keys")
        if int(lengths.sum()) != values.numel():
            raise ValueError(f"lengths sum to {int(lengths.sum())}, values has {values.numel()} ids")
        if weights is not None and weights.shape != values.shape:
            raise ValueError(f"weights has shape {tuple(weights.shape)}, values {tuple(values.shape)}")
        self._keys, self._values, self._lengths, self._weights = list(keys), values, lengths, weights

    @classmethod
    def from_lengths_sync(cls, keys: list[str], values: torch.Tensor, lengths: torch.Tensor,
                          weights: torch.Tensor | None = None) -> KeyedJaggedTensor:
        return cls(keys, values, lengths, weights)

    def keys(self) -> list[str]:
        return self._keys

    def stride(self) -> int:
        """B, the batch size."""
        return int(self._lengths.numel() // max(len(self._keys), 1))

    def to_sparse_features(self) -> SparseFeatures:
        """The trainer's own batch type (same layout)."""
        return SparseFeatures(keys=list(self._keys), values=self._values.long(), lengths=self._lengths.long(),
                              weights=None if self._weights is None else self._weights.float())


class JaggedTensor(_Weighted):
    """One feature's unpooled rows for B samples (what ``EmbeddingCollection`` gives per feature).

    values:  (sum(lengths), dim) float32, sample 0's rows first
    lengths: (B,) int64 rows per sample
    weights: (sum(lengths),) the ids themselves when the collection was built with ``need_indices``, else None
    """

    def __init__(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        if int(lengths.sum()) != values.shape[0]:
            raise ValueError(f"lengths sum to {int(lengths.sum())}, values has {values.shape[0]} rows")
        self._values, self._lengths, self._weights = values, lengths, weights

    def offsets(self) -> torch.Tensor:
        """(B+1,) int64 start of each sample's rows."""
        return torch.cat([self._lengths.new_zeros(1), torch.cumsum(self._lengths, 0)])

    def to_dense(self) -> list[torch.Tensor]:
        """Each sample's (length, dim) rows."""
        return list(torch.split(self._values, self._lengths.tolist()))


class KeyedTensor:
    """Pooled rows of F features side by side.

    values:         (B, sum(length_per_key)) float32, feature ``keys[i]`` in columns
                    ``offset_per_key()[i]:offset_per_key()[i + 1]``
    length_per_key: the width of each feature's rows (its table's embedding_dim)
    """

    def __init__(self, keys: list[str], length_per_key: list[int], values: torch.Tensor, key_dim: int = 1) -> None:
        if key_dim != 1:
            raise ValueError("only key_dim=1 (features side by side along dimension 1)")
        if values.dim() != 2 or values.shape[1] != sum(length_per_key):
            raise ValueError(f"values {tuple(values.shape)} do not hold keys of widths {length_per_key}")
        self._keys, self._lengths, self._values = list(keys), list(length_per_key), values

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return self._lengths

    def offset_per_key(self) -> list[int]:
        offsets = [0]
        for n in self._lengths:
            offsets.append(offsets[-1] + n)
        return offsets

    def key_dim(self) -> int:
        return 1

    def to_dict(self) -> dict[str, torch.Tensor]:
        """feature -> (B, its width) view of ``values``."""
        return dict(zip(self._keys, torch.split(self._values, self._lengths, dim=1), strict=True))

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.to_dict()[key]
