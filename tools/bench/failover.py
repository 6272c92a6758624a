"""``tigana bench failover``: ``kill -9`` of a primary under a push loop, again and again, checked by a ledger.

A scheduler and 2 shard daemons (1 replica of every slot, sync pushes) run a ledger push loop
(``tigana.tools.bench.ledger``: every acknowledged push adds exactly 1 to its ids' rows). Each trial waits
until every copy is in sync, ``kill -9``-s the server leading the most slots, measures the recovery (from the
kill to the acknowledgement of the first push sent after it), restarts the killed server on its data dir
(it comes back as a new process and is rebuilt as a copy by the slot copy), and goes on. At the end the
ledger is audited: acknowledged updates lost and doubled must be 0.

One JSON line: ``lost``, ``doubled``, ``recovery_s_p50``, ``recovery_s_p95``, ``trials`` (value: the p95
recovery against the 3 s target as the peer).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from tigana import ps
from tigana.ps import admin
from tigana.ps.daemon import ALLOCATOR_ENV
from tigana.tools.bench.ledger import PushLoop, audit, create_ledger_table
from tigana.tools.bench.report import emit, log

TARGET_P95_S = 3.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="3 trials instead of 10")
    parser.add_argument("--trials", type=int, default=None, help="kills of a primary (default 10, quick 3)")
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0, help="the scheduler's (default 3 s)")
    parser.add_argument("--ids", type=int, default=50_000, help="ledger ids (default 50,000)")
    parser.add_argument("--ids-per-push", type=int, default=2000, help="ids per push (default 2,000)")






def run(args: argparse.Namespace) -> int:
    trials = args.trials or (3 if args.quick else 10)
    env = {**ALLOCATOR_ENV, **os.environ}
    recoveries: list[float] = []
    with ps.LocalCluster(2, replicas=1, env=env, heartbeat_timeout=args.heartbeat_timeout) as cluster, \
            ps.connect(scheduler=cluster.scheduler, failover_timeout_s=120) as client:
        create_ledger_table(client)
        loop = PushLoop(client, num_ids=args.ids, ids_per_push=args.ids_per_push).start()
        try:
            for trial in range(trials):
                admin.wait_for(lambda: admin.settled(cluster.scheduler), 120, "every copy in sync")
                n = loop.acked_count()
                admin.wait_for(lambda n=n: loop.acked_count() > n + 20, 60, "pushes before the kill")
                m = admin.shard_map(cluster.scheduler)
                led = {m.servers[i].address: int(m.leads(i).sum()) for i in range(len(m.servers))}
                victim = max(range(len(cluster.addresses)), key=lambda i: led.get(cluster.addresses[i], 0))
                killed_at = time.monotonic()
                cluster.kill(victim)
                admin.wait_for(lambda t=killed_at: loop.first_ack_sent_after(t) is not None, 120, "a push after the kill")
                recoveries.append(loop.first_ack_sent_after(killed_at) - killed_at)
                log(f"bench failover: trial {trial + 1}/{trials}: killed shard {victim} ({led.get(cluster.addresses[victim])}"
                    f" slots led), recovery {recoveries[-1]:.3f}s, {loop.acked_count()} pushes acknowledged")
                cluster.restart(victim)
            admin.wait_for(lambda: admin.settled(cluster.scheduler), 120, "every copy in sync")
        finally:
            loop.stop()
        result = audit(client, loop)
        check = admin.verify(cluster.scheduler)
    p50, p95 = (float(np.percentile(recoveries, q)) for q in (50, 95))
    emit("failover", "s", p95, "target p95", TARGET_P95_S, lost=result.lost, doubled=result.doubled,
         recovery_s_p50=round(p50, 4), recovery_s_p95=round(p95, 4), trials=trials,
         acked_pushes=result.acked_pushes, acked_updates=result.acked_updates,
         failed_pushes=result.failed_pushes, copies_differing=len(check["differing"]),
         shards=2, replicas=1, durability="sync", heartbeat_timeout_s=args.heartbeat_timeout,
         ids_per_push=args.ids_per_push, quick=bool(args.quick))
    return 0 if result.lost == 0 and result.doubled == 0 and not check["differing"] else 1
