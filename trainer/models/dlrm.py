"""DLRM (Naumov et al., 2019) with the dot interaction.

::

    dense x (B, nd) ──► bottom MLP ──► z (B, D) ─┐
    sparse ids ──► collection ──► e_1..e_F ──────┤ vectors (B, 1 + F, D)
                                                 ▼
                                  dot interaction: <v_i, v_j>, i < j   (B, (F+1) F / 2)
                                                 ▼
                                  concat(z, pairs) ──► top MLP ──► 1 ──► logit

    logit = top( [ z ; (<v_i, v_j>)_{i<j} ] ),  z = bottom(x),  v = (z, e_1, ..., e_F)

The bottom MLP ends at width D (= the collection's dim) so z can be dotted with the embeddings. Without
dense features there is no bottom MLP and only the F embeddings interact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tigana.trainer.models.base import CTRModel
from tigana.trainer.models.layers import MLP, dot_interaction
from tigana.trainer.types import EmbeddingCollection

__all__ = ["DLRM"]


class DLRM(CTRModel):
    """DLRM over ``embeddings`` (B, F, D) and ``num_dense`` numeric features; returns logits (B,).

    bottom: hidden widths of the bottom MLP before its final width-D layer; top: hidden widths of the top MLP.
    """

    def __init__(self, embeddings: EmbeddingCollection, num_dense: int, *, bottom: Sequence[int] = (64,),
                 top: Sequence[int] = (256, 128), dropout: float = 0.0,
                 wide: EmbeddingCollection | None = None) -> None:
        super().__init__(embeddings, num_dense, wide)
        d = self.dim
        self.bottom = MLP(num_dense, [*bottom, d], dropout=0.0) if num_dense else None
        n = self.num_sparse + (1 if num_dense else 0)
        top_in = n * (n - 1) // 2 + (d if num_dense else 0)
        self.top = MLP(top_in, top, 1, dropout=dropout)

    def interact(self, dense: torch.Tensor, emb: torch.Tensor, wide: torch.Tensor | None) -> torch.Tensor:
        if self.bottom is None:
            pairs = dot_interaction(emb)  # (B, F(F-1)/2)
            top_in = pairs
        else:
            z = self.bottom(dense)  # (B, D)
            pairs = dot_interaction(torch.cat([z.unsqueeze(1), emb], dim=1))  # (B, (F+1)F/2)
            top_in = torch.cat([z, pairs], dim=1)  # (B, D + (F+1)F/2)
        logits = self.top(top_in).squeeze(-1)  # (B,)
        if wide is not None:
            logits = logits + wide.sum(dim=(1, 2))  # (B,)
        return logits
