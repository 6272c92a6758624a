"""``bench ps --replicas N``: push and pull rows/s with sync and async replication against none, interleaved
in one run."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import numpy as np

from tigana import ps
from tigana.tools.bench.ps.workload import _Cycle, interleaved_rates, zipf_batches
from tigana.tools.bench.report import emit, log


def _bench_replication(args: argparse.Namespace) -> int:
    """Push (and pull) rows/s with sync and async replication against none, interleaved in one run."""
    repeats = args.repeats or (5 if args.quick else 9)
    dims = [int(d) for d in args.dims.split(",")] if args.dims != "16,64" else [64]
    batches = zipf_batches(4 if args.quick else 8, args.batch, args.num_ids, args.zipf)
    unique_rows = int(np.mean([np.unique(b).size for b in batches]))
    env = dict(os.environ, TIGANA_SNAPSHOT_ON_SHUTDOWN="0")
    log(f"bench ps --replicas {args.replicas}: batch {args.batch}, ~{unique_rows} unique ids, dims {dims}")
    base = {"batch": args.batch, "unique_ids": unique_rows, "num_ids": args.num_ids, "zipf": args.zipf, "shards": 2,
            "replicas": args.replicas, "repeats": repeats, "wire": "fp32", "optimizer": "adagrad"}
    with ps.LocalCluster(2, replicas=None, env=env) as plain, \
            ps.LocalCluster(2, replicas=args.replicas, env=env) as replicated, \
            ps.connect(plain.addresses) as none_client, ps.connect(scheduler=replicated.scheduler) as rep_client:
        for dim in dims:
            tables = {"none": (none_client, f"rep_none_d{dim}"), "sync": (rep_client, f"rep_sync_d{dim}"),
                      "async": (rep_client, f"rep_async_d{dim}")}
            for mode, (client, name) in tables.items():
                client.create_table(name, dim=dim, optimizer=ps.Adagrad(lr=0.01), initializer=ps.Normal(std=0.01),
                                    staleness=1, durability=None if mode == "none" else mode)
                for b in batches:  # insert every row first: the timed runs update existing rows
                    client.pull(name, b)
            rng = np.random.default_rng(1)
            grads = _Cycle([rng.normal(0, 0.01, (b.size, dim)).astype(np.float32) for b in batches])
            batch = _Cycle(batches)
            n, in_flight = batches[0].size, 4

            barrier = {"async": tables["sync"][1]}
            push = interleaved_rates({m: _pusher(*tables[m], batch, grads, n, in_flight, dim, barrier.get(m))
                                      for m in tables}, repeats)
            pull = interleaved_rates({m: _puller(*tables[m], batch, n) for m in tables}, repeats)
            params = dict(base, dim=dim)
            for mode in ("sync", "async"):
                emit(f"push_{mode}", "rows/s", push[mode], "no replication", push["none"], durability=mode,
                     copies_applied=True, **params)
            for mode in ("sync", "async"):
                emit(f"pull_{mode}", "rows/s", pull[mode], "no replication", pull["none"], durability=mode, **params)
            lag = rep_client.server_stats(tables["async"][1])
            log("bench ps --replicas: replication lag after the async runs: " + ", ".join(
                f"{a}: {v[tables['async'][1]].get('replication_lag_items', 0):.0f} items" for a, v in lag.items()))
            for client, name in tables.values():
                client.drop_table(name)
    return 0


def _pusher(client: ps.Client, name: str, batch: _Cycle, grads: _Cycle, n: int, in_flight: int, dim: int,
            barrier: str | None = None) -> Callable[[], int]:
    """Pushes ``in_flight`` batches and waits for their acknowledgements. With ``barrier`` (a sync table of the
    same cluster; for the async case) it then waits until the copies applied them too: the sustained rate,
    whose replication neither runs for free after the timed unit nor slows the case timed next (issue 17 found
    async figures of 0.70-0.96x that were that). A sync push acknowledged by a server's copies comes after every
    item queued before it to them (one ordered stream per copy, whatever the table), so a small sync push to
    every server is the wait."""
    probe = np.arange(1024, dtype=np.int64)  # spread over every slot's server
    zero = np.zeros((probe.size, dim), np.float32)

    def fn() -> int:
        for _ in range(in_flight):
            client.push(name, batch(), grads())
        client.flush()
        if barrier is not None:
            client.push(barrier, probe, zero)
            client.flush()
        return n * in_flight
    return fn


def _puller(client: ps.Client, name: str, batch: _Cycle, n: int) -> Callable[[], int]:
    def fn() -> int:
        client.pull(name, batch())
        return n
    return fn
