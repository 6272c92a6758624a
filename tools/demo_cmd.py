"""``tigana demo`` (temporary): a storage-engine demonstration until the trainer's DeepFM demo replaces it.

Creates one embedding table, runs a few hundred batches of Zipf-distributed ids through pull + push with
row-wise Adagrad, and prints a summary: rows, bytes per row, throughput, hit rate.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from tqdm import tqdm

from tigana import embeddings as emb
from tigana.tools.bench.table import zipf_batches


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, default=300, help="pull+push rounds")
    parser.add_argument("--batch", type=int, default=16384, help="ids per batch")
    parser.add_argument("--dim", type=int, default=16, help="embedding dim")
    parser.add_argument("--distinct", type=int, default=1_000_000, help="distinct ids (Zipf 1.05 over them)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    table = emb.EmbeddingTable(emb.TableConfig("demo", dim=args.dim, optimizer=emb.RowWiseAdagrad(lr=0.05),
                                               initializer=emb.Normal(std=0.01), seed=args.seed))
    pool = zipf_batches(args.distinct, args.batch, min(args.batches, 32), seed=args.seed)
    rng = np.random.default_rng(args.seed)
    grads = rng.standard_normal((args.batch, args.dim), dtype=np.float32) * 0.01
    print(f"storage-engine demo: {args.batches} batches of {args.batch} ids, Zipf(1.05) over "
          f"{args.distinct:,} ids, dim {args.dim}, row-wise Adagrad")
    start = time.perf_counter()
    for i in tqdm(range(args.batches), desc="pull+push", unit="batch"):
        ids = pool[i % len(pool)] ^ np.int64(i // len(pool))  # fresh ids each pass over the pool
        table.pull(ids)
        table.push(ids, grads)
    seconds = time.perf_counter() - start
    stats = table.stats()
    print(f"rows stored      {int(stats['rows']):,}")
    print(f"bytes per row    {stats['bytes_per_row']:.1f}  (dim {args.dim}, row-wise Adagrad state + metadata "
          "+ hash index)")
    print(f"throughput       {2 * args.batches * args.batch / seconds:,.0f} ids/s (pull + push)")
    print(f"hit rate         {stats['hit_rate']:.3f}")
    print(f"checksum         {table.checksum()}")
    table.close()
    return 0
