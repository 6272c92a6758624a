"""DeepFM (Guo et al., 2017): a factorization machine and an MLP over the same field embeddings.

::

    sparse ids ──► collection ──► e_1 .. e_F ─┐           (B, F, D)
    dense x    ──► x_k * v_k ───► e_F+1 ..    ┤ fields    (B, F + num_dense, D)
                                              ├─► FM: sum_{i<j} <e_i, e_j> ──────────┐
                                              ├─► flatten ─► MLP ─► 1 ───────────────┤ + ─► logit
    first order: b + w.x + sum_f s_f(id) ─────────────────────────────────────────────┘

    logit = b + w.x + sum_f s_f  +  1/2 sum_d [(sum_i e_id)^2 - sum_i e_id^2]  +  MLP(concat_i e_i)

Every numeric feature is a field of its own (its value times a learned vector), as in the paper's Criteo
setup. s_f, the per-id first-order scalars, come from the optional dim-1 ``wide`` collection, or by default
from a per-field projection of the shared embedding (see ``layers.FirstOrder``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tigana.trainer.models.base import CTRModel
from tigana.trainer.models.layers import MLP, FirstOrder, NumericFields, fm_interaction
from tigana.trainer.types import EmbeddingCollection

__all__ = ["DeepFM"]


class DeepFM(CTRModel):
    """DeepFM over ``embeddings`` (B, F, D) and ``num_dense`` numeric features; returns logits (B,)."""

    def __init__(self, embeddings: EmbeddingCollection, num_dense: int, *, hidden: Sequence[int] = (256, 128),
                 dropout: float = 0.0, wide: EmbeddingCollection | None = None) -> None:
        super().__init__(embeddings, num_dense, wide)
        d, fields = self.dim, self.num_sparse + num_dense
        self.numeric = NumericFields(num_dense, d) if num_dense else None
        self.first_order = FirstOrder(num_dense, self.num_sparse, d)
        self.deep = MLP(fields * d, hidden, 1, dropout=dropout)

    def interact(self, dense: torch.Tensor, emb: torch.Tensor, wide: torch.Tensor | None) -> torch.Tensor:
        fields = emb if self.numeric is None else torch.cat([emb, self.numeric(dense)], dim=1)  # (B, F+nd, D)
        first = self.first_order(dense, emb, wide)  # (B,)
        second = fm_interaction(fields)  # (B,)
        deep = self.deep(fields.flatten(1)).squeeze(-1)  # (B, (F+nd) D) -> (B,)
        return first + second + deep  # (B,)
