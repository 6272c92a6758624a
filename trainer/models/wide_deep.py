"""Wide & Deep (Cheng et al., 2016): a linear model and an MLP trained jointly.

::

    wide:  b + w.x + sum_f s_f(id_f) ─────────────────────────────┐
                                                                  + ─► logit
    deep:  concat(e_1 .. e_F, x) (B, F D + nd) ──► MLP ──► 1 ─────┘

    logit = b + w.x + sum_f s_f  +  MLP([e_1; ...; e_F; x])

The wide part's per-id weights s_f: pass a dim-1 collection over the same features as ``wide`` for the
classic separate weights (on the parameter server: a second set of dim-1 tables, one more pull per batch).
Without it (the default) s_f = <a_f, e_f>, a learned per-field projection of the deep part's own rows: one
collection, one pull, and each row still carries its own scalar. Hand-made cross-product features of the
paper are not built in; add them as extra sparse features.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tigana.trainer.models.base import CTRModel
from tigana.trainer.models.layers import MLP, FirstOrder
from tigana.trainer.types import EmbeddingCollection

__all__ = ["WideDeep"]


class WideDeep(CTRModel):
    """Wide & Deep over ``embeddings`` (B, F, D) and ``num_dense`` numeric features; returns logits (B,)."""

    def __init__(self, embeddings: EmbeddingCollection, num_dense: int, *, hidden: Sequence[int] = (256, 128),
                 dropout: float = 0.0, wide: EmbeddingCollection | None = None) -> None:
        super().__init__(embeddings, num_dense, wide)
        self.linear = FirstOrder(num_dense, self.num_sparse, self.dim)
        self.deep = MLP(self.num_sparse * self.dim + num_dense, hidden, 1, dropout=dropout)

    def interact(self, dense: torch.Tensor, emb: torch.Tensor, wide: torch.Tensor | None) -> torch.Tensor:
        linear = self.linear(dense, emb, wide)  # (B,)
        deep = self.deep(torch.cat([emb.flatten(1), dense], dim=1)).squeeze(-1)  # (B, F D + nd) -> (B,)
        return linear + deep  # (B,)
