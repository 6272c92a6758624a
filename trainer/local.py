"""The local reference embedding collection: one ``torch.nn.EmbeddingBag`` per table, in this process.

It is what the parameter-server collection is checked against (same ``SparseFeatures`` in, same
(B, F, dim) out) and the peer the training benchmark measures. Ids are folded into a table of n rows by
``id mod n`` (``torch.remainder``: non-negative for any int64 id), so hashed 63-bit ids work with a table of
any size (with collisions) and compact ids below n map to themselves (without).

Not thread-safe for concurrent training steps (as any nn.Module).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tigana.trainer.types import FeatureSpec, SparseFeatures

__all__ = ["LocalEmbeddingCollection"]


class LocalEmbeddingCollection(nn.Module):
    """Pooled embedding lookups for F sparse features from local ``nn.EmbeddingBag`` tables.

    features:       the features, in output order; features naming the same ``table`` share its rows
    dim:            embedding width
    num_embeddings: rows per table: one int for every table, or a mapping table name -> rows
                    (feature names work too for tables of their own)
    init_std:       rows start as Normal(0, init_std) draws (from ``seed`` when given)
    weights:        table name -> (rows, dim) initial weights, copied (e.g. to mirror another collection);
                    tables not named keep the random init
    sparse_grad:    give the tables sparse gradients (for ``torch.optim.SparseAdam`` / SGD on huge tables)

    forward(sparse) -> (B, F, dim) float32, pooled per feature by its ``pooling`` (sum or mean; an empty bag
    gives zeros). ``sparse`` may list its keys in any order but must hold every feature.
    """

    def __init__(self, features: Sequence[FeatureSpec], dim: int, num_embeddings: int | Mapping[str, int], *,
                 init_std: float = 0.01, weights: Mapping[str, torch.Tensor | np.ndarray] | None = None,
                 sparse_grad: bool = False, seed: int | None = None) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"dim must be positive, got {dim}")
        if not features:
            raise ValueError("a collection needs at least one feature")
        names = [f.name for f in features]
        if len(set(names)) != len(names):
            raise ValueError(f"feature names must be unique, got {names}")
        self.features = list(features)
        self.feature_names = names
        self.dim = dim
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        tables: dict[str, nn.EmbeddingBag] = {}
        for spec in self.features:
            table = spec.table_name
            if spec.pooling not in ("sum", "mean"):
                raise ValueError(f"feature {spec.name!r}: pooling must be 'sum' or 'mean', got {spec.pooling!r}")
            if table in tables:
                continue
            if "." in table or not table:
                raise ValueError(f"table name {table!r} must be non-empty and contain no '.'")
            rows = self._rows_of(table, spec.name, num_embeddings)
            bag = nn.EmbeddingBag(rows, dim, mode=spec.pooling, sparse=sparse_grad)
            with torch.no_grad():
                bag.weight.normal_(0.0, init_std, generator=generator)
            tables[table] = bag
        self.tables = nn.ModuleDict(tables)
        self._table_of = [spec.table_name for spec in self.features]
        if weights:
            self.load_weights(weights)

    @staticmethod
    def _rows_of(table: str, feature: str, num_embeddings: int | Mapping[str, int]) -> int:
        if isinstance(num_embeddings, Mapping):
            rows = num_embeddings.get(table, num_embeddings.get(feature))
            if rows is None:
                raise ValueError(f"num_embeddings has no entry for table {table!r}")
        else:
            rows = num_embeddings
        if int(rows) < 1:
            raise ValueError(f"table {table!r}: num_embeddings must be positive, got {rows}")
        return int(rows)

    def load_weights(self, weights: Mapping[str, torch.Tensor | np.ndarray]) -> None:
        """Copy (rows, dim) weights into the named tables; checks every table first, then copies."""
        staged = {}
        for table, w in weights.items():
            if table not in self.tables:
                raise ValueError(f"no table named {table!r} (tables: {sorted(self.tables)})")
            t = torch.as_tensor(w, dtype=torch.float32)
            expected = tuple(self.tables[table].weight.shape)
            if tuple(t.shape) != expected:
                raise ValueError(f"table {table!r}: weights have shape {tuple(t.shape)}, expected {expected}")
            staged[table] = t
        with torch.no_grad():
            for table, t in staged.items():
                self.tables[table].weight.copy_(t)

    def table_weights(self) -> dict[str, torch.Tensor]:
        """A detached copy of every table, name -> (rows, dim)."""
        return {name: bag.weight.detach().clone() for name, bag in self.tables.items()}

    def forward(self, sparse: SparseFeatures) -> torch.Tensor:
        b = sparse.batch_size
        keys = sparse.keys
        if keys == self.feature_names:
            index = range(len(keys))
        else:
            missing = [n for n in self.feature_names if n not in keys]
            if missing:
                raise ValueError(f"sparse features {missing} are missing from the batch (it has {keys})")
            index = [keys.index(n) for n in self.feature_names]
        if sparse.lengths.numel() != len(keys) * b:
            raise ValueError(f"lengths has {sparse.lengths.numel()} entries, expected {len(keys)} x {b}")
        offsets = sparse.offsets()
        pooled = []
        for spec, table, k in zip(self.features, self._table_of, index, strict=True):
            start, stop = int(offsets[k * b]), int(offsets[(k + 1) * b])
            bag = self.tables[table]
            ids = torch.remainder(sparse.values[start:stop], bag.num_embeddings)
            pooled.append(F.embedding_bag(ids, bag.weight, offsets[k * b:(k + 1) * b] - start, mode=spec.pooling,
                                          sparse=bag.sparse))  # (B, dim)
        return torch.stack(pooled, dim=1)  # (B, F, dim)
