"""Changes to what this server holds (``Ownership``): the install of a new map (tables created or dropped,
slots no longer held forgotten, replication streams started or stopped), the deletion of the rows of slots no
longer held, the hand-over of the primary role in a planned move, and periodic upkeep. The view itself and
the leads check every write and pull makes are ``view.Holdings``.

``install`` applies a map under the install lock, the registry lock and every table's write lock (in name
order), so a request is checked and applied against one map. What the replication core asks for in return
(streams, slot copies, reports to the scheduler) is carried out after every one of those locks is released:
no RPC and no wait runs under a table or install lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from tigana.embeddings import StorageError
from tigana.embeddings.changes import unique
from tigana.embeddings.errors import EmbeddingError as EngineError
from tigana.proto import shard_pb2 as pb
from tigana.ps.background import DROP_THREAD, start_thread
from tigana.ps.errors import InvalidArgument
from tigana.ps.logs import event, slots_text
from tigana.ps.replication import NO_POSITION, Replicator
from tigana.ps.replication.apply import delete_in_chunks
from tigana.ps.routing import ShardMap, format_slots, slot_of
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.hosted import HostedTables, _Hosted
from tigana.ps.shard.links import ServerLinks
from tigana.ps.shard.persistence import Persistence
from tigana.ps.shard.view import Holdings, View

log = logging.getLogger("tigana.ps.server")  # one logger for the whole shard server
_RATE_HALF_LIFE_S = 10.0


class Ownership:
    """The map this server runs under and what follows from each new one (see the module docstring).

    Dependencies: ``holdings`` (the view it replaces), ``tables`` (created, dropped and locked as a map says),
    ``persistence`` (the registry file, the corrupt-store count), ``replicator`` (None on a static server: its
    ``on_map`` returns the actions a map asks for, run by ``Replicator.run`` once every lock is released), and
    ``links`` (the lifecycle state; the agent the hand-over reports to). Locks: the install lock, then the
    registry lock, then every table's write lock in name order; no RPC and no wait runs under any of them."""

    def __init__(self, config: ServerConfig, server_id: str, boot: str, holdings: Holdings, tables: HostedTables,
                 persistence: Persistence, replicator: Replicator | None, links: ServerLinks,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.server_id, self.boot = config, server_id, boot
        self.clock = clock  # request-rate decay (the simulator's world clock there)
        self.num_slots = config.num_slots
        self.holdings, self.tables, self.persistence = holdings, tables, persistence
        self.replicator, self.links = replicator, links
        self.install_lock = threading.Lock()
        self._handover_wake = threading.Event()
        self._handover_started = False
        self._drop_lock = threading.Lock()
        self._drop_wanted = self._drop_running = False  # rows of slots no longer held to delete; a worker at it
        self._last_decay = clock()

    def cluster_figures(self) -> dict[str, float]:
        """Epoch, slots led/held/catching up and replication lag (the metrics endpoint and heartbeats)."""
        view = self.holdings.view
        out = {"epoch": float(view.epoch), "slots_led": float(view.leads.sum()),
               "slots_held": float(view.holds.sum()), "slots_catching_up": float(self.catching_up()),
               "corrupt_stores": float(self.persistence.corrupt_stores)}
        if self.replicator is not None:
            out.update(self.replicator.stats())
        return out

    def catching_up(self) -> int:
        """Copies on this server that are still being built (not yet in the in-sync set)."""
        view = self.holdings.view
        if view.map is None or not view.valid:
            return 0
        return int((view.map.copy_state(view.me) == 1).sum())

    def install(self, m: ShardMap) -> bool:
        """Make ``m`` this server's map if it is newer: tables created or dropped as it says, slots no longer
        held forgotten, replication streams and slot copies started or stopped. False when not newer.

        Takes the install lock, the registry lock and every table's write lock (in name order) to swap the
        view; the replicator's actions (streams, slot copies, reports to the scheduler) and the daemon's
        ``on_install`` run after they are released. Blocks while a table's lock is held (a push applying, a
        cluster cut holding writes)."""
        if m.num_slots != self.num_slots:
            raise InvalidArgument(f"shard map: {m.num_slots} slots, this server runs with {self.num_slots}")
        actions: list = []  # the replicator's, run once every lock below is released
        with self.install_lock:
            old = self.holdings.view
            if m.epoch <= old.epoch:
                return False
            me = m.index_of(self.server_id)
            valid = me >= 0 and m.servers[me].boot == self.boot
            down = valid and not m.servers[me].up  # declared dead, yet running: keep everything (S10)
            with self.tables.lock:
                self._sync_tables(m)
                hosted_all = self.tables.items()
                for _, h in hosted_all:
                    h.lock.acquire()
                try:
                    new = View.of(m, me, valid)
                    new = (new.kept_while_down(old) if down else new).held_from(old)
                    dropped = np.flatnonzero(old.holds & ~new.holds) if old.valid else np.empty(0, np.int64)
                    self.holdings.replace(new)
                    for _, h in hosted_all:
                        if dropped.size:
                            h.log.reset(dropped)
                            h.dedup.forget_slots(dropped)
                        h.table.set_evictable(self.holdings.leads_ids)  # the led slots changed: recount
                    if self.replicator is not None:
                        actions = self._replication_map(m, me if valid else -1, hosted_all)
                finally:
                    for _, h in reversed(hosted_all):
                        h.lock.release()
                if self.tables.catalog is not None:
                    try:
                        self.tables.save_registry()
                    except StorageError as exc:  # a cache of the map's tables: written again at the next change
                        log.warning("saving the table registry failed: %s", exc)
        self._run_replication(actions)
        if new.valid and not down and (not old.valid or dropped.size):
            self._request_drop()
        if new.fenced.any():
            self._start_hand_over()
        if self.links.on_install is not None:
            self.links.on_install()
        note = (" (this process is not in it yet)" if not valid else
                " (it declares this server dead: its rows are kept until it registers again)" if down else "")
        was_leading = old.leads if old.valid else np.zeros(self.num_slots, bool)
        was_holding = old.holds if old.valid else np.zeros(self.num_slots, bool)
        gained, lost = np.flatnonzero(new.leads & ~was_leading), np.flatnonzero(was_leading & ~new.leads)
        added = np.flatnonzero(new.holds & ~was_holding & ~new.leads)
        log.info("server %s installed map epoch %d: leads %d slot(s) (new: %s; no longer: %s), holds %d (new copies: "
                 "%s; dropped: %s)%s", self.server_id, m.epoch, int(new.leads.sum()), slots_text(gained),
                 slots_text(lost), int(new.holds.sum()), slots_text(added), slots_text(dropped),
                 note,
                 extra=event("map_installed", slots=np.union1d(np.union1d(gained, lost), np.union1d(added, dropped)),
                             epoch=m.epoch, server=self.server_id, leads_gained=format_slots(gained),
                             leads_lost=format_slots(lost), copies_added=format_slots(added),
                             copies_dropped=format_slots(dropped)))
        return True

    def _sync_tables(self, m: ShardMap) -> None:
        """Create the map's tables this server lacks, drop those it no longer has (registry lock held)."""
        for name, spec in m.tables.items():
            hosted = self.tables.find(name)
            if hosted is not None and hosted.spec.created_epoch != spec.created_epoch:
                self.tables.drop(name)  # dropped and created again (between two maps this server saw)
                hosted = None
            if hosted is not None and hosted.spec != spec:
                if hosted.spec.config == spec.config:  # durability or min_copies changed: keep the rows
                    hosted.spec = spec
                    continue
                self.tables.drop(name)
                hosted = None
            if hosted is None:
                self.tables.create(spec)
                log.info("created table %r from the shard map", name)
        for name in [n for n in self.tables.names() if n not in m.tables]:
            self.tables.drop(name)
            log.info("dropped table %r (not in the shard map)", name)

    def _request_drop(self) -> None:
        """Have the rows of slots no longer held deleted: by one worker at a time, which goes over the tables
        again while maps came in during its pass (a rebalance drops copies in many maps; a pass per map, each
        reading every stored id, would compete with the writes and the hand-overs for the CPU)."""
        with self._drop_lock:
            self._drop_wanted = True
            if self._drop_running:
                return
            self._drop_running = True
        if self.replicator is not None:
            self.replicator.spawn(DROP_THREAD, self._drop_loop)
        else:
            start_thread(DROP_THREAD, self._drop_loop)

    def _drop_loop(self) -> None:
        while True:
            with self._drop_lock:  # the check and the end of the worker are one step: no request is missed
                if not self._drop_wanted or self.links.closed:
                    self._drop_running = False
                    return
                self._drop_wanted = False
            try:
                self.drop_unheld()
            except BaseException:
                with self._drop_lock:
                    self._drop_running = False
                raise

    def drop_unheld(self) -> None:
        """Delete the rows of slots this server no longer holds, checked against the map current at each step:
        the ids are found outside the table's write lock and deleted a chunk per lock hold, so pushes to the
        slots it still leads are not held up by a large delete. One pass (the drop worker runs passes while
        maps come in); blocks on each table's lock in turn, never on the network."""
        for name in self.tables.names():
            hosted = self.tables.find(name)
            if hosted is None or not self.holdings.view.valid:
                continue
            try:
                self._drop_unheld_rows(name, hosted)
            except EngineError:
                if not hosted.table.closed:
                    raise
                # closed meanwhile (dropped, or the server shutting down): its rows are gone with it

    def _drop_unheld_rows(self, name: str, hosted: _Hosted) -> None:
        """``drop_unheld`` for one table."""
        with hosted.lock:  # no slot copy builds a copy the map removed from here (``replication.intake``)
            hosted.intake.drop(np.flatnonzero(~self.holdings.view.holds))
        gone = hosted.table.stored_ids_in_slots(self.num_slots, ~self.holdings.view.holds)

        def keep(chunk: np.ndarray) -> np.ndarray | None:
            view = self.holdings.view
            if not view.valid or self.tables.find(name) is not hosted:
                return None
            return chunk[~view.holds[slot_of(chunk, self.num_slots)]]  # not taken back meanwhile

        deleted = delete_in_chunks(hosted, gone, keep)  # a chunk per lock hold, after the pushes waiting for it
        if deleted:
            view = self.holdings.view
            slots = unique(slot_of(gone, self.num_slots))
            log.info("server %s at epoch %d: table %r: deleted %d row(s) of slots no longer held (slots %s)",
                     self.server_id, view.epoch, name, deleted, slots_text(slots),
                     extra=event("rows_dropped", slots=slots, epoch=view.epoch, server=self.server_id, table=name,
                                 rows=deleted))

    def maintain(self) -> None:
        """Periodic work (the daemon calls it about once a second): decay request rates, restart broken
        streams nothing depends on, report again what the scheduler missed. Takes each table's lock briefly."""
        now = self.clock()
        dt = max(1e-3, now - self._last_decay)
        self._last_decay = now
        keep = 0.5 ** (dt / _RATE_HALF_LIFE_S)
        for _, hosted in self.tables.items():
            with hosted.lock:
                hosted.pull_rate = hosted.pull_rate * keep + hosted.pulled / dt * (1 - keep)
                hosted.push_rate = hosted.push_rate * keep + hosted.pushed / dt * (1 - keep)
                hosted.pulled[:] = 0
                hosted.pushed[:] = 0
        if self.replicator is not None and self.holdings.view.map is not None:
            if self.replicator.needs_restart():
                self._reapply_map()
            self.replicator.retry_reports()

    def _reapply_map(self) -> None:
        with self.install_lock, self.tables.lock:
            view = self.holdings.view
            if view.map is None or self.replicator is None:
                return
            hosted_all = self.tables.items()
            for _, h in hosted_all:
                h.lock.acquire()
            try:
                actions = self._replication_map(view.map, view.me if view.valid else -1, hosted_all)
            finally:
                for _, h in reversed(hosted_all):
                    h.lock.release()
        self._run_replication(actions)

    def _replication_map(self, m: ShardMap, me: int, hosted_all: list[tuple[str, _Hosted]]) -> list:
        """``Replicator.on_map`` (the caller holds the install lock and every table's write lock): the actions
        it returns, for ``_run_replication`` once those locks are released."""
        assert self.replicator is not None
        return self.replicator.on_map(m, me, [n for n, _ in hosted_all],
                                      lambda name, slots: self.tables.get(name).log.positions[slots].copy(),
                                      lambda name, slots: self.tables.get(name).dedup.records_for(slots))

    def _run_replication(self, actions: list) -> None:
        """Carry out a map's replication actions (streams opened or closed, slot copies started, failures
        reported to the scheduler) with no table, registry or install lock held: no scheduler call, and no
        install its answer may bring, ever waits under them."""
        if actions and self.replicator is not None:
            self.replicator.run(actions)

    def _start_hand_over(self) -> None:
        with self.install_lock:
            if not self._handover_started and self.replicator is not None:
                self._handover_started = True  # one thread (the replicator's spawn: a simulator drives it)
                self.replicator.spawn("tigana-hand-over", self._hand_over_loop)
        self._handover_wake.set()

    # --- handing the primary role over (a planned move) ----------------------------------------------------
    def _hand_over_loop(self) -> None:
        """While the map names slots this server leads as handing over (it refuses writes to them since it
        installed that map), wait until every in-sync copy acknowledged the stream's tail, then report them
        ready: the scheduler makes the next map name the new primary, which then holds every write made here.
        Runs on one thread; woken by each map and about once a second (the report is repeated until the map
        changes, so a scheduler restart loses nothing)."""
        while not self.links.closed:
            self._handover_wake.wait(1.0)
            self._handover_wake.clear()
            try:
                self.hand_over(self.config.ack_timeout_s)
            except ValueError:  # the agent's channel closed under the call: the server is stopping
                return

    def hand_over(self, timeout_s: float) -> bool:
        """One try of the hand-over report: when the map names slots this server leads as handing over and
        their in-sync copies acknowledge the stream's tail within ``timeout_s``, report them. True: reported."""
        view = self.holdings.view
        agent = self.links.agent
        if self.replicator is None or agent is None or not view.valid or not view.fencing:
            return False
        fenced = np.flatnonzero(view.fenced)
        if not self.replicator.wait(self.replicator.tail_marks(fenced), timeout_s) or self.links.closed:
            return False
        # Maps installed during the wait (a failover or a rebalance sends one every ~0.1 s) do not void it for
        # the slots still fenced: they refused every write since ``view``, and the scheduler takes the report
        # only for slots whose copies and states did not change after ``view.epoch`` (their ``slot_epochs``),
        # so a slot fenced again meanwhile is refused. Requiring the very same map kept slots fenced, every
        # write to them refused, until the maps stopped (2.7 s in a ``bench nemesis`` run).
        now = self.holdings.view
        ready = fenced if now is view else fenced[now.fenced[fenced]] if now.valid else fenced[:0]
        if not ready.size:
            return False
        agent.handover_ready(ready.astype(np.int32), view.epoch)
        return True

    def positions(self) -> list[pb.SlotTableInfo]:
        """Per table, the log positions of every slot with data (for registering after a restart)."""
        out = []
        for name, hosted in self.tables.items():
            with hosted.lock:
                pos = hosted.log.positions.copy()
            have = np.flatnonzero((pos[:, 1] > 0) & (pos[:, 1] != NO_POSITION)).astype(np.int32)
            out.append(pb.SlotTableInfo(table=name, slots=have.astype("<i4").tobytes(),
                                        lsn_epochs=pos[have, 0].astype("<u8").tobytes(),
                                        lsn_indexes=pos[have, 1].astype("<u8").tobytes()))
        return out

