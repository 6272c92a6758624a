"""``tigana demo`` (``make demo``): DeepFM trained by 2 trainer processes through a local parameter server.

Starts a local cluster of 2 shard daemons (what ``tigana local`` runs), trains DeepFM with 2 trainer processes
on MovieLens-100K when ``../shared/data/movielens-100k`` (next to the repository) or ``--data`` holds it, on
synthetic Criteo-format data otherwise; prints AUC, logloss and samples/s and where the TensorBoard logs are;
stops every process it started, also on Ctrl-C or failure. A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import tigana.tools
from tigana.trainer import TrainConfig, launch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", metavar="PATH",
                        help="MovieLens-100K folder (default: ../shared/data/movielens-100k next to the repository)")
    parser.add_argument("--synthetic", action="store_true", help="use synthetic Criteo-format data even if "
                                                                  "MovieLens-100K is there")
    parser.add_argument("--nproc", type=int, default=2, help="trainer processes (default 2)")
    parser.add_argument("--shards", type=int, default=2, help="shard daemons (default 2)")
    parser.add_argument("--epochs", type=int, default=None, help="default 3 on MovieLens, 2 on synthetic data")
    parser.add_argument("--logdir", default=None, help="TensorBoard folder (default runs/demo-<time>)")
    parser.add_argument("--synthetic-rows", type=int, default=100_000, metavar="N",
                        help="training rows of synthetic data (default 100,000)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def find_movielens(explicit: str | None) -> Path | None:
    """The MovieLens-100K folder (holding ml-100k/u1.base), or None."""
    candidates = [Path(explicit)] if explicit else []
    repo = Path(tigana.tools.__file__).resolve().parents[1]
    candidates += [repo.parent / "shared" / "data" / "movielens-100k", Path.cwd().parent / "shared" / "data" /
                   "movielens-100k"]
    for c in candidates:
        for root in (c, c.parent):
            if (root / "ml-100k" / "u1.base").is_file():
                return root
        if (c / "u1.base").is_file():
            return c
    return None


def run(args: argparse.Namespace) -> int:
    movielens = None if args.synthetic else find_movielens(args.data)
    if args.data and movielens is None and not args.synthetic:
        print(f"tigana demo: no MovieLens-100K files under {args.data}", file=sys.stderr)
        return 2
    logdir = Path(args.logdir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if movielens is not None:
        config = TrainConfig(model="deepfm", dataset="movielens-100k", data=str(movielens),
                             epochs=args.epochs or 3, batch_size=512, staleness=1)
        what = f"MovieLens-100K u1.base -> u1.test ({movielens})"
    else:
        config = TrainConfig(model="deepfm", dataset="synthetic", synthetic_rows=args.synthetic_rows, synthetic_vocab=50_000,
                             epochs=args.epochs or 2, batch_size=1024, staleness=1)
        what = f"synthetic Criteo-format data ({args.synthetic_rows:,} training rows; no MovieLens-100K used)"
    print(f"tigana demo: DeepFM, {args.nproc} trainer processes, {args.shards} shards, {what}", flush=True)
    cluster = launch.start_cluster(args.shards)
    try:
        print(f"local cluster up: scheduler {cluster.scheduler}, shards {', '.join(cluster.addresses)}, "
              f"{cluster.replicas} replica(s) of every slot (data in {cluster.data_dir})", flush=True)
        config = config.replace(ps=(cluster.target,), nproc=args.nproc, logdir=str(logdir),
                                progress=not args.no_progress)
        result = launch.run(config)
    finally:
        cluster.close()
    print("local cluster stopped", flush=True)
    if result is None:
        return 1
    print(f"AUC        {result['auc']:.4f}   (held-out rows: {result['eval_rows']:,})")
    print(f"logloss    {result['logloss']:.4f}")
    print(f"samples/s  {result['samples_per_s']:,.0f}   ({result['steps']} steps, {result['world_size']} trainers, "
          f"dense sync: {result['allreduce']})")
    print(f"TensorBoard logs: {logdir}   (tensorboard --logdir {logdir})")
    print(json.dumps(result), flush=True)
    return 0
