"""``tigana bench table``: the storage engine against the dense-tensor limits, measured in the same run.

Cases (one JSON line each, for dim 16 and 64):
  lookup   EmbeddingTable.pull (hash lookup + gather) of batches whose ids are all stored, vs
           torch.index_select on pre-mapped indices into a dense tensor holding the same rows (the limit).
  lookup_or_insert  the same pulls on first sight: new ids are hashed in and initialized (new_ids_per_batch),
           vs the dense limit of the same work (new rows drawn and written, then every row gathered).
  update   EmbeddingTable.push with row-wise Adagrad (lookup, dedup + segment sum, update) vs the same update
           in torch on pre-mapped indices (torch.unique + index_add_ + row-wise Adagrad + index_copy_).
  hashtable.lookup  the numba hash lookup vs the numpy fallback on the same index (why numba is used).
  capacity bytes per resident row after inserting ``--rows`` ids (1 M, 10 M, 20 M; dim 16, row-wise Adagrad):
           the engine's count and the RSS growth, against the same rows in a Python dict + numpy arrays.
  push_during_snapshot  p99 latency of pushes (4,096 Zipf ids, dim 16) while a full snapshot of the table is
           written (through a copy-on-write cut) against the same pushes with none running; ``snapshot_s`` is
           how long the snapshot took, ``max_ms_snapshot_under_lock`` how long one push waits behind a
           snapshot written under the table's lock (the way before cuts).

Ids: batches of 65,536 drawn Zipf(1.05) over ``--distinct`` ids (10 M; fewer with --quick), each rank
hashed to an arbitrary int64 id. Rates are medians over batches; the ratio (ours / limit) is what to read on
a shared machine. Our kernels run on one core (a server overlaps requests on the others), so the torch
limits run with one thread unless --torch-threads says otherwise.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from tigana import embeddings as emb
from tigana.embeddings.mixing import mix64
from tigana.tools.bench.report import emit, log, parse_counts
from tigana.tools.bench.scale.resources import _rss_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes; finishes in under a minute")
    parser.add_argument("--rows", default=None,
                        help="comma-separated row counts of the capacity case (default 1M,10M,20M; quick 1M)")
    parser.add_argument("--distinct", type=int, default=None,
                        help="distinct ids the Zipf batches draw from (default 10M; quick 1M)")
    parser.add_argument("--batch", type=int, default=65536, help="ids per batch")
    parser.add_argument("--dims", type=str, default="16,64", help="comma-separated embedding dims")
    parser.add_argument("--repeats", type=int, default=None, help="timed batches per case (median)")
    parser.add_argument("--backend", choices=("auto", "numba", "numpy"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot-rows", type=int, default=None,
                        help="rows of the push_during_snapshot table (default 2M; quick 200k; else --rows if given)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="threads for the torch limits (default 1, as our kernels use one core)")


def zipf_batches(distinct: int, batch: int, count: int, *, alpha: float = 1.05, seed: int = 0) -> list[np.ndarray]:
    """``count`` batches of ``batch`` int64 ids, ranks ~ Zipf(alpha) truncated to ``distinct``, hashed."""
    ranks = np.arange(1, distinct + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -alpha)
    cdf /= cdf[-1]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        r = np.searchsorted(cdf, rng.random(batch)).astype(np.uint64)
        out.append(mix64(r + np.uint64(seed)).view(np.int64))
    return out


def _torch_limits(table: emb.EmbeddingTable, batches: list[np.ndarray], lr: float, eps: float):
    """Dense copies of the table's rows and the batches' ids pre-mapped to row numbers."""
    import torch

    rows = table.export_rows()
    # clone: torch's own 64-byte aligned memory (numpy's 16-byte alignment makes gathers ~30% slower)
    weights = torch.from_numpy(np.ascontiguousarray(rows.weights)).clone()
    state = torch.from_numpy(np.ascontiguousarray(rows.state[:, 0])).clone()
    order = rows.ids  # sorted
    mapped = [torch.from_numpy(np.searchsorted(order, b)) for b in batches]

    def gather(i: int) -> int:
        idx = mapped[i % len(mapped)]
        torch.index_select(weights, 0, idx)
        return idx.shape[0]

    def update(i: int, grads: torch.Tensor) -> int:
        idx = mapped[i % len(mapped)]
        uniq, inverse = torch.unique(idx, return_inverse=True)
        summed = torch.zeros(uniq.shape[0], weights.shape[1]).index_add_(0, inverse, grads)
        acc = state.index_select(0, uniq) + summed.pow(2).mean(dim=1)
        state.index_copy_(0, uniq, acc)
        new = weights.index_select(0, uniq) - (lr / (acc.sqrt() + eps)).unsqueeze(1) * summed
        weights.index_copy_(0, uniq, new)
        return idx.shape[0]

    return gather, update


def _first_sight(table: emb.EmbeddingTable, batches: list[np.ndarray], warm: int, dim: int
                 ) -> tuple[list[float], list[float]]:
    """ids/s of each timed batch's first pull (hits plus inserts of its new ids), each followed by the dense
    limit of the same work: a tensor pre-sized for every id of the run, the batch's ids pre-mapped to rows, its
    new rows drawn (``torch.randn``) and written (``index_copy_``), then every row gathered."""
    import torch

    every = np.unique(np.concatenate(batches))
    dense = torch.zeros(every.shape[0], dim)
    ours, theirs = [], []
    for b in batches[warm:]:
        pos = np.searchsorted(every, b)
        new_pos = torch.from_numpy(np.unique(pos[~table.contains(b)]))  # untimed: what the limit must insert
        idx = torch.from_numpy(pos)
        t0 = time.perf_counter()
        table.pull(b)
        t1 = time.perf_counter()
        dense.index_copy_(0, new_pos, torch.randn(new_pos.shape[0], dim) * 0.01)
        torch.index_select(dense, 0, idx)
        t2 = time.perf_counter()
        ours.append(b.shape[0] / (t1 - t0))
        theirs.append(b.shape[0] / (t2 - t1))
    return ours, theirs


def _paired(ours, theirs, count: int, warmup: int) -> tuple[float, float]:
    """Median rates of ``ours(i)`` and ``theirs(i)`` (each returns items done) run alternately on the same
    inputs, so load from other processes hits both alike. The first ``warmup`` rounds are not timed (torch's
    first calls on fresh tensors run several times slower)."""
    a, b = [], []
    for i in range(warmup + count):
        t0 = time.perf_counter()
        n_a = ours(i)
        t1 = time.perf_counter()
        n_b = theirs(i)
        t2 = time.perf_counter()
        if i >= warmup:
            a.append(n_a / (t1 - t0))
            b.append(n_b / (t2 - t1))
    return statistics.median(a), statistics.median(b)


def _bench_dim(args, dim: int, distinct: int, repeats: int) -> None:
    import torch

    batch = args.batch
    warm = 8 if args.quick else 32
    batches = zipf_batches(distinct, batch, warm + repeats + 1, seed=args.seed)
    lr, eps = 0.01, 1e-8
    table = emb.EmbeddingTable(emb.TableConfig(
        f"bench{dim}", dim=dim, optimizer=emb.RowWiseAdagrad(lr=lr, eps=eps), initializer=emb.Uniform(),
        backend=args.backend))
    t0 = time.perf_counter()
    for b in batches[:warm]:
        table.pull(b)
    log(f"dim {dim}: warm-up {warm} batches, {len(table)} rows, {time.perf_counter() - t0:.1f}s")
    timed = batches[warm:]
    params = dict(dim=dim, batch=batch, ids=f"zipf(1.05) over {distinct}", repeats=repeats,
                  backend=table.backend, quick=bool(args.quick), torch_threads=torch.get_num_threads())

    rows_before = len(table)
    fresh_rates, dense_fresh_rates = _first_sight(table, batches, warm, dim)
    new_per_batch = (len(table) - rows_before) / len(timed)
    gather, update = _torch_limits(table, timed, lr, eps)  # a dense copy of the same rows

    def ours_lookup(i: int) -> int:
        b = timed[i % len(timed)]
        table.pull(b)
        return b.shape[0]

    hits, limit = _paired(ours_lookup, gather, repeats, warmup=2 * len(timed))
    emit("table.lookup", "ids/s", hits, "torch.index_select (pre-mapped, dense)", limit,
         rows=len(table), **params)
    emit("table.lookup_or_insert", "ids/s", statistics.median(fresh_rates[1:]),
         "torch randn + index_copy_ of the new rows, index_select (pre-mapped, dense, pre-sized)",
         statistics.median(dense_fresh_rates[1:]), rows=len(table), new_ids_per_batch=round(new_per_batch), **params)

    rng = np.random.default_rng(args.seed + 1)
    grads = [rng.standard_normal((batch, dim), dtype=np.float32) * 0.01 for _ in range(2)]
    grads_t = [torch.from_numpy(g) for g in grads]

    def ours_update(i: int) -> int:
        b = timed[i % len(timed)]
        table.push(b, grads[i % 2])
        return b.shape[0]

    ours, limit = _paired(ours_update, lambda i: update(i, grads_t[i % 2]), repeats, warmup=len(timed))
    emit("table.update_rowwise_adagrad", "ids/s", ours, "torch unique+index_add+rowwise adagrad (pre-mapped)",
         limit, rows=len(table), **params)
    table.close()


def _bench_hash(args, distinct: int, repeats: int) -> None:
    """The choice of kernels: the numba hash lookup against the vectorized numpy fallback, same index."""
    keys = mix64(np.arange(1, distinct + 1, dtype=np.uint64) + np.uint64(args.seed)).view(np.int64)
    batches = zipf_batches(distinct, args.batch, repeats + 1, seed=args.seed + 2)
    if emb.HashIndex().backend != "numba":  # numba missing: nothing to compare
        return
    indexes = {}
    for backend in ("numba", "numpy"):
        indexes[backend] = emb.HashIndex(backend=backend)
        indexes[backend].insert(keys, np.arange(distinct))

    def lookup(backend: str):
        def fn(i: int) -> int:
            b = batches[i % len(batches)]
            indexes[backend].lookup(b)
            return b.shape[0]
        return fn

    ours, peer = _paired(lookup("numba"), lookup("numpy"), 3 * repeats, warmup=3)
    emit("hashtable.lookup", "ids/s", ours, "numpy fallback (vectorized open addressing)", peer,
         keys=distinct, batch=args.batch, ids=f"zipf(1.05) over {distinct}", quick=bool(args.quick))


def _bench_capacity(args, sizes: list[int]) -> None:
    """Bytes per resident row (dim 16, row-wise Adagrad) at each size: the engine's own count (and this
    process's RSS growth), against the same ids and rows held the plain Python way (a dict id -> row number and
    numpy rows), counted the same way in the same run."""
    dim = 16
    for rows in sizes:
        gc.collect()
        rss0 = _rss_bytes(os.getpid())
        table = emb.EmbeddingTable(emb.TableConfig("capacity", dim=dim, optimizer=emb.RowWiseAdagrad(),
                                                   initializer=emb.Uniform(), backend=args.backend))
        t0 = time.perf_counter()
        for start in range(0, rows, _CHUNK):
            table.pull(_capacity_ids(start, min(rows, start + _CHUNK)))
        secs = time.perf_counter() - t0
        st = table.stats()
        rss = _rss_bytes(os.getpid()) - rss0
        table.close()
        del table
        peer, peer_rss = _dict_peer_bytes(rows, dim)
        emit("table.capacity", "bytes/row", st["bytes_per_row"], "python dict id->row + numpy rows", peer,
             dim=dim, optimizer="rowwise_adagrad", rows_resident=int(st["rows_resident"]),
             bytes_resident=int(st["bytes_resident"]), rss_bytes_per_row=round(rss / rows, 1),
             peer_rss_bytes_per_row=round(peer_rss, 1),
             slot_bytes=int(st["slot_bytes"]), insert_rate=round(rows / secs), quick=bool(args.quick))


_CHUNK = 1 << 20


def _capacity_ids(start: int, stop: int) -> np.ndarray:
    return mix64(np.arange(start, stop, dtype=np.uint64)).view(np.int64)


def _dict_peer_bytes(rows: int, dim: int) -> tuple[float, float]:
    """Bytes per row of the same ids in a dict (id -> row number) beside numpy weights and state: as Python
    counts them (the dict, its int objects, the arrays; what the engine's own count is set against) and as
    this process's RSS grew (noisy at small sizes, where freed memory is reused)."""
    gc.collect()
    rss0 = _rss_bytes(os.getpid())
    index: dict[int, int] = {}
    for start in range(0, rows, _CHUNK):
        ids = _capacity_ids(start, min(rows, start + _CHUNK)).tolist()
        index.update(zip(ids, range(start, start + len(ids)), strict=True))
    weights = np.ones((rows, dim), np.float32)  # touched, as stored rows are
    state = np.ones(rows, np.float32)
    grown = _rss_bytes(os.getpid()) - rss0
    counted = (sys.getsizeof(index) + sum(map(sys.getsizeof, index)) + sum(map(sys.getsizeof, index.values()))
               + weights.nbytes + state.nbytes)
    del index, weights, state
    gc.collect()
    return counted / rows, grown / rows


def _bench_snapshot_stall(args, rows: int) -> None:
    """Push latency while a full snapshot is written, against the same pushes with no snapshot running."""
    dim, batch = 16, min(args.batch, 4096)
    table = emb.EmbeddingTable(emb.TableConfig("stall", dim=dim, optimizer=emb.RowWiseAdagrad(),
                                               initializer=emb.Uniform(), backend=args.backend))
    for start in range(0, rows, 1 << 20):
        table.pull(mix64(np.arange(start, min(rows, start + (1 << 20)), dtype=np.uint64)).view(np.int64))
    batches = zipf_batches(rows, batch, 64, seed=0)  # seed 0: the ranks hash to the stored ids
    grads = np.random.default_rng(args.seed).normal(size=(batch, dim)).astype(np.float32)

    def pushes(more) -> list[float]:
        took: list[float] = []
        while more(len(took)):
            t0 = time.perf_counter()
            table.push(batches[len(took) % len(batches)], grads)
            took.append(time.perf_counter() - t0)
        return took

    quiet = pushes(lambda n: n < 200)
    root = tempfile.mkdtemp(prefix="tigana-bench-snap-")
    try:
        timing: list[float] = []

        def snapshot() -> None:
            t0 = time.perf_counter()
            table.snapshot(root)
            timing.append(time.perf_counter() - t0)

        writer = threading.Thread(target=snapshot)
        writer.start()
        during = pushes(lambda n: writer.is_alive() or n < 5)
        writer.join()
        locked = _push_behind_locked_snapshot(table, root, batches[0], grads)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        table.close()

    def ms(xs: list[float], q: float) -> float:
        return float(np.quantile(np.array(xs), q) * 1e3)

    emit("table.push_during_snapshot", "ms (p99 push)", ms(during, 0.99), "no snapshot running", ms(quiet, 0.99),
         rows=rows, dim=dim, batch=batch, optimizer="rowwise_adagrad", pushes_during=len(during),
         median_ms=round(ms(during, 0.5), 3), peer_median_ms=round(ms(quiet, 0.5), 3),
         max_ms=round(max(during) * 1e3, 3), snapshot_s=round(timing[0], 3),
         max_ms_snapshot_under_lock=round(locked * 1e3, 3), quick=bool(args.quick))


def _push_behind_locked_snapshot(table: emb.EmbeddingTable, root: str, ids: np.ndarray, grads: np.ndarray) -> float:
    """The old way, for reference: a snapshot written under the table's lock; seconds one push issued as it
    starts waits."""
    started = threading.Event()

    def snapshot() -> None:
        with table._lock:
            started.set()
            table.snapshot(f"{root}-locked", track=False)

    writer = threading.Thread(target=snapshot)
    writer.start()
    started.wait()
    t0 = time.perf_counter()
    table.push(ids, grads)
    took = time.perf_counter() - t0
    writer.join()
    shutil.rmtree(f"{root}-locked", ignore_errors=True)
    return took


def run(args: argparse.Namespace) -> int:
    import torch

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, args.torch_threads))
    try:
        quick = bool(args.quick)
        distinct = args.distinct or (1_000_000 if quick else 10_000_000)
        rows = parse_counts(args.rows) if args.rows else ([1_000_000] if quick else [1_000_000, 10_000_000, 20_000_000])
        repeats = args.repeats or (11 if quick else 21)
        for dim in (int(d) for d in args.dims.split(",") if d.strip()):  # --dims "": capacity only
            _bench_dim(args, dim, distinct, repeats)
        if args.dims.strip():
            _bench_hash(args, distinct, repeats)
        _bench_capacity(args, rows)
        _bench_snapshot_stall(args, args.snapshot_rows or (rows[0] if args.rows else (200_000 if quick else 2_000_000)))
    finally:
        torch.set_num_threads(saved_threads)
    return 0
