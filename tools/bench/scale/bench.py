"""``tigana bench scale``: the arguments, the sizes of each curve, and the run (every curve's points up at
once, measured, emitted; the figure last)."""

from __future__ import annotations

import argparse
import time

from tigana.tools.bench.report import log, parse_counts
from tigana.tools.bench.scale import tiered
from tigana.tools.bench.scale.clients import _Worker, _worker_main
from tigana.tools.bench.scale.cluster import _Cluster
from tigana.tools.bench.scale.figure import _require_matplotlib, plot
from tigana.tools.bench.scale.points import _emit_curve, _measure, _Point
from tigana.tools.bench.scale.resources import _bytes_per_row_estimate, _mem_available
from tigana.tools.bench.scale.workload import CURVES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes and fewer repeats (rows 100k and 1M; about a minute on 2 cores)")
    parser.add_argument("--full", action="store_true",
                        help="add 100M resident rows to the rows curve (needs about 65 GB of RAM)")
    parser.add_argument("--plot", metavar="FILE", default=None,
                        help="write a 2x2 PNG of the curves (rows/s and CPU-s per M rows); needs the `plot` extra")
    parser.add_argument("--curves", default=",".join(CURVES), help="comma-separated curves to run")
    parser.add_argument("--shards", default="1,2,4", help="shard counts of the shards curve")
    parser.add_argument("--clients", default="1,2,4", help="client processes of the clients curve")
    parser.add_argument("--rows", default=None,
                        help="resident rows of the rows curve (default 1M,10M,20M; quick 100k,1M; full adds 100M)")
    parser.add_argument("--batches", default="4096,16384,65536,262144", help="batch sizes of the batch curve")
    parser.add_argument("--base-rows", type=int, default=1_000_000,
                        help="resident rows of the shards, clients and batch curves")
    parser.add_argument("--base-shards", type=int, default=2, help="shards of the clients, rows and batch curves")
    parser.add_argument("--batch", type=int, default=65536, help="ids per batch of the shards, clients, rows curves")
    parser.add_argument("--dim", type=int, default=64, help="embedding dim")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per point and case (default 7, "
                                                                  "quick 3)")
    parser.add_argument("--unit-rows", type=int, default=None,
                        help="ids per client per timed repeat, at least 2 batches (default 1M, quick 256k)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a client process (internal)
    tiered.add_arguments(parser)


# --- sizes ------------------------------------------------------------------------------------------------
def _sizes(args: argparse.Namespace) -> dict[str, list[int]]:
    if args.rows is not None:
        rows = parse_counts(args.rows)
    elif args.quick:
        rows = [100_000, 1_000_000]
    else:
        rows = [1_000_000, 10_000_000, 20_000_000]
    if args.full and args.rows is None:
        rows.append(100_000_000)
    return {"shards": parse_counts(args.shards), "clients": parse_counts(args.clients), "rows": rows, "batch": parse_counts(args.batches)}


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker_main()
    if args.tiered:
        return tiered.run_tiered(args)
    plt = _require_matplotlib() if args.plot else None  # fail before minutes of measuring, not after
    curves = [c.strip() for c in args.curves.split(",") if c.strip()]
    unknown = sorted(set(curves) - set(CURVES))
    if unknown:
        raise SystemExit(f"bench scale: unknown curve(s) {unknown}; choose from {list(CURVES)}")
    sizes = _sizes(args)
    repeats = args.repeats or (3 if args.quick else 7)
    unit_rows = args.unit_rows or ((1 << 18) if args.quick else (1 << 20))
    base = {"dim": args.dim, "wire": "fp32", "optimizer": "adagrad", "zipf": args.zipf, "staleness": 1,
            "repeats": repeats, "quick": bool(args.quick), "full": bool(args.full)}
    if "rows" in curves:  # the biggest cluster must fit: refuse before starting anything
        biggest = max(sizes["rows"])
        need = biggest * _bytes_per_row_estimate(args.dim)
        avail = _mem_available()
        if avail is not None and need * 1.15 + (1 << 30) > avail:
            raise SystemExit(f"bench scale: {biggest:,} resident rows at dim {args.dim} need about "
                             f"{need / 1e9:.1f} GB of RAM; {avail / 1e9:.1f} GB available (lower --rows, or drop "
                             f"--full)")
    log(f"bench scale: curves {curves}, sizes { {c: sizes[c] for c in curves} }, dim {args.dim}, repeats {repeats}, "
        f"{unit_rows} ids per client per repeat")
    started = time.perf_counter()
    n_workers = max([1, *(sizes["clients"] if "clients" in curves else [])])
    clusters: dict[tuple[int, int], _Cluster] = {}
    workers: list[_Worker] = []
    lines: list[dict] = []
    keys = iter(range(1 << 30))
    try:
        workers = [_Worker() for _ in range(n_workers)]

        def cluster(shards: int, rows: int) -> _Cluster:
            if (shards, rows) not in clusters:
                clusters[(shards, rows)] = _Cluster(shards, rows, args.dim)
            return clusters[(shards, rows)]

        home = (args.base_shards, args.base_rows)
        for curve in curves:
            t0 = time.perf_counter()
            points = []
            for x in sizes[curve]:
                shards, rows = {"shards": (x, args.base_rows), "rows": (args.base_shards, x)}.get(curve, home)
                p = _Point(curve, x, cluster(shards, rows), workers[:x] if curve == "clients" else workers[:1],
                           x if curve == "batch" else args.batch, f"p{next(keys)}")
                p.prepare(args, unit_rows)
                points.append(p)
            _measure(points, repeats)
            lines += _emit_curve(points, base)
            for p in points:
                p.release()
            for key in [k for k in clusters if k != home]:  # keep the shared 2-shard cluster for later curves
                clusters.pop(key).close()
            log(f"bench scale: curve {curve} in {time.perf_counter() - t0:.0f}s")
    finally:
        for w in workers:
            w.close()
        for c in clusters.values():
            c.close()
    log(f"bench scale: done in {time.perf_counter() - started:.0f}s")
    if plt is not None:
        plot(lines, args.plot, plt)
        log(f"bench scale: wrote {args.plot}")
    return 0
