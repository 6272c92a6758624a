"""The push side of ``PSEmbeddingBags``: a step's row gradients, scaled, counted by the hot-row cache
and sent to the PS tables (summed at the node leader first with an ``aggregate_group``; through the table's
compressor when it has one)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tigana.trainer.cache import RowCache
from tigana.trainer.compression import AdaptiveCompressor
from tigana.trainer.embedding.aggregate import _aggregate
from tigana.trainer.embedding.plan import _Plan

_PUSH_LOG = 8  # own pushes per PS table remembered for the lag of the pulls in flight


class _PushSide:
    """The push half of ``PSEmbeddingBags`` (which sets every attribute annotated here and defines
    ``_ps_ids``, ``_fused_ids``, ``_set_codecs`` and ``_timed``)."""

    client: Any
    tables: list[str]
    ps_tables: list[str]
    fused_table: str | None
    grad_scale: float
    caches: dict[str, RowCache]
    compressors: dict[str, AdaptiveCompressor]
    pushed_rows: int
    _aggregate_group: dist.ProcessGroup | None
    _push_no: dict[str, int]
    _push_log: dict[str, deque[tuple[int, np.ndarray]]]

    def _push(self, plan: _Plan, grad: torch.Tensor) -> None:
        grad = grad.detach().cpu()
        if self.grad_scale != 1.0:
            grad = grad * self.grad_scale
        grads = list(torch.split(grad, [u.shape[0] for u in plan.unique]))
        for table, own in zip(self.ps_tables, self._ps_ids(plan), strict=True):
            self._note_push(table, own)  # this trainer's contribution, whoever sends it
        if self.fused_table is not None and self._aggregate_group is None:
            # the gradient rows are already stacked in the order of the fused ids: no split and join
            if grad.shape[0]:
                self._send(self.fused_table, self._ps_ids(plan)[0], grad.numpy(), unique=True)
            return
        ids = [torch.from_numpy(u) for u in plan.unique]
        if self._aggregate_group is not None:
            ids, grads = _aggregate(ids, grads, self._aggregate_group, self.dim)
        if self.fused_table is not None:
            if sum(t.numel() for t in ids):
                fused = self._ps_ids(plan)[0] if self._aggregate_group is None else \
                    self._fused_ids([t.numpy() for t in ids])
                self._send(self.fused_table, fused, torch.cat(grads).numpy())
            return
        self._send_all([(table, t_ids.numpy(), t_grads.numpy())
                        for table, t_ids, t_grads in zip(self.tables, ids, grads, strict=True) if t_ids.numel()],
                       unique=self._aggregate_group is None)

    def _note_push(self, table: str, ids: np.ndarray) -> None:
        """One own push of ``ids`` to ``table``: counted by its cache and remembered for the lag of pulls in
        flight."""
        self._push_no[table] += 1
        cache = self.caches.get(table)
        if cache is not None:
            cache.pushed(ids)
            self._push_log[table].append((self._push_no[table], np.sort(ids)))

    def _send(self, table: str, ids: np.ndarray, grads: np.ndarray, unique: bool = False) -> None:
        """Push ``grads`` of ``ids`` to PS table ``table`` (through its compressor when it has one)."""
        self._send_all([(table, ids, grads)], unique=unique)

    def _send_all(self, pushes: list[tuple[str, np.ndarray, np.ndarray]], unique: bool) -> None:
        """Push each (table, ids, grads), through the table's compressor when it has one, in one client call:
        one message to each server for every table's part. ``unique``: each ids array is distinct (a plan's)."""
        tables, all_ids, all_grads = [], [], []
        for table, ids, grads in pushes:
            comp = self.compressors.get(table)
            if comp is not None:
                plan = comp.plan_push(ids, grads)
                ids, grads = plan.ids, plan.grads
                self._set_codecs(table, push=plan.codec)
            if ids.shape[0]:
                tables.append(table)
                all_ids.append(ids)
                all_grads.append(np.ascontiguousarray(grads, dtype=np.float32))
        if not tables:
            return
        start = time.perf_counter()
        futs = self.client.push_many(tables, all_ids, all_grads, unique=unique)
        for ids, fut in zip(all_ids, futs, strict=True):
            self._timed("push", fut, start, ids.shape[0])
            self.pushed_rows += ids.shape[0]
