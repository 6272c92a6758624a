"""Pieces the CTR models share: MLPs, the FM and dot interactions, the DCN-v2 cross layer, first-order terms.

All are plain torch modules/functions over whole batches; shapes are noted per line (B batch, F fields,
D embedding width).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["MLP", "CrossNetwork", "FirstOrder", "NumericFields", "dot_interaction", "fm_interaction"]


class MLP(nn.Sequential):
    """Linear -> ReLU (-> Dropout) per hidden width, then a final Linear to ``out_dim`` when given
    (no activation after it). ``out_features`` is the width of what it returns."""

    def __init__(self, in_dim: int, hidden: Sequence[int], out_dim: int | None = None, *, dropout: float = 0.0) -> None:
        layers: list[nn.Module] = []
        width = in_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        if out_dim is not None:
            layers.append(nn.Linear(width, out_dim))
            width = out_dim
        super().__init__(*layers)
        self.out_features = width


def fm_interaction(fields: torch.Tensor) -> torch.Tensor:
    """Factorization-machine second-order term: sum over field pairs i<j of <v_i, v_j>.

    fields (B, F, D) -> (B,); computed in O(F D) as 1/2 * sum_d [(sum_i v_id)^2 - sum_i v_id^2].
    """
    square_of_sum = fields.sum(dim=1).pow(2)  # (B, D)
    sum_of_square = fields.pow(2).sum(dim=1)  # (B, D)
    return 0.5 * (square_of_sum - sum_of_square).sum(dim=1)  # (B,)


def dot_interaction(vectors: torch.Tensor) -> torch.Tensor:
    """DLRM's dot interaction: the pairwise inner products <x_i, x_j>, i < j.

    vectors (B, n, D) -> (B, n (n-1) / 2), pairs in row-major order of the strict upper triangle.
    """
    n = vectors.shape[1]
    gram = torch.bmm(vectors, vectors.transpose(1, 2))  # (B, n, n)
    rows, cols = torch.triu_indices(n, n, offset=1, device=vectors.device)
    return gram[:, rows, cols]  # (B, n(n-1)/2)


class NumericFields(nn.Module):
    """Dense features as fields of an FM: numeric feature k becomes x_k * v_k with a learned v_k.

    dense (B, num_dense) -> (B, num_dense, D).
    """

    def __init__(self, num_dense: int, dim: int) -> None:
        super().__init__()
        self.vectors = nn.Parameter(torch.randn(num_dense, dim) * 0.01)  # (num_dense, D)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return dense.unsqueeze(-1) * self.vectors  # (B, num_dense, D)


class FirstOrder(nn.Module):
    """The linear ("wide", first-order) part: bias + w . dense + a per-id scalar summed over the fields.

    The per-id scalars come from ``wide`` (B, F, 1), the output of a dim-1 embedding collection, when the
    model has one; otherwise from a learned per-field projection of the shared embeddings,
    sum_f <a_f, e_f>, which needs no second table (the rows are free parameters, so each row can carry
    its own scalar along a_f) and so no second parameter-server round trip.
    """

    def __init__(self, num_dense: int, num_fields: int, dim: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1))
        self.dense = nn.Linear(num_dense, 1, bias=False) if num_dense else None
        self.projection = nn.Parameter(torch.randn(num_fields, dim) * 0.01)  # (F, D)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor, wide: torch.Tensor | None) -> torch.Tensor:
        if wide is not None:
            out = wide.sum(dim=(1, 2))  # (B,)
        else:
            out = (emb * self.projection).sum(dim=(1, 2))  # (B,)
        if self.dense is not None:
            out = out + self.dense(dense).squeeze(-1)  # (B,)
        return out + self.bias  # (B,)


class CrossNetwork(nn.Module):
    """DCN-v2 cross layers: x_{l+1} = x_0 * (W_l x_l + b_l) + x_l, with W_l full (d x d) or low rank U_l V_l^T.

    x0 (B, d) -> (B, d).
    """

    def __init__(self, width: int, num_layers: int, low_rank: int | None = None) -> None:
        super().__init__()
        if low_rank is None:
            self.maps = nn.ModuleList(nn.Linear(width, width) for _ in range(num_layers))
        else:
            self.maps = nn.ModuleList(nn.Sequential(nn.Linear(width, low_rank, bias=False), nn.Linear(low_rank, width))
                                      for _ in range(num_layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for linear in self.maps:
            x = x0 * linear(x) + x  # (B, d)
        return x
