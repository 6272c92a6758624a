"""``tigana bench cache [--quick]``: the trainer's hot-row cache under Zipf(1.05) ids.

DeepFM (dim 16) on synthetic Criteo-format data (26 categorical features whose ids follow a Zipf(1.05)
popularity law, vocabularies capped at ``--vocab``; a learnable hidden model gives the labels), 1 trainer
and 2 shard daemons, the tables fused into one PS table, prefetch on. For each staleness k in 0, 1, 4 and 16
the same batches are trained twice, from the same initial rows and dense seed: without a cache, and with a
cache of ``--cache-rows`` rows (``tigana.trainer.cache``, LFU). One JSON line per k:

- ``case: "cache"``, ``staleness``; ``unit``: pulled bytes, ``value`` with the cache, ``peer``: no cache, pulled
  with the same client bound as the cached run's misses (``peer_client_bound``: 0, every pull reflects every
  earlier own push; the collection pulls a cached table's misses so and spends the staleness on the cache), so
  the only difference between the runs is the cache; ``peer_value``, ``ratio``;
- ``hit_rate``: rows the training forwards read from the cache / rows they read;
- ``pulled_bytes_saved``: 1 - ratio (bytes of the pull direction, both ways, measured by the client);
- ``auc``, ``auc_no_cache``, ``auc_delta`` (with - without, on held-out rows of the same generator): the
  accuracy the cache's staleness costs; ``samples_per_s`` and ``samples_per_s_no_cache``.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from typing import Any

import torch
from torch.nn import functional as F

from tigana import ps
from tigana.ps.allocator import ALLOCATOR_ENV, tune_allocator
from tigana.tools.bench.report import emit, log
from tigana.trainer.data import SyntheticCriteo
from tigana.trainer.data.synthetic import CRITEO_KAGGLE_CARDINALITIES
from tigana.trainer.embedding import PSEmbeddingBags, TableOptions
from tigana.trainer.loop import evaluate
from tigana.trainer.models import build_model
from tigana.trainer.types import Batch

DIM = 16
ZIPF = 1.05
STALENESS = (0, 1, 4, 16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer steps and held-out rows (about a minute)")
    parser.add_argument("--batch-size", type=int, default=2048, help="samples per step")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 120, quick 24)")
    parser.add_argument("--cache-rows", type=int, default=65536, help="rows of the cache (one fused PS table)")
    parser.add_argument("--vocab", type=int, default=100_000, help="cap on each feature's vocabulary")


def _pull_bytes(client: ps.Client, table: str) -> int:
    stats = client.stats()
    return int(stats["bytes_sent"].get(table, {}).get("pull", 0) + stats["bytes_received"].get(table, {}).get("pull", 0))


def _train(client: ps.Client, coll: PSEmbeddingBags, batches: list[Batch], eval_batches: list[Batch]
           ) -> dict[str, Any]:
    """Train DeepFM once over ``batches`` (prefetching the next), then score ``eval_batches``; with the bytes
    the training pulls moved (evaluation reads bypass the cache and are not counted)."""
    table = coll.ps_tables[0]
    start_bytes = _pull_bytes(client, table)
    torch.manual_seed(0)
    model = build_model("deepfm", coll, 13)
    opt = torch.optim.Adam(model.dense_parameters(), lr=1e-3)
    prefetch = coll.min_staleness >= 1
    t0 = time.perf_counter()
    for i, batch in enumerate(batches):
        if prefetch and i + 1 < len(batches):
            coll.prefetch(batches[i + 1].sparse)
        loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    coll.flush()
    seconds = time.perf_counter() - t0
    pulled = _pull_bytes(client, table) - start_bytes
    scores = evaluate(model, iter(eval_batches), coll)
    return dict(scores, samples_per_s=sum(len(b) for b in batches) / seconds, pull_bytes=pulled,
                stats=coll.stats())


def run(args: argparse.Namespace) -> int:
    tune_allocator(top_pad=64 << 20)
    steps = args.steps or (24 if args.quick else 120)
    bs = args.batch_size
    vocab = tuple(min(v, args.vocab) for v in CRITEO_KAGGLE_CARDINALITIES)
    gen = SyntheticCriteo(vocab_sizes=vocab, seed=0, zipf_exponent=ZIPF)
    log(f"bench cache: making {steps} batches of {bs} synthetic Criteo rows (Zipf {ZIPF})")
    batches = list(gen.batches(bs, bs * steps))
    n_eval = (4 if args.quick else 16) * 1024
    eval_batches = list(gen.dataset(n_eval, start=bs * steps).batches(4096))
    params = dict(model="deepfm", dim=DIM, batch_size=bs, steps=steps, eval_rows=n_eval, zipf=ZIPF,
                  vocab_cap=args.vocab, sparse_features=26, cache_rows=args.cache_rows, cache_policy="lfu",
                  shards=2, trainers=1, prefetch=True, wire="fp32", quick=bool(args.quick))
    env = dict(os.environ, TIGANA_SNAPSHOT_ON_SHUTDOWN="0", **ALLOCATOR_ENV)
    prefix = f"bc{uuid.uuid4().hex[:6]}_"
    with ps.LocalCluster(2, replicas=None, env=env) as cluster:
        client = ps.connect(cluster.addresses)
        try:
            features = gen.feature_specs()
            _train(client, PSEmbeddingBags(client, features, DIM, fused_table=f"{prefix}warm"), batches[:4],
                   eval_batches[:1])  # untimed: the servers' kernels compile
            for k in STALENESS:
                out = {}
                for cached in (False, True):
                    table = f"{prefix}s{k}_{'cache' if cached else 'plain'}"
                    log(f"bench cache: staleness {k}, {'with' if cached else 'without'} the cache")
                    # The peer pulls as the cached run's misses do (client bound 0): staleness 1 without a
                    # cache is bound 0 with prefetch (trainer.embedding: the client's k-1), staleness 0 is 0.
                    options = TableOptions(optimizer=ps.Adagrad(lr=0.05), staleness=k if cached else min(k, 1),
                                           cache_rows=args.cache_rows if cached else 0)
                    coll = PSEmbeddingBags(client, features, DIM, fused_table=table, options=options)
                    out[cached] = _train(client, coll, batches, eval_batches)
                _report(k, out, params)
        finally:
            client.close()
    return 0


def _report(k: int, out: dict[bool, dict[str, Any]], params: dict[str, Any]) -> None:
    plain, cached = out[False], out[True]
    (cache,) = cached["stats"]["cache"].values()
    emit("cache", "pulled bytes", cached["pull_bytes"], "no cache (same client bound)", plain["pull_bytes"],
         staleness=k, peer_client_bound=0, hit_rate=round(cache["hit_rate"], 4),
         pulled_bytes_saved=round(1 - cached["pull_bytes"] / plain["pull_bytes"], 4),
         pulled_rows=cached["stats"]["pulled_rows"], pulled_rows_no_cache=plain["stats"]["pulled_rows"],
         cached_rows=cached["stats"]["cached_rows"], evictions=cache["evictions"],
         auc=round(cached["auc"], 5), auc_no_cache=round(plain["auc"], 5),
         auc_delta=round(cached["auc"] - plain["auc"], 5), logloss=round(cached["logloss"], 5),
         logloss_no_cache=round(plain["logloss"], 5), samples_per_s=round(cached["samples_per_s"], 1),
         samples_per_s_no_cache=round(plain["samples_per_s"], 1), **params)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))
