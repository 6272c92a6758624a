"""Moves: how the map walks toward a placement, one safe step per map.

``_reconcile`` runs after every event (lock held): the first placement (once ``expect_servers`` are up, or
``bootstrap_wait_s`` after the first registered), elections (``liveness``), re-replication of lost copies as
catching-up copies on the least loaded servers, then one step toward the target (``placement.step_toward``).
A target comes from ``rebalance`` (by measured load), ``move_slot``, ``drain`` or the automatic rebalance
that gives a server holding nothing its share. A primary's move is a hand-over: the old primary stops
writing and reports ``handover_ready`` once its in-sync copies hold everything, and only then is the new
primary named, so a planned move loses no write. The placement arithmetic is pure (``tigana.ps.scheduler.placement``);
this room decides when to apply it and says what changed.

Failure domains (``tigana.ps.domains``): every placement keeps a slot's copies in distinct domains at the
widest level the placeable servers allow (``_groups``); a map whose copies share a domain that a balanced
placement would keep apart (servers registered one host at a time, a domain back after a loss) gets that
placement as its target (``_respread``, with or without auto-rebalance: like re-replication, it restores
protection); a drain or a move that would put copies of a slot into one domain they do not share now is refused,
naming the slot and the domain.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from tigana.ps import domains
from tigana.ps.errors import InvalidArgument
from tigana.ps.logs import event, slots_text
from tigana.ps.routing import HANDING_OVER, IN_SYNC, NO_SERVER, format_slots
from tigana.ps.scheduler import placement
from tigana.ps.scheduler.spread import Spread, _pad

log = logging.getLogger("tigana.ps.scheduler")  # one logger for the whole scheduler


class Moves(Spread):
    """Placement: first placement, re-replication, targets and the steps toward them; see the module docstring."""

    def handover_ready(self, reporter: str, slots: np.ndarray, epoch: int, *, now: float) -> tuple[bool, str]:
        """``reporter``, the primary of ``slots`` marked handing over, refuses writes to them since map
        ``epoch`` and its in-sync copies hold everything it wrote: name the target's primary (an in-sync
        copy) as the new primary. A planned hand-over thus loses no write, sync or async."""
        self.now = now
        m = self.map
        p = m.index_of(reporter)
        if p < 0 or self.target is None:
            return False, "no hand-over in progress"
        slots = np.asarray(slots, np.int64)
        slots = slots[(slots >= 0) & (slots < m.num_slots)]
        # the report must come from a map that already had the hand-over of the slot (the fence)
        slots = slots[(m.copies[slots, 0] == p) & m.handing_over()[slots] & (m.slot_epochs[slots] <= epoch)]
        copies, states, done = placement.hand_over(m.copies, m.states, slots, self.target)
        if not done.size:
            return False, "no such hand-over (the map changed)"
        for slot in done:
            self.handover_since.pop(int(slot), None)
        self._moved.update(int(x) for x in done)
        self.metrics.slot_moves.labels("primary_handover").inc(done.size)
        primaries = self._ids(copies[done, 0])
        self._commit(m.evolve(copies=copies, states=states),
                     f"{done.size} primar(ies) handed over by {reporter} to {','.join(primaries)} (slots "
                     f"{slots_text(done)})", event("primary_handover", slots=done, server=primaries, source=reporter))
        return True, ""  # the next tick drops the copies the target does not keep (one step per map)

    # --- placement -----------------------------------------------------------------------------------
    def _placeable(self) -> np.ndarray:
        """(num_servers,) bool: alive and not being drained (may receive copies)."""
        alive = self._alive()
        for i, s in enumerate(self.map.servers):
            if s.id in self.draining:
                alive[i] = False
        return alive

    def _find(self, server: str) -> int:
        """A server's index by id or address; ``InvalidArgument`` naming it when unknown."""
        for i, s in enumerate(self.map.servers):
            if server in (s.id, s.address):
                return i
        raise InvalidArgument(f"server {server!r}: no such server in the map (ids: "
                              f"{[s.id for s in self.map.servers]})")

    def rebalance(self, *, plan_only: bool = False, rows: np.ndarray | None = None,
                  bytes_: np.ndarray | None = None, rates: np.ndarray | None = None,
                  cost: placement.CostModel | None = None, now: float) -> placement.Plan:
        """Plan a placement that evens out the measured load (``placement.plan``); unless ``plan_only``, make it
        the target (the map then moves toward it, one safe step at a time). A balanced placement plans no move
        and the plan's ``note`` says so."""
        self.now = now
        m = self.map
        n = m.num_slots
        rows = np.ones(n) if rows is None else np.asarray(rows, float)
        plan = placement.plan(m.copies, self._placeable(), self.config.replicas, rows,
                              np.zeros(n) if bytes_ is None else bytes_, np.zeros(n) if rates is None else rates,
                              cost, self._groups(self._placeable()))
        if not plan.moves:
            plan = dataclasses.replace(plan, note="the placement is balanced already: nothing to move")
        if not plan_only:
            self.target, self.target_kind = plan.target, "balance"
            self._save()
            slots = [mv[0] for mv in plan.moves]
            ids = self._ids(x for mv in plan.moves for x in (*mv[1], *mv[2], mv[3], mv[4]))
            log.info("rebalance at epoch %d: %d move(s) (slots %s, servers %s), %d bytes to copy", m.epoch,
                     len(plan.moves), slots_text(slots), ",".join(ids) or "none", plan.bytes_moved,
                     extra=event("rebalance", slots=slots, epoch=m.epoch, server=ids, bytes=plan.bytes_moved))
            self._reconcile()
        return plan

    def move_slot(self, slot: int, to: str, *, from_: str = "", primary: bool = False, now: float
                  ) -> placement.Plan:
        """Target: ``slot``'s copy on ``from_`` (default: its primary) moves to ``to``; the copy keeps its role
        (a primary's move ends with ``to`` leading), or leads with ``primary``. Idempotent: when the end state
        already holds (or is already planned) nothing changes and the plan's ``note`` says what holds; a
        refusal names what holds (who leads the slot, who holds a copy, a server draining or down)."""
        self.now = now
        m = self.map
        if not 0 <= slot < m.num_slots:
            raise InvalidArgument(f"move-slot: field 'slot' must be in [0, {m.num_slots}), got {slot}")
        t = self._find(to)
        if not m.servers[t].up:
            raise InvalidArgument(f"move-slot: server {to!r} is down (declared dead): it cannot take slot {slot}")
        if m.servers[t].id in self.draining:
            raise InvalidArgument(f"move-slot: server {to!r} is draining: it cannot take slot {slot} (undrain it "
                                  "first: tigana admin drain SERVER --undrain)")
        target = (self.target if self.target is not None else m.copies).copy()
        if target.shape[1] < m.width:
            target = _pad(target, m.width)
        row = [int(x) for x in target[slot] if x >= 0]
        if not row:
            raise InvalidArgument(f"move-slot: slot {slot} has no copy to move (no primary)")
        src = row[0] if not from_ else self._find(from_)
        # The end state asked for: ``to`` leads the slot (--primary, or the primary's copy moves), else ``to``
        # holds a copy and ``from_`` none (or they are one server).
        leads = primary or not from_
        if (row[0] == t) if leads else (t in row and (src == t or src not in row)):
            return self._nothing_to_move(slot, t, leads=leads, planned=target)
        if src not in row:
            raise InvalidArgument(f"move-slot: server {from_!r} holds no copy of slot {slot} "
                                  f"({self._holders(slot)})")
        was_primary = row[0] == src
        if t in row and not primary:
            hint = " (--primary makes it lead)" if was_primary else ""
            raise InvalidArgument(f"move-slot: server {to!r} already holds a copy of slot {slot} "
                                  f"({self._holders(slot)}): {m.servers[src].id}'s copy cannot move there{hint}")
        if t in row:  # make an existing copy the primary: roles swap, no data moves
            new = [t] + [x for x in row if x != t]
        else:
            new = [t if x == src else x for x in row]
            if primary and not was_primary:
                new = [t] + [x for x in new if x != t]
        target[slot] = np.full(target.shape[1], NO_SERVER, np.int32)
        target[slot, :len(new)] = new
        refused = self._collapses(self._placeable(), target, np.array([slot]))
        if refused:
            raise InvalidArgument(f"move-slot: {refused}; move it to a server in another domain")
        self.target, self.target_kind = target, "moves"
        self._save()
        log.info("move-slot at epoch %d: slot %d from %s to %s%s", m.epoch, slot, m.servers[src].id,
                 m.servers[t].id, " (as primary)" if new[0] == t else "",
                 extra=event("move_slot", slots=[slot], epoch=m.epoch, server=self._ids([src, t]),
                             source=m.servers[src].id, target=m.servers[t].id))
        self._reconcile()
        return placement.Plan(target, [(slot, [x for x in new if x not in row], [x for x in row if x not in new],
                                        row[0], new[0], 0)], np.zeros(0), np.zeros(0), 0, 0.0)

    def _holders(self, slot: int) -> str:
        """Who holds ``slot`` in the map now, for messages: "s1 leads it, s2 holds an in-sync copy"."""
        m = self.map
        roles = []
        for j, x in enumerate(m.copies[slot]):
            if x < 0:
                continue
            sid = m.servers[int(x)].id
            if j == 0:
                roles.append(f"{sid} {'hands it over' if m.states[slot, 0] == HANDING_OVER else 'leads it'}")
            else:
                roles.append(f"{sid} holds {'an in-sync' if m.states[slot, j] == IN_SYNC else 'a catching-up'} copy")
        return ", ".join(roles) or "no server holds it"

    def _nothing_to_move(self, slot: int, t: int, *, leads: bool, planned: np.ndarray) -> placement.Plan:
        """The plan of a move whose end state already holds in the map, or is already the target's."""
        m = self.map
        tid = m.servers[t].id
        row = m.copies[slot]
        held = (row[0] == t and m.states[slot, 0] == IN_SYNC) if leads else \
            bool(((row == t) & (m.states[slot] == IN_SYNC)).any())
        if held:
            note = f"server {tid} already {'leads' if leads else 'holds a copy of'} slot {slot}: nothing to move"
        else:
            note = (f"slot {slot} is already moving to server {tid}{' as primary' if leads else ''} "
                    f"({self._holders(slot)}): nothing more to plan")
        log.info("move-slot at epoch %d: %s", m.epoch, note,
                 extra=event("move_slot_not_needed", slots=[slot], epoch=m.epoch, server=[tid], target=tid))
        return placement.Plan(planned, [], np.zeros(0), np.zeros(0), 0, 0.0, note=note)

    def drain(self, server: str, *, undrain: bool = False, now: float) -> placement.Plan:
        """Move every copy off ``server`` (it then holds nothing and may be stopped); ``undrain`` takes it back.
        Idempotent: a drain of a server already draining keeps its moves (or plans its copies left again when
        no target remains), an undrain of a server not draining changes nothing; the plan's ``note`` says so."""
        self.now = now
        i = self._find(server)
        sid = self.map.servers[i].id
        if undrain:
            if sid not in self.draining:
                return placement.Plan(self.map.copies, [], np.zeros(0), np.zeros(0), 0, 0.0,
                                      note=f"server {sid} is not draining: nothing to undo")
            self.draining.discard(sid)
            if self.target is not None and self.target_kind == "balance":
                self.target = None  # stop moving its copies away (what moved stays where it is)
                self._moved.clear()
                self._moved_on.clear()
            self._save()
            return placement.Plan(self.map.copies, [], np.zeros(0), np.zeros(0), 0, 0.0)
        if sid in self.draining:
            holds = int(self.map.holds(i).sum())
            if not holds:
                return placement.Plan(self.map.copies, [], np.zeros(0), np.zeros(0), 0, 0.0,
                                      note=f"server {sid} is already drained: it holds nothing")
            if self.target is not None:
                todo = placement.moves(self.map.copies, self.target)
                return placement.Plan(self.target, [(s, a, r, -1, -1, 0) for s, a, r in todo], np.zeros(0),
                                      np.zeros(0), 0, 0.0, note=f"server {sid} is already draining: {holds} "
                                      f"slot cop(ies) still on it, {len(todo)} slot(s) still to move")
        before = self._placeable()
        self.draining.add(sid)
        left = int(self._placeable().sum())
        if not left:
            self.draining.discard(sid)
            raise InvalidArgument(f"drain: {server!r} is the last server that can hold slots")
        if left < 1 + self.config.replicas and self.map.holds(i).any():
            self.draining.discard(sid)
            raise InvalidArgument(f"drain: {server!r}: {left} server(s) would be left to hold {1 + self.config.replicas} "
                                  "copies of every slot; add a server first (a drain never makes the cluster "
                                  "under-replicated)")
        target = placement.balance(self.map.copies, self._placeable(), self.config.replicas,
                                   groups=self._groups(self._placeable()))
        refused = self._collapses(before, target)
        if refused:
            self.draining.discard(sid)
            raise InvalidArgument(f"drain: {server!r}: {refused}; add a server in another domain first (a drain "
                                  "never puts a slot's copies into one failure domain)")
        todo = placement.moves(self.map.copies, target)
        self.target, self.target_kind = target, "balance"
        self._save()
        slots = [mv[0] for mv in todo]
        log.info("draining %s at epoch %d: %d slot(s) to move (slots %s)", sid, self.map.epoch, len(todo),
                 slots_text(slots), extra=event("drain", slots=slots, epoch=self.map.epoch, server=sid))
        self._reconcile()
        return placement.Plan(target, [(s, a, r, -1, -1, 0) for s, a, r in todo], np.zeros(0), np.zeros(0),
                              0, 0.0)

    def _fixed_target(self, target: np.ndarray, alive: np.ndarray, placeable: np.ndarray,
                      current: np.ndarray) -> np.ndarray:
        """The target with slots that name a dead server rolled back to their current copies, and re-planned
        when it names a server being drained."""
        if target.shape[0] != current.shape[0] or not placeable.any():
            return current.copy()  # nothing to plan toward while no server can hold a slot (every one down)
        named = target[target >= 0]
        groups = self._groups(placeable)
        if named.size and not placeable[named].all() and self.target_kind == "balance":  # plan again without them
            return placement.balance(current, placeable, self.config.replicas, groups=groups)
        if named.size and not placeable[named].all():
            dead_rows = ((target >= 0) & ~alive[np.clip(target, 0, None)]).any(axis=1)
            if dead_rows.any():  # a move to or from a dead server is rolled back
                width = max(target.shape[1], current.shape[1])
                target = _pad(target, width).copy()
                target[dead_rows] = _pad(current, width)[dead_rows]
            named = target[target >= 0]
            if named.size and not placeable[named].all():  # a draining server still named: plan again
                target = placement.balance(current, placeable, self.config.replicas, groups=groups)
        return target

    def _reconcile(self) -> None:
        """First placement, elections, re-replication and one step toward the target (lock held)."""
        m = self.map
        alive = self._alive()
        placeable = self._placeable()
        if not alive.any():
            return
        if (m.copies < 0).all() and not m.slot_epochs.any():
            # A new cluster (no slot ever placed). A cluster whose every copy was lost (all servers declared
            # dead) is not one: its slots go to an unclean election below, newest rows first, once every
            # server is back or the timeout passed; a first placement would hand every slot to whichever
            # server registered first and discard newer rows of the others.
            if not self._bootstrap_due(int(placeable.sum())):
                return
            live = np.flatnonzero(placeable)
            copies = live[placement.initial(live.size, m.num_slots, self.config.replicas)].astype(np.int32)
            copies[:, 0] = live[placement.initial(live.size, m.num_slots, 0)[:, 0]]
            groups = self._groups(placeable)
            if groups is not None and domains.collapsed(copies, groups).any():
                copies = placement.balance(copies, placeable, self.config.replicas, groups=groups)
            self._commit(m.evolve(copies=copies, states=np.zeros(copies.shape, np.uint8)),
                         f"first placement over {live.size} server(s)",
                         event("first_placement", slots=range(m.num_slots), server=self._ids(live)))
            return
        self._elect()
        m = self.map
        copies, states = placement.repair(m.copies, m.states, alive, self.config.replicas, placeable,
                                          self._groups(placeable))
        repaired, repair_servers = _placement_changes(m.copies, copies)
        stepped: dict[str, list[int]] = {"added": [], "primary": [], "dropped": []}
        step_servers: set[int] = set()
        self._auto_rebalance(copies, placeable)
        self._respread(copies, placeable)
        had_target = self.target is not None
        reached = False
        if self.target is not None:
            self.target = self._fixed_target(self.target, alive, placeable, copies)
        now = self.now
        expired = np.zeros(m.num_slots, bool)
        for slot, since in self.handover_since.items():
            expired[slot] = now - since > self._handover_timeout()
        states = placement.cancel_hand_overs(copies, states, self.target, expired)
        if self.target is not None:
            before = copies
            copies, states = placement.step_toward(copies, states, self.target,
                                                   max_new_copies=self.config.max_copies_per_step)
            stepped, step_servers = _placement_changes(before, copies)
            for kind in ("added", "primary", "dropped"):
                self._moved.update(stepped[kind])
            self._moved_on.update(self._ids(step_servers))
            if not placement.moves(copies, self.target) and (states[copies >= 0] == IN_SYNC).all():
                self.target = None
                reached = True
        if self.target is None:
            copies, states = placement.trim(copies, states, self.config.replicas)
        if expired.any():  # cancelled for one map at least: the primary serves writes again, then retries
            states[expired & (states[:, 0] == HANDING_OVER), 0] = IN_SYNC
        handing = np.flatnonzero((copies[:, 0] >= 0) & (states[:, 0] == HANDING_OVER))
        self.handover_since = {int(x): self.handover_since.get(int(x), now) for x in handing}
        if not (np.array_equal(_pad(copies, m.width), _pad(m.copies, copies.shape[1]))
                and np.array_equal(_pad(states, m.width), _pad(m.states, states.shape[1]))):
            why, extra = self._describe_step(repaired["added"], repair_servers, stepped, step_servers,
                                             _placement_changes(m.copies, copies))
            self._commit(m.evolve(copies=copies, states=states), why, extra)
            self.metrics.copies_added.inc(len(repaired["added"]))
            for kind, step in (("added", "copy_started"), ("primary", "primary_handover"),
                               ("dropped", "copy_dropped")):
                self.metrics.slot_moves.labels(step).inc(len(stepped[kind]))
        elif had_target and self.target is None:
            self._save()
        if reached:
            moved, on = sorted(self._moved), sorted(self._moved_on)
            self._moved.clear()
            self._moved_on.clear()
            self.metrics.moves_completed.inc(len(moved))
            log.info("placement reached its target at epoch %d: %d slot(s) moved (slots %s; servers %s)",
                     self.map.epoch, len(moved), slots_text(moved), ",".join(on) or "none",
                     extra=event("moves_done", slots=moved, epoch=self.map.epoch, server=on))

    def _handover_timeout(self) -> float:
        """How long a primary may take to report a hand-over before it is cancelled (it serves writes again
        and the step is retried): its drain needs only its in-sync copies' acknowledgement of the stream."""
        return max(5.0, 2 * self.config.heartbeat_timeout_s)

    def _auto_rebalance(self, copies: np.ndarray, placeable: np.ndarray) -> None:
        """With ``auto_rebalance``: when a server that may hold slots holds or leads none (and is planned none)
        while another holds several, aim for a balanced placement over every server (lock held). Only such a
        server triggers it, so a placement an operator chose (``rebalance`` by load, ``move-slot``) stays."""
        if not self.config.auto_rebalance or placeable.sum() < 2 or (copies < 0).all():
            return
        if self.target is not None and self.target_kind != "balance":
            return  # an operator's moves first
        planned = copies if self.target is None else self.target
        prim, total = placement.copy_counts(planned, placeable.shape[0])
        # a server with no copy, or none to lead (a server joining after the first placement gets the
        # missing replicas first, and would lead nothing), while another has several
        empty = placeable & ((total == 0) | (prim == 0))
        if not empty.any() or max(total[placeable].max(), 2 * prim[placeable].max()) < 2:
            return
        target = placement.balance(copies, placeable, self.config.replicas, groups=self._groups(placeable))
        if not placement.moves(copies, target):
            return  # as balanced as it gets (fewer slots than servers)
        self.target, self.target_kind = target, "balance"
        self._save()
        ids = self._ids(np.flatnonzero(empty))
        log.info("auto-rebalance at epoch %d: server(s) %s hold or lead no slot; %d slot(s) to move", self.map.epoch,
                 ",".join(ids), len(placement.moves(copies, self.target)),
                 extra=event("auto_rebalance", epoch=self.map.epoch, server=ids))

    def _describe_step(self, rebuilt: list[int], rebuilt_on: set[int], stepped: dict[str, list[int]],
                       step_servers: set[int], overall: tuple[dict[str, list[int]], set[int]]
                       ) -> tuple[str, dict[str, Any]]:
        """The log text and fields of a placement step: copies re-added after a failure, and the move steps
        (copies started, primaries handed over, copies dropped), each naming its slots and servers; else what
        changed overall (extra catching-up copies trimmed, copy states)."""
        parts = []
        if rebuilt:
            parts.append(f"{len(rebuilt)} lost cop(ies) re-added (slots {slots_text(rebuilt)}) on "
                         f"{','.join(self._ids(rebuilt_on))}")
        for kind, what in (("added", "move cop(ies) started"), ("primary", "primar(ies) handed over"),
                           ("dropped", "old cop(ies) dropped")):
            if stepped[kind]:
                parts.append(f"{len(stepped[kind])} {what} (slots {slots_text(stepped[kind])})")
        servers = self._ids(rebuilt_on | step_servers)
        if step_servers:
            parts[-1] += f"; servers {','.join(self._ids(step_servers))}"
        slots = sorted({*rebuilt, *stepped["added"], *stepped["primary"], *stepped["dropped"]})
        if not parts:
            changed, on = overall
            slots, servers = sorted({*changed["added"], *changed["primary"], *changed["dropped"]}), self._ids(on)
            parts.append(f"{len(changed['dropped'])} extra cop(ies) trimmed (slots {slots_text(changed['dropped'])})"
                         f" on {','.join(servers)}" if changed["dropped"] else "copy states updated")
        text = "placement step: " + "; ".join(parts)
        return text, event("slot_move" if step_servers else "re_replication", slots=slots, server=servers,
                           rebuilt=format_slots(rebuilt), copies_started=format_slots(stepped["added"]),
                           primaries_moved=format_slots(stepped["primary"]),
                           copies_dropped=format_slots(stepped["dropped"]))

    def _bootstrap_due(self, up: int) -> bool:
        if up >= self.config.expect_servers:
            return True
        return self.first_register is not None and self.now - self.first_register >= self.config.bootstrap_wait_s


def _placement_changes(before: np.ndarray, after: np.ndarray) -> tuple[dict[str, list[int]], set[int]]:
    """What changed between two copies arrays, for logs and metrics: the slots where a server gained a copy
    (``added``), the primary changed (``primary``) or a server lost its copy (``dropped``), and the indexes
    of the servers involved. Vectorized over slots: a (slots, servers) membership matrix per side."""
    width = max(before.shape[1], after.shape[1])
    a, b = _pad(np.asarray(before, np.int32), width), _pad(np.asarray(after, np.int32), width)
    servers = int(max(a.max(initial=-1), b.max(initial=-1))) + 1
    had, has = _members(a, servers), _members(b, servers)
    gained, lost = has & ~had, had & ~has
    primary = a[:, 0] != b[:, 0]
    out = {"added": np.flatnonzero(gained.any(axis=1)).tolist(),
           "primary": np.flatnonzero(primary).tolist(),
           "dropped": np.flatnonzero(lost.any(axis=1)).tolist()}
    heads = np.concatenate([a[primary, 0], b[primary, 0]])
    involved = set(np.flatnonzero((gained | lost).any(axis=0)).tolist()) | set(heads[heads >= 0].tolist())
    return out, involved


def _members(copies: np.ndarray, servers: int) -> np.ndarray:
    """(slots, servers) bool: which servers hold a copy of each slot."""
    out = np.zeros((copies.shape[0], max(servers, 1)), bool)
    rows, cols = np.nonzero(copies >= 0)
    out[rows, copies[rows, cols]] = True
    return out
