"""The nemesis's faults on real processes: ``kill -9`` then a restart on the old data dir once the scheduler
declared the server dead (``kill9``), ``kill -9`` and an immediate restart (``crash_restart``: back before the
heartbeat timeout, with a new boot id), and SIGSTOP past the heartbeat timeout then SIGCONT (``pause``).

One failure at a time: the cluster keeps 1 + replicas copies of a slot, so it promises to lose nothing to
one failure, not to a second one while the copies of the first are being rebuilt. Before each fault the
nemesis waits until no slot lacks an in-sync copy (``protect_timeout_s``; the wait is reported as
``max_reprotect_s``, and a fault that had to go ahead on an unprotected cluster as ``faults_unprotected``,
a missed target). A fault injected 0.8 s after a crash-restart, with 2,390 copies still catching up, made
the unclean election of 880 slots lose 61,715 sync updates: that is the second failure, not a bug.

The victim is the server leading the most slots. Just before the fault, the replication lag that server
reports for the async ledger table is sampled; after it, the async loss bound grows by that lag plus the
async pushes sent before the fault and acknowledged after the sample, in updates (``ids_per_push`` each, the
same bound as ``tigana bench faults``' ``kill_async``), counted once the clients stopped. Each fault opens a window with a failure in the
``Monitor`` and marks it healed once the daemon runs again.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

from tigana import ps
from tigana.ps.ops import admin
from tigana.tools.testing.nemesis.daemons import Daemon, Daemons
from tigana.tools.testing.nemesis.monitor import Monitor
from tigana.tools.testing.nemesis.operations import OpResult
from tigana.tools.testing.nemesis.workload import Ledgers


@dataclass
class Faults:
    daemons: Daemons
    ledgers: Ledgers
    monitor: Monitor
    ctl: ps.Client
    heartbeat_timeout_s: float
    primaries_killed: int = 0
    lag_samples_failed: int = 0
    protect_timeout_s: float = 60.0
    faults_unprotected: int = 0  # faults injected while slots still lacked an in-sync copy (after the timeout)
    max_reprotect_s: float = 0.0  # the longest wait for the cluster to be whole again before a fault
    # (lag sampled at, fault at, lag items) of each fault that took a primary away
    samples: list[tuple[float, float, int]] = field(default_factory=list)

    def async_loss_bound(self) -> int:
        """Updates the async table may have lost to the faults: call once the clients stopped (every reply
        of a push sent before a fault has arrived)."""
        acked_since = sum(self.ledgers.count_acked("async", at, sampled_at) for sampled_at, at, _ in self.samples)
        return (sum(lag for _, _, lag in self.samples) + acked_since) * self.ledgers.ids_per_push

    def run(self, fault: str) -> OpResult:
        t = time.monotonic()
        try:
            ok, detail = getattr(self, f"_{fault}")()
        except Exception as exc:  # noqa: BLE001 - a fault that could not be applied; the run goes on
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        return OpResult(fault, ok, time.monotonic() - t, detail, started_at=t)

    def _victim(self) -> tuple[Daemon, int]:
        """(the running server leading the most slots, how many it leads)."""
        m = admin.shard_map(self.daemons.scheduler_address)
        best: tuple[Daemon, int] | None = None
        for i, s in enumerate(m.servers):
            d = self.daemons.by_address(s.address)
            if d is None or not d.alive or not s.up:
                continue
            led = int(np.count_nonzero(m.copies[:, 0] == i))
            if best is None or led > best[1]:
                best = (d, led)
        if best is None:
            raise RuntimeError("no running server in the map")
        return best

    def _lag_items(self, victim: Daemon) -> int:
        table = self.ledgers.table("async")
        try:
            stats = self.ctl.server_stats(table)
            return int(stats[victim.address][table].get("replication_lag_items", 0))
        except (ps.PSError, KeyError):
            self.lag_samples_failed += 1
            return 0

    def _wait_protected(self) -> None:
        """Wait until every slot has all its in-sync copies (none degraded or unavailable) or the timeout."""
        t = time.monotonic()
        deadline = t + self.protect_timeout_s
        while True:
            with contextlib.suppress(ps.PSError):
                reply = admin.status(self.daemons.scheduler_address, timeout_s=5.0)
                if not reply.degraded_slots and not reply.unavailable_slots:
                    break
            if time.monotonic() >= deadline:
                self.faults_unprotected += 1
                break
            time.sleep(0.2)
        self.max_reprotect_s = max(self.max_reprotect_s, time.monotonic() - t)

    def _begin(self) -> tuple[Daemon, int, float, int]:
        self._wait_protected()
        victim, led = self._victim()
        self.monitor.fault_begins()
        sampled_at = time.monotonic()  # before the lag is read: a push acknowledged meanwhile is in the bound
        return victim, led, sampled_at, self._lag_items(victim)

    def _end(self, led: int, sampled_at: float, at: float, lag_items: int) -> None:
        """The fault is healed; one that took a primary away counts against the async bound."""
        self.monitor.fault_healed()
        if led:
            self.primaries_killed += 1
            self.samples.append((sampled_at, at, lag_items))

    def _declared_dead(self, victim: Daemon, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(ps.PSError):
                m = admin.shard_map(self.daemons.scheduler_address, timeout_s=2.0)
                if any(s.address == victim.address and not s.up for s in m.servers):
                    return True
            time.sleep(0.1)
        return False

    def _kill9(self) -> tuple[bool, str]:
        victim, led, sampled_at, lag = self._begin()
        at = time.monotonic()
        victim.kill9()
        dead = self._declared_dead(victim, 3 * self.heartbeat_timeout_s)
        self.daemons.restart(victim)
        victim.wait_ready(120)
        self._end(led, sampled_at, at, lag)
        return dead, (f"kill -9 {victim.name} ({led} slots led, async lag {lag} items); declared dead {dead}; "
                      f"restarted on its data dir")

    def _crash_restart(self) -> tuple[bool, str]:
        victim, led, sampled_at, lag = self._begin()
        at = time.monotonic()
        victim.kill9()
        self.daemons.restart(victim)
        victim.wait_ready(120)
        self._end(led, sampled_at, at, lag)
        return True, f"kill -9 {victim.name} ({led} slots led, async lag {lag} items) and restart at once"

    def _pause(self) -> tuple[bool, str]:
        victim, led, sampled_at, lag = self._begin()
        at = time.monotonic()
        victim.pause()
        try:
            dead = self._declared_dead(victim, 3 * self.heartbeat_timeout_s)
            time.sleep(0.5)
        finally:
            victim.resume()
        self._end(led, sampled_at, at, lag)
        return dead, f"SIGSTOP {victim.name} ({led} slots led, async lag {lag} items); declared dead {dead}; SIGCONT"
