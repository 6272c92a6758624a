"""What the primaries of a cluster report to a ``SchedulerCore`` in the tests that drive one without servers:
every catching-up copy caught up, every hand-over drained (each report made from the map current then)."""

from __future__ import annotations

import numpy as np

from tigana.ps.routing import CATCHING_UP
from tigana.ps.scheduler import SchedulerDriver


def report_all(core: SchedulerDriver) -> int:
    """Report until nothing is left to report; returns the reports made."""
    reports = 0
    while True:
        m = core.map
        n = len(m.servers)
        pending = [(p, t, np.flatnonzero(m.leads(p) & (m.copy_state(t) == CATCHING_UP)))
                   for p in range(n) for t in range(n) if t != p]
        pending = [x for x in pending if x[2].size]
        if pending:
            p, t, slots = pending[0]
            ok, msg = core.copy_caught_up(m.servers[p].id, m.servers[t].id, slots, m.epoch)
            assert ok, msg
            reports += 1
            continue
        handing = [(p, np.flatnonzero(m.leads(p) & m.handing_over())) for p in range(n)]
        handing = [x for x in handing if x[1].size]
        if not handing:
            return reports
        p, slots = handing[0]
        ok, msg = core.handover_ready(m.servers[p].id, slots, m.epoch)
        assert ok, msg
        reports += 1
