"""``tigana bench sim --seeds N``: the deterministic simulator (``tigana.tools.testing.sim``) over many seeds.

Each seed runs the real scheduler core, shard services and membership agents, and trainers on the real client,
over a simulated network with planned operations and faults, checking the invariants of docs/replication.md after every step. One JSON line: ``seeds``,
``steps``, ``violations`` (seeds that broke an invariant, with the first ones named and how to replay them),
``slowest_convergence_s`` (simulated seconds from the end of the busy phase to a fully replicated, settled
cluster), ``sim_speed`` (simulated seconds per wall second of one simulation process, every checker included;
``wall_speed``: per second of the whole run, which ``--jobs N`` processes side by side raise). The peer is the target:
0 violations. Exit 1 on any violation.

Replay one seed with its minimal trace: ``tigana bench sim --seed-from 17 --seeds 1 --trace`` (a failing
seed prints its replay command). ``--snapshot-every S`` gives the servers data dirs, snapshots every S
simulated seconds and the fault of losing every copy of a slot (the unclean election). ``--hosts H`` puts server
k on host ``h{k mod H}`` (its failure domain) and adds the fault of losing a whole host at once.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from multiprocessing import get_context

from tigana.tools.bench.report import emit, log
from tigana.tools.testing.sim import Settings, run_seed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=1000, help="seeds to run (default 1000)")
    parser.add_argument("--seed-from", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--quick", action="store_true", help="20 seeds")
    parser.add_argument("--faults", action=argparse.BooleanOptionalAction, default=True,
                        help="crashes, pauses, partitions, drops and scheduler restarts (default on)")
    parser.add_argument("--busy", type=float, default=15.0, help="simulated seconds of workload per seed (15)")
    parser.add_argument("--servers", type=int, default=3, help="servers at the start (default 3)")
    parser.add_argument("--snapshot-every", type=float, default=0.0, metavar="SECONDS",
                        help="servers get data dirs, snapshots this often, and the fault of losing every copy "
                             "of a slot (default 0: memory only)")
    parser.add_argument("--hosts", type=int, default=0,
                        help="server k runs on host h{k mod HOSTS}, and a fault crashes every server of a host at "
                             "once (default 0: every server a host of its own, no such fault)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="worker processes running seeds side by side (default 1); the report is the same "
                             "whatever the number")
    parser.add_argument("--trace", action="store_true",
                        help="print the minimal trace of every failing seed to stderr (its operations and the "
                             "lines about the violation's servers and tables)")


def run(args: argparse.Namespace) -> int:
    seeds = 20 if args.quick else args.seeds
    if args.jobs < 1:
        log(f"bench sim: --jobs must be >= 1, got {args.jobs}")
        return 2
    settings = Settings(servers=args.servers, busy_s=args.busy, faults=bool(args.faults),
                        snapshot_every_s=args.snapshot_every, hosts=args.hosts)
    replay = (f"tigana bench sim --seed-from SEED --seeds 1 --busy {args.busy:g} --servers {args.servers}"
              f"{'' if args.faults else ' --no-faults'}{f' --hosts {args.hosts}' if args.hosts else ''}"
              f"{f' --snapshot-every {args.snapshot_every:g}' if args.snapshot_every else ''} --trace")
    started = time.perf_counter()
    steps, failing, slowest, acked, demoted, pulls, simulated, seed_wall = 0, [], 0.0, 0, 0, 0, 0.0, 0.0
    for seed, out in _outcomes(range(args.seed_from, args.seed_from + seeds), settings, args.jobs, args.trace):
        steps += out.steps
        simulated += out.simulated_s
        seed_wall += out.seconds
        acked += out.acked
        demoted += out.demotions_without_fault
        pulls += out.pulls
        if out.convergence_s is not None:
            slowest = max(slowest, out.convergence_s)
        if out.violation:
            failing.append({"seed": seed, "violation": out.violation[:300]})
            log(f"bench sim: seed {seed}: {out.violation}")
            log(f"bench sim: replay: {replay.replace('SEED', str(seed))}")
            if args.trace:
                log("\n".join(out.trace))
    wall = time.perf_counter() - started
    emit("sim", "violations", float(len(failing)), "target", 0.0, seeds=seeds, seed_from=args.seed_from,
         steps=steps, violations=len(failing), failing=failing[:10], slowest_convergence_s=round(slowest, 3),
         acked_pushes=acked, faults=bool(args.faults), busy_s=args.busy, servers=args.servers,
         snapshot_every_s=args.snapshot_every, hosts=args.hosts, demotions_without_fault=demoted, pulls=pulls,
         jobs=args.jobs, seconds=round(wall, 1), simulated_s=round(simulated, 1),
         sim_speed=round(simulated / max(seed_wall, 1e-9), 2), wall_speed=round(simulated / wall, 2), replay=replay)
    return 1 if failing else 0


@dataclass(frozen=True)
class _Summary:
    """What the report needs of one seed's ``Outcome`` (small enough to send back from a worker process)."""

    steps: int
    simulated_s: float
    seconds: float  # wall seconds the seed took in its process
    acked: int
    demotions_without_fault: int
    pulls: int
    convergence_s: float | None
    violation: str  # the first one, "" when the seed passed
    trace: list[str]  # the minimal trace of a failing seed (with --trace), else empty


_seeds_run = 0  # per process: gc.freeze() once the first seed has loaded the modules and compiled kernels


def _run_one(seed: int, settings: Settings, trace: bool) -> _Summary:
    global _seeds_run
    started = time.perf_counter()
    out = run_seed(seed, settings)
    seconds = time.perf_counter() - started
    _seeds_run += 1
    if _seeds_run == 1:  # what the first seed loaded lives as long as the process: a full collection scanned it
        gc.collect()  # every time (a tenth of the run); later seeds' garbage is collected as before
        gc.freeze()
    return _Summary(out.steps, out.simulated_s, seconds, out.acked, out.demotions_without_fault, out.pulls,
                    out.convergence_s, out.violations[0] if out.violations else "",
                    out.minimal_trace() if trace and out.violations else [])


def _outcomes(seeds: range, settings: Settings, jobs: int, trace: bool) -> Iterator[tuple[int, _Summary]]:
    """Each seed's summary, in seed order: in this process, or with ``jobs`` > 1 in that many worker processes
    (spawned: each seed is deterministic in its own process whichever worker runs it)."""
    if jobs == 1:
        for seed in seeds:
            yield seed, _run_one(seed, settings, trace)
        return
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        yield from zip(seeds, pool.map(partial(_run_one, settings=settings, trace=trace), seeds), strict=True)
