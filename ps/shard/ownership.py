"""What this server holds, and changes to it: ``_View`` (the slots it leads and holds under one map), the
leads check every write and pull makes (``_check_leads``), the install of a new map (tables created or
dropped, slots no longer held forgotten, replication streams started or stopped), the hand-over of the
primary role in a planned move, the links to the scheduler (the daemon's agent) and periodic upkeep.

``install`` applies a map under the install lock, the registry lock and every table's write lock (in name
order), so a request is checked and applied against one map. What the replication core asks for in return
(streams, slot copies, reports to the scheduler) is carried out after every one of those locks is released:
no RPC and no wait runs under a table or install lock.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import numpy as np

from tigana.embeddings import StorageError
from tigana.embeddings.changes import unique
from tigana.embeddings.errors import EmbeddingError as EngineError
from tigana.proto import shard_pb2 as pb
from tigana.ps import _kernels
from tigana.ps.background import DROP_THREAD, start_thread
from tigana.ps.errors import InvalidArgument, Unavailable, WrongShard
from tigana.ps.logs import event, slots_text
from tigana.ps.replication import NO_POSITION
from tigana.ps.replication.apply import delete_in_chunks
from tigana.ps.routing import ShardMap, format_slots, slot_of
from tigana.ps.shard._fields import ShardFields

if TYPE_CHECKING:
    from tigana.ps.shard.hosted import _Hosted

log = logging.getLogger("tigana.ps.server")  # one logger for the whole shard server
_COPY_CHUNK = 16384  # rows per SNAPSHOT_ROWS item of a slot copy
_RATE_HALF_LIFE_S = 10.0


@dataclasses.dataclass(frozen=True, eq=False)
class _View:
    """What this server holds under one map: epoch, the slots it leads and holds, whether the map names this
    process (``valid``), per slot the number of in-sync copies, the slots it leads but refuses writes to
    while it hands them over (``fenced``), the copies the cluster keeps of a slot (``want``), and per slot the
    epoch since which this server has held it without a break (``held_since``: a slot dropped loses its rows
    and log, so a write applied before that is not in what it holds now)."""

    epoch: int
    map: ShardMap | None
    me: int
    leads: np.ndarray
    holds: np.ndarray
    valid: bool
    in_sync: np.ndarray
    fenced: np.ndarray
    want: int = 1
    held_since: np.ndarray | None = None

    def held_from(self, old: _View) -> _View:
        """This view with ``held_since`` carried on from ``old`` (the view it replaces)."""
        kept = self.holds & old.holds & old.valid
        before = old.held_since if old.held_since is not None else np.zeros(self.holds.shape[0], np.int64)
        return dataclasses.replace(self, held_since=np.where(kept, before, self.epoch).astype(np.int64))

    def kept_while_down(self, old: _View) -> _View:
        """This view for a map that declares this very process dead while it runs (a pause, a partition, a new
        scheduler that did not hear it in time): it leads nothing, yet keeps every row and log position it held
        until it registers again, as the scheduler then asks it to. Its rows may be the newest of a slot that
        lost every in-sync copy meanwhile: the election needs them (invariant S10)."""
        none = np.zeros_like(self.leads)
        return dataclasses.replace(self, leads=none, fenced=none, holds=old.holds.copy() if old.valid else none)

    @classmethod
    def static(cls, owned: np.ndarray) -> _View:
        return cls(0, None, -1, owned, owned, True, np.ones(owned.shape[0], np.int64), np.zeros_like(owned))

    @classmethod
    def waiting(cls, num_slots: int) -> _View:
        none = np.zeros(num_slots, bool)
        return cls(0, None, -1, none, none, False, np.zeros(num_slots, np.int64), none)

    @classmethod
    def of(cls, m: ShardMap, me: int, valid: bool) -> _View:
        if me < 0 or not valid:
            none = np.zeros(m.num_slots, bool)
            return cls(m.epoch, m, me, none, none, False, m.in_sync_count(), none, 1 + m.replicas)
        leads = m.leads(me)
        return cls(m.epoch, m, me, leads, m.holds(me), True, m.in_sync_count(), leads & m.handing_over(),
                   1 + m.replicas)


class Ownership(ShardFields):
    """The slots this server leads and holds, and the map that says so (a room of ``ShardService``)."""

    def set_owned_slots(self, mask: np.ndarray) -> None:
        """Static mode: replace the owned slot set ((num_slots,) bool)."""
        mask = np.asarray(mask, dtype=bool)
        if self.clustered:
            raise InvalidArgument("owned slots: this server takes its slots from the scheduler's map")
        if mask.shape != (self.num_slots,):
            raise InvalidArgument(f"owned slots: expected a mask of {self.num_slots} slots, got {mask.shape}")
        self._view = _View.static(mask.copy())

    def owned_slots(self) -> np.ndarray:
        return self._view.leads.copy()

    @property
    def epoch(self) -> int:
        return self._view.epoch

    def _check_leads(self, table: str, ids: np.ndarray, epoch: int) -> tuple[_View, np.ndarray]:
        """(view, slot of each id) after checking this server leads every id's slot in its current map."""
        view = self._view
        if not view.valid:
            raise Unavailable(f"table {table!r}: server {self.server_id} is not in the cluster yet "
                              "(registering with the scheduler)", epoch=view.epoch)
        hosted = self._tables.get(table)
        if hosted is not None and hosted.spec.created_epoch > view.epoch:
            # ``install`` creates a new map's tables before it has every table's lock and the new view: until
            # then the table is not served (a write now would be stamped and replicated under the old map).
            raise Unavailable(f"table {table!r} (created at epoch {hosted.spec.created_epoch}) is not served by "
                              f"{self.server_id} before it installs that map (it is at epoch {view.epoch}); retry",
                              epoch=view.epoch)
        slots, count, first = _kernels.slots_foreign(ids, view.leads)
        if not count and view.fenced.any():
            fenced = view.fenced[slots]
            if fenced.any():
                s = int(slots[np.argmax(fenced)])
                raise WrongShard(f"table {table!r}: slot {s} is being handed over to a new primary at epoch "
                                 f"{view.epoch}; retry by the next map (nothing applied)", epoch=view.epoch)
        if count:
            if epoch > view.epoch and self.agent is not None:
                self.agent.refresh_soon(epoch)
            example = int(ids[first])
            raise WrongShard(f"table {table!r}: field 'ids' has {count} id(s) in slots this server does not lead "
                             f"at epoch {view.epoch} (e.g. id {example}, slot {int(slots[first])}; the request "
                             f"was routed at epoch {epoch})", epoch=view.epoch)
        return view, slots

    def cluster_figures(self) -> dict[str, float]:
        """Epoch, slots led/held/catching up and replication lag (the metrics endpoint and heartbeats)."""
        view = self._view
        out = {"epoch": float(view.epoch), "slots_led": float(view.leads.sum()),
               "slots_held": float(view.holds.sum()), "slots_catching_up": float(self.catching_up()),
               "corrupt_stores": float(self.corrupt_stores)}
        if self.replicator is not None:
            out.update(self.replicator.stats())
        return out

    def catching_up(self) -> int:
        """Copies on this server that are still being built (not yet in the in-sync set)."""
        view = self._view
        if view.map is None or not view.valid:
            return 0
        return int((view.map.copy_state(view.me) == 1).sum())

    def install(self, m: ShardMap) -> bool:
        """Make ``m`` this server's map if it is newer: tables created or dropped as it says, slots no longer
        held forgotten, replication streams and slot copies started or stopped. False when not newer."""
        if m.num_slots != self.num_slots:
            raise InvalidArgument(f"shard map: {m.num_slots} slots, this server runs with {self.num_slots}")
        actions: list = []  # the replicator's, run once every lock below is released
        with self._install_lock:
            old = self._view
            if m.epoch <= old.epoch:
                return False
            me = m.index_of(self.server_id)
            valid = me >= 0 and m.servers[me].boot == self.boot
            down = valid and not m.servers[me].up  # declared dead, yet running: keep everything (S10)
            with self._registry_lock:
                self._sync_tables(m)
                hosted_all = sorted(self._tables.items())
                for _, h in hosted_all:
                    h.lock.acquire()
                try:
                    new = _View.of(m, me, valid)
                    new = (new.kept_while_down(old) if down else new).held_from(old)
                    dropped = np.flatnonzero(old.holds & ~new.holds) if old.valid else np.empty(0, np.int64)
                    self._view = new
                    for _, h in hosted_all:
                        if dropped.size:
                            h.log.reset(dropped)
                            h.dedup.forget_slots(dropped)
                        h.table.set_evictable(self._leads_ids)  # the led slots changed: recount
                    if self.replicator is not None:
                        actions = self._replication_map(m, me if valid else -1, hosted_all)
                finally:
                    for _, h in reversed(hosted_all):
                        h.lock.release()
                if self.catalog is not None:
                    try:
                        self._save_registry()
                    except StorageError as exc:  # a cache of the map's tables: written again at the next change
                        log.warning("saving the table registry failed: %s", exc)
        self._run_replication(actions)
        if new.valid and not down and (not old.valid or dropped.size):
            self._request_drop()
        if new.fenced.any():
            self._start_hand_over()
        if self.on_install is not None:
            self.on_install()
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
            hosted = self._tables.get(name)
            if hosted is not None and hosted.spec.created_epoch != spec.created_epoch:
                self._drop_local(name)  # dropped and created again (between two maps this server saw)
                hosted = None
            if hosted is not None and hosted.spec != spec:
                if hosted.spec.config == spec.config:  # durability or min_copies changed: keep the rows
                    hosted.spec = spec
                    continue
                self._drop_local(name)
                hosted = None
            if hosted is None:
                self._create_local(spec)
                log.info("created table %r from the shard map", name)
        for name in [n for n in self._tables if n not in m.tables]:
            self._drop_local(name)
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
                if not self._drop_wanted or self.state == "closed":
                    self._drop_running = False
                    return
                self._drop_wanted = False
            try:
                self._drop_unheld()
            except BaseException:
                with self._drop_lock:
                    self._drop_running = False
                raise

    def _drop_unheld(self) -> None:
        """Delete the rows of slots this server no longer holds, checked against the map current at each step:
        the ids are found outside the table's write lock and deleted a chunk per lock hold, so pushes to the
        slots it still leads are not held up by a large delete."""
        for name in self.table_names():
            hosted = self._tables.get(name)
            if hosted is None or not self._view.valid:
                continue
            try:
                self._drop_unheld_rows(name, hosted)
            except EngineError:
                if not hosted.table.closed:
                    raise
                # closed meanwhile (dropped, or the server shutting down): its rows are gone with it

    def _drop_unheld_rows(self, name: str, hosted: _Hosted) -> None:
        """``_drop_unheld`` for one table."""
        with hosted.lock:  # no slot copy builds a copy the map removed from here (``replication.intake``)
            hosted.intake.drop(np.flatnonzero(~self._view.holds))
        gone = hosted.table.stored_ids_in_slots(self.num_slots, ~self._view.holds)

        def keep(chunk: np.ndarray) -> np.ndarray | None:
            view = self._view
            if not view.valid or self._tables.get(name) is not hosted:
                return None
            return chunk[~view.holds[slot_of(chunk, self.num_slots)]]  # not taken back meanwhile

        deleted = delete_in_chunks(hosted, gone, keep)  # a chunk per lock hold, after the pushes waiting for it
        if deleted:
            view = self._view
            slots = unique(slot_of(gone, self.num_slots))
            log.info("server %s at epoch %d: table %r: deleted %d row(s) of slots no longer held (slots %s)",
                     self.server_id, view.epoch, name, deleted, slots_text(slots),
                     extra=event("rows_dropped", slots=slots, epoch=view.epoch, server=self.server_id, table=name,
                                 rows=deleted))

    def maintain(self) -> None:
        """Periodic work (the daemon calls it about once a second): decay request rates, restart broken
        streams nothing depends on, report again what the scheduler missed."""
        now = self.clock()
        dt = max(1e-3, now - self._last_decay)
        self._last_decay = now
        keep = 0.5 ** (dt / _RATE_HALF_LIFE_S)
        for hosted in list(self._tables.values()):
            with hosted.lock:
                hosted.pull_rate = hosted.pull_rate * keep + hosted.pulled / dt * (1 - keep)
                hosted.push_rate = hosted.push_rate * keep + hosted.pushed / dt * (1 - keep)
                hosted.pulled[:] = 0
                hosted.pushed[:] = 0
        if self.replicator is not None and self._view.map is not None:
            if self.replicator.needs_restart():
                self._reapply_map()
            self.replicator.retry_reports()

    def _reapply_map(self) -> None:
        with self._install_lock, self._registry_lock:
            view = self._view
            if view.map is None or self.replicator is None:
                return
            hosted_all = sorted(self._tables.items())
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
                                      lambda name, slots: self._tables[name].log.positions[slots].copy(),
                                      lambda name, slots: self._tables[name].dedup.records_for(slots))

    def _run_replication(self, actions: list) -> None:
        """Carry out a map's replication actions (streams opened or closed, slot copies started, failures
        reported to the scheduler) with no table, registry or install lock held: no scheduler call, and no
        install its answer may bring, ever waits under them."""
        if actions and self.replicator is not None:
            self.replicator.run(actions)

    # --- links to the scheduler (the daemon's agent) ------------------------------------------------------
    def _refresh(self, epoch: int, wait_s: float = 0.0) -> None:
        if self.agent is not None:
            self.agent.refresh(epoch, wait_s)

    def _report_failure(self, target: str, slots: np.ndarray, reason: str, epoch: int) -> None:
        if self.agent is not None:
            self.agent.report_copy_failure(target, slots, reason, epoch)

    def _start_hand_over(self) -> None:
        with self._install_lock:
            if not self._handover_started and self.replicator is not None:
                self._handover_started = True  # one thread (the replicator's spawn: a simulator drives it)
                self.replicator.spawn("tigana-hand-over", self._hand_over_loop)
        self._handover_wake.set()

    def _caught_up(self, target: str, slots: np.ndarray, since_epoch: int) -> bool | None:
        if self.agent is not None:
            return self.agent.copy_caught_up(target, slots, since_epoch)
        return None

    # --- handing the primary role over (a planned move) ----------------------------------------------------
    def _hand_over_loop(self) -> None:
        """While the map names slots this server leads as handing over (it refuses writes to them since it
        installed that map), wait until every in-sync copy acknowledged the stream's tail, then report them
        ready: the scheduler makes the next map name the new primary, which then holds every write made here.
        Runs on one thread; woken by each map and about once a second (the report is repeated until the map
        changes, so a scheduler restart loses nothing)."""
        while self.state != "closed":
            self._handover_wake.wait(1.0)
            self._handover_wake.clear()
            try:
                self.hand_over(self.config.ack_timeout_s)
            except ValueError:  # the agent's channel closed under the call: the server is stopping
                return

    def hand_over(self, timeout_s: float) -> bool:
        """One try of the hand-over report: when the map names slots this server leads as handing over and
        their in-sync copies acknowledge the stream's tail within ``timeout_s``, report them. True: reported."""
        view = self._view
        if self.replicator is None or self.agent is None or not view.valid or not view.fenced.any():
            return False
        fenced = np.flatnonzero(view.fenced)
        if not self.replicator.wait(self.replicator.tail_marks(fenced), timeout_s) or self.state == "closed":
            return False
        # Maps installed during the wait (a failover or a rebalance sends one every ~0.1 s) do not void it for
        # the slots still fenced: they refused every write since ``view``, and the scheduler takes the report
        # only for slots whose copies and states did not change after ``view.epoch`` (their ``slot_epochs``),
        # so a slot fenced again meanwhile is refused. Requiring the very same map kept slots fenced, every
        # write to them refused, until the maps stopped (2.7 s in a ``bench nemesis`` run).
        now = self._view
        ready = fenced if now is view else fenced[now.fenced[fenced]] if now.valid else fenced[:0]
        if not ready.size:
            return False
        self.agent.handover_ready(ready.astype(np.int32), view.epoch)
        return True

    def positions(self) -> list[pb.SlotTableInfo]:
        """Per table, the log positions of every slot with data (for registering after a restart)."""
        out = []
        for name in self.table_names():
            hosted = self._tables[name]
            with hosted.lock:
                pos = hosted.log.positions.copy()
            have = np.flatnonzero((pos[:, 1] > 0) & (pos[:, 1] != NO_POSITION)).astype(np.int32)
            out.append(pb.SlotTableInfo(table=name, slots=have.astype("<i4").tobytes(),
                                        lsn_epochs=pos[have, 0].astype("<u8").tobytes(),
                                        lsn_indexes=pos[have, 1].astype("<u8").tobytes()))
        return out

