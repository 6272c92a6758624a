"""``tigana bench ps --inserts N``: first-sight pulls (every id new, so every row is inserted and initialized)
against pushes of resident rows, through one shard daemon, and the daemon's memory per resident row.

The common case of a CTR job's first epoch over billions of ids is a pull of ids the table has never seen. Each
timed unit inserts one batch of fresh random int64 ids and pushes one batch of ids already resident (drawn at
random from the rows inserted so far), so both kinds see the same machine load and the same table size; the
insert rate and the push rate are medians over every unit. At the end the daemon's RSS and the engine's own
count of resident bytes are divided by the rows it holds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import numpy as np

from tigana import ps
from tigana.tools.bench.report import emit, log
from tigana.tools.bench.scale.resources import _rss_bytes, process_cpu_s

TABLE = "first_sight"
TARGET_BYTES_PER_ROW = 100.0


def bench_inserts(args: argparse.Namespace) -> int:
    rows, batch, dim = args.inserts, args.batch, args.insert_dim
    units = max(2, rows // batch)
    rng = np.random.default_rng(7)
    env = dict(os.environ, TIGANA_SNAPSHOT_ON_SHUTDOWN="0")
    params = {"rows": units * batch, "batch": batch, "dim": dim, "optimizer": "rowwise_adagrad",
              "initializer": "normal", "ids": "uniform random int64", "shards": 1, "replicas": 0}
    cluster = client = None
    try:
        cluster = ps.LocalCluster(1, replicas=None, env=env)
        client = ps.connect(cluster.addresses)
        client.wait_ready(30)
        client.create_table(TABLE, dim=dim, optimizer=ps.RowWiseAdagrad(lr=0.01), initializer=ps.Normal(std=0.01),
                            staleness=0)
        pid = cluster.procs[0].pid
        rss0 = _rss_bytes(pid)
        grads = rng.normal(0, 0.01, (batch, dim)).astype(np.float32)
        seen = np.empty(units * batch, np.int64)
        insert_rates, push_rates = [], []
        cpu0, t_start = process_cpu_s(pid), time.perf_counter()
        for u in range(units):
            fresh = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, batch, dtype=np.int64,
                                 endpoint=True)
            t0 = time.perf_counter()
            client.pull(TABLE, fresh)
            t1 = time.perf_counter()
            seen[u * batch:(u + 1) * batch] = fresh
            resident = seen[rng.integers(0, (u + 1) * batch, batch)]
            t2 = time.perf_counter()
            client.push(TABLE, resident, grads)
            client.flush()
            t3 = time.perf_counter()
            if u:  # the first unit pays the daemon's kernel warm-up
                insert_rates.append(batch / (t1 - t0))
                push_rates.append(batch / (t3 - t2))
            if (u + 1) % max(1, units // 10) == 0:
                log(f"bench ps --inserts: {(u + 1) * batch / 1e6:.1f} M rows, insert "
                    f"{statistics.median(insert_rates or [0]) / 1e6:.2f} M rows/s, push "
                    f"{statistics.median(push_rates or [0]) / 1e6:.2f} M rows/s, RSS "
                    f"{_rss_bytes(pid) / 2**20:.0f} MiB")
        elapsed, cpu = time.perf_counter() - t_start, process_cpu_s(pid) - cpu0
        emit("insert", "rows/s", statistics.median(insert_rates), "push (resident rows, same daemon)",
             statistics.median(push_rates), daemon_cpu_s=round(cpu, 1), elapsed_s=round(elapsed, 1), **params)
        rss = _rss_bytes(pid)
        stats = client.describe_table(TABLE).stats
        resident_rows, engine_bytes = int(stats["rows_resident"]), int(stats["bytes_resident"])
        emit("insert.memory", "bytes/row", rss / resident_rows, "target", TARGET_BYTES_PER_ROW,
             rss_bytes=rss, rss_at_start_bytes=rss0, rss_growth_per_row=round((rss - rss0) / resident_rows, 1),
             engine_bytes_per_row=round(engine_bytes / resident_rows, 1), rows_resident=resident_rows, **params)
    finally:
        if client is not None:
            with contextlib.suppress(ps.PSError):
                client.close()
        if cluster is not None:
            cluster.close(timeout=30)
    return 0
