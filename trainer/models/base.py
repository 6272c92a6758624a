"""What every CTR model here has in common: an embedding collection passed in, dense layers of its own.

The collection (local ``nn.EmbeddingBag`` tables or the parameter-server one) is registered as the
submodule ``embeddings`` (and an optional dim-1 one as ``wide``), so ``model.embeddings`` works and a local
collection's tables move with ``.to()`` and appear in ``state_dict()``. Its rows are *not* dense parameters:

- ``dense_parameters()`` / ``dense_named_parameters()``: what the dense optimizer and all-reduce see
  (everything outside ``embeddings.`` and ``wide.``);
- ``embedding_parameter_names()``: fully qualified names of the collections' own parameters, e.g. to hand to
  ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` so DDP leaves them alone (a
  parameter-server collection should hold no ``nn.Parameter`` at all; a local one trained by DDP may);
- ``dense_state_dict()`` / ``load_dense_state_dict()``: the dense checkpoint, without tables.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from tigana.trainer.types import EmbeddingCollection, SparseFeatures

__all__ = ["EMBEDDING_PREFIXES", "CTRModel"]

EMBEDDING_PREFIXES = ("embeddings.", "wide.")


class CTRModel(nn.Module):
    """Base class: ``forward(dense (B, num_dense) float32, sparse) -> logits (B,)``.

    Subclasses implement ``interact(dense, emb (B, F, D), wide (B, F, 1) | None) -> (B,)``.
    Like any nn.Module, not safe for concurrent training steps from several threads.
    """

    def __init__(self, embeddings: EmbeddingCollection, num_dense: int,
                 wide: EmbeddingCollection | None = None) -> None:
        super().__init__()
        for what, coll in (("embeddings", embeddings), ("wide", wide)):
            if coll is not None and not (hasattr(coll, "feature_names") and hasattr(coll, "dim") and callable(coll)):
                raise TypeError(f"{what} must be an embedding collection (feature_names, dim, __call__)")
        if num_dense < 0:
            raise ValueError(f"num_dense must be non-negative, got {num_dense}")
        if wide is not None:
            if wide.dim != 1:
                raise ValueError(f"the wide collection must have dim 1, it has {wide.dim}")
            if list(wide.feature_names) != list(embeddings.feature_names):
                raise ValueError("the wide collection must hold the same features, in the same order, as embeddings")
        self.embeddings = embeddings
        self.wide = wide
        self.num_dense = num_dense
        self.num_sparse = len(embeddings.feature_names)
        self.dim = embeddings.dim

    def forward(self, dense: torch.Tensor, sparse: SparseFeatures) -> torch.Tensor:
        b = sparse.batch_size
        if dense.dim() != 2 or dense.shape[0] != b or dense.shape[1] != self.num_dense:
            raise ValueError(f"dense has shape {tuple(dense.shape)}, expected ({b}, {self.num_dense})")
        emb = self.embeddings(sparse)  # (B, F, D)
        if emb.shape != (b, self.num_sparse, self.dim):
            raise ValueError(f"the collection returned {tuple(emb.shape)}, expected ({b}, {self.num_sparse}, {self.dim})")
        wide = self.wide(sparse) if self.wide is not None else None  # (B, F, 1)
        return self.interact(dense, emb, wide)  # (B,)

    def interact(self, dense: torch.Tensor, emb: torch.Tensor, wide: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def dense_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for name, p in self.named_parameters():
            if not name.startswith(EMBEDDING_PREFIXES):
                yield name, p

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """The model's own (dense) parameters: give these, not ``parameters()``, to the dense optimizer."""
        for _, p in self.dense_named_parameters():
            yield p

    def embedding_parameter_names(self) -> list[str]:
        return [name for name, _ in self.named_parameters() if name.startswith(EMBEDDING_PREFIXES)]

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """``state_dict()`` without the collections' entries, which are not even computed (a PS collection's
        would read its rows or write a cluster checkpoint)."""
        state: dict[str, torch.Tensor] = {}
        self._save_to_state_dict(state, "", keep_vars=False)
        for name, child in self.named_children():
            if f"{name}." not in EMBEDDING_PREFIXES:
                state.update(child.state_dict(prefix=f"{name}."))
        return state

    def load_dense_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a ``dense_state_dict``; every dense key must be present and no table key may be."""
        expected = set(self.dense_state_dict())
        if set(state) != expected:
            raise ValueError(f"dense state mismatch: missing {sorted(expected - set(state))}, "
                             f"unexpected {sorted(set(state) - expected)}")
        self.load_state_dict(state, strict=False)
