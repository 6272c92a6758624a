"""Embedding tables that live on the parameter server, as a torch module.

forward(sparse) -> (B, F, dim):

    values of each table ──sort──> distinct ids ──pull once each──> (U, dim) rows of every table, stacked
         │                            (or the rows prefetched while the previous step ran)      │
         └── index of each value's row ──────────┐                                            │
                                                 └──> _PooledLookup: gather (single-hot) or
                                                      embedding_bag (sum; 1/len weights for mean) ──> (F*B, dim)
    backward: d(F*B, dim) ──segmented sum over each id's values──> d(U, dim) ──push (async)──> shard servers

No table ever has a dense gradient: the only gradient computed is the (U, dim) one of the distinct rows this
batch used, summed by the custom autograd function itself (the values are grouped by row once, when the batch
is planned) and sent to the shard servers instead of to an optimizer; the servers apply the table's own
optimizer. The collection has no parameters, so the dense optimizer and DDP never see the tables.

Fused tables (``fused_table``): every logical table is stored in one PS table, its ids salted per table
(a bijection, so tables stay apart), and a step costs one pull and one push per shard instead of one per table.

Staleness: a table created with ``staleness=k`` lets the rows a step reads miss the pushes of at most the
``k`` previous steps of this trainer (the client holds a pull back until the older pushes are acknowledged,
without blocking the caller). ``prefetch(next_batch)`` overlaps the pull of step t+1 with step t's compute,
which needs k >= 1 (the rows cannot include step t's own pushes); with k = 0 every pull waits for every
earlier push and prefetch does nothing. Pushes of other trainers are never waited for (asynchronous SGD).

Hot-row cache (``TableOptions.cache_rows``, ``tigana.trainer.cache``): training forwards read the rows of hot
ids from copies pulled earlier while each copy is within the table's staleness bound (per row: this
trainer's own pushes it misses, counted at every push; the invariant is in ``cache``), and pull only the
rest. A prefetch decides which rows the cache will serve counting the pushes of the steps that run before
its forward; the forward checks again and pulls any row that is no longer servable. With a cache the misses
are pulled with a client bound of 0 (a pull reflects every push issued before it), so the whole staleness
budget goes to the cache. Evaluation (read-only) forwards never use it.

Adaptive compression (``TableOptions(compression="adaptive")``, ``tigana.trainer.compression``): each PS
table's pull and push codecs are chosen per step from the measured quantization error, pushes carry error
feedback and top-k sparsification, and a guard backs off to full precision; ``flush`` delivers every
gradient still held. ``observe_loss`` feeds the guard the training loss.

Hierarchical sparse aggregation (``aggregate_group``): the ranks of one node gather their (ids, grads) at the
node leader, which sums the rows of equal ids and pushes once for the node.

Thread-safety: one collection per trainer thread; forward/backward/prefetch must come from one thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures as cf
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from tigana import ps
from tigana.trainer._kernels import group_ids, group_segments
from tigana.trainer.cache import POLICIES, RowCache
from tigana.trainer.compression import AdaptiveCompressor, AdaptiveConfig
from tigana.trainer.data.hashing import mix64
from tigana.trainer.distributed import collective_device
from tigana.trainer.types import FeatureSpec, SparseFeatures

__all__ = ["COMPRESSIONS", "PSEmbeddingCollection", "TableOptions"]

_PUSH_LOG = 8  # own pushes per PS table remembered for the lag of the pulls in flight


COMPRESSIONS = (None, "none", "fp32", "fp16", "bf16", "int8", "adaptive")


@dataclass(frozen=True)
class TableOptions:
    """How a PS table is created and read: its server-side optimizer and initializer, staleness bound, seed,
    the wire compression of its rows (None: float32; a codec for both directions; "adaptive": chosen per
    step by ``AdaptiveCompressor`` with the knobs of ``adaptive``) and the trainer's hot-row cache
    (``cache_rows`` rows, 0: none; ``cache_max_age`` steps a copy may serve, None: no age bound;
    ``cache_policy`` lfu or lru)."""

    optimizer: Any = field(default_factory=lambda: ps.Adagrad(lr=0.05))
    initializer: Any = field(default_factory=lambda: ps.Normal(std=0.01))
    staleness: int = 1
    seed: int = 0
    compression: str | None = None
    adaptive: AdaptiveConfig | None = None
    cache_rows: int = 0
    cache_max_age: int | None = None
    cache_policy: str = "lfu"

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.compression not in COMPRESSIONS:
            raise ps.InvalidArgument(f"table options: field 'compression' must be one of {COMPRESSIONS}, "
                                     f"got {self.compression!r}")
        if self.adaptive is not None and not isinstance(self.adaptive, AdaptiveConfig):
            raise ps.InvalidArgument(f"table options: field 'adaptive' must be an AdaptiveConfig, got "
                                     f"{type(self.adaptive).__name__}")
        if isinstance(self.cache_rows, bool) or not isinstance(self.cache_rows, int) or self.cache_rows < 0:
            raise ps.InvalidArgument(f"table options: field 'cache_rows' must be an integer >= 0, got "
                                     f"{self.cache_rows!r}")
        if self.cache_max_age is not None and (isinstance(self.cache_max_age, bool)
                                               or not isinstance(self.cache_max_age, int) or self.cache_max_age < 0):
            raise ps.InvalidArgument(f"table options: field 'cache_max_age' must be None or an integer >= 0, got "
                                     f"{self.cache_max_age!r}")
        if self.cache_policy not in POLICIES:
            raise ps.InvalidArgument(f"table options: field 'cache_policy' must be one of {POLICIES}, got "
                                     f"{self.cache_policy!r}")


@dataclass
class _Plan:
    """What one batch needs from the tables: distinct ids per table and where each value's row sits.

    N values of F*B bags; the rows of every table are stacked, table after table, into (U, dim), U = sum U_t.
    """

    unique: list[np.ndarray]          # per table: (U_t,) int64 distinct ids, in first-seen order
    index: torch.Tensor               # (N,) int64 stacked row of each value
    offsets: torch.Tensor             # (F*B,) int64 bag starts in the values
    weights: torch.Tensor | None      # (N,) float32 per-value weights (1/len of its bag for mean pooling)
    order: torch.Tensor               # (N,) int64 the values grouped by row: values of row 0 first, ...
    row_starts: torch.Tensor          # (U,) int64 start of each row's group in ``order``
    bag_of_value: torch.Tensor | None  # (N,) int64 bag of each value (multi-hot batches only)
    batch_size: int
    single_hot: bool                  # every bag holds exactly one id
    ps_ids: list[np.ndarray] | None = None  # the distinct ids as the PS tables key them (set once, by _ps_ids)


@dataclass
class _Fetch:
    """One PS table's rows for one plan: which rows the cache serves at the forward, and the pull of the rest."""

    table: str                   # PS table
    ids: np.ndarray              # (U,) physical ids, in the plan's row order
    hit: np.ndarray | None       # (U,) bool rows to read from the cache (None: no cache, everything pulled)
    future: Any                  # rows of ids[~hit] (or of every id)
    push_no: int                 # this table's own pushes issued when the pull was sent
    absorbed: bool = False       # its pulled rows are in the cache


@dataclass
class _Prefetch:
    """A batch whose rows are being pulled ahead of its forward."""

    batch: SparseFeatures
    plan: _Plan
    fetches: list[_Fetch]
    steps: int                   # training forwards done when the pulls were sent
    insert: bool                 # training (inserting) pulls, or read-only (evaluation)


def _plan_on(plan: _Plan, device: torch.device) -> _Plan:
    """The plan's tensors on ``device`` (the distinct ids stay on the CPU, for the client)."""
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    return dataclasses.replace(plan, index=move(plan.index), offsets=move(plan.offsets), weights=move(plan.weights),
                               order=move(plan.order), row_starts=move(plan.row_starts),
                               bag_of_value=move(plan.bag_of_value))


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
    def forward(ctx, anchor: torch.Tensor, rows: torch.Tensor, owner: PSEmbeddingCollection,
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


class PSEmbeddingCollection(nn.Module):
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

    Tables are created on construction (identical specs from several ranks are fine).
    """

    def __init__(self, client: Any, features: Sequence[FeatureSpec], dim: int, *,
                 options: TableOptions | None = None, table_options: Mapping[str, TableOptions] | None = None,
                 aggregate_group: dist.ProcessGroup | None = None, grad_scale: float = 1.0,
                 fused_table: str | None = None, create: bool = True) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"dim must be positive, got {dim}")
        if not features:
            raise ValueError("a PSEmbeddingCollection needs at least one feature")
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
        if create:
            for table in self.ps_tables:
                self._create(table)

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
                                 seed=o.seed, staleness=staleness, compression=codec)

    @property
    def min_staleness(self) -> int:
        return min(o.staleness for o in self.options.values())

    # ------------------------------------------------------------------ forward
    def _plan(self, sparse: SparseFeatures) -> _Plan:
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
        single_hot = values.numel() == lengths.numel() and bool((lengths == 1).all())
        weights = bag_of_value = None
        if not single_hot:
            bag_of_value = torch.repeat_interleave(torch.arange(lengths.numel()), lengths,
                                                   output_size=values.numel())
            if self._any_mean:
                per_bag = torch.where(self._mean.repeat_interleave(b), 1.0 / lengths.clamp(min=1).float(),
                                      torch.ones(lengths.numel()))
                weights = per_bag.index_select(0, bag_of_value)
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

    def _issue_pulls(self, plan: _Plan, insert: bool, pending: Sequence[_Prefetch] = ()) -> list[_Fetch]:
        """Send the pulls of ``plan``'s rows, except (training) the rows the cache will serve at a forward
        that runs after the forwards of ``pending`` (prefetched batches whose steps will push first)."""
        # The client holds each pull back (asynchronously) until the pushes the staleness bound needs are in.
        # ``insert=False`` (evaluation): ids the tables lack read as their initial rows, stored nowhere and not
        # counted toward admission, so held-out data never grows the tables.
        start = time.perf_counter()
        fetches = []
        for table, ids in zip(self.ps_tables, self._ps_ids(plan), strict=True):
            cache = self.caches.get(table) if insert else None
            hit = None
            wanted = ids
            if cache is not None:
                ahead = [p.fetches[self.ps_tables.index(table)].ids for p in pending if p.insert]
                touches = sum((np.isin(ids, a) for a in ahead), np.zeros(ids.shape[0], np.int64))
                hit = cache.lookup(ids, pending=touches, ahead=len(ahead)) >= 0
                wanted = ids[~hit]
            self._set_codecs(table)
            fut = self._timed("pull", self.client.pull_async(table, wanted, insert=insert), start, wanted.shape[0])
            fetches.append(_Fetch(table, ids, hit, fut, self._push_no[table]))
        return fetches

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

    def _fused_ids(self, ids: list[np.ndarray]) -> np.ndarray:
        """The physical ids of every logical table's ``ids`` in the fused table, stacked table after table."""
        return np.concatenate([_salted(t_ids, salt) for t_ids, salt in zip(ids, self._salts, strict=True)])

    def _collect(self, plan: _Plan, fetches: list[_Fetch], training: bool,
                 pending: Sequence[_Prefetch] = ()) -> torch.Tensor:
        """(U, dim) rows of the plan, stacked table after table: pulled rows, plus (training, with a cache)
        the rows the cache serves, checked again now; ``pending``: prefetches still ahead (their promised
        rows stay cached)."""
        if self.observer is not None:
            start = time.perf_counter()
            cf.wait([f.future for f in fetches])
            self.observer("pull_wait", time.perf_counter() - start, sum(u.shape[0] for u in plan.unique))
        blocks = [self._rows_of(f, training, pending) for f in fetches]
        return torch.from_numpy(blocks[0] if len(blocks) == 1 else np.concatenate(blocks))

    def _pulled(self, f: _Fetch) -> np.ndarray:
        """The rows ``f``'s pull returned, shape-checked (and seen by the table's compressor)."""
        n = f.ids.shape[0] if f.hit is None else int(f.hit.shape[0] - f.hit.sum())
        rows = np.asarray(f.future.result(), dtype=np.float32)
        if rows.shape != (n, self.dim):
            raise RuntimeError(f"table {f.table!r}: pulled rows of shape {rows.shape}, expected ({n}, {self.dim})")
        return rows

    def _rows_of(self, f: _Fetch, training: bool, pending: Sequence[_Prefetch]) -> np.ndarray:
        pulled = self._pulled(f)
        comp = self.compressors.get(f.table)
        if comp is not None:
            comp.observe_pull(pulled)
        self.pulled_rows += pulled.shape[0]
        cache = self.caches.get(f.table) if training else None
        if cache is None or f.hit is None:
            return pulled if pulled.flags.writeable else pulled.copy()
        rows = np.empty((f.ids.shape[0], self.dim), np.float32)
        miss = ~f.hit
        rows[miss] = pulled
        promised = np.flatnonzero(f.hit)
        late = promised[:0]
        if promised.shape[0]:
            # Checked again: this forward may come after more own pushes than the prefetch counted.
            slots = cache.lookup(f.ids[promised])
            ok = slots >= 0
            rows[promised[ok]] = cache.read(slots[ok])
            self.cached_rows += int(ok.sum())
            late = promised[~ok]
            if late.shape[0]:  # no longer servable: pull them now (they reflect every push issued so far)
                self._set_codecs(f.table)
                fresh = np.asarray(self.client.pull(f.table, f.ids[late]), np.float32)
                rows[late] = fresh
                self.pulled_rows += late.shape[0]
                if cache.staleness:  # (this step pushes them: at staleness 0 they would be dead at once)
                    cache.insert(f.ids[late], fresh, 0, protect=self._promised(f.table, pending))
        cache.miss(int(miss.sum()) + late.shape[0])
        self._absorb(f, pending, pulled)
        return rows

    def _promised(self, table: str, pending: Sequence[_Prefetch]) -> np.ndarray:
        """Ids of ``table`` that the pending prefetches will read from its cache (kept from eviction)."""
        i = self.ps_tables.index(table)
        parts = [p.fetches[i].ids[p.fetches[i].hit] for p in pending if p.insert and p.fetches[i].hit is not None]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def _absorb(self, f: _Fetch, pending: Sequence[_Prefetch], pulled: np.ndarray | None = None) -> None:
        """Put ``f``'s pulled rows into the table's cache (once), with the lag of the own pushes issued
        after the pull was sent."""
        cache = self.caches.get(f.table)
        if cache is None or f.hit is None or f.absorbed:
            return
        f.absorbed = True
        rows = self._pulled(f) if pulled is None else pulled
        ids = f.ids[~f.hit]
        lag = self._lag_since(f.table, ids, f.push_no)
        # Its step has not pushed yet and will push every one of these rows: a copy whose lag is already at the
        # bound would be dead after that push (at staleness 0, every copy), so it is not cached at all.
        live = lag < cache.staleness
        if not live.all():
            ids, rows, lag = ids[live], rows[live], lag[live]
        cache.insert(ids, rows, lag, born=f.push_no, protect=self._promised(f.table, pending))

    def _lag_since(self, table: str, ids: np.ndarray, push_no: int) -> np.ndarray:
        """(n,) how many of this trainer's pushes of ``table`` issued after push ``push_no`` touched each id
        (more than the staleness bound, so never cached, when the log does not reach that far back)."""
        lag = np.zeros(ids.shape[0], np.int64)
        if self._push_no[table] - push_no > _PUSH_LOG:
            lag += self.caches[table].staleness + 1
            return lag
        for no, pushed in self._push_log[table]:
            if no > push_no:
                pos = np.minimum(np.searchsorted(pushed, ids), max(pushed.shape[0] - 1, 0))
                if pushed.shape[0]:
                    lag += pushed[pos] == ids
        return lag

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
            rows = rows.to(device, non_blocking=True)
        if training:
            self.steps += 1
            pooled = _PooledLookup.apply(self._anchor, rows, self, plan)
        else:
            pooled = _pool(rows, plan)
        return pooled.view(len(self.feature_names), plan.batch_size, self.dim).transpose(0, 1)

    # ------------------------------------------------------------------ backward
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
                self._send(self.fused_table, self._ps_ids(plan)[0], grad.numpy())
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
        for table, t_ids, t_grads in zip(self.tables, ids, grads, strict=True):
            if t_ids.numel():
                self._send(table, t_ids.numpy(), t_grads.numpy())

    def _note_push(self, table: str, ids: np.ndarray) -> None:
        """One own push of ``ids`` to ``table``: counted by its cache and remembered for the lag of pulls in
        flight."""
        self._push_no[table] += 1
        cache = self.caches.get(table)
        if cache is not None:
            cache.pushed(ids)
            self._push_log[table].append((self._push_no[table], np.sort(ids)))

    def _send(self, table: str, ids: np.ndarray, grads: np.ndarray) -> None:
        """Push ``grads`` of ``ids`` to PS table ``table`` (through its compressor when it has one)."""
        comp = self.compressors.get(table)
        if comp is not None:
            plan = comp.plan_push(ids, grads)
            ids, grads = plan.ids, plan.grads
            self._set_codecs(table, push=plan.codec)
        if ids.shape[0]:
            start = time.perf_counter()
            self._timed("push", self.client.push(table, ids, np.ascontiguousarray(grads, dtype=np.float32)), start,
                        ids.shape[0])
            self.pushed_rows += ids.shape[0]

    def observe_loss(self, loss: float) -> None:
        """A training step's loss, for the accuracy guard of adaptive compression (no-op without it)."""
        for comp in self.compressors.values():
            comp.observe_loss(float(loss))

    def stats(self) -> dict[str, Any]:
        """Rows pulled, pushed and served by the cache, and per PS table its cache's and compressor's counters."""
        return {"pulled_rows": self.pulled_rows, "pushed_rows": self.pushed_rows, "cached_rows": self.cached_rows,
                "cache": {t: c.stats() for t, c in self.caches.items()},
                "compression": {t: c.stats() for t, c in self.compressors.items()}}

    def table_rows(self, table: str, ids: np.ndarray | torch.Tensor) -> np.ndarray:
        """(n, dim) float32 current rows of logical table ``table`` for int64 ``ids`` (through the fused table
        when there is one): an inspection, so a read-only pull (ids the table lacks read as their initial rows
        and are not inserted, nor counted toward admission). It does not wait for this collection's pushes;
        ``flush`` first."""
        if table not in self.tables:
            raise ValueError(f"no table named {table!r} (tables: {self.tables})")
        ids = np.ascontiguousarray(torch.as_tensor(ids).numpy(), dtype=np.int64)
        physical = table if self.fused_table is None else self.fused_table
        if self.fused_table is not None:
            ids = _salted(ids, self._salts[self.tables.index(table)])
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

    def _drop_prefetch(self) -> None:
        while self._prefetched:
            self._finish(self._prefetched.pop(0))

    @staticmethod
    def _finish(entry: _Prefetch) -> None:
        for f in entry.fetches:  # let an unused pull finish (errors surface here) and drop its rows
            f.future.result()

    def extra_repr(self) -> str:
        return f"features={len(self.features)}, tables={len(self.tables)}, dim={self.dim}"


def _aggregate(ids: list[torch.Tensor], grads: list[torch.Tensor], group: dist.ProcessGroup,
               dim: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Gather every node rank's (ids, grads) per table at the node leader and sum rows of equal ids there.

    Returns the merged ids and grads on the leader (group rank 0) and empty ones elsewhere, on the CPU. Every
    rank of the group must call it with the same number of tables. What crosses the group is on the device its
    backend carries (``collective_device``: CUDA for NCCL).
    """
    members = dist.get_world_size(group)
    leader = dist.get_global_rank(group, 0)
    me = dist.get_rank(group)
    device = collective_device(group)
    counts = torch.tensor([t.numel() for t in ids], dtype=torch.int64, device=device)
    all_counts = [torch.empty_like(counts) for _ in range(members)]
    dist.all_gather(all_counts, counts, group=group)
    all_counts = [c.cpu() for c in all_counts]
    totals = [int(c.sum()) for c in all_counts]
    width = max(totals)
    empty_ids = [ids[0].new_empty(0) for _ in ids]
    empty_grads = [grads[0].new_empty(0, dim) for _ in grads]
    if width == 0:
        return (ids, grads) if me == 0 else (empty_ids, empty_grads)
    flat_ids = torch.zeros(width, dtype=torch.int64, device=device)
    flat_grads = torch.zeros(width, dim, dtype=torch.float32, device=device)
    n = totals[me]
    flat_ids[:n] = torch.cat(ids)
    flat_grads[:n] = torch.cat(grads)
    if me == 0:
        id_list = [torch.empty_like(flat_ids) for _ in range(members)]
        grad_list = [torch.empty_like(flat_grads) for _ in range(members)]
    else:
        id_list = grad_list = None
    dist.gather(flat_ids, id_list, dst=leader, group=group)
    dist.gather(flat_grads, grad_list, dst=leader, group=group)
    if me != 0:
        return empty_ids, empty_grads
    id_list, grad_list = [t.cpu() for t in id_list], [t.cpu() for t in grad_list]
    per_rank_ids = [torch.split(id_list[r][:totals[r]], all_counts[r].tolist()) for r in range(members)]
    per_rank_grads = [torch.split(grad_list[r][:totals[r]], all_counts[r].tolist()) for r in range(members)]
    out_ids, out_grads = [], []
    for t in range(len(ids)):
        t_ids = torch.cat([per_rank_ids[r][t] for r in range(members)])
        t_grads = torch.cat([per_rank_grads[r][t] for r in range(members)])
        if t_ids.numel() == 0:
            out_ids.append(t_ids)
            out_grads.append(t_grads)
            continue
        uniq, _, order, starts = _group(t_ids.numpy())
        summed = F.embedding_bag(torch.from_numpy(order), t_grads.contiguous(), torch.from_numpy(starts), mode="sum")
        out_ids.append(torch.from_numpy(uniq))
        out_grads.append(summed)
    return out_ids, out_grads
