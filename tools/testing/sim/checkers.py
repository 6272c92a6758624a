"""The simulator's invariant checkers (docs/replication.md, "Checked by simulation"): each reads the real state of
the simulated nodes (the scheduler's maps, the servers' views, hosted tables, log positions and exactly-once
windows, the pushes they applied) after every step of the world.

| checker | property |
| --- | --- |
| ``Checkers._fence`` | S4: a push is applied only for slots its server's map says it leads, not handed over; S9: only once that server installed the map that created its table |
| ``Checkers._transition`` (each map the scheduler publishes, in order) | S2: a new primary was an in-sync copy; S10: a slot with no in-sync copy left gets, by an election, a server whose registered rows of it are the newest; S3 (with ``_joined``): a copy entering the in-sync set holds every acknowledged sync write |
| ``exactness.Exactness`` | S1, S6, S7, S8 (the ledger, exactly) |
| ``Checkers._order`` | S5: two copies at the same log position of a slot hold the same rows of it |
| ``Checkers._domains`` | S12: a slot whose in-sync copies span fewer hosts than it wants copies is reported domain-degraded |
| ``Checkers._bounded`` | L5: a write is queued to the copies only while the replication queue is within its bound |
| ``detector.Detector`` | L6: a server declared dead could not reach the scheduler within the timeout; a crashed one is declared dead in time |

The liveness properties (L1-L4) and the properties only a quiet cluster shows (S11: every in-sync copy equal to
its primary; S12: no slot's copies share a host) are checked at convergence and at the deadline
(``convergence``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tigana.ps.routing import CATCHING_UP, HANDING_OVER, IN_SYNC, ShardMap
from tigana.ps.wire.cluster import CHANGES
from tigana.tools.testing.sim import kernels
from tigana.tools.testing.sim.detector import Detector
from tigana.tools.testing.sim.exactness import LEDGERS, Exactness
from tigana.tools.testing.sim.memo import Passed
from tigana.tools.testing.sim.reroute import stranded

__all__ = ["Checkers"]


class Checkers:
    """Every per-step checker of one run (``run``: a ``simulation._Run``). ``on_map`` takes each map the
    scheduler publishes; ``after_step`` returns the violations found now (empty: none)."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.exact = Exactness(run)
        self.detector = Detector(run)
        self.published: list[ShardMap] = []
        self.last: ShardMap | None = None
        self.placed = np.zeros(run.s.num_slots, bool)  # slots that ever had a primary
        self.joined: list[tuple[str, str, int]] = []  # (server, boot, slot) that entered the in-sync set
        self.passed = Passed()  # S5, per table: the inputs its last check passed with

    def on_map(self, m: ShardMap) -> None:
        """Each map the scheduler persists, in order (before anyone sees it)."""
        self.published.append(m)

    def after_step(self) -> list[str]:
        pushed = {}
        for server in self.run.servers.values():
            pushed[server.name], server.pushed = server.pushed, []
        out = self._fence(pushed)
        out += self.detector.check(self.published)  # before ``_transitions`` takes them
        out += self._transitions()
        out += self._joined()
        out += self.exact.check(pushed)
        out += self._order()
        out += self._domains()
        out += self._bounded()
        out += stranded(self.run.clients)
        return out

    # --- S4, S9: what a server applies ---
    def _fence(self, pushed: dict[str, list]) -> list[str]:
        out = []
        for name, applied in pushed.items():
            server = self.run.servers[name]
            for request, p in applied:
                view, slots = p.view, p.uslots
                if not view.valid or not view.leads[slots].all() or view.fenced[slots].any():
                    bad = slots[~view.leads[slots] | view.fenced[slots]] if view.valid else slots
                    out.append(f"S4: {name} applied push seq {request.seq} of {p.name} (routed at epoch "
                               f"{request.epoch}) for slot {int(bad[0])}, which its map (epoch {view.epoch}) "
                               "does not let it write")
                hosted = server.svc.tables.find(p.name) if server.svc is not None else None
                if hosted is not None and hosted.spec.created_epoch > view.epoch:
                    out.append(f"S9: {name} applied push seq {request.seq} of {p.name} (created at epoch "
                               f"{hosted.spec.created_epoch}) under its map of epoch {view.epoch}")
        return out

    # --- S2, S3, S10: the maps, one after the other ---
    def _transitions(self) -> list[str]:
        maps, self.published = self.published, []
        current = self.run.scheduler.core.map
        if not maps or maps[-1].epoch < current.epoch:
            maps.append(current)  # a restarted scheduler's map (loaded, not saved again)
        out = []
        for m in sorted(maps, key=lambda m: m.epoch):
            if self.last is not None and m.epoch <= self.last.epoch:
                continue
            if self.last is not None:
                out += self._transition(self.last, m)
            self.placed |= m.copies[:, 0] >= 0
            self.last = m
        return out

    def _transition(self, old: ShardMap, new: ShardMap) -> list[str]:
        out = []
        old_ids = [e.id for e in old.servers]
        new_ids = [e.id for e in new.servers]
        old_up = np.array([e.up for e in old.servers], bool)
        boots = {e.id: e.boot for e in new.servers}
        old_boots = {e.id: e.boot for e in old.servers}
        new_up = {e.id: e.up for e in new.servers}
        for slot in range(new.num_slots):
            row, states = new.copies[slot], new.states[slot]
            was, was_states = old.copies[slot], old.states[slot]
            before = {old_ids[int(c)]: int(st) for c, st in zip(was, was_states, strict=True) if c >= 0}
            in_sync_before = [old_ids[int(c)] for c, st in zip(was, was_states, strict=True)
                              if c >= 0 and st != CATCHING_UP and old_up[int(c)]]
            primary = new_ids[int(row[0])] if row[0] >= 0 else None
            old_primary = old_ids[int(was[0])] if was[0] >= 0 else None
            if primary is not None and primary != old_primary:
                # planned: a hand-over its old primary completed (it drained first); unplanned: a failover,
                # also one that cut a hand-over short (its old primary declared dead meanwhile, or restarted: a
                # new process, up again under another boot, never drained what the old one acknowledged)
                if old_primary is not None and (int(was_states[0]) != HANDING_OVER or not new_up.get(old_primary)
                                                or boots.get(old_primary) != old_boots.get(old_primary)):
                    self.exact.primary_lost(np.array([slot]))
                if before.get(primary, CATCHING_UP) != CATCHING_UP and boots.get(primary) == old_boots.get(primary):
                    pass  # an in-sync copy promoted (or a hand-over completed)
                elif not in_sync_before and self.placed[slot]:
                    out += self._election(new, primary, slot)  # an unclean election (S10)
                elif self.placed[slot]:
                    out.append(f"S2: epoch {new.epoch} makes {primary} the primary of slot {slot}, which was "
                               f"{'catching up' if primary in before else 'no copy'} at epoch {old.epoch} "
                               f"(in-sync copies then: {in_sync_before})")
            elif primary is not None and old_boots.get(primary) != boots.get(primary):
                self.exact.primary_lost(np.array([slot]))  # the primary restarted: a new process
            for c, st in zip(row, states, strict=True):
                if c < 0 or st == CATCHING_UP:
                    continue
                who = new_ids[int(c)]
                if before.get(who, CATCHING_UP) == CATCHING_UP and in_sync_before:
                    self.joined.append((who, boots[who], slot))
        return out

    def _joined(self) -> list[str]:
        """S3: a copy that entered the in-sync set (and is still in it) holds every acknowledged sync write of
        its slot."""
        joined, self.joined = self.joined, []
        run = self.run
        m = run.scheduler.core.map
        acked = run.ledger.acked.get(LEDGERS[0])
        if acked is None or LEDGERS[0] not in m.tables:
            return []
        index = {e.id: i for i, e in enumerate(m.servers)}
        for who, boot, slot in joined:
            server, i = run.servers.get(who), index.get(who)
            if server is None or i is None or not server.alive or server.svc is None or server.svc.boot != boot:
                continue
            if m.servers[i].boot != boot or not ((m.copies[slot] == i) & (m.states[slot] != CATCHING_UP)).any():
                continue
            hosted = server.svc.tables.find(LEDGERS[0])
            if hosted is None or hosted.spec.created_epoch != m.tables[LEDGERS[0]].created_epoch:
                continue
            ids = run.ids[(run.slots == slot) & ~np.isfinite(run.ledger.lost_at)]
            v = self.exact.values(server, hosted)
            short = ids[v[ids, 0] < acked[ids]]
            if short.size:
                k = int(short[0])
                return [f"S3: {who} entered the in-sync set of slot {slot} (epoch {m.epoch}) holding {LEDGERS[0]} "
                        f"id {k} at {v[k, 0]}, {acked[k]} acknowledged"]
        return []

    def _election(self, m: ShardMap, who: str, slot: int) -> list[str]:
        """S10: a slot's unclean election names a server whose rows of it, as the servers registered them with
        the scheduler (their log positions, table by table), are the newest of the servers up."""
        registered = self.run.scheduler.core.positions
        up = [e.id for e in m.servers if e.up and e.id in registered]

        def key(server: str) -> tuple:
            return tuple(registered.get(server, {}).get(t, {}).get(slot, (0, 0)) for t in sorted(m.tables))

        newer = [s for s in up if key(s) > key(who)]
        if newer:
            return [f"S10: epoch {m.epoch} elects {who} for slot {slot} with rows at {key(who)}; {newer[0]} "
                    f"registered newer ones, at {key(newer[0])}"]
        return []

    # --- S5: the same position, the same rows ---
    def _order(self) -> list[str]:
        """Every in-sync copy at its primary's log position of a slot holds the primary's rows of it (values
        of the ledger's ids); one pass over every copy (``kernels.order_verdict``) finds the first that does not."""
        run = self.run
        m = run.scheduler.core.map
        slots, n = run.slots, len(m.servers)
        if not n:
            return []
        for name in LEDGERS:
            spec = m.tables.get(name)
            if spec is None:
                continue
            copies: list[tuple[int, Any, Any]] = []  # (server index, server, hosted table) of each copy read
            for i, entry in enumerate(m.servers):
                server = run.servers.get(entry.id)
                if server is None or not server.alive or server.svc is None or server.svc.boot != entry.boot:
                    continue
                hosted = server.svc.tables.find(name)
                if hosted is not None and hosted.spec.created_epoch == spec.created_epoch:
                    copies.append((i, server, hosted))
            # checked again only when the map or a copy read changed (a call, a map installed: ``memo``)
            objects = (m, *(o for _, server, hosted in copies for o in (server.svc, hosted, server.svc.holdings.view)))
            seen = tuple((i, server.stamp(name)) for i, server, _ in copies)
            if self.passed.again(name, objects, seen):
                continue
            positions = np.zeros((n, m.num_slots, 2), np.uint64)
            values = np.zeros((n, run.s.ids, 2), np.int64)
            valid = np.zeros(n, bool)
            for i, server, hosted in copies:
                positions[i], values[i], valid[i] = hosted.log.positions, self.exact.values(server, hosted), True
            col, k = kernels.order_verdict(m.copies, m.states, IN_SYNC, valid, positions, values, slots)
            if col >= 0:  # the first column with a copy that differs, and its first id
                slot = int(slots[k])
                p, c = int(m.copies[slot, 0]), int(m.copies[slot, col])
                vp, vc = values[p, run.ids[k]], values[c, run.ids[k]]
                found = (f"S5: {m.servers[c].id} and its primary {m.servers[p].id} are both "
                         f"at position {positions[p, slot].tolist()} of slot {slot} of {name} and differ: "
                         f"id {k} at {vc.tolist()} and {vp.tolist()}")
                self.passed.failed(name, found)
                return [found]
            digest = None
            if Passed.verify:  # the copies' positions and rows, read afresh past every cache
                digest = tuple((hosted.log.positions.tobytes(), hosted.table.peek(run.ids)[0].tobytes())
                               for _, _, hosted in copies)
            self.passed.passed(name, objects, seen, digest)
        return []

    # --- S12: shared domains are reported ---
    def _domains(self) -> list[str]:
        run = self.run
        if run.s.hosts <= 0 or not run.scheduler.up:
            return []
        core = run.scheduler.core
        m = core.map
        if not m.servers:
            return []
        host = np.array([run.servers[e.id].domain.host if e.id in run.servers else e.id for e in m.servers])
        up = np.array([e.up for e in m.servers], bool)
        counted = (m.copies >= 0) & (m.states != CATCHING_UP) & up[np.clip(m.copies, 0, None)]
        hosts = np.where(counted, host[np.clip(m.copies, 0, None)], "")
        g = np.sort(hosts, axis=1)  # "" (not counted) first
        new = np.ones(g.shape, bool)
        new[:, 1:] = g[:, 1:] != g[:, :-1]
        distinct = ((g != "") & new).sum(axis=1)  # the hosts each slot's in-sync copies span
        shared = distinct < np.minimum(counted.sum(axis=1), 1 + run.s.replicas)
        if not shared.any():
            return []
        reported, level = core.domain_degraded()
        if level != "host" and level:
            return []  # kept apart at a wider level, where sharing a host is not what is reported
        silent = np.flatnonzero(shared & ~reported)
        if silent.size:
            s = int(silent[0])
            return [f"S12: slot {s}'s in-sync copies span fewer hosts than its copies wanted at epoch {m.epoch} "
                    "and it is not reported domain-degraded"]
        return []

    # --- L5: back-pressure, not an unbounded queue ---
    def _bounded(self) -> list[str]:
        """L5: a write (a ``CHANGES`` item: a push, a pull that inserted, ``ImportRows``) is queued only after its
        server found every replication stream within ``replication_queue_bytes`` (a writer waits for room, or
        is refused, before it takes its table's lock). What is queued ahead of a write now is what was queued
        when it was admitted less what was acknowledged since, so it never exceeds the bound; only the items
        the primary queues itself (barriers, slot copy steps) and the one write admitted last may go past it.
        The simulated writers never wait (the world would stop): they are refused at once."""
        for server in self.run.servers.values():
            if not server.up or server.svc is None or server.svc.replicator is None:
                continue
            core = server.svc.replicator.core
            bound = core.max_queue_bytes
            for s in list(core.streams.values()):
                if s.queued_bytes <= bound:
                    continue  # nothing can be queued behind more than the bound
                queued = list(s.queue)
                sizes = np.array([q.nbytes for q in queued], np.int64)
                ahead = np.cumsum(sizes) - sizes
                writes = np.array([q.item.kind == CHANGES for q in queued], bool)
                over = np.flatnonzero(writes & (ahead > bound))
                if over.size:
                    q = queued[int(over[0])]
                    return [f"L5: {server.name} queued a write of {q.item.table} (seq {q.seq}) to {s.target_id} "
                            f"behind {int(ahead[over[0]])} bytes, more than its replication queue's bound of "
                            f"{bound} bytes"]
        return []
