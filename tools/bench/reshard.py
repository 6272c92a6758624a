"""``tigana bench reshard``: live slot moves on a real cluster, measured against the data path of the same run.

A scheduler and 3 shard daemons (1 replica of every slot, sync pushes) hold a table of ``--rows`` rows (dim 16,
row-wise Adagrad). Cases, one JSON line each:

- ``reshard.move``: a 4th server joins and ``rebalance`` moves its share of the slots to it while a push loop
  runs; rows copied per second (peer: pulling every row of the table once, the read limit of the data path),
  with ``rows_moved`` and ``rows_share`` (a quarter of every row's two copies: what an even move copies);
- ``reshard.push_p99``: push latency p99 during that move (peer: p99 of the same push loop over the 8 s before
  it, about as many pushes as the move sees), with the
  medians of both, the slowest push during the move and when it started (seconds into the move); the servers
  pace the move's copies at their ``--copy-rate`` (32MiB by default; ``--copy-rate`` here sets theirs);
- ``reshard.drain``: seconds to drain one server (peer: the time to pull the rows it held), with the slots whose
  copies differ afterwards (``copies_differing``; any makes the exit status 1);
- ``reshard.balance``: max/mean server load (rows held + request rate led, the planner's cost model) under
  Zipf(1.05) pulls and pushes after ``rebalance``, against the same figure before it.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np

from tigana import ps
from tigana.ps.allocator import ALLOCATOR_ENV
from tigana.ps.ops import admin
from tigana.ps.scheduler import placement
from tigana.tools.bench.ps import zipf_batches
from tigana.tools.bench.report import emit, log

DIM = 16
BEFORE_S = 8.0  # seconds of pushes measured before the move (the peer): about a move's length


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="1M rows instead of 10M")
    parser.add_argument("--rows", type=int, default=None, help="rows in the table (default 10M, quick 1M)")
    parser.add_argument("--batch", type=int, default=65536, help="ids per push of the traffic (default 65536)")
    parser.add_argument("--copy-rate", default=None,
                        help="the servers' --copy-rate (default: theirs, 32MiB; 'unlimited' for none)")


class _Traffic:
    """Zipf(1.05) pushes (and the pulls a trainer does first), one batch at a time; latency of every push."""

    def __init__(self, client: ps.Client, table: str, num_ids: int, batch: int) -> None:
        self.client, self.table = client, table
        self.batches = zipf_batches(8, batch, num_ids, 1.05, seed=7)
        rng = np.random.default_rng(3)
        self.grads = [rng.normal(0, 0.01, (b.size, DIM)).astype(np.float32) for b in self.batches]
        self.latencies: list[tuple[float, float]] = []  # (start, seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> _Traffic:
        self._thread.start()
        return self

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            b = self.batches[i % len(self.batches)]
            self.client.pull(self.table, b)
            t = time.monotonic()
            self.client.push(self.table, b, self.grads[i % len(self.grads)]).result()
            self.latencies.append((t, time.monotonic() - t))
            i += 1

    def p99(self, t0: float, t1: float) -> float:
        xs = self.between(t0, t1)
        return float(np.percentile(xs, 99)) if xs else float("nan")

    def between(self, t0: float, t1: float) -> list[float]:
        """Latencies of the pushes started in [t0, t1) (how many there are says what a p99 of them means)."""
        return [d for t, d in self.latencies if t0 <= t < t1]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)


def _pull_all(client: ps.Client, table: str, ids: np.ndarray) -> float:
    """Seconds to pull (read only) every one of ``ids`` once, in batches of 65536."""
    t = time.monotonic()
    for lo in range(0, ids.size, 65536):
        client.pull(table, ids[lo:lo + 65536], insert=False)
    return time.monotonic() - t


def _replication_drained(client: ps.Client, table: str) -> bool:
    stats = client.server_stats(table)
    lag = {a: int(v[table].get("replication_lag_items", 0)) for a, v in stats.items() if table in v}
    if any(lag.values()):
        log(f"bench reshard: replication still queued: {lag}")
    return not any(lag.values())


def _measured_balance(scheduler: str) -> float:
    """Max/mean server load under the planner's cost model, from the servers' own per-slot figures."""
    m = admin.shard_map(scheduler)
    load = admin.slot_load(scheduler)
    rows = np.frombuffer(load.rows, "<i8").astype(float)
    rates = np.frombuffer(load.rates, "<f8")
    up = np.array([s.up for s in m.servers])
    loads = placement.server_loads(m.copies, len(m.servers), rows, rates, placement.CostModel())[up]
    return float(loads.max() / loads.mean())


def run(args: argparse.Namespace) -> int:
    total = args.rows or (1_000_000 if args.quick else 10_000_000)
    env = {**ALLOCATOR_ENV, **os.environ}
    params = {"rows": total, "dim": DIM, "optimizer": "rowwise_adagrad", "replicas": 1, "durability": "sync",
              "copy_rate": args.copy_rate or "32MiB (default)", "quick": bool(args.quick)}
    server_args = ["--copy-rate", args.copy_rate] if args.copy_rate else []
    # No automatic rebalance: it would start moving slots to the 4th server as it joins, before the measured
    # window, and the rebalance below would then re-plan a move already half done.
    with ps.LocalCluster(3, replicas=1, env=env, server_args=server_args,
                         scheduler_args=["--no-auto-rebalance"]) as cluster, \
            ps.connect(scheduler=cluster.scheduler) as client:
        # A server that registers after the scheduler's --bootstrap-wait (a cold start on a loaded machine) joins
        # a placement made without it and, with no automatic rebalance, stays empty: the move below then fills
        # two servers instead of one (a make test run copied every row once, twice the 4th server's share).
        # The three are evened out first, while the cluster holds no rows.
        admin.rebalance(cluster.scheduler)
        admin.wait_for(lambda: admin.settled(cluster.scheduler), 600, "the initial balance")
        client.create_table("reshard", dim=DIM, optimizer=ps.RowWiseAdagrad(lr=0.01), staleness=None)
        ids = np.arange(total, dtype=np.int64) * 2654435761 % (1 << 62)
        t = time.monotonic()
        for lo in range(0, total, 65536):
            client.pull("reshard", ids[lo:lo + 65536])
        log(f"bench reshard: {total} rows inserted in {time.monotonic() - t:.1f}s")
        read_s = _pull_all(client, "reshard", ids)
        # the inserts' replication may still be queued: the pushes measured before the move would wait behind it
        admin.wait_for(lambda: _replication_drained(client, "reshard"), 600, "the load's replication")
        traffic = _Traffic(client, "reshard", total, args.batch).start()
        try:
            # the window before the move as long as a move (about as many pushes): a p99 of 40 pushes swung
            # 0.03-0.07 s between runs, and the ratio with it
            time.sleep(BEFORE_S)
            before_move = time.monotonic()
            # a 4th server joins; rebalance moves its share to it while the traffic runs
            new = cluster.add_server()
            time.sleep(1.5)  # its rates and rows show in the servers' figures
            balance_before = _measured_balance(cluster.scheduler)
            start = time.monotonic()
            load = admin.slot_load(cluster.scheduler)
            plan = admin.rebalance(cluster.scheduler, load=load)
            admin.wait_for(lambda: admin.settled(cluster.scheduler), 3600, "the rebalance")
            move_s = time.monotonic() - start
            rows_of_slot = np.frombuffer(load.rows, "<i8")
            moved = int(sum(int(rows_of_slot[m.slot]) * len(m.add) for m in plan.moves))  # rows copied
            share = int(rows_of_slot.sum()) * 2 // 4  # the 4th server's share: a quarter of every row's 2 copies
            log(f"bench reshard: {len(plan.moves)} slot move(s) onto server {new}, {moved} rows copied")
            p99_idle, p99_move = traffic.p99(before_move - BEFORE_S, before_move), traffic.p99(start, start + move_s)
            during = traffic.between(start, start + move_s)
            before = traffic.between(before_move - BEFORE_S, before_move)
            slowest = max(((d, t - start) for t, d in traffic.latencies if start <= t < start + move_s), default=(0, 0))
            time.sleep(3.0)  # rates settle on the new placement
            balance_after = _measured_balance(cluster.scheduler)
        finally:
            traffic.stop()
        emit("reshard.move", "rows/s", moved / move_s, "pull of every row (read limit)", total / read_s,
             rows_moved=moved, rows_share=share, seconds=round(move_s, 3), **params)
        emit("reshard.push_p99", "s", p99_move, "push p99 before the move", p99_idle, batch=args.batch,
             pushes_during=len(during),
             pushes_before=len(before), push_p50_during=round(float(np.median(during)), 4),
             push_p50_before=round(float(np.median(before)), 4), push_max_during=round(slowest[0], 4),
             push_max_at_s=round(slowest[1], 2), **params)
        emit("reshard.balance", "max/mean", balance_after, "max/mean before rebalance", balance_before,
             servers=4, traffic="zipf(1.05) pull+push", **params)
        # drain one of the original servers (no traffic): the time it takes against reading its rows
        status = admin.cluster_status(cluster.scheduler)
        victim = status["servers"][0]
        held = int(victim["stats"].get("rows", 0))
        start = time.monotonic()
        admin.drain(cluster.scheduler, victim["id"])
        admin.wait_for(lambda: admin.settled(cluster.scheduler), 3600, "the drain")
        drain_s = time.monotonic() - start
        differing = admin.verify(cluster.scheduler)["differing"]  # the moves and the drain left every copy equal
        emit("reshard.drain", "s", drain_s, "pull of the rows it held", read_s * held / total, rows_held=held,
             copies_differing=len(differing), **params)
        log(f"bench reshard: verify {differing[:3] or 'all copies equal'}")
    return 1 if differing else 0
