"""The simulated disk: periodic snapshots of every server with a data dir, and what the ledger may lose when
every copy of a slot is lost at once.

A snapshot is written (atomically, fsynced) when ``snapshot`` runs, so a crash keeps exactly the snapshots
taken before it: the disk up to its last fsync. docs/replication.md allows one loss: when every in-sync copy
of a slot is lost, the unclean election restarts it from the newest snapshot, so what was acknowledged after
that snapshot may be gone. ``lose_slots`` lowers the ledger's floor for those slots' ids to what was
acknowledged when that snapshot was taken (the slot complete in it): nothing older may be missing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tigana.ps.routing import IN_SYNC

__all__ = ["lose_slots", "snapshot"]


def snapshot(run: Any, incremental: bool, only: str = "") -> None:
    """Snapshot every up server with a data dir (the daemon's periodic snapshot), or the server named ``only``
    (a scripted ``snapshot``: servers whose snapshots hold a slot at different log positions), noting what the
    ledger had acknowledged then and the slots complete in it."""
    for server in run.servers.values():
        if not server.up or server.svc.catalog is None or (only and server.name != only):
            continue
        complete = server.svc.holdings.view.complete_slots().copy()
        acked = {name: a.copy() for name, a in run.ledger.acked.items()}
        server.svc.snapshot_all(incremental=incremental)
        server.snapshots = [*server.snapshots[-3:], (run.world.now, acked, complete)]


def lose_slots(run: Any, crashed: set[str]) -> list[int]:
    """After ``crashed`` went down together: the slots none of whose in-sync copies is left; the ledger may
    now miss, for their ids, what was acknowledged after the newest snapshot (with the slot complete) of
    any of their copies. Returns those slots."""
    m = run.scheduler.core.map
    lost = []
    for slot in range(m.num_slots):
        holders = [m.servers[int(c)].id for c, st in zip(m.copies[slot], m.states[slot], strict=True)
                   if c >= 0 and (st == IN_SYNC)]
        if not holders or not all(h in crashed for h in holders):
            continue
        lost.append(slot)
        newest = None
        for h in holders:
            for taken, acked, complete in run.servers[h].snapshots:
                if complete[slot] and (newest is None or taken > newest[0]):
                    newest = (taken, acked)
        ids = run.ids[run.slots == slot]
        run.ledger.lost_at[ids] = run.world.now
        for name, floor in run.ledger.acked.items():
            kept = newest[1].get(name) if newest is not None else None
            floor[ids] = np.minimum(floor[ids], 0 if kept is None else kept[ids])
    return lost
