"""``tigana bench faults [--quick] [--only NAME,...]``: the fault suite, with real daemons and a ledger.

Every fault runs its trials on real processes (``ps.LocalCluster``: a scheduler and ``tigana server``
daemons) and prints one JSON line: ``case`` ``faults.<name>``, the figure that judges it against its target,
and the keys scripts read (``lost``, ``doubled``, ``crashes``, ``state_changes``, ``stale_epoch_writes``,
``split_brain_writes``, ``false_failovers``, ``rejected_pct``, ``detected_pct``, ``recovery_s_p50``,
``recovery_s_p95``, ``trials``, where they apply) plus ``ok``. Faults that need root (network namespaces,
tmpfs) print a line with ``skipped`` and the reason when they cannot run. The exit code is 1 when any fault
missed its target.

The quick form (``--quick``: fewer trials, a 1-minute soak) of the faults that need no root runs in
``make test`` through ``tests/faults/test_fault_suite.py``.
"""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable

from tigana.tools.bench.report import emit, log
from tigana.tools.testing.faults.common import Report, root_problem

# name -> (module, function, needs root, one line)
FAULTS: dict[str, tuple[str, str, bool, str]] = {
    "kill_sync": ("kills", "kill_sync", False, "kill -9 of a primary, sync replication"),
    "kill_async": ("kills", "kill_async", False, "kill -9 of a primary, async: loss within the reported lag"),
    "snapshot_kill": ("storage", "snapshot_kill", False, "kill -9 during a snapshot write"),
    "pause": ("kills", "pause", False, "SIGSTOP of a primary past the timeout, then SIGCONT"),
    "partition": ("network", "partition", True, "a primary cut off from the scheduler and its replicas"),
    "slow_link": ("network", "slow_link", False, "a slow link (delaying TCP proxy) under the timeout"),
    "disk_full": ("storage", "disk_full", True, "a full disk (small tmpfs) under snapshots and the spill tier"),
    "lmdb_map_full": ("storage", "lmdb_map_full", False, "the spill tier at its --spill-max-bytes cap"),
    "corrupt_store": ("storage", "corrupt_store", False, "truncated or flipped snapshot files, resync"),
    "malformed": ("requests", "malformed", False, "random bytes to every method of every service"),
    "invalid": ("requests", "invalid", False, "well-formed but invalid requests"),
    "credentials": ("requests", "credentials", False, "wrong, missing, expired or wrong-role credentials"),
    "mid_reshard": ("kills", "mid_reshard", False, "kill -9 of a slot move's source or target, then retry"),
    "scheduler": ("kills", "scheduler_kill", False, "kill -9 of the scheduler under load"),
    "scheduler_ha": ("kills", "scheduler_ha", False, "kill -9 of the leading scheduler (2 on etcd), then of a shard"),
    "soak": ("soak", "soak", False, "4 clients with a server killed and replaced periodically"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="3 trials a fault (10 otherwise), a 1-minute soak")
    parser.add_argument("--trials", type=int, default=None, help="trials per fault (default 10, quick 3)")
    parser.add_argument("--only", default=None, help=f"comma-separated faults to run: {','.join(FAULTS)}")
    parser.add_argument("--skip", default=None, help="comma-separated faults to leave out")
    parser.add_argument("--soak-minutes", type=float, default=None, help="soak length (default 10, quick 1)")


def selected(only: str | None, skip: str | None) -> list[str]:
    names = list(FAULTS) if not only else [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names + (skip.split(",") if skip else []) if n and n not in FAULTS]
    if unknown:
        raise SystemExit(f"tigana bench faults: unknown fault(s) {unknown}; known: {', '.join(FAULTS)}")
    return [n for n in names if not skip or n not in skip.split(",")]


def function(name: str) -> Callable[..., Report]:
    import importlib

    module, fn, _, _ = FAULTS[name]
    return getattr(importlib.import_module(f"tigana.tools.testing.faults.{module}"), fn)


def run(args: argparse.Namespace) -> int:
    trials = args.trials or (3 if args.quick else 10)
    soak_s = 60.0 * (args.soak_minutes or (1.0 if args.quick else 10.0))
    failed = []
    for name in selected(args.only, args.skip):
        _, _, needs_root, what = FAULTS[name]
        problem = root_problem() if needs_root else None
        if problem:
            emit(f"faults.{name}", "skipped", 0.0, "none", None, skipped=problem, fault=what, ok=True)
            continue
        log(f"bench faults: {name}: {what}")
        try:
            report = function(name)(trials=trials, quick=bool(args.quick), soak_s=soak_s)
        except Exception as exc:  # noqa: BLE001 - one fault's harness failure must not hide the others
            traceback.print_exc()
            emit(f"faults.{name}", "error", 0.0, "none", None, error=f"{type(exc).__name__}: {exc}"[:500],
                 fault=what, ok=False)
            failed.append(name)
            continue
        report.emit(name, what)
        if not report.ok:
            failed.append(name)
    if failed:
        log(f"bench faults: missed target: {', '.join(failed)}")
    return 1 if failed else 0
