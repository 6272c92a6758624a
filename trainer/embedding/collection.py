"""``PSEmbeddingBags``: sparse features -> pooled rows, every table held by the parameter server.

The module itself: its tables (created, fused, with their caches and compressors), ``forward`` and
``prefetch``, and what a trainer asks of it (stats, inspection, flush). It plans batches (``plan``), pools
them (``pooling``), pulls (``pulls``) and pushes (``pushes``) through the rooms named so. Its state dict entries
are ``tigana.trainer.table_rows``'s, one ``PSTable`` per table (per fused PS table).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from tigana import ps
from tigana.trainer.cache import RowCache
from tigana.trainer.compression import AdaptiveCompressor
from tigana.trainer.embedding.options import TableOptions
from tigana.trainer.embedding.plan import _plan_on, _Planner, _salted, _table_salt
from tigana.trainer.embedding.pooling import _pool, _PooledLookup
from tigana.trainer.embedding.pulls import _Prefetch, _PullSide
from tigana.trainer.embedding.pushes import _PUSH_LOG, _PushSide
from tigana.trainer.table_rows import DEFAULT_STATE_DICT_ROWS, PSTable, check_state_dict
from tigana.trainer.types import FeatureSpec, SparseFeatures

__all__ = ["PSEmbeddingBags"]


def _to_device(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """(U, dim) pulled rows on ``device``: to a CUDA device from pinned (page-locked) memory with a
    non-blocking copy, so the copy overlaps whatever the host does next (the pooling kernels queue behind it
    on the stream); to any other device, a plain copy."""
    if device.type == "cuda":
        pinned = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        pinned.copy_(rows)
        return pinned.to(device, non_blocking=True)
    return rows.to(device)


class PSEmbeddingBags(_Planner, _PullSide, _PushSide, nn.Module):
    """Sparse features -> pooled rows, with every table held by the parameter server behind ``client``.

    features: one FeatureSpec per sparse feature, in the order batches list them (features may share a table)
    dim:      row width of every table
    options:  default TableOptions; ``table_options`` overrides them per table name
    aggregate_group: a node-local process group (ranks of this node only) for hierarchical sparse
              aggregation; None pushes from every rank directly
    grad_scale: factor applied to row gradients before they are pushed
    fused_table: store every table in this one PS table (ids salted per table, so the tables stay apart):
              a step then costs one pull and one push per shard instead of one per table; every table must
              have the same TableOptions
    num_embeddings: table name -> n for tables whose ids are all in [0, n) (the state dict's tensor size);
              other tables take any int64 id
    state_dict_rows, checkpoint_dir: how ``state_dict()`` saves the tables (below)
    table_state: False leaves the tables out of ``state_dict()``, for a module that holds this one and gives
              their entries itself (the TorchRec drop-ins do, under TorchRec's keys)

    Tables are created on construction (identical specs from several ranks are fine).

    ``state_dict()`` holds one entry per table, keyed ``embedding_bags.<table>.`` (a fused collection: one for
    its PS table, ``embedding_bags.<fused_table>.``), as ``tigana.trainer.table_rows`` describes: ``weight``,
    the (n, dim) rows of ids 0..n-1, for a table bounded by ``num_embeddings`` n <= ``state_dict_rows`` that
    holds no other id; otherwise ``_extra_state``, a cluster checkpoint written under ``checkpoint_dir`` (or,
    without one, a note that the rows stay on the cluster). ``load_state_dict`` writes them back (rows i as
    ids i, or the checkpoint restored), after checking every entry: a bad one raises ``ValueError`` naming
    the table, with nothing written. A model's ``dense_state_dict()`` leaves them out.
    """

    def __init__(self, client: Any, features: Sequence[FeatureSpec], dim: int, *,
                 options: TableOptions | None = None, table_options: Mapping[str, TableOptions] | None = None,
                 aggregate_group: dist.ProcessGroup | None = None, grad_scale: float = 1.0,
                 fused_table: str | None = None, create: bool = True,
                 num_embeddings: Mapping[str, int] | None = None, state_dict_rows: int = DEFAULT_STATE_DICT_ROWS,
                 checkpoint_dir: str | None = None, table_state: bool = True) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"dim must be positive, got {dim}")
        if not features:
            raise ValueError("a PSEmbeddingBags needs at least one feature")
        names = [f.name for f in features]
        if len(set(names)) != len(names):
            raise ValueError(f"feature names must be distinct, got {names}")
        self.client = client
        self.features = list(features)
        self.feature_names = names
        self.dim = int(dim)
        self.grad_scale = float(grad_scale)
        self.tables: list[str] = list(dict.fromkeys(f.table_name for f in features))
        default = options or TableOptions()
        table_options = dict(table_options or {})
        unknown = sorted(set(table_options) - set(self.tables))
        if unknown:
            raise ValueError(f"table_options name tables no feature reads: {unknown}")
        self.options: dict[str, TableOptions] = {t: table_options.get(t, default) for t in self.tables}
        self._features_of_table = [[i for i, f in enumerate(features) if f.table_name == t] for t in self.tables]
        self._table_per_feature = self._features_of_table == [[i] for i in range(len(features))]
        self._mean = torch.tensor([f.pooling == "mean" for f in features])
        self._any_mean = bool(self._mean.any())
        # The anchor makes autograd call _PooledLookup.backward; it is not a Parameter, so no optimizer sees it.
        self._anchor = torch.zeros((), requires_grad=True)
        # Follows .to(device): pooling runs where the model runs (ids, plans and pushes stay on the CPU).
        self.register_buffer("_device_marker", torch.empty(0), persistent=False)
        self.steps = 0  # training forwards (one push per table each)
        self._prefetched: list[_Prefetch] = []  # oldest first
        self._aggregate_group = aggregate_group
        self.pushed_rows = 0
        self.pulled_rows = 0
        self.cached_rows = 0  # rows training forwards read from the hot-row cache instead of pulling
        # (op, seconds, rows) for the trainer's metrics: "pull" and "push" from the call to the rows or the
        # acknowledgement (on a client callback thread), "pull_wait" the time a forward waited for its rows.
        self.observer: Callable[[str, float, int], None] | None = None
        self.fused_table = fused_table
        if fused_table is not None:
            distinct = set(self.options.values())
            if len(distinct) > 1:
                raise ValueError(f"fused_table {fused_table!r}: every table must have the same TableOptions to "
                                 f"share one PS table, got {len(distinct)} different ones")
            self._salts = [_table_salt(t) for t in self.tables]
        # The PS tables behind the logical ones, and per PS table its cache, compressor and own-push log.
        self.ps_tables: list[str] = [fused_table] if fused_table is not None else list(self.tables)
        self.caches: dict[str, RowCache] = {}
        self.compressors: dict[str, AdaptiveCompressor] = {}
        self._push_no = {t: 0 for t in self.ps_tables}
        # (push number, sorted distinct ids) of the last pushes: the lag of rows pulled before them
        self._push_log: dict[str, deque[tuple[int, np.ndarray]]] = {t: deque(maxlen=_PUSH_LOG) for t in self.ps_tables}
        for table in self.ps_tables:
            o = self._options_of(table)
            if o.cache_rows:
                if aggregate_group is not None:
                    raise ps.InvalidArgument(f"table {table!r}: field 'cache_rows' needs the pushes of this rank "
                                             "sent by this rank (no aggregate_group): the cache counts them")
                self.caches[table] = RowCache(o.cache_rows, self.dim, o.staleness, max_age=o.cache_max_age,
                                              policy=o.cache_policy, table=table)
            if o.compression == "adaptive":
                self.compressors[table] = AdaptiveCompressor(self.dim, o.adaptive, table=table)
        self._state_tables = self._table_entries(num_embeddings or {}, state_dict_rows, checkpoint_dir) \
            if table_state else {}
        if create:
            for table in self.ps_tables:
                self._create(table)

    def _table_entries(self, num_embeddings: Mapping[str, int], max_rows: int, checkpoint_dir: str | None
                       ) -> dict[str, PSTable]:
        """The state dict entry of each table (of the fused PS table), by key: not child modules, so table
        names need not be attribute names."""
        unknown = sorted(set(num_embeddings) - set(self.tables))
        if unknown:
            raise ValueError(f"num_embeddings names tables no feature reads: {unknown}")
        bad = {t: n for t, n in num_embeddings.items() if int(n) < 1}
        if bad:
            raise ValueError(f"num_embeddings must be positive, got {bad}")
        if max_rows < 0:
            raise ValueError(f"state_dict_rows must be >= 0, got {max_rows}")
        if self.fused_table is not None:  # one PS table, one entry: its rows are saved together
            return {self.fused_table: PSTable(self, self.fused_table, self.tables[0], None, self.dim,
                                              max_rows=max_rows, checkpoint_dir=checkpoint_dir)}
        return {t: PSTable(self, t, t, num_embeddings.get(t), self.dim, max_rows=max_rows,
                           checkpoint_dir=checkpoint_dir) for t in self.tables}

    # ------------------------------------------------------------------ tables
    def _options_of(self, table: str) -> TableOptions:
        return self.options[self.tables[0]] if table == self.fused_table else self.options[table]

    def _create(self, table: str) -> None:
        o = self._options_of(table)
        # The client's bound counts its own pushes before the pull is sent. A prefetched pull for step t+1 is
        # sent before step t pushes, so the client's k-1 is this table's k (and a stricter k-1 for a pull
        # sent at its own step). With a cache, pulls reflect every push issued before them (bound 0) and the
        # cache spends the table's k.
        staleness = 0 if table in self.caches else max(o.staleness - 1, 0)
        codec = None if o.compression in (None, "adaptive") else o.compression
        self.client.create_table(table, dim=self.dim, optimizer=o.optimizer, initializer=o.initializer,
                                 seed=o.seed, staleness=staleness, compression=codec, durability=o.durability)

    @property
    def min_staleness(self) -> int:
        return min(o.staleness for o in self.options.values())

    # ------------------------------------------------------------------ client calls (pulls and pushes)
    def _set_codecs(self, table: str, push: str | None = None) -> None:
        """Point the client's codecs of ``table`` at what its compressor chose (no-op without one)."""
        comp = self.compressors.get(table)
        if comp is not None:
            self.client.set_compression(table, {"pull": comp.pull_codec, "push": push or comp.push_dir.codec()})

    def _timed(self, op: str, fut: Any, start: float, rows: int) -> Any:
        """``fut``, reporting to ``observer`` how long it took from ``start`` once it is done."""
        observer = self.observer
        if observer is not None:
            fut.add_done_callback(lambda _: observer(op, time.perf_counter() - start, rows))
        return fut

    # ------------------------------------------------------------------ forward
    def prefetch(self, sparse: SparseFeatures) -> None:
        """Start pulling the rows of ``sparse`` now, for the next ``forward(sparse)`` (the same object).

        A no-op unless every table's staleness is at least 1. The training loop calls it with batch t+1 before
        (or while) running step t. Rows prefetched further ahead than the next step would break the staleness
        bound, so such a prefetch is pulled again at its forward; at most two prefetches are kept. Like
        ``forward``, a prefetch with gradients disabled (evaluation) pulls read-only; a forward in the other
        mode pulls again."""
        if self.min_staleness < 1 or any(p.batch is sparse for p in self._prefetched):
            return
        while len(self._prefetched) >= 2:
            self._finish(self._prefetched.pop(0))
        plan = self._plan(sparse)
        insert = torch.is_grad_enabled()
        if insert and self.caches:
            # The rows already on their way go into the cache first, so this batch can be served from them.
            for p in self._prefetched:
                for f in p.fetches:
                    self._absorb(f, self._prefetched)
        self._prefetched.append(_Prefetch(sparse, plan, self._issue_pulls(plan, insert, self._prefetched),
                                          self.steps, insert))

    def forward(self, sparse: SparseFeatures) -> torch.Tensor:
        """(B, F, dim) float32 pooled rows, features in ``feature_names`` order.

        With gradients enabled (training) the pulls insert the rows the backward pushes to; without
        (evaluation) they are read-only: missing ids read as their initial rows and the tables do not grow."""
        training = torch.is_grad_enabled()
        pre = next((p for p in self._prefetched if p.batch is sparse), None)
        if pre is not None:
            self._prefetched.remove(pre)
            # Pulled after ``pre.steps`` steps; its client-side bound assumed it serves step pre.steps + 2 at
            # latest. A prefetch of the other mode (read-only for training, inserting for evaluation) is pulled
            # again.
            if pre.insert != training or (training and self.steps + 1 - pre.steps > 2):
                self._finish(pre)
                pre = None
        if pre is not None:
            plan, fetches = pre.plan, pre.fetches
        else:
            plan = self._plan(sparse)
            fetches = self._issue_pulls(plan, insert=training)
        rows = self._collect(plan, fetches, training, self._prefetched)
        device = self._device_marker.device
        if device.type != "cpu":
            plan = _plan_on(plan, device)
            rows = _to_device(rows, device)
        if training:
            self.steps += 1
            pooled = _PooledLookup.apply(self._anchor, rows, self, plan)
        else:
            pooled = _pool(rows, plan)
        return pooled.view(len(self.feature_names), plan.batch_size, self.dim).transpose(0, 1)

    # ------------------------------------------------------------------ what a trainer asks of it
    def observe_loss(self, loss: float) -> None:
        """A training step's loss, for the accuracy guard of adaptive compression (no-op without it)."""
        for comp in self.compressors.values():
            comp.observe_loss(float(loss))

    def stats(self) -> dict[str, Any]:
        """Rows pulled, pushed and served by the cache, and per PS table its cache's and compressor's counters."""
        return {"pulled_rows": self.pulled_rows, "pushed_rows": self.pushed_rows, "cached_rows": self.cached_rows,
                "cache": {t: c.stats() for t, c in self.caches.items()},
                "compression": {t: c.stats() for t, c in self.compressors.items()}}

    def ps_ids(self, table: str, ids: np.ndarray | torch.Tensor) -> tuple[str, np.ndarray]:
        """(the PS table, its int64 ids) that logical table ``table``'s ``ids`` are stored under: the table
        itself, or the fused table with the ids salted per table."""
        if table not in self.tables:
            raise ValueError(f"no table named {table!r} (tables: {self.tables})")
        ids = np.ascontiguousarray(torch.as_tensor(ids).numpy(), dtype=np.int64)
        if self.fused_table is None:
            return table, ids
        return self.fused_table, _salted(ids, self._salts[self.tables.index(table)])

    def table_rows(self, table: str, ids: np.ndarray | torch.Tensor) -> np.ndarray:
        """(n, dim) float32 current rows of logical table ``table`` for int64 ``ids`` (through the fused table
        when there is one): an inspection, so a read-only pull (ids the table lacks read as their initial rows
        and are not inserted, nor counted toward admission). It does not wait for this collection's pushes;
        ``flush`` first."""
        physical, ids = self.ps_ids(table, ids)
        comp = self.compressors.get(physical)
        if comp is None:
            return self.client.pull(physical, ids, insert=False)
        self.client.set_compression(physical, {"pull": "fp32", "push": comp.push_dir.codec()})  # exact rows
        try:
            return self.client.pull(physical, ids, insert=False)
        finally:
            self._set_codecs(physical)

    def flush(self) -> None:
        """Deliver every gradient adaptive compression still holds, wait until every push this collection made
        has been applied, and drop any prefetched rows (they may predate those pushes)."""
        self._drop_prefetch()
        for table, comp in self.compressors.items():
            plan = comp.drain()
            if plan is not None:
                self._set_codecs(table, push=plan.codec)
                self.client.push(table, plan.ids, plan.grads)
                self.pushed_rows += plan.ids.shape[0]
        self.client.flush()

    def write_rows(self, table: str, ids: np.ndarray | torch.Tensor, rows: np.ndarray | torch.Tensor) -> int:
        """Write ``rows`` (n, dim) as logical table ``table``'s rows of int64 ``ids`` (n,), replacing what the PS
        holds (their optimizer state restarts): one import of every row, after every push of this collection
        is applied; prefetched and cached rows are dropped. Returns n."""
        physical, ids = self.ps_ids(table, ids)
        self.flush()
        for cache in self.caches.values():
            cache.clear()
        return self.client.write_rows(physical, ids, torch.as_tensor(rows).detach().cpu().numpy())

    def reset_tables(self) -> None:
        """Drop every PS table of this collection and create it again: every row restarts from the table's
        initializer (as TorchRec's ``reset_parameters``). Other trainers on the same tables see it too."""
        self.flush()
        for cache in self.caches.values():
            cache.clear()
        for table in self.ps_tables:
            self.client.drop_table(table)
            self._create(table)

    # ------------------------------------------------------------------ state dict
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for key, entry in self._state_tables.items():
            entry._save_to_state_dict(destination, f"{prefix}embedding_bags.{key}.", keep_vars)

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        prefixes = {key: f"{prefix}embedding_bags.{key}." for key in self._state_tables}
        for key, entry in self._state_tables.items():  # every entry fits before any table is written
            check_state_dict(entry, state_dict, prefixes[key])
            if self.fused_table is not None and prefixes[key] + "weight" in state_dict:
                raise ValueError(f"table {key!r}: {prefixes[key]}weight is rows of one table, and {key!r} is the "
                                 f"fused PS table of {self.tables}: its entry is {prefixes[key]}_extra_state")
        for key, entry in self._state_tables.items():
            entry._load_from_state_dict(state_dict, prefixes[key], local_metadata, strict, missing_keys,
                                        unexpected_keys, error_msgs)
        if strict:  # the collection has no parameters or persistent buffers: any other key of ours is unknown
            known = (*prefixes.values(), *(f"{prefix}{name}." for name in self._modules))
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and not k.startswith(known))

    def _drop_prefetch(self) -> None:
        while self._prefetched:
            self._finish(self._prefetched.pop(0))

    @staticmethod
    def _finish(entry: _Prefetch) -> None:
        for f in entry.fetches:  # let an unused pull finish (errors surface here) and drop its rows
            f.future.result()

    def extra_repr(self) -> str:
        return f"features={len(self.features)}, tables={len(self.tables)}, dim={self.dim}"
