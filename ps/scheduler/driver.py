"""The scheduler core's driver: ``SchedulerDriver`` runs ``SchedulerCore`` on threads, a store and a clock.

One event at a time, under the core's lock: the driver reads the clock and hands the event to the core, which
changes its state in memory and returns what is left to do (``Ready``). Carrying that out (persisting the
states in the ``MapStore``, publishing and announcing the map, starting probes) happens *after* the core's
lock is released, under a lock of its own, in the order the events ran: a slow store (etcd, a loaded disk)
no longer holds up the events behind it, so a heartbeat is recorded when it arrives, not when the write
before it is done.

What stays true: nobody is shown a map that was not saved. Every event is given a ticket (the newest
``Ready`` it may depend on, its own or an earlier event's) and its caller gets the answer only once the
states up to that ticket are saved and their map published; long polls, reads and the announcer see only
``published``, and ``status`` and ``figures`` describe ``shown``, the state saved with it (the target and the
servers draining as of that map), so a cluster reads settled only once its settled map is what ``GetMap``
gives. A heartbeat, whose answer is the map to install, is answered at once with the newest *published* map
and waits for nothing. A store that refuses a write (``stores.etcd.Deposed``, a full disk)
leaves nothing of it visible: the core is rebuilt from the store, as after a restart, and the callers of that
event and of every event run after it (whose answers may rest on it) get the error. Probes run on their own
threads; a probe's answer comes back as an event (``probe_answered``). The announcer must not block: it is
called under the core's lock, in epoch order.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from tigana.proto import scheduler_pb2 as spb
from tigana.ps.domains import FailureDomain
from tigana.ps.metrics import SchedulerMetrics
from tigana.ps.routing import ShardMap, TableDef
from tigana.ps.scheduler import placement
from tigana.ps.scheduler.actions import Probe, Ready
from tigana.ps.scheduler.config import SchedulerConfig
from tigana.ps.scheduler.core import SchedulerCore, new_state
from tigana.ps.scheduler.stores.file import MapStore, SchedulerState

log = logging.getLogger("tigana.ps.scheduler")  # one logger for the whole scheduler

T = TypeVar("T")


class SchedulerDriver:
    """``SchedulerCore`` driven on threads: ``store`` (loaded at start, saved after every event that changed
    the state), ``announce(map)`` after every saved map change, outside the lock, ``probe(address) -> bool |
    None`` (port closed, open, unknown; None: no probes, every one answers unknown at once), ``clock`` and
    ``spawn(name, fn)``, which runs each probe (``fn``) on a thread of its own (None: a new thread; the
    simulator runs it as one of its world's events, so that a seed replays).
    Every event method of the core has its twin here without ``now``; other attributes read the core's."""

    def __init__(self, config: SchedulerConfig, store: MapStore,
                 announce: Callable[[ShardMap], None] = lambda m: None,
                 probe: Callable[[str], bool | None] | None = None, clock: Callable[[], float] = time.monotonic,
                 metrics: SchedulerMetrics | None = None, cluster_id: str | None = None,
                 spawn: Callable[[str, Callable[[], None]], None] | None = None) -> None:
        self.config, self.store, self.announce, self.probe, self.clock = config, store, announce, probe, clock
        self.spawn = spawn
        self.metrics = metrics if metrics is not None else SchedulerMetrics()
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.closing = False  # set when the service stops: long polls (``wait_map``) return at once
        self._probes: set[threading.Thread] = set()  # probes in flight (``wait_probes``)
        state = store.load()
        if state is None:
            state = new_state(config, cluster_id or uuid.uuid4().hex[:12])
            store.save(state)
            log.info("new cluster %s (%d slots, %d replica(s)); state in %s", state.map.cluster_id,
                     state.map.num_slots, config.replicas, store.describe())
        else:
            log.info("loaded cluster %s at epoch %d from %s: %s", state.map.cluster_id, state.map.epoch,
                     store.describe(), state.map.summary())
        self.core = SchedulerCore(config, state, now=clock(), metrics=self.metrics)
        self.published: ShardMap = self.core.map  # the newest saved map: what readers see
        self.saved = _kept(state)  # the last state saved: what a refused write falls back to
        self.shown = self.saved  # the state whose map is published: what status and figures describe
        # Tickets: every Ready the core returned gets the next one; ``_done`` is the newest carried out (or
        # refused). ``_pending`` holds the rest in order; ``_refused`` the error of each refused ticket.
        self._issued = 0
        self._done = 0
        self._pending: collections.deque[tuple[int, Ready]] = collections.deque()
        self._refused: dict[int, BaseException] = {}
        self._carry_lock = threading.Lock()  # one carrier at a time, in ticket order

    # --- running events ----------------------------------------------------------------------------------
    def _event(self, fn: Callable[[float], T], *, wait: bool = True) -> T:
        """Run one event (``fn(now)``) under the core's lock, then carry out its ``Ready`` and every earlier one
        (outside that lock) before answering, also when the event raised (what it changed before is saved).
        ``wait=False``: an event whose answer shows nothing unsaved (a heartbeat) waits only for its own."""
        error: BaseException | None = None
        with self.lock:
            try:
                result = fn(self.clock())
            except BaseException as exc:  # noqa: BLE001 - raised below, once what it changed is saved
                error = exc
            ready = self.core.take_ready()
            if ready.persist or ready.announce is not None or ready.probes:
                self._issued += 1
                self._pending.append((self._issued, ready))
                ticket = self._issued
            else:
                ticket = self._issued if wait else 0
        self._carry_out(ticket)
        if error is not None:
            raise error
        return result

    def _carry_out(self, ticket: int) -> None:
        """Carry out every pending ``Ready`` through ``ticket``, in order: persist its states (outside the
        core's lock), then publish and announce its map and start its probes. A refused write rebuilds the core
        from the store and refuses every ticket pending; the error is raised to each of their callers."""
        probes: list[Probe] = []
        if ticket > self._done:
            with self._carry_lock:
                while True:
                    with self.lock:
                        if self._done >= ticket or not self._pending:
                            break
                        number, ready = self._pending.popleft()
                    try:
                        for state in ready.persist:
                            self.store.save(state)
                            self.saved = _kept(state)
                    except BaseException as exc:
                        with self.lock:
                            self._reload()
                            for k in (number, *(k for k, _ in self._pending)):
                                self._refused[k] = exc
                            self._pending.clear()
                            self._done = self._issued
                        break
                    with self.lock:
                        if ready.announce is not None:
                            self.published = ready.announce
                            self.cond.notify_all()
                            self.announce(ready.announce)
                        if ready.persist:
                            self.shown = self.saved  # its map is the one just published (or unchanged)
                        self._done = number
                    probes.extend(ready.probes)
        for p in probes:
            if self.probe is None:  # no prober: every probe answers "unknown" at once (an event of its own)
                self._event(lambda now, p=p: self.core.probe_answered(p.server_id, p.boot, None, now=now))
            elif self.spawn is not None:
                self.spawn("tigana-probe", lambda p=p: self._run_probe(p))
            else:
                thread = threading.Thread(target=self._run_probe, args=(p,), name="tigana-probe", daemon=True)
                self._probes.add(thread)
                thread.start()
        refused = self._refused.get(ticket) if ticket else None
        if refused is not None:
            raise refused

    def _reload(self) -> None:
        try:
            state = self.store.load()
        except Exception:  # noqa: BLE001 - the store is gone too: the last state saved is still true
            log.exception("reloading the scheduler state after a refused write failed")
            state = None
        if state is None:
            state = _kept(self.saved)  # the map, its target and the servers draining, as last saved
        self.core = SchedulerCore(self.config, state, now=self.clock(), metrics=self.metrics)
        self.published = self.core.map
        self.shown = _kept(state)

    def _run_probe(self, p: Probe) -> None:
        closed: bool | None = None
        try:
            closed = self.probe(p.address) if self.probe is not None else None
        finally:
            try:
                self._event(lambda now: self.core.probe_answered(p.server_id, p.boot, closed, now=now))
            finally:
                self._probes.discard(threading.current_thread())

    def wait_probes(self, timeout_s: float) -> None:
        """Wait for the probes in flight (each a gRPC health check with a short deadline), so that a scheduler
        that stops leaves no gRPC call running behind it."""
        deadline = time.monotonic() + timeout_s
        for thread in list(self._probes):
            thread.join(max(0.0, deadline - time.monotonic()))

    # --- the events ----------------------------------------------------------------------------------------
    def register(self, server_id: str, address: str, boot: str,
                 positions: dict[str, dict[int, tuple[int, int]]] | None = None,
                 domain: FailureDomain | None = None) -> ShardMap:
        return self._event(lambda now: self.core.register(server_id, address, boot, positions, now=now,
                                                          domain=domain))

    def heartbeat(self, server_id: str, boot: str, epoch: int, stats: dict[str, float] | None = None
                  ) -> tuple[ShardMap | None, bool]:
        """Recorded at once, whatever the store is writing; the map in the answer is the newest published
        one (a newer map still being saved reaches the server by the announcer, or the next heartbeat)."""
        _, again = self._event(lambda now: self.core.heartbeat(server_id, boot, epoch, stats, now=now), wait=False)
        m = self.published
        return (m if m.epoch > epoch and not again else None), again

    def copy_failed(self, reporter: str, target: str, slots: np.ndarray, reason: str,
                    epoch: int = 0) -> tuple[bool, str]:
        return self._event(lambda now: self.core.copy_failed(reporter, target, slots, reason, now=now, epoch=epoch))

    def copy_caught_up(self, reporter: str, target: str, slots: np.ndarray, since_epoch: int = 0) -> tuple[bool, str]:
        return self._event(lambda now: self.core.copy_caught_up(reporter, target, slots, since_epoch, now=now))

    def handover_ready(self, reporter: str, slots: np.ndarray, epoch: int) -> tuple[bool, str]:
        return self._event(lambda now: self.core.handover_ready(reporter, slots, epoch, now=now))

    def create_table(self, spec: TableDef, exist_ok: bool) -> tuple[TableDef, bool]:
        return self._event(lambda now: self.core.create_table(spec, exist_ok, now=now))

    def drop_table(self, name: str) -> bool:
        return self._event(lambda now: self.core.drop_table(name, now=now))

    def rebalance(self, *, plan_only: bool = False, rows: np.ndarray | None = None,
                  bytes_: np.ndarray | None = None, rates: np.ndarray | None = None,
                  cost: placement.CostModel | None = None) -> placement.Plan:
        return self._event(lambda now: self.core.rebalance(plan_only=plan_only, rows=rows, bytes_=bytes_,
                                                           rates=rates, cost=cost, now=now))

    def move_slot(self, slot: int, to: str, *, from_: str = "", primary: bool = False) -> placement.Plan:
        return self._event(lambda now: self.core.move_slot(slot, to, from_=from_, primary=primary, now=now))

    def drain(self, server: str, *, undrain: bool = False) -> placement.Plan:
        return self._event(lambda now: self.core.drain(server, undrain=undrain, now=now))

    def unreachable(self, address: str) -> None:
        self._event(lambda now: self.core.unreachable(address, now=now))

    def tick(self, stalled: bool = False) -> None:
        """Failure detection, elections, placement. The time the tick waited for the lock counts as the
        scheduler's own silence (a long step held it), not the servers'."""
        asked = self.clock()
        self._event(lambda now: self.core.tick(now=now, stalled=stalled, waited_s=now - asked))

    # --- reads -----------------------------------------------------------------------------------------------
    @property
    def map(self) -> ShardMap:
        return self.published

    def figures(self) -> dict[str, float]:
        """The metrics of the published state (``shown``): a map still being saved counts nowhere."""
        with self.lock:
            return self.core.figures(self.shown)

    def status(self) -> spb.StatusResponse:
        """``Status`` of the published state (``shown``): its map is the one ``GetMap`` gives, so a cluster
        that reads settled here has its settled map published (servers and clients get it)."""
        with self.lock:
            return self.core.status(now=self.clock(), state=self.shown)

    def wait_map(self, known_epoch: int, wait_s: float) -> ShardMap | None:
        """The map when newer than ``known_epoch``, waiting up to ``wait_s`` for one; else None."""
        deadline = self.clock() + max(0.0, wait_s)
        with self.cond:
            while self.published.epoch <= known_epoch:
                left = deadline - self.clock()
                if left <= 0 or self.closing:
                    return None
                self.cond.wait(min(left, 1.0))
            return self.published

    def close(self) -> None:
        """Wake the long polls (their threads would hold the process up to 30 s) and refuse new ones."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()

    def __getattr__(self, name: str) -> Any:  # the core's state, read-only by convention (target, draining...)
        if name == "core":
            raise AttributeError(name)
        return getattr(self.core, name)


def _kept(state: SchedulerState) -> SchedulerState:
    """A copy of ``state`` that the core's later changes cannot reach (the target is an array)."""
    return dataclasses.replace(state, target=np.array(state.target, np.int32, copy=True))
