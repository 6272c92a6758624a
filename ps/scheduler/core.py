"""The scheduler's state machine: ``SchedulerCore``, its state, and the changes it makes to the map itself.

A sans-IO core, as etcd's ``raft`` is: no lock, thread, socket, store or clock inside. Every event is a
method call that carries the time (``now``); what the core wants done comes out of ``take_ready()``: the state
to persist, the map to announce, the servers to probe (``Ready``). The driver (``driver.SchedulerDriver``)
runs one event at a time, persists the state *before* anyone sees the map (a reply, a long poll or an
announcement), and feeds probe answers back as events; the simulator drives the same core on its own clock.

Every change is a new map (epoch + 1). This room handles what servers and operators tell the core directly:
a server registers (a new one is added; a known one with a new boot lost its memory since its last snapshot,
so its copies are demoted to catching up and it never leads with stale rows while a valid copy exists
elsewhere) and heartbeats; a primary reports a copy failed (demoted out of the in-sync set before the
primary acknowledges anything without it: invariant I1 of ``replication``) or caught up (it joins the
in-sync set); tables are created or dropped. It also answers the reads: ``figures`` and ``status``.

Failure detection and elections live in ``liveness``, placement and its steps in ``moves``; ``SchedulerCore``
is the one class assembled from them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from tigana.proto import scheduler_pb2 as spb
from tigana.proto import shard_pb2 as pb
from tigana.ps.domains import FailureDomain
from tigana.ps.errors import InvalidArgument, TableExists
from tigana.ps.logs import event, slots_text
from tigana.ps.metrics import SchedulerMetrics
from tigana.ps.routing import CATCHING_UP, IN_SYNC, NO_SERVER, ServerEntry, ShardMap, TableDef, format_slots
from tigana.ps.scheduler import placement
from tigana.ps.scheduler.actions import Probe, Ready
from tigana.ps.scheduler.config import SchedulerConfig
from tigana.ps.scheduler.liveness import Liveness
from tigana.ps.scheduler.moves import Moves
from tigana.ps.scheduler.stores.file import SchedulerState
from tigana.ps.wire import cluster as cluster_wire

log = logging.getLogger("tigana.ps.scheduler")  # one logger for the whole scheduler


def new_state(config: SchedulerConfig, cluster_id: str) -> SchedulerState:
    """The state of a new cluster: an empty map of ``config.num_slots`` slots (the first placement waits for
    ``expect_servers``)."""
    m = ShardMap.empty(config.num_slots, config.replicas, cluster_id)
    return SchedulerState(m, m.copies.copy())


class SchedulerCore(Liveness, Moves):
    """The cluster state machine (see the ``tigana.ps.scheduler`` docstring), assembled from one room per
    concept: this module (state, commits, servers, copy reports, tables, reads), ``liveness`` and ``moves``.
    Built from a loaded (or ``new_state``) ``state`` at time ``now``; not thread-safe (its driver serializes
    the events)."""

    def __init__(self, config: SchedulerConfig, state: SchedulerState, *, now: float,
                 metrics: SchedulerMetrics | None = None) -> None:
        if state.map.num_slots != config.num_slots:
            raise InvalidArgument(f"scheduler: the saved map has {state.map.num_slots} slots, "
                                  f"--num-slots is {config.num_slots}")
        self.config = config
        self.metrics = metrics if metrics is not None else SchedulerMetrics()
        self.now = now
        self._moved: set[int] = set()  # slots changed by placement steps since the target was set
        self._moved_on: set[str] = set()  # and the ids of the servers those steps involved
        self.map: ShardMap = state.map
        self.target: np.ndarray | None = None if np.array_equal(state.target, state.map.copies) else state.target
        self.draining: set[str] = set(state.draining)
        self.target_kind = state.target_kind  # "balance": re-planned on failures; "moves": rolled back per slot
        self.started = now
        self.ticked = False  # no tick yet: the time from the start to the first is this process's silence too
        # Liveness is not persisted: every server in the map gets a full timeout from this start.
        self.last_seen: dict[str, float] = {s.id: now for s in self.map.servers}
        self.heard: set[str] = set()           # servers heard from (register/heartbeat) since this start
        self.stats: dict[str, dict[str, float]] = {}
        self.positions: dict[str, dict[str, dict[int, tuple[int, int]]]] = {}  # server -> table -> slot -> pos
        self.orphaned_since: dict[int, float] = {}  # slot -> when it lost its last in-sync copy
        self.first_register: float | None = None
        self.registered_at: dict[str, float] = {}
        self._probing: set[str] = set()
        # When each copy last became catching up ((slot, server index) -> epoch): a caught-up report of a
        # slot copy started before that is stale. Not persisted: after a restart every catching-up copy
        # counts from the loaded epoch (older reports are refused; the primary starts the copy again).
        self.catching_since: dict[tuple[int, int], int] = {
            (int(r), int(self.map.copies[r, c])): self.map.epoch
            for r, c in zip(*np.nonzero((self.map.copies >= 0) & (self.map.states == CATCHING_UP)), strict=True)}
        self.handover_since: dict[int, float] = {}  # slot -> when its primary was told to hand over
        self._warned_unprotected = -1e9
        self._degraded_since: float | None = None
        self._states: list[SchedulerState] = []  # to persist, in order: the state at each change since the last Ready
        self._announce: ShardMap | None = None
        self._probes: list[Probe] = []

    # --- outputs -------------------------------------------------------------------------------------
    def state(self) -> SchedulerState:
        """What survives a restart: the map, the target, the servers draining and the target's kind."""
        m = self.map
        target = self.target if self.target is not None else m.copies
        return SchedulerState(m, np.asarray(target, np.int32), tuple(sorted(self.draining)), self.target_kind)

    def take_ready(self) -> Ready:
        """What the events since the last call left to do (see ``Ready``); clears it."""
        ready = Ready(tuple(self._states), self._announce, tuple(self._probes))
        self._states, self._announce, self._probes = [], None, []
        return ready

    # --- helpers -------------------------------------------------------------------------------------
    def _commit(self, new: ShardMap, why: str, extra: dict[str, Any] | None = None) -> ShardMap:
        """Make ``new`` current; it is persisted, then announced, by the driver (``take_ready``).
        ``extra``: the log record's fields (``logs.event``: slots, server...); the epoch is added."""
        self._note_catching(self.map, new)
        self.map = new
        self._states.append(self.state())
        self._announce = new
        self.metrics.map_changes.inc()
        log.info("epoch %d: %s (%s)", new.epoch, why, new.summary(),
                 extra={**(extra or event("map_change")), "epoch": new.epoch})
        return new

    def _note_catching(self, old: ShardMap, new: ShardMap) -> None:
        """Record the epoch at which each copy became catching up (added, demoted, or its server restarted: a
        new boot holds none of the rows a copy into the old process had built, so that copy's report is stale)."""
        was = set()
        for r, c in zip(*np.nonzero((old.copies >= 0) & (old.states == CATCHING_UP)), strict=True):
            server = int(old.copies[r, c])
            if server < len(new.servers) and new.servers[server].boot == old.servers[server].boot:
                was.add((int(r), server))
        now = set()
        for r, c in zip(*np.nonzero((new.copies >= 0) & (new.states == CATCHING_UP)), strict=True):
            key = (int(r), int(new.copies[r, c]))
            now.add(key)
            if key not in was:
                self.catching_since[key] = new.epoch
        for key in [k for k in self.catching_since if k not in now]:
            del self.catching_since[key]

    def _save(self) -> None:
        """The target, its kind or the servers draining changed (the map did not): persist them."""
        self._states.append(self.state())

    def _alive(self) -> np.ndarray:
        return np.array([s.up for s in self.map.servers], bool)
    # --- servers -----------------------------------------------------------------------------------------
    def register(self, server_id: str, address: str, boot: str,
                 positions: dict[str, dict[int, tuple[int, int]]] | None = None, *, now: float,
                 domain: FailureDomain | None = None) -> ShardMap:
        """A server (re)joins (from failure ``domain``: None or empty parts, unknown); returns the map it should
        install."""
        if not server_id or not address or not boot:
            raise InvalidArgument("register: fields 'server_id', 'address' and 'boot' are required")
        domain = domain or FailureDomain()
        self.now = now
        self.last_seen[server_id] = now
        self.heard.add(server_id)
        if self.first_register is None:
            self.first_register = now
        self.positions[server_id] = positions or {}
        self.registered_at[server_id] = now
        log.info("server %s (%s, boot %s, domain %s) registers at epoch %d with rows of %s", server_id, address,
                 boot, domain or "unknown", self.map.epoch,
                 {t: len(p) for t, p in (positions or {}).items()} or "no table",
                 extra=event("server_register", epoch=self.map.epoch, server=server_id, address=address))
        m = self.map
        i = m.index_of(server_id)
        if i < 0:
            servers = (*m.servers, ServerEntry(server_id, address, boot, True, domain))
            self._commit(m.evolve(servers=servers), f"server {server_id} ({address}, {domain or 'domain unknown'}) "
                         "joined", event("server_joined", server=server_id, address=address))
        else:
            s = m.servers[i]
            if s.boot == boot:
                if s.address != address or not s.up or s.domain != domain:
                    self._commit(m.evolve(servers=m.replace_server(i, address=address, up=True, domain=domain)),
                                 f"server {server_id} ({address}, {domain or 'domain unknown'}) is back",
                                 event("server_back", server=server_id, address=address))
            else:
                self._restarted(i, address, boot, domain)
        self._adopt_orphans(server_id, positions or {})
        self._reconcile()
        return self.map

    def _adopt_orphans(self, server_id: str, positions: dict[str, dict[int, tuple[int, int]]]) -> None:
        """Slots with no primary (every copy lost) of which ``server_id`` registered rows: it holds them as
        catching-up copies, so that it keeps those rows until the unclean election (``_elect``) picks the
        newest. A server declared dead lost its copies from the map; back without them, it would delete the
        very rows the election may name it primary for (a fault test lost updates so)."""
        m = self.map
        i = m.index_of(server_id)
        held = sorted({int(slot) for rows in positions.values() for slot, pos in rows.items() if tuple(pos) != (0, 0)})
        if i < 0 or not held or not m.slot_epochs.any():
            return  # a cluster that never placed a slot has no orphans: its first placement comes (moves)
        slots = np.array(held, np.int64)
        slots = slots[(slots >= 0) & (slots < m.num_slots)]
        orphans = slots[(m.copies[slots, 0] < 0) & ~(m.copies[slots] == i).any(axis=1)]
        if not orphans.size:
            return
        copies, states = m.copies.copy(), m.states.copy()
        free = copies[orphans] < 0
        free[:, 0] = False  # the primary's place stays empty for the election
        if not free.any(axis=1).all():  # a full row: one more column
            copies, states = placement.widen(copies, states, copies.shape[1] + 1)
            free = copies[orphans] < 0
            free[:, 0] = False
        col = free.argmax(axis=1)
        copies[orphans, col], states[orphans, col] = i, CATCHING_UP
        for slot in orphans:
            self.orphaned_since.setdefault(int(slot), self.now)
        self._commit(m.evolve(copies=copies, states=states),
                     f"server {server_id} holds its rows of {orphans.size} slot(s) with no copy left (slots "
                     f"{slots_text(orphans)}) until their election", event("orphans_held", slots=orphans,
                                                                            server=server_id))

    def _restarted(self, i: int, address: str, boot: str, domain: FailureDomain) -> None:
        """Server ``i`` came back as a new process: its copies are no longer known to be in sync."""
        m = self.map
        copies, states = m.copies.copy(), m.states.copy()
        alive = self._alive()
        alive[i] = False  # for promotion purposes its old copies do not count
        held = np.flatnonzero((copies == i).any(axis=1))
        promoted = orphaned = 0
        moved: list[int] = []  # slots it led whose primary role went to an in-sync copy
        for slot in held:
            row = copies[slot]
            j = int(np.flatnonzero(row == i)[0])
            if j == 0:
                cand = [k for k in range(1, row.shape[0])
                        if row[k] >= 0 and alive[row[k]] and states[slot, k] == IN_SYNC]
                if cand:
                    k = cand[0]
                    copies[slot, 0], copies[slot, k] = row[k], i
                    states[slot, 0], states[slot, k] = IN_SYNC, CATCHING_UP
                    promoted += 1
                    moved.append(int(slot))
                else:  # no valid copy left anywhere: an unclean election decides (``_elect``)
                    copies[slot, 0] = NO_SERVER
                    states[slot, :] = CATCHING_UP
                    free = np.flatnonzero(copies[slot, 1:] < 0)
                    if free.size:
                        copies[slot, 1 + free[0]] = i
                    else:
                        copies = np.concatenate([copies, np.full((copies.shape[0], 1), NO_SERVER, np.int32)], 1)
                        states = np.concatenate([states, np.zeros((states.shape[0], 1), np.uint8)], 1)
                        copies[slot, -1] = i
                        states[slot, -1] = CATCHING_UP
                    orphaned += 1
                    self.orphaned_since.setdefault(int(slot), self.now)
            else:
                states[slot, j] = CATCHING_UP
        servers = m.replace_server(i, address=address, boot=boot, up=True, domain=domain)
        sid = m.servers[i].id
        self._commit(m.evolve(copies=copies, states=states, servers=servers),
                     f"server {sid} restarted (boot {boot}): {held.size} cop(ies) to rebuild (slots "
                     f"{slots_text(held)}), {promoted} primar(ies) failed over (slots {slots_text(moved)}), "
                     f"{orphaned} slot(s) await an election",
                     event("server_restarted", slots=held, server=sid, failed_over=format_slots(moved),
                           address=address))
        self.metrics.failovers.labels("restart").inc(promoted)
        self.metrics.copies_demoted.labels("restart").inc(held.size)

    def heartbeat(self, server_id: str, boot: str, epoch: int, stats: dict[str, float] | None = None, *,
                  now: float) -> tuple[ShardMap | None, bool]:
        """(the map when newer than ``epoch``, whether the server must register again)."""
        m = self.map
        i = m.index_of(server_id)
        if i < 0 or m.servers[i].boot != boot:
            return None, True
        self.now = now
        self.last_seen[server_id] = now
        self.heard.add(server_id)
        if stats:
            self.stats[server_id] = dict(stats)
        if not m.servers[i].up:
            # Declared dead, yet alive (a pause, a partition, or a new leader that did not hear it in time): it
            # registers again, with the log positions of the rows it holds now. Its rows may be the newest of a
            # slot that lost every in-sync copy meanwhile; brought back by a heartbeat, with no copy in the map,
            # it deleted them and the election found no rows anywhere (a fault test lost every update so).
            return None, True
        return (self.map if self.map.epoch > epoch else None), False

    # --- reports from primaries ------------------------------------------------------------------------
    def _primary_copies(self, reporter: str, target: str, slots: np.ndarray, state: int
                        ) -> tuple[np.ndarray, np.ndarray] | None:
        """(slots, columns) of ``target``'s copies in ``state`` among ``slots`` led by ``reporter``; None when
        either server is unknown. Only a slot's primary may report on its copies."""
        m = self.map
        p, t = m.index_of(reporter), m.index_of(target)
        if p < 0 or t < 0:
            return None
        slots = np.asarray(slots, np.int64)
        slots = slots[(slots >= 0) & (slots < m.num_slots)]
        mine = slots[m.copies[slots, 0] == p]
        rows, cols = np.nonzero((m.copies[mine] == t) & (m.states[mine] == state))
        return mine[rows], cols

    def copy_failed(self, reporter: str, target: str, slots: np.ndarray, reason: str, *, now: float,
                    epoch: int = 0) -> tuple[bool, str]:
        """``reporter`` could not stream to ``target``: demote target's copies of the reporter's slots. This is
        the only way a copy leaves the in-sync set (invariant I1 of ``replication``).

        ``epoch``: the map epoch at which the reporter saw the failure (0: not said; such a report is taken as
        current). A slot whose copies or states changed after it (``slot_epochs`` above ``epoch``: the copy was
        demoted and rebuilt, or the slot moved, since) is left alone: the report is stale for it, and a
        failure that still holds is reported again at the reporter's newer epoch."""
        self.now = now
        hit = self._primary_copies(reporter, target, slots, IN_SYNC)
        if hit is None:
            return False, "unknown server"
        stale = hit[0][:0]
        if epoch:
            fresh = self.map.slot_epochs[hit[0]] <= np.uint64(epoch)
            stale, hit = hit[0][~fresh], (hit[0][fresh], hit[1][fresh])
            if stale.size:
                log.info("stale failure report from %s about %s (seen at epoch %d; slots %s changed after it): "
                         "those copies are kept", reporter, target, epoch, slots_text(stale),
                         extra=event("stale_failure_report", slots=stale, server=target, reporter=reporter,
                                     reason=reason))
        if hit[0].size == 0:
            if stale.size:
                return False, f"stale report: seen at epoch {epoch}, slots {slots_text(stale)} changed after it"
            return True, "nothing to demote"
        states = self.map.states.copy()
        states[hit] = CATCHING_UP
        self._commit(self.map.evolve(states=states),
                     f"{hit[0].size} cop(ies) on {target} out of the in-sync set (slots {slots_text(hit[0])}; "
                     f"reported by {reporter}: {reason})",
                     event("copy_demoted", slots=hit[0], server=target, reporter=reporter, reason=reason))
        self.metrics.copies_demoted.labels("replication_failed").inc(hit[0].size)
        return True, ""

    def copy_caught_up(self, reporter: str, target: str, slots: np.ndarray, since_epoch: int = 0, *,
                       now: float) -> tuple[bool, str]:
        """``reporter`` (the primary) says ``target`` caught up on ``slots`` with a slot copy it started at map
        epoch ``since_epoch``: they join the in-sync set, unless the copy became catching up after that (the
        report is stale: a retried report of an earlier copy must not mark a half-built one in sync)."""
        self.now = now
        t = self.map.index_of(target)
        hit = self._primary_copies(reporter, target, slots, CATCHING_UP)
        if hit is None or not self.map.servers[t].up:
            return False, "unknown or dead server"
        if hit[0].size == 0:
            # A repeated report of copies already in sync (the first was committed but its answer was lost, or
            # came late to a starved primary) is answered yes: a "no" would make the primary start the copy
            # again, and its SNAPSHOT_BEGIN would empty an in-sync copy on a target that has not installed this
            # map yet (the new copy is then cut short when both install it: an in-sync copy missing rows).
            done = self._primary_copies(reporter, target, slots, IN_SYNC)
            if done is not None and done[0].size:
                return True, "already in sync"
            return False, "no such catching-up copy (the map changed)"
        stale = np.array([self.catching_since.get((int(r), t), 0) > since_epoch for r in hit[0]], bool)
        if stale.any():
            log.info("stale caught-up report from %s about %s (slot copy of epoch %d; slots %s became catching "
                     "up later): refused", reporter, target, since_epoch, slots_text(hit[0][stale]),
                     extra=event("copy_report_stale", slots=hit[0][stale], server=target, reporter=reporter))
            return False, f"stale: the copies became catching up after epoch {since_epoch}"
        states = self.map.states.copy()
        states[hit] = IN_SYNC
        self._commit(self.map.evolve(states=states),
                     f"{hit[0].size} cop(ies) on {target} caught up (slots {slots_text(hit[0])}; reported by "
                     f"{reporter})", event("copy_caught_up", slots=hit[0], server=target, reporter=reporter))
        self.metrics.copies_caught_up.inc(hit[0].size)
        self._reconcile()
        return True, ""

    # --- tables ------------------------------------------------------------------------------------------
    def create_table(self, spec: TableDef, exist_ok: bool, *, now: float) -> tuple[TableDef, bool]:
        self.now = now
        m = self.map
        existing = m.tables.get(spec.config.name)
        if existing is not None:
            if existing != spec:
                diff = [f.name for f in dataclasses.fields(spec.config)
                        if getattr(spec.config, f.name) != getattr(existing.config, f.name)]
                diff += [f for f in ("durability", "min_copies") if getattr(spec, f) != getattr(existing, f)]
                raise TableExists(f"table {spec.config.name!r} already exists with a different spec "
                                  f"(field(s) {', '.join(diff)} differ)")
            if not exist_ok:
                raise TableExists(f"table {spec.config.name!r} already exists (pass exist_ok to accept it)")
            return existing, False
        tables = dict(m.tables)
        spec = dataclasses.replace(spec, created_epoch=m.epoch + 1)  # this incarnation (see TableDef)
        tables[spec.config.name] = spec
        self._commit(m.evolve(tables=tables), f"table {spec.config.name!r} created ({spec.durability})",
                     event("table_created", table=spec.config.name))
        return spec, True

    def drop_table(self, name: str, *, now: float) -> bool:
        self.now = now
        m = self.map
        if name not in m.tables:
            return False
        tables = {k: v for k, v in m.tables.items() if k != name}
        self._commit(m.evolve(tables=tables), f"table {name!r} dropped", event("table_dropped", table=name))
        return True

    # --- names for logs --------------------------------------------------------------------------------
    def _ids(self, indexes: Any) -> list[str]:
        """The sorted distinct ids of the servers at ``indexes`` (negative ones skipped), for logs."""
        servers = self.map.servers
        return sorted({servers[int(i)].id for i in indexes if 0 <= int(i) < len(servers)})

    # --- reads -------------------------------------------------------------------------------------------
    def figures(self, state: SchedulerState | None = None) -> dict[str, float]:
        """The map's state for the metrics endpoint: epoch, servers up and down, slots unavailable, degraded,
        domain-degraded and moving, copies catching up; of ``state`` (the driver passes the one whose map is
        published), default the core's own."""
        state = self.state() if state is None else state
        m = state.map
        summary = m.summary()
        moving = len(placement.moves(m.copies, state.target))
        apart = float(self.domain_degraded(m)[0].sum())
        return {"leader": 1.0, "epoch": float(m.epoch), "servers_up": float(summary["servers_up"]),
                "servers_down": float(len(m.servers) - summary["servers_up"]),
                "slots_unavailable": float(summary["unavailable_slots"]),
                "slots_degraded": float(summary["degraded_slots"]),
                "slots_unprotected": float(summary["unprotected_slots"]),
                "copies_catching_up": float(summary["catching_up"]), "slots_moving": float(moving),
                "slots_domain_degraded": apart}

    def status(self, *, now: float, state: SchedulerState | None = None) -> spb.StatusResponse:
        """What ``admin status`` shows: the map of ``state`` (the driver passes the one whose map is published,
        so that a map still being saved is shown by no read, this one included), what it still moves toward,
        the servers draining; and each server's heartbeat and stats as the core heard them last."""
        state = self.state() if state is None else state
        m = state.map
        out = spb.StatusResponse(map=cluster_wire.map_to_pb(m))
        s = m.summary()
        out.degraded_slots, out.unavailable_slots = s["degraded_slots"], s["unavailable_slots"]
        out.moving_slots = len(placement.moves(m.copies, state.target))  # no target: the copies themselves
        out.draining.extend(sorted(state.draining))
        apart, out.domain_level = self.domain_degraded(m)
        out.domain_degraded_slots = int(apart.sum())
        for i, srv in enumerate(m.servers):
            hit = m.copies == i
            st = spb.ServerStatus(
                info=pb.ServerInfo(id=srv.id, address=srv.address, boot=srv.boot,
                                   state=pb.SERVER_UP if srv.up else pb.SERVER_DEAD,
                                   domain=cluster_wire.domain_to_pb(srv.domain)),
                last_heartbeat_s=(now - self.last_seen[srv.id]) if srv.id in self.heard else -1.0,
                primaries=int(hit[:, 0].sum()), replicas=int((hit[:, 1:] & (m.states[:, 1:] == IN_SYNC)).sum()),
                catching_up=int((hit & (m.states == CATCHING_UP)).sum()))
            st.stats.update(self.stats.get(srv.id, {}))
            out.servers.append(st)
        return out
