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

from tigana.tools.bench.report import emit
from tigana.tools.testing.faults.kills import TARGET_P95_S, kill_primaries


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="3 trials instead of 10")
    parser.add_argument("--trials", type=int, default=None, help="kills of a primary (default 10, quick 3)")
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0, help="the scheduler's (default 3 s)")
    parser.add_argument("--ids", type=int, default=50_000, help="ledger ids (default 50,000)")
    parser.add_argument("--ids-per-push", type=int, default=2000, help="ids per push (default 2,000)")


def run(args: argparse.Namespace) -> int:
    trials = args.trials or (3 if args.quick else 10)
    f = kill_primaries(trials, heartbeat_timeout=args.heartbeat_timeout, num_ids=args.ids,
                       ids_per_push=args.ids_per_push)
    emit("failover", "s", f["recovery_s_p95"], "target p95", TARGET_P95_S, **f, quick=bool(args.quick))
    return 0 if f["lost"] == 0 and f["doubled"] == 0 and not f["copies_differing"] else 1
