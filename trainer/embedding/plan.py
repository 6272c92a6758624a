"""A batch's plan: the distinct ids each table needs and where each value's row sits, computed once per
batch on the CPU (the forward pools with it, the backward groups the gradient by it, pulls and pushes send its
ids); and the ids as the PS tables key them (salted per table in a fused table)."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from tigana.trainer._kernels import group_ids, group_segments
from tigana.trainer.data.hashing import mix64
from tigana.trainer.types import SparseFeatures


@dataclass
class _Plan:
    """What one batch needs from the tables: distinct ids per table and where each value's row sits.

    N values of F*B bags; the rows of every table are stacked, table after table, into (U, dim), U = sum U_t.
    """

    unique: list[np.ndarray]          # per table: (U_t,) int64 distinct ids, in first-seen order
    index: torch.Tensor               # (N,) int64 stacked row of each value
    offsets: torch.Tensor             # (F*B,) int64 bag starts in the values
    weights: torch.Tensor | None      # (N,) float32 per-value weights (1/len of its bag for mean pooling, times
                                      # the batch's per-id weights when it has them)
    order: torch.Tensor               # (N,) int64 the values grouped by row: values of row 0 first, ...
    row_starts: torch.Tensor          # (U,) int64 start of each row's group in ``order``
    bag_of_value: torch.Tensor | None  # (N,) int64 bag of each value (multi-hot batches only)
    batch_size: int
    single_hot: bool                  # every bag holds exactly one id
    ps_ids: list[np.ndarray] | None = None  # the distinct ids as the PS tables key them (set once, by _ps_ids)


def _plan_on(plan: _Plan, device: torch.device) -> _Plan:
    """The plan's tensors on ``device`` (the distinct ids stay on the CPU, for the client)."""
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    return dataclasses.replace(plan, index=move(plan.index), offsets=move(plan.offsets), weights=move(plan.weights),
                               order=move(plan.order), row_starts=move(plan.row_starts),
                               bag_of_value=move(plan.bag_of_value))


def _table_salt(name: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))


def _salted(ids: np.ndarray, salt: np.uint64) -> np.ndarray:
    """A logical table's ids -> ids in a fused table: splitmix64(id ^ salt), a bijection per table, so distinct
    ids stay distinct and two tables' ids meet only by a 2**-64 chance."""
    return mix64(ids.view(np.uint64) ^ salt).view(np.int64)


def _group(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(n,) int64 -> (distinct ids in first-seen order, inverse (n,), order (n,) grouping equal ids, group
    starts in order): one hash pass and a counting sort (``_kernels.group_ids``), no sort."""
    return group_ids(ids)


class _Planner:
    """The planning half of ``PSEmbeddingBags`` (which sets every attribute annotated here)."""

    feature_names: list[str]
    fused_table: str | None
    _features_of_table: list[list[int]]
    _table_per_feature: bool
    _mean: torch.Tensor
    _any_mean: bool
    _salts: list[np.uint64]

    def _plan(self, sparse: SparseFeatures) -> _Plan:
        """The plan of ``sparse`` (checked against the collection's features): its distinct ids per table and
        each value's stacked row, grouped by row for the backward."""
        if list(sparse.keys) != self.feature_names:
            raise ValueError(f"sparse features {list(sparse.keys)} do not match the collection's "
                             f"{self.feature_names}")
        values, lengths = sparse.values, sparse.lengths
        if values.dtype != torch.int64 or lengths.dtype != torch.int64:
            raise ValueError(f"sparse values and lengths must be int64, got {values.dtype} and {lengths.dtype}")
        nf = len(self.feature_names)
        if lengths.numel() % nf:
            raise ValueError(f"sparse lengths has {lengths.numel()} entries, not a multiple of {nf} features")
        b = lengths.numel() // nf
        if int(lengths.sum()) != values.numel():
            raise ValueError(f"sparse lengths sum to {int(lengths.sum())} but there are {values.numel()} values")
        per_feature = lengths.view(nf, b).sum(1).tolist()
        starts_of_feature = np.concatenate([[0], np.cumsum(per_feature)])
        values_np = values.numpy()
        unique: list[np.ndarray] = []
        index = np.empty(values.numel(), dtype=np.int64)
        order_parts, start_parts = [], []
        rows_before = values_before = 0
        if self._table_per_feature:  # the values are already table after table: one kernel call for all
            uniq, index, order, row_starts, counts = group_segments(values_np, starts_of_feature)
            unique = np.split(uniq, np.cumsum(counts)[:-1])
            order_parts, start_parts = [order], [row_starts]
        for feats in () if self._table_per_feature else self._features_of_table:
            # positions (into values) of this table's values, feature after feature
            spans = [(int(starts_of_feature[f]), int(starts_of_feature[f + 1])) for f in feats]
            if len(spans) == 1:
                positions = None
                ids = values_np[spans[0][0]:spans[0][1]]
            else:
                positions = np.concatenate([np.arange(a, z) for a, z in spans])
                ids = values_np[positions]
            uniq, inverse, order, group_starts = _group(ids)
            if positions is None:
                index[spans[0][0]:spans[0][1]] = inverse + rows_before
                order_parts.append(order + spans[0][0])
            else:
                index[positions] = inverse + rows_before
                order_parts.append(positions[order])
            start_parts.append(group_starts + values_before)
            values_before += ids.shape[0]
            unique.append(uniq)
            rows_before += uniq.shape[0]
        offsets = torch.cumsum(lengths, 0) - lengths
        per_id = sparse.weights
        if per_id is not None:
            if per_id.shape != values.shape or not per_id.is_floating_point():
                raise ValueError(f"sparse weights must be floats shaped like the values {tuple(values.shape)}, "
                                 f"got {per_id.dtype} {tuple(per_id.shape)}")
            per_id = per_id.detach().to("cpu", torch.float32)
        # a weighted batch pools through embedding_bag's per-sample weights, never the single-hot gather
        single_hot = per_id is None and values.numel() == lengths.numel() and bool((lengths == 1).all())
        weights = bag_of_value = None
        if not single_hot:
            bag_of_value = torch.repeat_interleave(torch.arange(lengths.numel()), lengths,
                                                   output_size=values.numel())
            if self._any_mean:
                per_bag = torch.where(self._mean.repeat_interleave(b), 1.0 / lengths.clamp(min=1).float(),
                                      torch.ones(lengths.numel()))
                weights = per_bag.index_select(0, bag_of_value)
            if per_id is not None:  # (N,) each row times its id's weight, in the forward and in its gradient
                weights = per_id if weights is None else weights * per_id
        cat = np.concatenate
        return _Plan(unique=unique, index=torch.from_numpy(index), offsets=offsets, weights=weights,
                     order=torch.from_numpy(cat(order_parts) if len(order_parts) > 1 else order_parts[0]),
                     row_starts=torch.from_numpy(cat(start_parts) if len(start_parts) > 1 else start_parts[0]),
                     bag_of_value=bag_of_value, batch_size=b, single_hot=single_hot)

    def _ps_ids(self, plan: _Plan) -> list[np.ndarray]:
        """The plan's distinct ids per PS table (one fused block, or one per table), in stacked row order;
        computed once per plan (the pull, the push and the cache all need them)."""
        if plan.ps_ids is None:
            plan.ps_ids = [self._fused_ids(plan.unique)] if self.fused_table is not None else plan.unique
        return plan.ps_ids

    def _fused_ids(self, ids: list[np.ndarray]) -> np.ndarray:
        """The physical ids of every logical table's ``ids`` in the fused table, stacked table after table."""
        return np.concatenate([_salted(t_ids, salt) for t_ids, salt in zip(ids, self._salts, strict=True)])
