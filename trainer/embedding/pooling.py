"""Pooling the pulled rows into bags, and the autograd function whose backward turns the bags' gradient
into one gradient row per distinct id and hands it to the collection to push."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from tigana.trainer.embedding.plan import _Plan

if TYPE_CHECKING:
    from tigana.trainer.embedding.collection import PSEmbeddingBags


def _pool(rows: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """(U, dim) stacked rows -> (F*B, dim) pooled bags."""
    if plan.single_hot:
        return rows.index_select(0, plan.index)
    return F.embedding_bag(plan.index, rows, plan.offsets, mode="sum", per_sample_weights=plan.weights)


class _PooledLookup(torch.autograd.Function):
    """Pool the pulled rows; backward turns the bags' gradient into one gradient row per distinct id (a
    segmented sum over the plan's grouping, no scatter) and hands it to the collection, which pushes it.
    ``anchor`` (requires grad) is what makes autograd call backward; the rows themselves are plain data."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, rows: torch.Tensor, owner: PSEmbeddingBags,
                plan: _Plan) -> torch.Tensor:
        ctx.owner, ctx.plan, ctx.num_rows = owner, plan, rows.shape[0]
        return _pool(rows, plan)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        plan = ctx.plan
        grad = grad.contiguous()
        if plan.single_hot:
            per_value = grad  # bag i holds value i
        else:
            per_value = grad.index_select(0, plan.bag_of_value)
            if plan.weights is not None:
                per_value = per_value * plan.weights.unsqueeze(1)
        if per_value.shape[0]:
            row_grads = F.embedding_bag(plan.order, per_value, plan.row_starts, mode="sum")
        else:
            row_grads = grad.new_zeros(ctx.num_rows, grad.shape[1])
        ctx.owner._push(plan, row_grads)
        return None, None, None, None
