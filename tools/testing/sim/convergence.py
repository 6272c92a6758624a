"""What a quiet cluster must reach, and what it must then show (docs/replication.md): the liveness properties
checked after the busy phase, and the safety properties only a settled cluster can be held to.

- ``converged``: every slot has 1 + replicas in-sync copies (as many as servers are up), no move pending,
  every push settled, and with auto-rebalance no up server left without a copy while another holds several
  (L1, L2, L3).
- ``why_not`` names the property a run that did not converge by its deadline broke: L3 (a move, drain or
  rebalance still pending), L1 (a slot short of in-sync copies), L2 (a server left idle), else L4 (pushes
  never settled: wedged).
- ``check_settled`` once converged: the streams drain within the deadline (L4), every in-sync copy holds its
  primary's rows, values and presence (S11, S3: ``admin verify``'s check), and with hosts no slot's copies
  share a host while enough hosts are up (S12).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tigana.ps.routing import CATCHING_UP, IN_SYNC, slot_of
from tigana.tools.testing.sim.exactness import LEDGERS

__all__ = ["check_settled", "converged", "why_not"]

STEP_S = 0.01


def converged(run: Any) -> bool:
    m = run.scheduler.core.map
    up = sum(1 for e in m.servers if e.up)
    want = min(1 + run.s.replicas, up)
    return (run.scheduler.core.target is None and all(c.in_flight == 0 for c in run.clients)
            and bool(((m.copies >= 0) & (m.states == IN_SYNC)).sum(axis=1).min() >= want)
            and not ((m.copies >= 0) & (m.states != IN_SYNC)).any() and not _idle(run))


def _lag(run: Any) -> dict[str, float]:
    return {srv.name: srv.svc.cluster_figures().get("replication_lag_items", 0) for srv in run.servers.values()
            if srv.alive and srv.svc is not None}


def why_not(run: Any) -> str:
    """The violation of a run not converged ``run.s.converge_s`` after its busy phase."""
    core = run.scheduler.core
    m = core.map
    s = m.summary()
    lag = {name: n for name, n in _lag(run).items() if n}
    up = sum(1 for e in m.servers if e.up)
    replicated = (bool(((m.copies >= 0) & (m.states == IN_SYNC)).sum(axis=1).min() >= min(1 + run.s.replicas, up))
                  and not ((m.copies >= 0) & (m.states != IN_SYNC)).any())
    idle = _idle(run)
    rule = "L3" if core.target is not None else "L1" if not replicated else "L2" if idle else "L4"
    return (f"{rule}: not converged {run.s.converge_s:.0f}s after the busy phase (epoch {m.epoch}: {s}, target "
            f"{'set' if core.target is not None else 'none'}, items queued {lag or 'none'}, pushes in flight "
            f"{sum(c.in_flight for c in run.clients)}{'; ' + idle if idle else ''})")


def check_settled(run: Any, deadline: float) -> list[str]:
    """Once converged: the violations of L4, S11 and S12 (empty: none)."""
    out = _drained(run, deadline)
    return out or _copies_equal(run) or _apart(run)


def _drained(run: Any, deadline: float) -> list[str]:
    """L4: the primaries' streams drain (async ones lag behind the pushes) before the deadline."""
    w = run.world
    alive = [srv for srv in run.servers.values() if srv.alive and srv.svc is not None]
    while w.now < deadline and any(_lag(run).values()):
        w.run_until(w.now + STEP_S)
        for srv in alive:
            srv.step()
    lag = {name: n for name, n in _lag(run).items() if n}
    if lag:
        return [f"L4: streams still hold items at the deadline ({lag}), with every copy in sync"]
    return []


def _copies_equal(run: Any) -> list[str]:
    """Every in-sync copy holds its primary's rows, every id of the universe, in both ledgers (S11: the copy
    lane left them exactly as the primary's; S3). A copy missing rows at its primary's log position fails only
    here until its primary dies."""
    m = run.scheduler.core.map
    ids = np.arange(run.s.ids + 64, dtype=np.int64)  # every id pushed or pulled (pulls reach 64 beyond)
    slot = slot_of(ids, m.num_slots)
    for name in LEDGERS:
        values = {}
        for i, entry in enumerate(m.servers):
            srv = run.servers.get(entry.id)
            hosted = None if srv is None or srv.svc is None else srv.svc.tables.find(name)
            if hosted is not None and srv.alive and srv.svc.boot == entry.boot:
                with hosted.lock:  # a row's presence too: a missing row reads as its initial values
                    values[i] = np.column_stack(hosted.table.peek(ids))
        for copy_col in range(1, m.copies.shape[1]):
            for i, vals in values.items():
                mine = (m.copies[slot, copy_col] == i) & (m.states[slot, copy_col] == IN_SYNC)
                primary = m.copies[slot, 0]
                for p in np.unique(primary[mine]):
                    if int(p) not in values:
                        continue
                    sel = mine & (primary == p)
                    differ = np.flatnonzero(sel & (values[int(p)] != vals).any(axis=1))
                    if differ.size:
                        k = int(differ[0])
                        return [f"S11: {m.servers[i].id}, in sync for slot {int(slot[k])} at epoch {m.epoch}, holds "
                                f"{name} id {k} at {vals[k].tolist()}, its primary {m.servers[int(p)].id} at "
                                f"{values[int(p)][k].tolist()} (values, then 1 when the row is stored)"]
    return []


def _idle(run: Any) -> str:
    """L2, with auto-rebalance: an up server that may hold copies holding none while another holds several
    (what keeps a run from converging: it gets its share within the deadline, with no admin command)."""
    core = run.scheduler.core
    if not run.s.auto_rebalance:
        return ""
    m = core.map
    counts = {e.id: int((m.copies == i).sum()) for i, e in enumerate(m.servers)
              if e.up and e.id not in core.draining}
    if counts and min(counts.values()) == 0 and max(counts.values()) > 1:
        return f"{min(counts, key=counts.get)} holds no copy while others hold {counts}"
    return ""


def _apart(run: Any) -> list[str]:
    """S12, with hosts: no slot's in-sync copies share a host while the servers that may hold copies (up, not
    draining) span as many hosts as a slot has copies (placement keeps them apart; docs/cluster.md). Where
    they do not, the slots are domain-degraded, which status reports. The hosts are the simulation's own."""
    if run.s.hosts <= 0:
        return []
    core = run.scheduler.core
    m = core.map
    host = np.array([run.servers[e.id].domain.host if e.id in run.servers else e.id for e in m.servers])
    usable = [i for i, e in enumerate(m.servers) if e.up and e.id not in core.draining]
    if len({host[i] for i in usable}) < 1 + run.s.replicas:
        return []
    counted = (m.copies >= 0) & (m.states != CATCHING_UP)
    hosts = np.where(counted, host[np.clip(m.copies, 0, None)], "")
    for slot in range(m.num_slots):
        held = [h for h in hosts[slot] if h]
        if len(set(held)) < len(held):
            return [f"S12: slot {slot}'s in-sync copies share a host at convergence (epoch {m.epoch}: "
                    f"{[m.servers[int(c)].id for c in m.copies[slot] if c >= 0]}, hosts {held})"]
    return []
