"""``tigana bench nemesis``: the run, its targets and its JSON line (see the package's docstring)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import random
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tigana import ps
from tigana.tools.bench.report import emit, log
from tigana.tools.testing.nemesis.daemons import Daemons
from tigana.tools.testing.nemesis.faults import Faults
from tigana.tools.testing.nemesis.monitor import Monitor, demotion_reasons
from tigana.tools.testing.nemesis.operations import Operations, OpResult, admin_cli
from tigana.tools.testing.nemesis.schedule import FAULTS, pause_between, plan_round
from tigana.tools.testing.nemesis.workload import DURABILITIES, Ledgers

KEYS = ("lost_sync", "doubled_sync", "lost_async", "doubled_async", "async_loss_bound", "primaries_killed",
        "linearizability_violations", "linearizability_violations_async", "copies_demoted_without_failure",
        "max_push_stall_s", "verify", "rss_growth_mib")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="one round of every planned operation, then one of the faults (about a minute)")
    parser.add_argument("--seed", type=int, default=0, help="orders the operations and picks their slots (default 0)")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds of rounds, at least one clean and one with faults (default 240, quick 0)")
    parser.add_argument("--servers", type=int, default=3, help="servers started as the README does (default 3)")
    parser.add_argument("--replicas", type=int, default=1, help="the scheduler's --replicas (default 1)")
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0, help="the scheduler's (default 3 s)")
    parser.add_argument("--clients", type=int, default=2, help="ledger clients per table (default 2)")
    parser.add_argument("--ids", type=int, default=20_000, help="ids of each ledger table (default 20,000)")
    parser.add_argument("--ids-per-push", type=int, default=500, help="ids per ledger push (default 500)")
    parser.add_argument("--push-pause", type=float, default=None,
                        help=f"seconds a ledger client waits after each push (default {Ledgers.pause_s}, quick 0.25)")
    parser.add_argument("--faults", action=argparse.BooleanOptionalAction, default=True,
                        help="kill -9, SIGSTOP and restarts after the clean round (default on)")
    parser.add_argument("--op-timeout", type=float, default=None,
                        help="seconds an admin command may wait for its moves (default 60, quick 10)")
    parser.add_argument("--dir", default=None, help="keep the daemons' data dirs and logs here (default: a "
                                                    "temporary folder, its path printed, removed when the run "
                                                    "meets its targets)")


def run(args: argparse.Namespace) -> int:
    duration = args.duration if args.duration is not None else (0.0 if args.quick else 240.0)
    op_timeout = args.op_timeout or (10.0 if args.quick else 60.0)
    # The quick form (a test of the suite) paces its clients: the run lasts as long as its waits for heartbeats
    # and moves, which a loaded machine stretches, and the traffic costs the daemons CPU the whole time (an idle
    # cluster costs next to nothing). Beside the suite's elastic trainer test, a pause of 20 ms took
    # 266 CPU-s for the two and 160 s; 100 ms, 126 CPU-s and 65 s, with ~16 pushes a second per table. Alone on
    # a loaded machine: 100 ms, 189 CPU-s (4,860 pushes); 250 ms, 103 CPU-s (1,338 pushes, ~7 a second per
    # table, still dozens during each operation).
    push_pause = args.push_pause if args.push_pause is not None else (0.25 if args.quick else Ledgers.pause_s)
    run_dir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tigana-nemesis-"))
    params = {"seed": args.seed, "duration_s": duration, "servers": args.servers, "replicas": args.replicas,
              "heartbeat_timeout_s": args.heartbeat_timeout, "clients_per_table": args.clients, "ids": args.ids,
              "ids_per_push": args.ids_per_push, "push_pause_s": push_pause, "faults": bool(args.faults),
              "quick": bool(args.quick), "dir": str(run_dir)}
    log(f"bench nemesis: daemons, data and logs in {run_dir}")
    try:
        figures = _run(args, run_dir, duration, op_timeout, push_pause)
    except Exception as exc:  # noqa: BLE001 - the harness failed: say so on the JSON line
        traceback.print_exc()
        emit("nemesis", "s", float("nan"), "3x heartbeat timeout", 3 * args.heartbeat_timeout, **params,
             error=f"{type(exc).__name__}: {exc}"[:500], ok=False, targets_missed=["harness"])
        return 1
    missed = targets_missed(figures, args.heartbeat_timeout)
    if not missed and not args.dir:  # a temporary folder of a run that met its targets: nothing to read there
        shutil.rmtree(run_dir, ignore_errors=True)
        params["dir"] = None
    emit("nemesis", "s", figures["max_push_stall_s"], "3x heartbeat timeout", 3 * args.heartbeat_timeout,
         **{k: figures[k] for k in KEYS}, ok=not missed, targets_missed=missed,
         **{k: v for k, v in figures.items() if k not in KEYS}, **params)
    return 1 if missed else 0


def targets_missed(f: dict[str, Any], heartbeat_timeout_s: float) -> list[str]:
    """The names of the targets the run missed (empty: every target held)."""
    missed = []
    if f["lost_sync"] != 0 or f["doubled_sync"] != 0 or f.get("lost_sync_before_faults", 0) != 0:
        missed.append("sync: 0 lost, 0 doubled")
    async_limit = f["async_loss_bound"] if f["primaries_killed"] else 0
    if f["doubled_async"] != 0 or f["lost_async"] is None or f["lost_async"] > async_limit \
            or f.get("lost_async_before_faults", 0) != 0:
        missed.append("async: 0 doubled, 0 lost unless a primary was killed, then within the bound")
    if f.get("linearizability_violations", 0) != 0:
        missed.append("sync: 0 linearizability violations")
    h = f.get("history_async", {})
    if h and (h["phantom_reads"] or (h["linearizability_violations"] if not f["primaries_killed"]
                                     else h["max_read_deficit"] > f["async_loss_bound"])):
        missed.append("async history: no phantom read; linearizable unless a primary was killed, then within "
                      "the bound")
    if f["copies_demoted_without_failure"] != 0:
        missed.append("0 copies demoted without a failure")
    if not f["max_push_stall_s"] < 3 * heartbeat_timeout_s:
        missed.append("max push stall under 3x the heartbeat timeout")
    if f["verify"] != "ok":
        missed.append("admin verify: every copy equal")
    if f["ops_failed"]:
        missed.append("every planned operation succeeds")
    if f["torn_rows"]:
        missed.append("no torn ledger row")
    if f.get("faults_unprotected", 0):
        missed.append("one failure at a time: every fault found each slot with its in-sync copies")
    return missed


def _run(args: argparse.Namespace, run_dir: Path, duration: float, op_timeout: float,
         push_pause: float) -> dict[str, Any]:
    rng = random.Random(args.seed)
    hb = args.heartbeat_timeout
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_client_log(run_dir / "clients.log"))
        d = stack.enter_context(Daemons(run_dir, heartbeat_timeout_s=hb))
        # The README's order: the scheduler, then the servers, then the clients: no wait for the cluster to
        # settle, only for each process to serve (its ready file).
        d.start_scheduler(replicas=args.replicas)
        d.scheduler.wait_ready(60)
        for _ in range(args.servers):
            d.start_server()
        d.wait_ready(120)
        log(f"bench nemesis: scheduler {d.scheduler_address} and {args.servers} servers up after "
            f"{time.monotonic() - t0:.1f}s")
        ctl = stack.enter_context(ps.connect(scheduler=d.scheduler_address))
        ledgers = Ledgers(d.scheduler_address, clients_per_table=args.clients, num_ids=args.ids,
                          ids_per_push=args.ids_per_push, pause_s=push_pause, seed=args.seed,
                          read_pause_s=4 * push_pause if args.quick else 0.05)
        ledgers.create_tables(ctl)
        stack.callback(ledgers.stop)
        ledgers.start()
        assert d.metrics_port is not None
        monitor = Monitor(d.scheduler_address, d.metrics_port, t0=t0).start()
        stack.callback(monitor.finish)
        rss_start = d.rss()
        operations = Operations(d, ledgers, ctl, rng, run_dir, timeout_s=op_timeout,
                                max_joins=1 if args.quick else 2)
        stack.callback(operations.close_scratch)
        faults = Faults(d, ledgers, monitor, ctl, hb)
        clean: dict[str, Any] = {}

        def audit_clean_round() -> None:  # what the planned operations lost, before any fault
            with ps.connect(scheduler=d.scheduler_address) as reader:
                for dur in DURABILITIES:
                    try:
                        clean[f"lost_{dur}_before_faults"] = ledgers.lost_so_far(reader, dur)
                    except ps.PSError as exc:
                        clean[f"lost_{dur}_before_faults"] = f"{type(exc).__name__}: {exc}"[:200]
            log(f"bench nemesis: after the clean round: {clean}")

        results = _rounds(args, rng, operations, faults, duration, audit_clean_round)
        time.sleep(1.0)  # a last second of traffic after the last operation
        operations.close_scratch()
        ledgers.stop()
        histories = {dur: ledgers.history(dur) for dur in DURABILITIES}
        stall, stall_at, stall_table = ledgers.max_stall()
        first_ack = ledgers.first_ack_s()
        first_ack = None if first_ack is None else round(first_ack, 3)
        with ps.connect(scheduler=d.scheduler_address) as reader:  # a client with no push history
            audits = {dur: _audit(ledgers, reader, dur) for dur in DURABILITIES}
        verify = _verify(d.scheduler_address, op_timeout)
        rss_end = d.rss()
        watched = monitor.finish()
        scheduler_log = d.scheduler.log_path if d.scheduler else run_dir / "scheduler.log"
    failed = [r.as_dict() for r in results if not r.ok]
    grown = [rss_end[pid] - mib for pid, mib in rss_start.items() if pid in rss_end]
    return {
        **{f"{k}_{dur}": audits[dur][k] for dur in DURABILITIES for k in ("lost", "doubled")},
        **clean, "async_loss_bound": faults.async_loss_bound(), "primaries_killed": faults.primaries_killed,
        "linearizability_violations": histories["sync"]["linearizability_violations"],
        "linearizability_violations_async": histories["async"]["linearizability_violations"],
        "history_sync": histories["sync"], "history_async": histories["async"],
        "faults_unprotected": faults.faults_unprotected, "max_reprotect_s": round(faults.max_reprotect_s, 2),
        "copies_demoted_without_failure": watched.pop("copies_demoted_without_failure"),
        "max_push_stall_s": round(stall, 3), "verify": verify,
        "max_push_stall_during": _during(results, stall_at, stall, stall_table, t0),
        "max_push_stall_at": _wall(stall_at), "first_ack_s": first_ack,
        "rss_growth_mib": round(sum(grown), 1), "rss_growth_mib_max": round(max(grown, default=0.0), 1),
        **watched, "demotion_reasons": demotion_reasons(scheduler_log),
        **{f"{k}_{dur}": audits[dur][k] for dur in DURABILITIES
           for k in ("acked_updates", "acked_pushes", "failed_pushes", "lost_ids", "errors")},
        "torn_rows": sum(a["torn_rows"] or 0 for a in audits.values()),
        **{f"audit_error_{dur}": audits[dur]["error"] for dur in DURABILITIES if "error" in audits[dur]},
        "ops": len(results), "ops_failed": len(failed), "failed": failed[:8],
        "ops_run": [r.op for r in results if not r.skipped], "faults_injected": sum(r.op in FAULTS for r in results),
        "lag_samples_failed": faults.lag_samples_failed, "elapsed_s": round(time.monotonic() - t0, 1),
    }


def _rounds(args: argparse.Namespace, rng: random.Random, operations: Operations, faults: Faults,
            duration: float, after_clean_round: Callable[[], None]) -> list[OpResult]:
    """The clean round (then ``after_clean_round()``), then rounds with faults (when on) until ``duration``
    has passed."""
    results: list[OpResult] = []
    start = time.monotonic()
    round_no = 0
    while round_no == 0 or (args.faults and round_no == 1) or time.monotonic() - start < duration:
        plan = plan_round(rng, faults=args.faults and round_no > 0, join=operations.joins_left > 0)
        if args.quick and round_no > 0:  # the quick form's fault round: the faults alone
            plan = [op for op in plan if op in FAULTS]
        log(f"bench nemesis: round {round_no + 1}: {' '.join(plan)}")
        for op in plan:
            time.sleep(pause_between(rng, args.quick))
            r = faults.run(op) if op in FAULTS else operations.run(op)
            results.append(r)
            log(f"  {op}: {'ok' if r.ok else 'FAILED'}{' (skipped)' if r.skipped else ''} in {r.seconds:.1f}s: "
                f"{r.detail[:200]}")
        if round_no == 0:
            after_clean_round()
        round_no += 1
        if not args.faults and args.quick:
            break
    return results


def _audit(ledgers: Ledgers, reader: ps.Client, durability: str) -> dict[str, Any]:
    """``Ledgers.audit``, or (the table unreadable: every figure unknown, which misses the targets) the error."""
    try:
        return ledgers.audit(reader, durability)
    except ps.PSError as exc:
        keys = ("lost", "doubled", "acked_updates", "acked_pushes", "failed_pushes", "lost_ids", "errors",
                "torn_rows")
        return {**dict.fromkeys(keys), "error": f"{type(exc).__name__}: {exc}"[:300]}


def _during(results: list[OpResult], at: float, seconds: float, table: str, t0: float) -> str:
    """Where a stall of ``seconds`` that began at ``at`` falls: the operations that overlap it, else the last
    one before it."""
    overlap = [r.op for r in results if r.started_at < at + seconds and r.started_at + r.seconds > at]
    before = [r for r in results if r.started_at <= at]
    where = "start-up, before any operation"
    if overlap:
        where = ", ".join(overlap) + " (overlapping it)"
    elif before:
        where = f"{before[-1].op} (the last one before)"
    return f"{table} client, {at - t0:.1f}s after start: {where}"


def _wall(at: float) -> str:
    """A monotonic instant as the local wall-clock time the daemons' logs use."""
    when = datetime.datetime.now() - datetime.timedelta(seconds=time.monotonic() - at)
    return when.strftime("%H:%M:%S.%f")[:-3]


@contextlib.contextmanager
def _client_log(path: Path):  # noqa: ANN202 - a context manager
    """The ledger clients' retries and map changes (DEBUG of ``tigana.ps.client`` and the map follower) in
    ``path``, stamped like the daemons' logs, to read a stall against them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(n) for n in ("tigana.ps.client", "tigana.ps.mapfollower")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
        handler.close()


def _verify(scheduler: str, timeout_s: float) -> str:
    """``tigana admin verify``: "ok", or what it found."""
    rc, report, err = admin_cli(scheduler, ["verify"], timeout_s)
    if rc == 0:
        return "ok"
    if report is None:
        return f"exit {rc}: {err.splitlines()[-1] if err else ''}"[:200]
    return (f"{report.get('slots_differing', '?')} slot copies differ, unreachable "
            f"{report.get('unreachable', [])}" if "error" not in report else str(report["error"])[:200])
