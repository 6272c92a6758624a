"""The soak: 4 clients pushing and pulling for minutes while a server is ``kill -9``-ed and replaced by a new
one at a fixed period; errors, lost and doubled updates, and memory growth are reported."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tigana import ps
from tigana.ps.ops import admin
from tigana.tools.bench.ledger import PushLoop, audit, create_ledger_table
from tigana.tools.bench.report import log
from tigana.tools.testing.faults.common import Report, cluster, rss_mib

CLIENTS = 4


class _Reader:
    """Pulls (read only) random ledger ids in a loop; counts pulls and errors."""

    def __init__(self, client: ps.Client, table: str, num_ids: int, seed: int) -> None:
        self.client, self.table, self.num_ids = client, table, num_ids
        self.rng = np.random.default_rng(seed)
        self.pulls = self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.client.pull(self.table, self.rng.choice(self.num_ids, 500, replace=False), insert=False)
                self.pulls += 1
            except ps.PSError:
                self.errors += 1
            self._stop.wait(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def _demotions(scheduler_log: Path) -> list[str]:
    """The scheduler's demotions (copies taken out of the in-sync set), as its log says them: each one makes
    the sync pushes to those slots acknowledged under-replicated until the copy is in sync again."""
    try:
        lines = scheduler_log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line.split(": ", 1)[-1][:200] for line in lines if "out of the in-sync set" in line]


def soak(trials: int, quick: bool, soak_s: float = 600.0, kill_every_s: float | None = None, **_: Any) -> Report:
    """``soak_s`` seconds (the trials count does not apply) of 4 clients, each with its own ledger table, a
    push loop and a pull loop, on 3 servers (1 replica, sync); every ``kill_every_s`` (2 minutes; a third of
    the soak when shorter than 6 minutes) the cluster is let settle, a random server is ``kill -9``-ed and a
    new one joins (the scheduler gives it slots)."""
    period = kill_every_s or (120.0 if soak_s >= 360 else soak_s / 3)
    rng = random.Random(11)
    kills = 0
    unsettled = 0
    with cluster(3, scheduler_args=["--auto-rebalance"]) as c:
        clients = [ps.connect(scheduler=c.scheduler, failover_timeout_s=120) for _ in range(CLIENTS)]
        loops: list[PushLoop] = []
        readers: list[_Reader] = []
        try:
            for k, client in enumerate(clients):
                create_ledger_table(client, f"soak-{k}")
                loops.append(PushLoop(client, table=f"soak-{k}", ids_per_push=500, seed=k, pause_s=0.01).start())
                readers.append(_Reader(client, f"soak-{k}", 20_000, k))
            time.sleep(min(10.0, period / 2))
            rss0 = {"client": rss_mib(os.getpid()), "scheduler": rss_mib(c.scheduler_proc.pid)}
            servers0 = {p.pid: rss_mib(p.pid) for p in c.procs}
            start = time.monotonic()
            next_kill = start + period
            while time.monotonic() - start < soak_s:
                time.sleep(1.0)
                if time.monotonic() >= next_kill and time.monotonic() - start < soak_s - 5:
                    try:
                        admin.wait_for(lambda: admin.settled(c.scheduler), 60, "every copy in sync")
                    except TimeoutError:
                        unsettled += 1
                    live = [i for i, up in enumerate(c.alive()) if up]
                    victim = rng.choice(live)
                    c.kill(victim)
                    c.add_server()
                    kills += 1
                    next_kill += period
                    log(f"  soak: {time.monotonic() - start:.0f}s: killed shard {victim}, added shard {c.shards - 1}; "
                        f"{sum(lp.acked_count() for lp in loops)} pushes, {sum(r.pulls for r in readers)} pulls")
            rss1 = {"client": rss_mib(os.getpid()), "scheduler": rss_mib(c.scheduler_proc.pid)}
            survivors = [p.pid for p in c.procs if p.poll() is None and p.pid in servers0]
            if survivors:  # the servers that lived through the whole soak: the largest growth of one
                grown = max(survivors, key=lambda pid: rss_mib(pid) - servers0[pid])
                rss0["server"], rss1["server"] = servers0[grown], rss_mib(grown)
            for r in readers:
                r.stop()
            for lp in loops:
                lp.stop()
            admin.wait_for(lambda: admin.settled(c.scheduler), 180, "every copy in sync")
            results = [audit(client, lp) for client, lp in zip(clients, loops, strict=True)]
            check = admin.verify(c.scheduler)
            under = sum(int(client.stats()["pushes_under_replicated"]) for client in clients)
            demotions = _demotions(c.scheduler_log())
        finally:
            for client in clients:
                client.close()
    lost, doubled = sum(r.lost for r in results), sum(r.doubled for r in results)
    errors = sum(r.failed_pushes for r in results) + sum(r.errors for r in readers)
    f = {"seconds": round(soak_s, 1), "clients": CLIENTS, "kills": kills, "kill_every_s": round(period, 1),
         "lost": lost, "doubled": doubled, "errors": errors, "push_errors": sum(r.failed_pushes for r in results),
         "pull_errors": sum(r.errors for r in readers), "acked_pushes": sum(r.acked_pushes for r in results),
         "pulls": sum(r.pulls for r in readers), "unsettled_before_kill": unsettled,
         "copies_differing": len(check["differing"]), "pushes_under_replicated": under,
         "demotions": demotions, "demotions_diverged": sum("REJECT_DIVERGED" in d for d in demotions),
         "rss_growth_mib": {k: round(rss1[k] - rss0[k], 1) for k in rss0}, "trials": 1}
    # A kill -9 demotes the dead server's copies (its streams fail), never a copy that refused a write as
    # diverged: copies of one slot only ever hold a prefix of their primary's log (S5), whatever was killed.
    ok = lost == 0 and doubled == 0 and not check["differing"] and kills > 0 and not f["demotions_diverged"]
    return Report("updates", lost, "target", 0, ok, f)
