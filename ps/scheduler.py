"""The scheduler: owns the shard map of a cluster, detects failed servers and recovers their slots.

``SchedulerCore`` is the state machine; ``SchedulerService`` its gRPC face; ``start_scheduler`` the one
function the CLI, tests and benchmarks start it with.

Every change is a new map (epoch + 1) saved in the ``MapStore`` before anyone sees it; servers get it pushed
(``InstallMap``) and with their heartbeats, clients long-poll ``GetMap``. What changes a map:

- a server registers: a new one is added (and, once ``expect_servers`` are up, the first placement made);
  a known one with a new boot (it restarted and lost its memory since its last snapshot) has its copies
  demoted to catching up, so it never leads with stale rows while a valid copy exists elsewhere;
- a server is declared dead (no heartbeat for ``heartbeat_timeout_s``, or a probe finds its port closed):
  its copies leave the map; for every slot it led the first in-sync copy is promoted (only an in-sync copy
  has every acknowledged update); then missing copies are added as catching-up copies on the least loaded
  servers, which their primaries build with the slot copy;
- a primary reports a copy failed (it could not stream to it): the copy is demoted to catching up, out of
  the in-sync set, before the primary acknowledges anything without it (invariant I1 of ``replication``);
- a primary reports a copy caught up: it joins the in-sync set;
- tables are created or dropped;
- the placement moves toward a target (``placement.step_toward``), one safe step per map.

A slot left with no in-sync copy at all (every copy lost its memory, e.g. all servers restarted) gets a
primary again by an unclean election among the servers that registered with rows of it, by their log
positions (newest wins): what their snapshots held, so at most the updates since the last snapshot
interval are lost. Thread-safety: every mutation runs under one lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tigana.proto import scheduler_pb2 as spb
from tigana.proto import scheduler_pb2_grpc as spb_grpc
from tigana.proto import shard_pb2 as pb
from tigana.proto import shard_pb2_grpc
from tigana.ps import cluster_wire, placement, rpc, settings
from tigana.ps.errors import InvalidArgument, PSError, TableExists, Unavailable, status_metadata, to_status
from tigana.ps.logs import event, slots_text
from tigana.ps.mapstore import FileMapStore, MapStore, SchedulerState
from tigana.ps.metrics import SchedulerMetrics
from tigana.ps.routing import (
    CATCHING_UP,
    DEFAULT_NUM_SLOTS,
    HANDING_OVER,
    IN_SYNC,
    NO_SERVER,
    ServerEntry,
    ShardMap,
    TableDef,
    format_slots,
)
from tigana.ps.security import NONE, Security, SecuritySettings

log = logging.getLogger("tigana.ps.scheduler")

SERVICE_NAME = spb.DESCRIPTOR.services_by_name["Scheduler"].full_name
# Health of the data's protection: NOT_SERVING while some slot has fewer than 1 + replicas in-sync copies.
REPLICATION_HEALTH_NAME = "tigana.v1.Scheduler.replication"


@dataclass(frozen=True)
class SchedulerConfig(SecuritySettings):
    """Settings of a scheduler. ``data_dir`` holds the persisted map (None: a temporary directory), unless
    ``store`` names another store: ``etcd://HOST:PORT[,HOST:PORT][/PREFIX]`` keeps it in etcd, where two or three
    schedulers elect a leader (an etcd lease of ``leader_ttl_s`` seconds) and the others stand by.

    replicas: copies per slot besides the primary. heartbeat_timeout_s: a server silent that long is dead
    (a probe that finds its port closed declares it dead sooner). expect_servers: the first placement waits
    for this many servers (or ``bootstrap_wait_s`` after the first one registered). auto_rebalance (the
    default): a server that holds nothing (it joined, or came back empty) gets its share of the slots, with
    no admin command. max_copies_per_step: slots that may start a copy in one placement step."""

    host: str = "127.0.0.1"
    port: int = 0
    data_dir: str | None = None
    replicas: int = 1
    num_slots: int = DEFAULT_NUM_SLOTS
    heartbeat_timeout_s: float = 3.0
    expect_servers: int = 1
    bootstrap_wait_s: float = 2.0
    auto_rebalance: bool = True
    max_workers: int = 256  # a connected client holds one in its long poll of the map
    max_copies_per_step: int | None = None
    probe_timeout_s: float = 0.5
    store: str | None = None
    leader_ttl_s: int = 2
    advertise: str | None = None  # host:port others reach this scheduler at (a standby names the leader by it)
    metrics_port: int = 0  # Prometheus /metrics: 0 off, -1 any free port (SchedulerHandle.metrics_port)
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise InvalidArgument(f"scheduler config: field 'replicas' must be >= 0, got {self.replicas}")
        if not self.heartbeat_timeout_s > 0:
            raise InvalidArgument("scheduler config: field 'heartbeat_timeout_s' must be > 0")
        if self.expect_servers < 1:
            raise InvalidArgument("scheduler config: field 'expect_servers' must be >= 1")
        if self.num_slots < 1:
            raise InvalidArgument("scheduler config: field 'num_slots' must be >= 1")
        if self.store is not None and not self.store.startswith("etcd://"):
            raise InvalidArgument(f"scheduler config: field 'store' must be etcd://HOST:PORT[,...], got {self.store!r}")
        if self.leader_ttl_s < 1:
            raise InvalidArgument("scheduler config: field 'leader_ttl_s' must be >= 1 (etcd leases count seconds)")
        if not -1 <= self.metrics_port <= 65535:
            raise InvalidArgument(f"scheduler config: field 'metrics_port' must be -1 (any free port), 0 (off) or a "
                                  f"port, got {self.metrics_port}")


def load_scheduler_config(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                          file: str | None = None) -> settings.Loaded[SchedulerConfig]:
    """The scheduler's settings (and where each came from): flags (field -> value, None: not given) >
    ``TIGANA_SCHEDULER_<FIELD>`` > ``TIGANA_<FIELD>`` > ``file`` (or ``TIGANA_SCHEDULER_CONFIG``; a
    ``scheduler:`` section when present) > defaults."""
    env = os.environ if env is None else env
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    file = file or flags.pop("config", None) or env.get("TIGANA_SCHEDULER_CONFIG") or None
    flags.pop("config", None)
    from tigana.ps.config import PARSERS  # the server's parsers: "auto" metrics port

    return settings.load(SchedulerConfig, flags=flags, env=env, file=file, section="scheduler",
                         env_prefixes=("TIGANA_SCHEDULER_", settings.ENV_PREFIX),
                         parsers={"metrics_port": PARSERS["metrics_port"]})


class SchedulerCore:
    """The cluster state machine (see the module docstring). ``announce(map)`` is called after every saved
    change, outside the lock; ``probe(address) -> bool | None`` tells whether a server's port is closed
    (True), open (False) or unknown (None)."""

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

        Saved first: a store that refuses the write (``etcdstore.Deposed``) leaves this core's map as it was,
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
    def _mutating(self):
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

    def tick(self, stalled: bool = False) -> None:
        """Failure detection, elections, placement: called a few times a second. ``stalled``: the caller was
        not ticking for a while (this process was paused or starved); like a lock held long by a step, that
        time is the scheduler's silence, not the servers': every server gets a full timeout again."""
        asked = self.clock()
        with self._mutating():
            now = self.clock()
            timeout = self.config.heartbeat_timeout_s
            if stalled or now - asked > timeout / 3:  # heartbeats were waiting on us, not missing
                for sid in self.last_seen:
                    self.last_seen[sid] = max(self.last_seen[sid], now)
                log.warning("scheduler stalled (%s); every server gets a full heartbeat timeout again",
                            "paused or starved" if stalled else f"waited {now - asked:.1f}s for its lock")
            for i, s in enumerate(self.map.servers):
                if not s.up:
                    continue
                silent = now - self.last_seen.get(s.id, self.started)
                if silent > timeout:
                    self._declare_dead(i, f"no heartbeat for {silent:.1f}s")
                elif silent > timeout / 3 and s.id in self.heard and s.id not in self._probing:
                    self._probe_async(s.id, s.address, s.boot)
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

    def _probe_async(self, server_id: str, address: str, boot: str) -> None:
        self._probing.add(server_id)

        def run() -> None:
            try:
                closed = self.probe(address)
            finally:
                with self.lock:
                    self._probing.discard(server_id)
            if closed:
                self.dead_if(server_id, boot, f"port {address} closed")
            elif closed is False:  # its health service answered: running and reachable, only slow to beat
                self.seen(server_id, boot)

        threading.Thread(target=run, name="tigana-probe", daemon=True).start()

    def seen(self, server_id: str, boot: str) -> None:
        """``server_id`` (incarnation ``boot``) answered a probe: it counts as heard from now. Safe for the
        fencing argument: a server that cannot renew its own lease stops acknowledging async pushes whatever
        the scheduler thinks, and one that is not declared dead is not replaced."""
        with self.lock:
            i = self.map.index_of(server_id)
            if i >= 0 and self.map.servers[i].up and self.map.servers[i].boot == boot:
                self.last_seen[server_id] = max(self.last_seen.get(server_id, 0.0), self.clock())

    def unreachable(self, address: str) -> None:
        """A client or peer could not reach ``address``: probe it now."""
        log.debug("reported unreachable: %s", address)
        with self.lock:
            for s in self.map.servers:
                if s.address == address and s.up and s.id not in self._probing:
                    self._probe_async(s.id, s.address, s.boot)

    def dead_if(self, server_id: str, boot: str, why: str) -> None:
        """Declare ``server_id`` dead if it is still the incarnation ``boot`` and not heard from meanwhile."""
        with self._mutating():
            i = self.map.index_of(server_id)
            if i < 0 or not self.map.servers[i].up or self.map.servers[i].boot != boot:
                return
            self._declare_dead(i, why)
            self._reconcile()

    def _declare_dead(self, i: int, why: str) -> None:
        m = self.map
        alive = self._alive()
        alive[i] = False
        before = m.copies
        copies, states = placement.repair(m.copies, m.states, alive, 0)  # drop + promote only
        lost = np.flatnonzero((before[:, 0] >= 0) & (copies[:, 0] < 0))
        now = self.clock()
        for slot in lost:
            self.orphaned_since.setdefault(int(slot), now)
        servers = m.replace_server(i, up=False)
        moved = np.flatnonzero((before[:, 0] == i) & (copies[:, 0] >= 0))
        promoted = int(moved.size)
        sid = m.servers[i].id
        leaders = sorted({m.servers[int(p)].id for p in copies[moved, 0]})
        self._commit(m.evolve(copies=copies, states=states, servers=servers),
                     f"server {sid} ({m.servers[i].address}) declared dead: {why}; {promoted} slot(s) failed over "
                     f"(slots {slots_text(moved)}) to {','.join(leaders) or 'none'}"
                     + (f", {lost.size} left with no in-sync copy (slots {slots_text(lost)})" if lost.size else ""),
                     event("failover", slots=np.union1d(moved, lost), server=sid, reason=why,
                           failed_over=format_slots(moved), new_primaries=",".join(leaders),
                           no_copy=format_slots(lost)))
        self.metrics.servers_dead.inc()
        self.metrics.failovers.labels("dead").inc(promoted)

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

    def handover_ready(self, reporter: str, slots: np.ndarray, epoch: int) -> tuple[bool, str]:
        """``reporter``, the primary of ``slots`` marked handing over, refuses writes to them since map
        ``epoch`` and its in-sync copies hold everything it wrote: name the target's primary (an in-sync
        copy) as the new primary. A planned hand-over thus loses no write, sync or async."""
        with self._mutating():
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
            leaders = self._ids(copies[done, 0])
            self._commit(m.evolve(copies=copies, states=states),
                         f"{done.size} primar(ies) handed over by {reporter} to {','.join(leaders)} (slots "
                         f"{slots_text(done)})", event("primary_handover", slots=done, server=leaders, source=reporter))
            return True, ""  # the next tick drops the copies the target does not keep (one step per map)

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

    # --- placement -----------------------------------------------------------------------------------
    def _ids(self, indexes: Any) -> list[str]:
        """The sorted distinct ids of the servers at ``indexes`` (negative ones skipped), for logs."""
        servers = self.map.servers
        return sorted({servers[int(i)].id for i in indexes if 0 <= int(i) < len(servers)})

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
                  cost: placement.CostModel | None = None) -> placement.Plan:
        """Plan a placement that evens out the measured load (``placement.plan``); unless ``plan_only``, make it
        the target (the map then moves toward it, one safe step at a time)."""
        with self._mutating():
            m = self.map
            n = m.num_slots
            rows = np.ones(n) if rows is None else np.asarray(rows, float)
            plan = placement.plan(m.copies, self._placeable(), self.config.replicas, rows,
                                  np.zeros(n) if bytes_ is None else bytes_, np.zeros(n) if rates is None else rates,
                                  cost)
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

    def move_slot(self, slot: int, to: str, *, from_: str = "", primary: bool = False) -> placement.Plan:
        """Target: ``slot``'s copy on ``from_`` (default: its primary) moves to ``to``; the copy keeps its role
        (a primary's move ends with ``to`` leading), or leads with ``primary``."""
        with self._mutating():
            m = self.map
            if not 0 <= slot < m.num_slots:
                raise InvalidArgument(f"move-slot: field 'slot' must be in [0, {m.num_slots}), got {slot}")
            t = self._find(to)
            if not self._placeable()[t]:
                raise InvalidArgument(f"move-slot: server {to!r} is dead or draining")
            target = (self.target if self.target is not None else m.copies).copy()
            if target.shape[1] < m.width:
                target = _pad(target, m.width)
            row = [int(x) for x in target[slot] if x >= 0]
            if not row:
                raise InvalidArgument(f"move-slot: slot {slot} has no copy to move (no primary)")
            src = row[0] if not from_ else self._find(from_)
            if src not in row:
                raise InvalidArgument(f"move-slot: slot {slot} has no copy on {from_!r}")
            was_primary = row[0] == src
            if t in row and not (primary and t != row[0]):
                raise InvalidArgument(f"move-slot: server {to!r} already holds a copy of slot {slot}")
            if t in row:  # make an existing copy the primary: roles swap, no data moves
                new = [t] + [x for x in row if x != t]
            else:
                new = [t if x == src else x for x in row]
                if primary and not was_primary:
                    new = [t] + [x for x in new if x != t]
            target[slot] = np.full(target.shape[1], NO_SERVER, np.int32)
            target[slot, :len(new)] = new
            self.target, self.target_kind = target, "moves"
            self._save()
            log.info("move-slot at epoch %d: slot %d from %s to %s%s", m.epoch, slot, m.servers[src].id,
                     m.servers[t].id, " (as primary)" if new[0] == t else "",
                     extra=event("move_slot", slots=[slot], epoch=m.epoch, server=self._ids([src, t]),
                                 source=m.servers[src].id, target=m.servers[t].id))
            self._reconcile()
            return placement.Plan(target, [(slot, [x for x in new if x not in row], [x for x in row if x not in new],
                                            row[0], new[0], 0)], np.zeros(0), np.zeros(0), 0, 0.0)

    def drain(self, server: str, *, undrain: bool = False) -> placement.Plan:
        """Move every copy off ``server`` (it then holds nothing and may be stopped); ``undrain`` takes it back."""
        with self._mutating():
            i = self._find(server)
            sid = self.map.servers[i].id
            if undrain:
                self.draining.discard(sid)
                if self.target is not None and self.target_kind == "balance":
                    self.target = None  # stop moving its copies away (what moved stays where it is)
                    self._moved.clear()
                    self._moved_on.clear()
                self._save()
                return placement.Plan(self.map.copies, [], np.zeros(0), np.zeros(0), 0, 0.0)
            self.draining.add(sid)
            if not self._placeable().any():
                self.draining.discard(sid)
                raise InvalidArgument(f"drain: {server!r} is the last server that can hold slots")
            target = placement.balance(self.map.copies, self._placeable(), self.config.replicas)
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
        if target.shape[0] != current.shape[0]:
            return current.copy()
        named = target[target >= 0]
        if named.size and not placeable[named].all() and self.target_kind == "balance":
            return placement.balance(current, placeable, self.config.replicas)  # plan again without them
        if named.size and not placeable[named].all():
            dead_rows = ((target >= 0) & ~alive[np.clip(target, 0, None)]).any(axis=1)
            if dead_rows.any():  # a move to or from a dead server is rolled back
                width = max(target.shape[1], current.shape[1])
                target = _pad(target, width).copy()
                target[dead_rows] = _pad(current, width)[dead_rows]
            named = target[target >= 0]
            if named.size and not placeable[named].all():  # a draining server still named: plan again
                target = placement.balance(current, placeable, self.config.replicas)
        return target

    def _reconcile(self) -> None:
        """First placement, elections, re-replication and one step toward the target (lock held)."""
        m = self.map
        alive = self._alive()
        placeable = self._placeable()
        if not alive.any():
            return
        if (m.copies < 0).all():
            if not self._bootstrap_due(int(placeable.sum())):
                return
            live = np.flatnonzero(placeable)
            copies = live[placement.initial(live.size, m.num_slots, self.config.replicas)].astype(np.int32)
            copies[:, 0] = live[placement.initial(live.size, m.num_slots, 0)[:, 0]]
            self._commit(m.evolve(copies=copies, states=np.zeros(copies.shape, np.uint8)),
                         f"first placement over {live.size} server(s)",
                         event("first_placement", slots=range(m.num_slots), server=self._ids(live)))
            return
        self._elect()
        m = self.map
        copies, states = placement.repair(m.copies, m.states, alive, self.config.replicas, placeable)
        repaired, repair_servers = _placement_changes(m.copies, copies)
        stepped: dict[str, list[int]] = {"added": [], "primary": [], "dropped": []}
        step_servers: set[int] = set()
        self._auto_rebalance(copies, placeable)
        had_target = self.target is not None
        reached = False
        if self.target is not None:
            self.target = self._fixed_target(self.target, alive, placeable, copies)
        now = self.clock()
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
        target = placement.balance(copies, placeable, self.config.replicas)
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
        return self.first_register is not None and self.clock() - self.first_register >= self.config.bootstrap_wait_s

    def _elect(self) -> None:
        """Unclean elections for slots with no primary and no in-sync copy (see the module docstring)."""
        m = self.map
        orphans = np.flatnonzero(m.copies[:, 0] < 0)
        if orphans.size == 0:
            self.orphaned_since.clear()
            return
        now = self.clock()
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
            leaders = self._ids(copies[elected, 0])
            self._commit(m.evolve(copies=copies, states=states),
                         f"unclean election of {chosen} slot(s) with no in-sync copy (slots {slots_text(elected)}; "
                         f"new primaries {','.join(leaders)}; newest snapshot wins)",
                         event("unclean_election", slots=elected, server=leaders))
            self.metrics.elections.inc(chosen)

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


def _pad(a: np.ndarray, width: int) -> np.ndarray:
    if a.shape[1] >= width:
        return a
    fill = NO_SERVER if a.dtype == np.int32 else 0
    return np.concatenate([a, np.full((a.shape[0], width - a.shape[1]), fill, a.dtype)], axis=1)


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


# --- the gRPC service ---------------------------------------------------------------------------------------
def _handler(method: str) -> Callable:
    def wrap(fn: Callable) -> Callable:
        def wrapper(self: SchedulerService, request, context: grpc.ServicerContext):
            try:
                rpc.check(request)
                return fn(self, request, context)
            except Exception as exc:  # noqa: BLE001 - a request never takes the scheduler down
                code, message = to_status(exc)
                if code == grpc.StatusCode.INTERNAL:
                    log.exception("%s failed with a bug", method)
                context.set_trailing_metadata(status_metadata(exc, self.epoch()))
            context.abort(code, message)
        wrapper.__name__ = fn.__name__
        return wrapper
    return wrap


def _positions(infos) -> dict[str, dict[int, tuple[int, int]]]:
    out: dict[str, dict[int, tuple[int, int]]] = {}
    for t in infos:
        slots = cluster_wire.array(t.slots, "<i4", field="positions.slots")
        ep = cluster_wire.array(t.lsn_epochs, "<u8", field="positions.lsn_epochs", count=slots.shape[0])
        ix = cluster_wire.array(t.lsn_indexes, "<u8", field="positions.lsn_indexes", count=slots.shape[0])
        out[t.table] = {int(s): (int(e), int(i)) for s, e, i in zip(slots, ep, ix, strict=True)}
    return out


class SchedulerService(spb_grpc.SchedulerServicer):
    """The gRPC face of a ``SchedulerCore``: ``core`` is the core, or a function that returns the leading one
    (raising ``NotLeader`` on a standby, so every call there answers UNAVAILABLE naming the leader)."""

    def __init__(self, core: SchedulerCore | Callable[[], SchedulerCore]) -> None:
        self._core = core if not isinstance(core, SchedulerCore) else (lambda: core)

    @property
    def core(self) -> SchedulerCore:
        return self._core()

    def epoch(self) -> int:
        try:
            return self.core.map.epoch
        except PSError:
            return 0

    @_handler("Register")
    def Register(self, request, context):
        m = self.core.register(request.server_id, request.address, request.boot, _positions(request.positions))
        return spb.RegisterResponse(map=cluster_wire.map_to_pb(m))

    @_handler("Heartbeat")
    def Heartbeat(self, request, context):
        m, again = self.core.heartbeat(request.server_id, request.boot, request.epoch, dict(request.stats))
        out = spb.HeartbeatResponse(reregister=again)
        if m is not None:
            out.map.CopyFrom(cluster_wire.map_to_pb(m))
        return out

    @_handler("GetMap")
    def GetMap(self, request, context):
        m = self.core.wait_map(request.known_epoch, min(float(request.wait_s), 30.0))
        out = spb.GetMapResponse(epoch=self.core.map.epoch)
        if m is not None:
            out.map.CopyFrom(cluster_wire.map_to_pb(m))
        return out

    @_handler("ReportCopyFailure")
    def ReportCopyFailure(self, request, context):
        slots = cluster_wire.array(request.slots, "<i4", field="slots")
        ok, msg = self.core.copy_failed(request.reporter, request.target, slots, request.reason)
        return spb.ReportResponse(epoch=self.core.map.epoch, accepted=ok, message=msg)

    @_handler("CopyCaughtUp")
    def CopyCaughtUp(self, request, context):
        slots = cluster_wire.array(request.slots, "<i4", field="slots")
        ok, msg = self.core.copy_caught_up(request.reporter, request.target, slots, int(request.since_epoch))
        return spb.ReportResponse(epoch=self.core.map.epoch, accepted=ok, message=msg)

    @_handler("HandoverReady")
    def HandoverReady(self, request, context):
        slots = cluster_wire.array(request.slots, "<i4", field="slots")
        ok, msg = self.core.handover_ready(request.reporter, slots, int(request.epoch))
        return spb.ReportResponse(epoch=self.core.map.epoch, accepted=ok, message=msg)

    @_handler("ReportUnreachable")
    def ReportUnreachable(self, request, context):
        self.core.unreachable(request.address)
        return spb.ReportResponse(epoch=self.core.map.epoch, accepted=True)

    @_handler("CreateTable")
    def CreateTable(self, request, context):
        spec = cluster_wire.table_def_from_pb(request.spec)
        if spec.durability == "sync" and request.spec.durability == pb.DURABILITY_DEFAULT \
                and self.core.config.replicas == 0:
            spec = dataclasses.replace(spec, durability="async")  # nothing to wait for without replicas
        if spec.min_copies > 1 + self.core.config.replicas:
            raise InvalidArgument(f"table {spec.config.name!r}: field 'min_copies' is {spec.min_copies}, but the "
                                  f"cluster keeps {1 + self.core.config.replicas} cop(ies) of a slot")
        held, created = self.core.create_table(spec, request.exist_ok)
        return pb.CreateTableResponse(spec=cluster_wire.table_def_to_pb(held), created=created)

    @_handler("DropTable")
    def DropTable(self, request, context):
        return pb.DropTableResponse(dropped=self.core.drop_table(request.table))

    @_handler("ListTables")
    def ListTables(self, request, context):
        return pb.ListTablesResponse(tables=[cluster_wire.table_def_to_pb(t)
                                             for _, t in sorted(self.core.map.tables.items())])

    @_handler("Status")
    def Status(self, request, context):
        return self.core.status()

    @_handler("MoveSlot")
    def MoveSlot(self, request, context):
        plan = self.core.move_slot(int(request.slot), request.to, from_=getattr(request, "from"),
                                   primary=request.primary)
        return self._plan(plan, applied=True)

    @_handler("Drain")
    def Drain(self, request, context):
        return self._plan(self.core.drain(request.server, undrain=request.undrain), applied=True)

    @_handler("Rebalance")
    def Rebalance(self, request, context):
        n = self.core.map.num_slots
        load = request.load
        rows = cluster_wire.array(load.rows, "<i8", field="load.rows", count=n) if load.rows else None
        bytes_ = cluster_wire.array(load.bytes, "<i8", field="load.bytes", count=n) if load.bytes else None
        rates = cluster_wire.array(load.rates, "<f8", field="load.rates", count=n) if load.rates else None
        c = request.cost
        cost = placement.CostModel(row_weight=c.row_weight or 1.0, rate_weight=c.rate_weight or None,
                                   link_bytes_per_s=c.link_bytes_per_s or 100e6)
        plan = self.core.rebalance(plan_only=request.plan_only, rows=rows, bytes_=bytes_, rates=rates, cost=cost)
        return self._plan(plan, applied=not request.plan_only)

    def _plan(self, plan: placement.Plan, *, applied: bool) -> spb.PlanResponse:
        m = self.core.map
        ids = [s.id for s in m.servers]
        out = spb.PlanResponse(bytes_moved=plan.bytes_moved, predicted_seconds=plan.seconds, applied=applied,
                               epoch=m.epoch)
        for slot, add, remove, p_from, p_to, nbytes in plan.moves:
            out.moves.add(slot=slot, add=[ids[i] for i in add], remove=[ids[i] for i in remove],
                          primary_from=ids[p_from] if p_from >= 0 else "", primary_to=ids[p_to] if p_to >= 0 else "",
                          bytes=nbytes)
        for field_, load in (("before", plan.load_before), ("after", plan.load_after)):
            fig = getattr(out, field_)
            up = [i for i, s in enumerate(m.servers) if s.up and i < load.shape[0]]
            if up:
                fig.max = float(max(load[i] for i in up))
                fig.mean = float(np.mean([load[i] for i in up]))
                fig.per_server.update({ids[i]: float(load[i]) for i in up})
        return out


# --- running it ---------------------------------------------------------------------------------------------
class _Announcer:
    """Pushes every new map to the servers that are up (latest map only; a server that misses one gets the
    next, or fetches it with its heartbeat)."""

    def __init__(self, max_message_bytes: int = 64 << 20, security: Security = NONE) -> None:
        self._security = security
        self._latest: ShardMap | None = None
        self._cond = threading.Condition()
        self._channels: dict[str, grpc.Channel] = {}
        self._pool = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="tigana-announce")
        self._closed = False
        self._options = [("grpc.max_send_message_length", max_message_bytes),
                         ("grpc.max_receive_message_length", max_message_bytes),
                         ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                         ("grpc.max_reconnect_backoff_ms", 1000)]
        self._thread = threading.Thread(target=self._run, name="tigana-announcer", daemon=True)
        self._thread.start()

    def __call__(self, m: ShardMap) -> None:
        with self._cond:
            if self._latest is None or m.epoch > self._latest.epoch:
                self._latest = m
                self._cond.notify_all()

    def channel(self, address: str) -> grpc.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self._security.channel(address, self._options)
        return ch

    def _run(self) -> None:
        sent = 0
        while True:
            with self._cond:
                while not self._closed and (self._latest is None or self._latest.epoch <= sent):
                    self._cond.wait()
                if self._closed:
                    return
                m = self._latest
            request = pb.InstallMapRequest(map=cluster_wire.map_to_pb(m))
            calls = []
            for s in m.servers:
                if s.up:
                    stub = shard_pb2_grpc.ShardStub(self.channel(s.address))
                    calls.append(self._pool.submit(_quiet_call, stub.InstallMap, request, 2.0))
            futures.wait(calls, timeout=3.0)
            sent = m.epoch

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for ch in self._channels.values():
            ch.close()


def _quiet_call(method, request, timeout: float) -> None:
    with contextlib.suppress(grpc.RpcError, ValueError):
        method(request, timeout=timeout)


def probe_closed(address: str, timeout_s: float = 0.5, security: Security = NONE) -> bool | None:
    """True when nothing listens at ``address`` (connection refused), False when a health check answered,
    None when it timed out (a paused or partitioned server: the heartbeat timeout decides)."""
    channel = security.channel(address, [("grpc.initial_reconnect_backoff_ms", 50)])
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        return False
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            return True
        return None
    finally:
        channel.close()


class NotLeader(Unavailable):
    """This scheduler is a standby; the message names the leader (clients with a list move on to the next)."""


class SchedulerHandle:
    """A running scheduler: ``address``, ``core`` (None on a standby), ``metrics`` (its Prometheus registry;
    served on ``metrics_port`` when ``SchedulerConfig.metrics_port`` is set, else None), ``close()`` (idempotent).

    With an electing store (etcd) the handle serves at once but leads only once elected: the election thread
    campaigns, builds a ``SchedulerCore`` from the stored state when it wins (so a new leader starts from the
    last saved map, and gives every server a full heartbeat timeout), renews the lease every third of its
    TTL, and steps down (drops the core, answers as a standby, campaigns again) when the lease could not be
    renewed within the TTL or the store refused a write. The store's fencing, not this thread's timing, is
    what keeps a deposed leader from changing the map (``etcdstore``)."""

    def __init__(self, config: SchedulerConfig, store: MapStore | None = None) -> None:
        self.config = config
        self._tmp = None
        if store is None and config.store is not None:
            from tigana.ps.etcdstore import EtcdMapStore

            store = EtcdMapStore(config.store)
        if store is None:
            data_dir = config.data_dir
            if data_dir is None:
                import tempfile

                self._tmp = tempfile.TemporaryDirectory(prefix="tigana-scheduler-")
                data_dir = self._tmp.name
            store = FileMapStore(data_dir)
        self.store = store
        self.electing = hasattr(store, "campaign")
        self.security = config.security()
        self.announcer = _Announcer(security=self.security)
        # One registry for the process, kept across leadership terms; a standby reports leader 0.
        self.metrics = SchedulerMetrics(self._figures)
        self.metrics_port: int | None = None
        self.core: SchedulerCore | None = None if self.electing else self._new_core()
        self.auth_rejected = 0
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.max_workers,
                                                              thread_name_prefix="tigana-scheduler"),
                                   options=[("grpc.max_send_message_length", 64 << 20),
                                            ("grpc.max_receive_message_length", 64 << 20),
                                            ("grpc.so_reuseport", 0)],
                                   interceptors=self.security.interceptors(self._rejected))
        rpc.register(self._server, spb.DESCRIPTOR.services_by_name["Scheduler"], SchedulerService(self._leading))
        rpc.add_health_and_reflection(self._server, self.health, (SERVICE_NAME,))
        port = 0
        try:
            port = self.security.add_port(self._server, f"{config.host}:{config.port}")
        except RuntimeError:
            port = 0
        if not port:
            self.announcer.close()
            raise OSError(f"cannot bind {config.host}:{config.port} (port in use or address not local)")
        self.port = port
        host = "127.0.0.1" if config.host in ("", "0.0.0.0", "[::]", "::") else config.host
        self.address = config.advertise or f"{host}:{port}"
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="tigana-scheduler-tick", daemon=True)
        self._election = threading.Thread(target=self._elect, name="tigana-scheduler-election", daemon=True)
        self._closed = False
        self._renewed = 0.0  # when the last successful lease renewal was sent
        self.terms = 0  # times this scheduler became the leader

    def _new_core(self) -> SchedulerCore:
        return SchedulerCore(self.config, self.store, announce=self.announcer,
                             probe=lambda a: probe_closed(a, self.config.probe_timeout_s, self.security),
                             metrics=self.metrics)

    def _figures(self) -> dict[str, float]:
        core = getattr(self, "core", None)
        return core.figures() if core is not None else {"leader": 0.0}

    def _leading(self) -> SchedulerCore:
        core = self.core
        if core is None:
            try:
                leader = self.store.leader() if self.electing else None
            except PSError:
                leader = None
            raise NotLeader(f"scheduler {self.address} is a standby; the leader is "
                            f"{leader or 'being elected'}")
        return core

    # --- election (electing stores only) ----------------------------------------------------------------
    def _elect(self) -> None:
        ttl = self.config.leader_ttl_s
        while not self._stop.is_set():
            try:
                if self.core is None:
                    if self.store.campaign(self.address, ttl):
                        self._lead()
                    else:
                        self._stop.wait(min(0.25, ttl / 4))
                    continue
                sent = time.monotonic()
                renewed = self.store.keep_alive()
                if renewed:
                    self._renewed = sent  # the lease runs at least ttl from when the renewal was sent
                if self.store.deposed.is_set() or time.monotonic() - self._renewed >= ttl:
                    self._step_down("the store refused a write" if self.store.deposed.is_set()
                                    else f"the lease was not renewed for {ttl}s")
                    continue
                self._stop.wait(ttl / 3 if renewed else 0.1)
            except Exception:  # noqa: BLE001 - etcd unreachable: keep trying; a leader steps down on its TTL
                log.debug("election round failed", exc_info=True)
                if self.core is not None and time.monotonic() - self._renewed >= ttl:
                    self._step_down(f"the lease was not renewed for {ttl}s")
                self._stop.wait(0.2)

    def _lead(self) -> None:
        self._renewed = time.monotonic()
        try:
            core = self._new_core()  # loads the last saved state (and fences it from here on)
        except Exception:
            log.exception("taking over as leader failed; resigning")
            self.store.resign()
            raise
        self.terms += 1
        self.core = core
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log.info("leading cluster %s from epoch %d (term %d at %s; store %s)", core.map.cluster_id, core.map.epoch,
                 self.terms, self.address, self.store.describe())
        self.announcer(core.map)

    def _step_down(self, why: str) -> None:
        core, self.core = self.core, None
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.warning("stepping down as leader: %s", why)
        if core is not None:
            with core.cond:  # long polls on the old core return; their clients ask again and are redirected
                core.closing = True
                core.cond.notify_all()
        self.store.resign()

    def _rejected(self, method: str, reason: str) -> None:
        self.auth_rejected += 1
        log.warning("refused %s: %s credential", method, reason)

    def _tick(self) -> None:
        interval = min(0.2, self.config.heartbeat_timeout_s / 10)
        last = time.monotonic()
        while not self._stop.wait(interval):
            now = time.monotonic()
            stalled, last = now - last > max(1.0, self.config.heartbeat_timeout_s / 3), now
            core = self.core
            if core is None:
                continue
            try:
                core.tick(stalled)
                # tigana.v1.Scheduler.replication: SERVING only while every slot has its 1 + replicas copies
                degraded = core.figures()["slots_degraded"]
                self.health.set(REPLICATION_HEALTH_NAME, health_pb2.HealthCheckResponse.NOT_SERVING if degraded
                                else health_pb2.HealthCheckResponse.SERVING)
            except Unavailable as exc:  # the store: deposed (the election thread steps down) or unreachable
                log.warning("scheduler tick: %s", exc)
            except Exception:  # noqa: BLE001 - keep detecting failures whatever happened
                log.exception("scheduler tick failed")

    def start(self) -> SchedulerHandle:
        self._server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        # the scheduler service itself is SERVING only on the leader (a readiness probe on it routes a
        # Kubernetes Service to the leader alone); a standby answers UNAVAILABLE naming the leader
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING if self.electing
                        else health_pb2.HealthCheckResponse.SERVING)
        self._ticker.start()
        if self.electing:
            self._election.start()
        else:
            self.announcer(self.core.map)
        if self.config.metrics_port:
            self.metrics_port = self.metrics.serve_http(self.config.metrics_port, self.config.metrics_host)
        return self

    def close(self, grace: float = 1.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        core = self.core
        if core is not None:
            with core.cond:  # wake the long polls: their threads would hold the process up to 30 s
                core.closing = True
                core.cond.notify_all()
        self._server.stop(grace).wait()
        self.announcer.close()
        self.metrics.close()
        if self.electing:
            self._election.join(5.0)
            self.store.resign()  # a standby takes over at once instead of after the lease TTL
            self.store.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> SchedulerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_scheduler(config: SchedulerConfig | None = None, store: MapStore | None = None) -> SchedulerHandle:
    """Bind and start a scheduler; returns its handle (serving at once)."""
    return SchedulerHandle(config or SchedulerConfig(), store).start()


__all__ = ["NotLeader", "PSError", "SchedulerConfig", "SchedulerCore", "SchedulerHandle", "SchedulerService",
           "probe_closed", "start_scheduler"]
