"""DCN-v2 (Wang et al., 2021): explicit feature crosses of bounded degree, then (or beside) an MLP.

::

    x0 = concat(e_1 .. e_F, x)   (B, d),  d = F D + nd
        │
        ├─► cross 1 ─► cross 2 ─► ... ─► cross L ─┐   x_{l+1} = x0 * (W_l x_l + b_l) + x_l
        │                                         │   (W_l: d x d, or U_l V_l^T of rank r)
        │   stacked:  x_L ─► MLP ─► Linear ─► logit
        └── parallel: concat(x_L, MLP(x0)) ─► Linear ─► logit

Layer l holds polynomial crosses of x0 up to degree l + 1; the residual keeps lower degrees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from tigana.trainer.models.base import CTRModel
from tigana.trainer.models.layers import MLP, CrossNetwork
from tigana.trainer.types import EmbeddingCollection

__all__ = ["DCNv2"]


class DCNv2(CTRModel):
    """DCN-v2 over ``embeddings`` (B, F, D) and ``num_dense`` numeric features; returns logits (B,).

    num_cross: cross layers; low_rank: rank r of each W_l (None: full d x d); structure: stacked or parallel.
    """

    def __init__(self, embeddings: EmbeddingCollection, num_dense: int, *, num_cross: int = 3,
                 low_rank: int | None = None, hidden: Sequence[int] = (256, 128), dropout: float = 0.0,
                 structure: Literal["stacked", "parallel"] = "stacked",
                 wide: EmbeddingCollection | None = None) -> None:
        super().__init__(embeddings, num_dense, wide)
        if structure not in ("stacked", "parallel"):
            raise ValueError(f"structure must be 'stacked' or 'parallel', got {structure!r}")
        self.structure = structure
        width = self.num_sparse * self.dim + num_dense
        self.cross = CrossNetwork(width, num_cross, low_rank)
        self.deep = MLP(width, hidden, dropout=dropout)
        head_in = self.deep.out_features + (width if structure == "parallel" else 0)
        self.head = nn.Linear(head_in, 1)

    def interact(self, dense: torch.Tensor, emb: torch.Tensor, wide: torch.Tensor | None) -> torch.Tensor:
        x0 = torch.cat([emb.flatten(1), dense], dim=1)  # (B, d)
        crossed = self.cross(x0)  # (B, d)
        if self.structure == "stacked":
            h = self.deep(crossed)  # (B, hidden[-1])
        else:
            h = torch.cat([crossed, self.deep(x0)], dim=1)  # (B, d + hidden[-1])
        logits = self.head(h).squeeze(-1)  # (B,)
        if wide is not None:
            logits = logits + wide.sum(dim=(1, 2))  # (B,)
        return logits
