"""L6, the failure detector, checked against the world's ground truth (docs/replication.md, invariant L6).

The scheduler's view of a server (its heartbeats, its probes' answers, its own clock) may be wrong; the
simulator knows what truly happened: whether a server's process was alive, paused, or cut off from the
scheduler. ``Detector.check`` runs after every step (``Checkers.after_step``) and compares the two:

* safety: a server the scheduler declares dead (its map entry goes from up to down) could not reach the
  scheduler at some moment of the last ``heartbeat_timeout_s + SLACK_S`` of simulated time: it was crashed or
  stopped, paused, cut off from the scheduler by a partition, or the network was dropping messages then (a
  lossy phase counts as cut off: every heartbeat of a timeout may be lost). A server up, unpaused and
  reachable the whole window was declared dead for the scheduler's own silence (a stall, a clock jump);
* liveness: a server whose process is gone (its port closed) is declared dead within ``heartbeat_timeout_s +
  BOUND_S`` of its crash, counted from when the scheduler (the same process) was up and reaching it over a
  network that drops nothing; also when the scheduler was stalled at every tick, since a probe finds the
  closed port whatever the scheduler's own silence was.

The simulated probe (``probe_answer``) answers by the same ground truth, as ``daemon.probe_closed`` would: a
crashed process's port is closed (the simulator's crashes are processes gone; a lost machine would time out),
a paused or cut-off server's health check times out ("unknown"), a running one answers.

Cheap: a few dictionary updates per server and step; maps are compared only when a new one was saved.
"""

from __future__ import annotations

import math
from typing import Any

from tigana.ps.routing import ShardMap
from tigana.tools.testing.sim.nodes import SCHEDULER

__all__ = ["BOUND_S", "SLACK_S", "Detector", "probe_answer"]

# A healthy server's heartbeat reaches the scheduler every 0.5 s (its agent's interval, plus a few ms on the
# network), and the scheduler looks every 0.5 s (a tick): its silence can overstate the server's by a
# heartbeat interval and a tick at most.
SLACK_S = 1.0
# After the heartbeat timeout, a tick notices (0.5 s) and one lost or unknown probe is sent again at the next
# (0.5 s); the probe path (silent for a third of the timeout, probed, the closed port answers) is faster.
BOUND_S = 1.0


def probe_answer(run: Any, address: str) -> bool | None:
    """The scheduler's health probe of ``address`` (a server's name) in ``run`` (a ``simulation._Run``), by
    the world's ground truth: True (the port is closed: the process is gone), False (its health service
    answered) or None (no answer: paused, cut off from the scheduler, or the probe was dropped)."""
    server = run.servers.get(address)
    if server is None or frozenset((SCHEDULER, address)) in run.net.cut or run.world.rng.random() < run.net.drop:
        return None
    if not server.alive:
        return True
    return None if server.paused else False


class Detector:
    """The L6 checker of one run (``run``: a ``simulation._Run``); ``check(published)`` takes the maps the
    scheduler saved since the last step (in order) and returns the violations found now."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.impaired_at: dict[str, float] = {}  # server -> the last time it could not reach the scheduler
        self.crashed_at: dict[str, float] = {}  # server -> since when it is crashed and the scheduler reaches it
        self.up: dict[str, bool] = {}  # server -> up in the last map looked at
        self.epoch = -1
        self.core: Any = None  # the scheduler process the maps and ``crashed_at`` are about

    def check(self, published: list[ShardMap]) -> list[str]:
        run, now = self.run, self.run.world.now
        scheduler = run.scheduler
        timeout = scheduler.config.heartbeat_timeout_s
        if scheduler.core is not self.core:  # a new scheduler process: a full timeout for everyone again
            self.core, self.crashed_at = scheduler.core, {}
        lossy, cut = run.net.drop > 0, run.net.cut
        reaching = scheduler.up
        for name, server in run.servers.items():
            unreachable = lossy or (cut and frozenset((name, SCHEDULER)) in cut)
            if unreachable or not server.up:
                self.impaired_at[name] = now
            if server.alive or unreachable or not reaching:
                self.crashed_at.pop(name, None)
            elif name not in self.crashed_at:
                self.crashed_at[name] = now
        current = scheduler.core.map
        out: list[str] = []
        if current.epoch != self.epoch:
            for m in [*published, current]:
                if m.epoch > self.epoch:
                    out += self._declared(m, now, timeout)
        for name, since in self.crashed_at.items():
            if now - since > timeout + BOUND_S and self.up.get(name):
                out.append(f"L6: {name} crashed (its port closed) {now - since:.2f}s ago, the scheduler up and "
                           f"reaching it, and is still up in its map at epoch {current.epoch} (bound: the "
                           f"heartbeat timeout {timeout:.1f}s + {BOUND_S:.1f}s)")
                break
        return out

    def _declared(self, m: ShardMap, now: float, timeout: float) -> list[str]:
        """The servers map ``m`` declares dead (up in the map looked at before): each must have been unable
        to reach the scheduler within the last heartbeat timeout (+ ``SLACK_S``)."""
        out = []
        for e in m.servers:
            if not e.up and self.up.get(e.id):
                healthy = now - self.impaired_at.get(e.id, -math.inf)
                if healthy > timeout + SLACK_S:
                    out.append(f"L6: epoch {m.epoch} declares {e.id} dead, though it was up, unpaused and "
                               f"reachable from the scheduler for the last {min(healthy, now):.2f}s (the heartbeat "
                               f"timeout is {timeout:.1f}s): declared dead for the scheduler's own silence")
        self.up = {e.id: e.up for e in m.servers}
        self.epoch = m.epoch
        return out
