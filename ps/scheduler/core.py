"""The scheduler's state machine: ``SchedulerCore``, its state, and the changes it makes to the map itself.

Every change is a new map (epoch + 1) saved in the ``MapStore`` before anyone sees it (``_commit``), then
announced. This room handles what servers and operators tell the core directly: a server registers (a new
one is added; a known one with a new boot lost its memory since its last snapshot, so its copies are demoted
to catching up and it never leads with stale rows while a valid copy exists elsewhere) and heartbeats; a
primary reports a copy failed (demoted out of the in-sync set before the primary acknowledges anything
without it: invariant I1 of ``replication``) or caught up (it joins the in-sync set); tables are created or
dropped. It also answers the reads: ``figures``, ``status`` and the long poll ``wait_map``.

Failure detection and elections live in ``liveness``, placement and its steps in ``moves``; ``SchedulerCore``
is the one class assembled from them. Thread-safety: every mutation runs under one lock (``lock``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tigana.proto import scheduler_pb2 as spb
from tigana.proto import shard_pb2 as pb
from tigana.ps import placement
from tigana.ps.errors import InvalidArgument, TableExists
from tigana.ps.logs import event, slots_text
from tigana.ps.metrics import SchedulerMetrics
from tigana.ps.routing import CATCHING_UP, IN_SYNC, NO_SERVER, ServerEntry, ShardMap, TableDef, format_slots
from tigana.ps.scheduler.config import SchedulerConfig
from tigana.ps.scheduler.liveness import Liveness
from tigana.ps.scheduler.moves import Moves
from tigana.ps.scheduler.stores.file import MapStore, SchedulerState
from tigana.ps.wire import cluster as cluster_wire

log = logging.getLogger("tigana.ps.scheduler")  # one logger for the whole scheduler


class SchedulerCore(Liveness, Moves):
    """The cluster state machine (see the ``tigana.ps.scheduler`` docstring), assembled from one room per
    concept: this module (state, commits, servers, copy reports, tables, reads), ``liveness`` and ``moves``.
    ``announce(map)`` is called after every saved change, outside the lock; ``probe(address) -> bool | None``
    tells whether a server's port is closed (True), open (False) or unknown (None)."""

    def __init__(self, config: SchedulerConfig, store: MapStore,
                 announce: Callable[[ShardMap], None] = lambda m: None,
                 probe: Callable[[str], bool | None] = lambda a: None, clock: Callable[[], float] = time.monotonic,
                 metrics: SchedulerMetrics | None = None) -> None:
        self.config, self.store, self.announce, self.probe, self.clock = config, store, announce, probe, clock
        self.metrics = metrics if metrics is not None else SchedulerMetrics()
        self._moved: set[int] = set()  # slots changed by placement steps since the target was set
        self._moved_on: set[str] = set()  # and the ids of the servers those steps involved
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        state = store.load()
        if state is None:
            m = ShardMap.empty(config.num_slots, config.replicas, uuid.uuid4().hex[:12])
            state = SchedulerState(m, m.copies.copy())
            store.save(state)
            log.info("new cluster %s (%d slots, %d replica(s)); state in %s", m.cluster_id, m.num_slots,
                     config.replicas, store.describe())
        else:
            log.info("loaded cluster %s at epoch %d from %s: %s", state.map.cluster_id, state.map.epoch,
                     store.describe(), state.map.summary())
        if state.map.num_slots != config.num_slots:
            raise InvalidArgument(f"scheduler: the saved map has {state.map.num_slots} slots, "
                                  f"--num-slots is {config.num_slots}")
        self.map: ShardMap = state.map
        self.target: np.ndarray | None = None if np.array_equal(state.target, state.map.copies) else state.target
        self.draining: set[str] = set(state.draining)
        self.target_kind = state.target_kind  # "balance": re-planned on failures; "moves": rolled back per slot
        start = clock()
        self.started = start
        # Liveness is not persisted: every server in the map gets a full timeout from this start.
        self.last_seen: dict[str, float] = {s.id: start for s in self.map.servers}
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
        self.closing = False  # set when the service stops: long polls (``wait_map``) return at once

    # --- helpers -------------------------------------------------------------------------------------
    def _commit(self, new: ShardMap, why: str, extra: dict[str, Any] | None = None) -> ShardMap:
        """Save ``new`` (durable), make it current, wake long-polls; announce after the lock is released.
        ``extra``: the log record's fields (``logs.event``: slots, server...); the epoch is added.

        Saved first: a store that refuses the write (``stores.etcd.Deposed``) leaves this core's map as it was,
        so nobody is ever shown a map that was not saved."""
        self._save(new)
        self._note_catching(self.map, new)
        self.map = new
        self.cond.notify_all()
        self.metrics.map_changes.inc()
        log.info("epoch %d: %s (%s)", new.epoch, why, new.summary(),
                 extra={**(extra or event("map_change")), "epoch": new.epoch})
        self._pending_announce = new
        return new

    def _note_catching(self, old: ShardMap, new: ShardMap) -> None:
        """Record the epoch at which each copy became catching up (added, or demoted)."""
        was = set()
        for r, c in zip(*np.nonzero((old.copies >= 0) & (old.states == CATCHING_UP)), strict=True):
            was.add((int(r), int(old.copies[r, c])))
        now = set()
        for r, c in zip(*np.nonzero((new.copies >= 0) & (new.states == CATCHING_UP)), strict=True):
            key = (int(r), int(new.copies[r, c]))
            now.add(key)
            if key not in was:
                self.catching_since[key] = new.epoch
        for key in [k for k in self.catching_since if k not in now]:
            del self.catching_since[key]

    def _save(self, m: ShardMap | None = None) -> None:
        m = m if m is not None else self.map
        target = self.target if self.target is not None else m.copies
        self.store.save(SchedulerState(m, np.asarray(target, np.int32), tuple(sorted(self.draining)),
                                       self.target_kind))

    def _flush_announce(self) -> None:
        m = getattr(self, "_pending_announce", None)
        self._pending_announce = None
        if m is not None:
            self.announce(m)

    @contextlib.contextmanager
    def _mutating(self) -> Iterator[None]:
        with self.lock:
            yield
        self._flush_announce()

    def _alive(self) -> np.ndarray:
        return np.array([s.up for s in self.map.servers], bool)
    # --- servers -----------------------------------------------------------------------------------------
    def register(self, server_id: str, address: str, boot: str,
                 positions: dict[str, dict[int, tuple[int, int]]] | None = None) -> ShardMap:
        """A server (re)joins; returns the map it should install."""
        if not server_id or not address or not boot:
            raise InvalidArgument("register: fields 'server_id', 'address' and 'boot' are required")
        with self._mutating():
            now = self.clock()
            self.last_seen[server_id] = now
            self.heard.add(server_id)
            if self.first_register is None:
                self.first_register = now
            self.positions[server_id] = positions or {}
            self.registered_at[server_id] = now
            log.info("server %s (%s, boot %s) registers at epoch %d with rows of %s", server_id, address, boot,
                     self.map.epoch, {t: len(p) for t, p in (positions or {}).items()} or "no table",
                     extra=event("server_register", epoch=self.map.epoch, server=server_id, address=address))
            m = self.map
            i = m.index_of(server_id)
            if i < 0:
                servers = (*m.servers, ServerEntry(server_id, address, boot, True))
                self._commit(m.evolve(servers=servers), f"server {server_id} ({address}) joined",
                             event("server_joined", server=server_id, address=address))
            else:
                s = m.servers[i]
                if s.boot == boot:
                    if s.address != address or not s.up:
                        self._commit(m.evolve(servers=m.replace_server(i, address=address, up=True)),
                                     f"server {server_id} ({address}) is back",
                                     event("server_back", server=server_id, address=address))
                else:
                    self._restarted(i, address, boot)
            self._reconcile()
            return self.map

    def _restarted(self, i: int, address: str, boot: str) -> None:
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
                    self.orphaned_since.setdefault(int(slot), self.clock())
            else:
                states[slot, j] = CATCHING_UP
        servers = m.replace_server(i, address=address, boot=boot, up=True)
        sid = m.servers[i].id
        self._commit(m.evolve(copies=copies, states=states, servers=servers),
                     f"server {sid} restarted (boot {boot}): {held.size} cop(ies) to rebuild (slots "
                     f"{slots_text(held)}), {promoted} primar(ies) failed over (slots {slots_text(moved)}), "
                     f"{orphaned} slot(s) await an election",
                     event("server_restarted", slots=held, server=sid, failed_over=format_slots(moved),
                           address=address))
        self.metrics.failovers.labels("restart").inc(promoted)
        self.metrics.copies_demoted.labels("restart").inc(held.size)

    def heartbeat(self, server_id: str, boot: str, epoch: int, stats: dict[str, float] | None = None
                  ) -> tuple[ShardMap | None, bool]:
        """(the map when newer than ``epoch``, whether the server must register again)."""
        with self._mutating():
            m = self.map
            i = m.index_of(server_id)
            if i < 0 or m.servers[i].boot != boot:
                return None, True
            now = self.clock()
            self.last_seen[server_id] = now
            self.heard.add(server_id)
            if stats:
                self.stats[server_id] = dict(stats)
            if not m.servers[i].up:  # declared dead, yet alive (a pause or a partition): back, empty
                self._commit(m.evolve(servers=m.replace_server(i, up=True)),
                             f"server {server_id} is back after being declared dead",
                             event("server_back", server=server_id))
                self._reconcile()
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

    def copy_failed(self, reporter: str, target: str, slots: np.ndarray, reason: str) -> tuple[bool, str]:
        """``reporter`` could not stream to ``target``: demote target's copies of the reporter's slots. This is
        the only way a copy leaves the in-sync set (invariant I1 of ``replication``)."""
        with self._mutating():
            hit = self._primary_copies(reporter, target, slots, IN_SYNC)
            if hit is None:
                return False, "unknown server"
            if hit[0].size == 0:
                return True, "nothing to demote"
            states = self.map.states.copy()
            states[hit] = CATCHING_UP
            self._commit(self.map.evolve(states=states),
                         f"{hit[0].size} cop(ies) on {target} out of the in-sync set (slots {slots_text(hit[0])}; "
                         f"reported by {reporter}: {reason})",
                         event("copy_demoted", slots=hit[0], server=target, reporter=reporter, reason=reason))
            self.metrics.copies_demoted.labels("replication_failed").inc(hit[0].size)
            return True, ""

    def copy_caught_up(self, reporter: str, target: str, slots: np.ndarray, since_epoch: int = 0
                       ) -> tuple[bool, str]:
        """``reporter`` (the primary) says ``target`` caught up on ``slots`` with a slot copy it started at map
        epoch ``since_epoch``: they join the in-sync set, unless the copy became catching up after that (the
        report is stale: a retried report of an earlier copy must not mark a half-built one in sync)."""
        with self._mutating():
            t = self.map.index_of(target)
            hit = self._primary_copies(reporter, target, slots, CATCHING_UP)
            if hit is None or not self.map.servers[t].up:
                return False, "unknown or dead server"
            if hit[0].size == 0:
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
    def create_table(self, spec: TableDef, exist_ok: bool) -> tuple[TableDef, bool]:
        with self._mutating():
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

    def drop_table(self, name: str) -> bool:
        with self._mutating():
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
    def figures(self) -> dict[str, float]:
        """The map's state for the metrics endpoint: epoch, servers up and down, slots unavailable, degraded
        and moving, copies catching up."""
        with self.lock:
            m = self.map
            summary = m.summary()
            moving = len(placement.moves(m.copies, self.target)) if self.target is not None else 0
            return {"leader": 1.0, "epoch": float(m.epoch), "servers_up": float(summary["servers_up"]),
                    "servers_down": float(len(m.servers) - summary["servers_up"]),
                    "slots_unavailable": float(summary["unavailable_slots"]),
                    "slots_degraded": float(summary["degraded_slots"]),
                    "slots_unprotected": float(summary["unprotected_slots"]),
                    "copies_catching_up": float(summary["catching_up"]), "slots_moving": float(moving)}

    def wait_map(self, known_epoch: int, wait_s: float) -> ShardMap | None:
        """The map when newer than ``known_epoch``, waiting up to ``wait_s`` for one; else None."""
        deadline = self.clock() + max(0.0, wait_s)
        with self.cond:
            while self.map.epoch <= known_epoch:
                left = deadline - self.clock()
                if left <= 0 or self.closing:
                    return None
                self.cond.wait(min(left, 1.0))
            return self.map

    def status(self) -> spb.StatusResponse:
        with self.lock:
            m = self.map
            now = self.clock()
            out = spb.StatusResponse(map=cluster_wire.map_to_pb(m))
            s = m.summary()
            out.degraded_slots, out.unavailable_slots = s["degraded_slots"], s["unavailable_slots"]
            if self.target is not None:
                out.moving_slots = len(placement.moves(m.copies, self.target))
            out.draining.extend(sorted(self.draining))
            for i, srv in enumerate(m.servers):
                hit = m.copies == i
                st = spb.ServerStatus(
                    info=pb.ServerInfo(id=srv.id, address=srv.address, boot=srv.boot,
                                       state=pb.SERVER_UP if srv.up else pb.SERVER_DEAD),
                    last_heartbeat_s=(now - self.last_seen[srv.id]) if srv.id in self.heard else -1.0,
                    primaries=int(hit[:, 0].sum()), replicas=int((hit[:, 1:] & (m.states[:, 1:] == IN_SYNC)).sum()),
                    catching_up=int((hit & (m.states == CATCHING_UP)).sum()))
                st.stats.update(self.stats.get(srv.id, {}))
                out.servers.append(st)
            return out
