"""Liveness: which servers are alive, and who leads a slot that lost every in-sync copy.

A server silent for ``heartbeat_timeout_s``, or whose port a probe finds closed, is declared dead: its
copies leave the map and, for every slot it led, the first in-sync copy is promoted (only an in-sync copy has
every acknowledged update). A server silent for a third of the timeout is probed, also one not heard since
this scheduler started (a new leader: the servers' heartbeats may still be on the old one); a health answer
counts as hearing from it. A server declared dead that turns out alive registers again, with its rows' log
positions (``SchedulerCore.heartbeat``), and keeps its rows meanwhile. A scheduler that was
itself paused or starved gives every server a full timeout again (the silence was its own), and still probes
those that looked silent: a closed port does not depend on the scheduler's own silence, so a scheduler
starved at every tick still sees a killed server die.

A slot left with no in-sync copy at all gets a primary again by an unclean election (``_elect``) among the
servers that registered with rows of it, by their log positions (newest wins). While slots lack copies the
scheduler says so every 10 s (``_warn_under_replicated``). Probes are actions (``Probe``): the driver runs
them and reports the answer (``probe_answered``).
"""

from __future__ import annotations

import logging

import numpy as np

from tigana.ps.logs import event, slots_text
from tigana.ps.routing import IN_SYNC, NO_SERVER, format_slots
from tigana.ps.scheduler import placement
from tigana.ps.scheduler._fields import CoreFields
from tigana.ps.scheduler.actions import Probe

log = logging.getLogger("tigana.ps.scheduler")  # one logger for the whole scheduler


def stalled_between(last: float, now: float, heartbeat_timeout_s: float) -> bool:
    """Whether two passes of the scheduler's tick loop, at ``last`` and ``now`` on its own clock, lie so far
    apart that the scheduler itself was paused or starved (or its clock jumped): the silence meanwhile is its
    own, not the servers' (``Liveness.tick(stalled=True)``). The daemon's loop and the simulator's both ask."""
    return now - last > max(1.0, heartbeat_timeout_s / 3)


class Liveness(CoreFields):
    """Failure detection, probes and unclean elections; see the module docstring."""

    def tick(self, *, now: float, stalled: bool = False, waited_s: float = 0.0) -> None:
        """Failure detection, elections, placement: called a few times a second. ``stalled``: the caller was
        not ticking for a while (this process was paused or starved); ``waited_s``: how long the tick waited
        for the driver's lock. Either way that time is the scheduler's silence, not the servers': every
        server gets a full timeout again."""
        self.now = now
        timeout = self.config.heartbeat_timeout_s
        if not self.ticked:  # the first tick of this process: no tick before it for the caller to measure a stall
            self.ticked = True  # by, and the time since the start (loading the store, a pause, a clock step
            stalled = stalled or now - self.started > timeout / 3  # before any tick) was its own silence
        overdue: set[str] = set()
        if stalled or waited_s > timeout / 3:  # heartbeats were waiting on us, not missing
            overdue = {sid for sid, seen in self.last_seen.items() if now - seen > timeout / 3}
            for sid in self.last_seen:
                self.last_seen[sid] = max(self.last_seen[sid], now)
            log.warning("scheduler stalled (%s); every server gets a full heartbeat timeout again",
                        "paused or starved" if stalled else f"waited {waited_s:.1f}s for its lock")
        for i, s in enumerate(self.map.servers):
            if not s.up:
                continue
            silent = now - self.last_seen.get(s.id, self.started)
            if silent > timeout:
                self._declare_dead(i, f"no heartbeat for {silent:.1f}s")
            elif (silent > timeout / 3 or s.id in overdue) and s.id not in self._probing:
                # a stall forgives the silence but still probes: a closed port is the server's own answer,
                # whatever our silence was (a scheduler starved at every tick would otherwise never see a
                # killed server die). Servers not heard since this scheduler started are probed too: after a
                # leader change their heartbeats may still be timing out on the old leader, and a health
                # answer keeps them from being declared dead for the hand-over's silence (L6)
                self._probe(s.id, s.address, s.boot)
        self._reconcile()
        self._warn_under_replicated(now)

    def _warn_under_replicated(self, now: float) -> None:
        """Say loudly, every 10 s while it lasts past one heartbeat timeout, that slots lack copies: a server
        lost then may lose acknowledged updates (lock held)."""
        s = self.map.summary()
        if not s["degraded_slots"]:
            self._degraded_since = None
            return
        since = self._degraded_since
        if since is None:
            self._degraded_since = since = now
        if now - since < self.config.heartbeat_timeout_s or now - self._warned_unprotected < 10.0:
            return
        self._warned_unprotected = now
        want = 1 + self.config.replicas
        why = (f"only {s['servers_up']} server(s) up, {want} needed" if s["servers_up"] < want
               else f"{s['catching_up']} cop(ies) still being built")
        log.warning("UNDER-REPLICATED for %.0fs: %d slot(s) have fewer than %d in-sync copies, %d of them only "
                    "their primary (%s): losing a server now may lose acknowledged updates", now - since,
                    s["degraded_slots"], want, s["unprotected_slots"], why,
                    extra=event("under_replicated", epoch=self.map.epoch, degraded=s["degraded_slots"],
                                unprotected=s["unprotected_slots"]))

    def _probe(self, server_id: str, address: str, boot: str) -> None:
        """Action: probe ``address``; one probe per server at a time (``probe_answered`` ends it)."""
        self._probing.add(server_id)
        self._probes.append(Probe(server_id, address, boot))

    def probe_answered(self, server_id: str, boot: str, closed: bool | None, *, now: float) -> None:
        """The probe of ``server_id`` (incarnation ``boot``) found its port closed (True: declared dead), its
        health service answering (False: heard from now) or could not tell (None)."""
        self.now = now
        self._probing.discard(server_id)
        i = self.map.index_of(server_id)
        if i < 0 or not self.map.servers[i].up or self.map.servers[i].boot != boot:
            return  # another incarnation, or already dead: the answer is about nobody
        if closed:
            address = self.map.servers[i].address
            self._declare_dead(i, f"port {address} closed")
            self._reconcile()
        elif closed is False:
            # running and reachable, only slow to beat. Safe for the fencing argument: a server that cannot
            # renew its own lease stops acknowledging async pushes whatever the scheduler thinks, and one
            # that is not declared dead is not replaced.
            self.last_seen[server_id] = max(self.last_seen.get(server_id, 0.0), now)

    def unreachable(self, address: str, *, now: float) -> None:
        """A client or peer could not reach ``address``: probe it now."""
        self.now = now
        log.debug("reported unreachable: %s", address)
        for s in self.map.servers:
            if s.address == address and s.up and s.id not in self._probing:
                self._probe(s.id, s.address, s.boot)

    def _declare_dead(self, i: int, why: str) -> None:
        m = self.map
        alive = self._alive()
        alive[i] = False
        before = m.copies
        copies, states = placement.repair(m.copies, m.states, alive, 0)  # drop + promote only
        lost = np.flatnonzero((before[:, 0] >= 0) & (copies[:, 0] < 0))
        now = self.now
        for slot in lost:
            self.orphaned_since.setdefault(int(slot), now)
        servers = m.replace_server(i, up=False)
        moved = np.flatnonzero((before[:, 0] == i) & (copies[:, 0] >= 0))
        promoted = int(moved.size)
        sid = m.servers[i].id
        primaries = sorted({m.servers[int(p)].id for p in copies[moved, 0]})
        self._commit(m.evolve(copies=copies, states=states, servers=servers),
                     f"server {sid} ({m.servers[i].address}) declared dead: {why}; {promoted} slot(s) failed over "
                     f"(slots {slots_text(moved)}) to {','.join(primaries) or 'none'}"
                     + (f", {lost.size} left with no in-sync copy (slots {slots_text(lost)})" if lost.size else ""),
                     event("failover", slots=np.union1d(moved, lost), server=sid, reason=why,
                           failed_over=format_slots(moved), new_primaries=",".join(primaries),
                           no_copy=format_slots(lost)))
        self.metrics.servers_dead.inc()
        self.metrics.failovers.labels("dead").inc(promoted)

    def _elect(self) -> None:
        """Unclean elections for slots with no primary and no in-sync copy (see the module docstring)."""
        m = self.map
        orphans = np.flatnonzero(m.copies[:, 0] < 0)
        if orphans.size == 0:
            self.orphaned_since.clear()
            return
        now = self.now
        alive = self._alive()
        copies, states = m.copies.copy(), m.states.copy()
        chosen, empty, elected = 0, [], []
        for slot in orphans:
            since = self.orphaned_since.setdefault(int(slot), now)
            # Wait for every server of the map to be back (registered with its rows' positions), or the timeout.
            everyone = all(s.up and s.id in self.heard for s in m.servers)
            if not everyone and now - since < 2 * self.config.heartbeat_timeout_s:
                continue
            best, best_key = -1, None
            for i, s in enumerate(m.servers):
                if not alive[i] or s.id not in self.heard:
                    continue
                key = tuple(self.positions.get(s.id, {}).get(t, {}).get(int(slot), (0, 0))
                            for t in sorted(m.tables))
                if any(k != (0, 0) for k in key) and (best_key is None or key > best_key):
                    best, best_key = i, key
            if best < 0:
                # No server has rows of it: what it held is gone (or it never had any). It starts empty on
                # the least loaded server, so the cluster serves again.
                _, load = placement.copy_counts(copies, len(m.servers))
                holders = [int(x) for x in copies[slot] if x >= 0 and alive[x]]  # no data moves for them
                live = np.array(holders) if holders else np.flatnonzero(alive)
                best = int(live[np.argmin(load[live])])
                empty.append(int(slot))
            row = copies[slot]
            j = np.flatnonzero(row == best)
            if j.size:
                copies[slot, j[0]] = NO_SERVER
            copies[slot, 0], states[slot, 0] = best, IN_SYNC
            self.orphaned_since.pop(int(slot), None)
            chosen += 1
            elected.append(int(slot))
        if empty:
            on = self._ids(copies[empty, 0])
            log.warning("%d slot(s) with no copy and no rows on any server (never written, or lost) start empty at "
                        "epoch %d: slots %s on %s", len(empty), m.epoch, slots_text(empty), ",".join(on),
                        extra=event("slots_empty", slots=empty, epoch=m.epoch, server=on))
        if chosen:
            primaries = self._ids(copies[elected, 0])
            self._commit(m.evolve(copies=copies, states=states),
                         f"unclean election of {chosen} slot(s) with no in-sync copy (slots {slots_text(elected)}; "
                         f"new primaries {','.join(primaries)}; newest snapshot wins)",
                         event("unclean_election", slots=elected, server=primaries))
            self.metrics.elections.inc(chosen)
