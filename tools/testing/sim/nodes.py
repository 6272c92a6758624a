"""The simulated nodes: the real ``SchedulerCore`` and the real ``ShardService``, driven on the world's clock.

Nothing of the protocol is re-implemented here: a server's pushes, map installs, replication (its
``Primary`` core and its streams, the copies' ``apply_item``), slot copies and hand-overs are the daemon's own code.
These adapters replace only the I/O: threads (the ``Replicator`` adapter's ``spawn`` is collected and run by the world),
gRPC (the ``Net``), the scheduler's store (the bytes a real store writes, on the simulated disk) and the membership
agent's I/O (``SimAgent`` drives the real ``Membership`` core: heartbeats, registration and reports over the
``Net``; with ``real_agent``, ``realagent.RealSimAgent`` runs the daemon's ``Agent`` itself).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tigana.proto import shard_pb2 as pb
from tigana.ps.background import DROP_THREAD, SLOT_COPY_THREAD, SLOT_RESTORE_THREAD
from tigana.ps.domains import FailureDomain
from tigana.ps.membership import REGISTER, Membership, caught_up_answer
from tigana.ps.routing import ShardMap
from tigana.ps.scheduler import SchedulerConfig, SchedulerDriver
from tigana.ps.scheduler.service import _positions
from tigana.ps.scheduler.stores.file import SchedulerState, decode_state, encode_state
from tigana.ps.shard import ShardService
from tigana.ps.shard.config import ServerConfig
from tigana.ps.wire import cluster as cluster_wire
from tigana.tools.testing.sim.realagent import RealSimAgent
from tigana.tools.testing.sim.world import Deferred, Lost, Net, World

__all__ = ["SchedulerNode", "SimServer"]

SCHEDULER = "scheduler"
WALL_BASE = 2.0e9  # a simulated machine's wall clock reads this + the world's time (+ its skew): past any real
# time a table was created at, so that rows and removals the cluster stamps are all in the world's time


class _Channel:
    """What a replication stream holds as its channel: the world sends for it."""

    def unary_unary(self, *args: Any, **kwargs: Any) -> None:
        return None

    def close(self) -> None:
        return None


class _Security:
    def channel(self, address: str, options: list) -> _Channel:
        return _Channel()


class _WatchedStore:
    """The scheduler's store on the simulated disk: the bytes the daemon's stores write (``encode_state``, as
    ``FileMapStore`` and ``EtcdMapStore`` do), kept by the ``SchedulerNode`` across restarts and read back through
    ``decode_state`` (a real file's fsyncs cost more wall time than the rest of a save). Tells ``saved`` every
    map it persists, in order (the checkers see each one, also those a single event changed twice and announced
    once)."""

    def __init__(self, node: SchedulerNode, saved: Callable[[ShardMap], None]) -> None:
        self._node, self._saved = node, saved

    def describe(self) -> str:
        return f"the simulated disk of {SCHEDULER}"

    def load(self) -> SchedulerState | None:
        data = self._node.stored
        return None if data is None else decode_state(data, self.describe())

    def save(self, state: SchedulerState) -> None:
        self._node.stored = encode_state(state)
        self._saved(state.map)


class SchedulerNode:
    """The scheduler: the real ``SchedulerCore`` (in its ``SchedulerDriver``, probes answered "unknown") on the
    world's clock and its store on the simulated disk (``stored``); ``restart`` loads a new core from the store
    (a crash: nothing but the store survives)."""

    def __init__(self, world: World, net: Net, config: SchedulerConfig,
                 announce: Callable[[ShardMap], None], saved: Callable[[ShardMap], None] = lambda m: None) -> None:
        self.world, self.net, self.config = world, net, config
        self._announce, self._saved = announce, saved
        self.up = True
        self.skew = 0.0  # how far this machine's clock is ahead of the world's (a clock jump)
        self.demoted_before = 0.0  # copies the cores replaced by restarts demoted
        self.stored: bytes | None = None  # the store's state on the simulated disk (what survives a crash)
        self.core = self._core()

    def clock(self) -> float:
        return self.world.now + self.skew

    def _core(self) -> SchedulerDriver:
        return SchedulerDriver(self.config, _WatchedStore(self, self._saved), announce=self._announce, probe=None,
                               clock=self.clock, cluster_id=f"sim{self.world.seed}")

    def demotions(self, reason: str = "replication_failed") -> int:
        """Copies taken out of the in-sync set for ``reason`` (the scheduler's counter, over its restarts)."""
        return int(self.demoted_before + self.core.metrics.copies_demoted.labels(reason)._value.get())

    def restart(self) -> None:
        self.demoted_before = self.demotions()
        self.core = self._core()


class SimAgent:
    """A server's link to the scheduler (the ``membership.Agent`` surface the service calls): the real
    ``Membership`` core, its calls made over the ``Net`` on the world's clock."""

    def __init__(self, server: SimServer) -> None:
        self.server = server
        self.core = Membership(interval_s=0.5, lease_s=server.config.lease_s)

    @property
    def registered(self) -> bool:
        return self.core.registered

    def _call(self, fn: Callable[[SchedulerDriver], Any]) -> Any:
        s = self.server
        return s.net.now_call(s.name, SCHEDULER, lambda: fn(s.scheduler.core))

    def lease_ok(self) -> bool:
        return self.core.lease_ok(self.server.clock())

    def refresh(self, epoch: int = 0, wait_s: float = 0.0) -> None:
        try:
            m = self._call(lambda core: core.map)
        except Lost:
            return
        self.server.install(m)

    def refresh_soon(self, epoch: int) -> None:
        if self.core.want(epoch):  # coalesced, as the daemon's refresher does
            self.server.world.at(0.01, self._refresh_wanted)

    def _refresh_wanted(self) -> None:
        s = self.server
        if s.agent is not self or not s.up:
            return  # a process that is gone (or paused) refreshes nothing
        self.refresh(self.core.wanted)
        if self.core.wants_more(s.svc.epoch):
            s.world.at(self.core.interval_s, self._refresh_wanted)

    def report_copy_failure(self, target: str, slots: np.ndarray, reason: str, epoch: int = 0) -> None:
        me = self.server.name
        with contextlib.suppress(Lost):
            self._call(lambda core: core.copy_failed(me, target, np.asarray(slots), reason, epoch))

    def copy_caught_up(self, target: str, slots: np.ndarray, since_epoch: int) -> bool | None:
        me, w = self.server.name, self.server.world
        slots = np.array(slots)
        try:
            ok, message = self._call(lambda core: core.copy_caught_up(me, target, slots, since_epoch))
        except Lost:
            return None
        late = self.server.late_reports_s()
        if late > 0:  # a retried report whose first answer was lost: it arrives again, later, unchanged
            def again() -> None:
                with contextlib.suppress(Lost):
                    done = self._call(lambda core: core.copy_caught_up(me, target, slots, since_epoch))
                    w.log(f"late caught-up report {me} -> {target} (slot copy of epoch {since_epoch}, slots "
                          f"{slots.tolist()[:8]}): {done}")
            w.at(late, again)
        return caught_up_answer(ok, message)

    def handover_ready(self, slots: np.ndarray, epoch: int) -> None:
        me = self.server.name
        with contextlib.suppress(Lost):
            self._call(lambda core: core.handover_ready(me, np.asarray(slots), epoch))

    def report_unreachable(self, address: str) -> None:
        return None

    def beat(self) -> None:
        """Register, or heartbeat; install the map that comes back (the daemon's agent loop, once)."""
        s = self.server
        sent = s.clock()
        try:
            if self.core.next_call() == REGISTER:
                positions = _positions(s.svc.positions())  # what it loaded, for an unclean election
                m = self._call(lambda core: core.register(s.name, s.name, s.svc.boot, positions, s.domain))
                s.install(m)
                self.core.registered_ok(sent)
            else:
                self.core.beat_sent(sent)
                try:
                    m, again = self._call(lambda core: core.heartbeat(s.name, s.svc.boot, s.svc.epoch, {}))
                except Lost:
                    self.core.heartbeat_failed(sent)  # the world's beat timer, not the backoff, spaces the next
                    return
                if again:
                    self.core.heartbeat_answered(sent, True)
                    return
                if m is not None:
                    s.install(m)
                self.core.heartbeat_answered(sent, False)
        except Lost:
            self.core.call_failed()  # the world's beat timer, not the backoff, spaces the next try


class SimServer:
    """One shard server process (``start`` makes a new one: a new boot, empty memory) on the machine ``domain``
    names (unknown: a host of its own)."""

    def __init__(self, world: World, net: Net, name: str, scheduler: SchedulerNode, servers: dict[str, SimServer],
                 num_slots: int, late_reports_s: Callable[[], float] = lambda: 0.0,
                 data_dir: Path | None = None, domain: FailureDomain = FailureDomain(), real_agent: bool = False,
                 real_sender: bool = False) -> None:
        self.world, self.net, self.name, self.scheduler, self.servers = world, net, name, scheduler, servers
        self.real_agent = real_agent  # the daemon's ``Agent`` (``realagent``) instead of ``SimAgent``
        self.real_sender = real_sender  # a lane waits after each send as its sender thread would (``sent``)
        self.domain = domain
        self.late_reports_s = late_reports_s
        self.skew = 0.0  # how far this machine's clock is ahead of the world's (a clock jump)
        self.config = ServerConfig(num_slots=num_slots, scheduler=SCHEDULER, server_id=name, ack_timeout_s=5.0,
                                   replication_timeout_s=2.0, lease_s=2.0, snapshot_every_s=0.0,
                                   snapshot_on_shutdown=False, keep_snapshots=2,
                                   # copy tasks run on the world's clock, where a pacing sleep would stall every
                                   # node; pacing only delays a copy, which the world's schedules explore anyway
                                   copy_rate=None,
                                   data_dir=None if data_dir is None else str(data_dir))
        self.snapshots: list[tuple[float, dict[str, np.ndarray], np.ndarray]] = []  # (time, acked, complete)
        self.writes = 0  # calls that may have changed any of its tables (the checkers re-read them only then)
        self.table_writes: dict[str, int] = {}  # calls that may have changed one table only (``stamp``)
        self.pushed: list[tuple[pb.PushRequest, Any]] = []  # pushes applied since the checkers last looked
        self.alive = False
        self.paused = False
        self.svc: ShardService | None = None
        self.start()

    @property
    def up(self) -> bool:
        return self.alive and not self.paused

    def clock(self) -> float:
        return self.world.now + self.skew

    def wall_clock(self) -> float:
        return WALL_BASE + self.world.now + self.skew

    def start(self) -> None:
        if self.svc is not None:
            self.svc.close_tables()
        self.tasks: list[Callable[[], None]] = []
        self.in_flight: set[tuple[int, int]] = set()  # (stream, lane) with a batch on the wire
        self.acks: list[tuple[Any, Deferred, float]] = []
        self.boots = getattr(self, "boots", 0) + 1  # boot ids and stream generations from the seed, not uuid4/clock
        self.svc = ShardService(self.config, security=_Security(), clock=self.clock, spawn=self._spawn,
                                boot=f"{self.name}-boot{self.boots}", generation=self.boots << 20,
                                wall_clock=self.wall_clock)
        self.writes += 1
        self.svc.load()  # what its data dir holds: its snapshots, as the daemon does at start (none: nothing)
        self.svc.state = "serving"
        self.agent = RealSimAgent(self) if self.real_agent else SimAgent(self)
        self.svc.agent = self.agent
        self.alive, self.paused = True, False

    def crash(self) -> None:
        self.alive = False
        self.acks = []  # a process that is gone answers nothing
        if self.svc is not None:
            self.svc.state = "closed"

    def close(self) -> None:
        if self.svc is not None:
            self.svc.close_tables()

    def stamp(self, table: str) -> tuple[int, int]:
        """Changes whenever a call may have changed ``table`` here (its rows, log positions, exactly-once window):
        what the checkers' reads of it are cached by. A push, a pull and a replicated item change their own table
        only; a map, a task, a restart may change any."""
        return self.writes, self.table_writes.get(table, 0)

    def _touched(self, table: str) -> None:
        self.table_writes[table] = self.table_writes.get(table, 0) + 1

    def _spawn(self, name: str, fn: Callable[[], None]) -> None:
        if name in (SLOT_COPY_THREAD, SLOT_RESTORE_THREAD, DROP_THREAD):
            self.tasks.append(fn)  # run by ``step``, as its thread would
        # a stream's two senders (its lanes) are driven by ``step`` (``core.request``, then ``answered`` or
        # ``send_failed``); closing a stream's channel is nothing here

    def install(self, m: ShardMap) -> None:
        if self.up:
            self.writes += 1
            self.svc.install(m)

    # --- one step of the daemon's threads ---
    def step(self) -> None:
        if not self.up:
            return
        tasks, self.tasks = self.tasks, []
        self.writes += bool(tasks)
        for task in tasks:
            task()
        rep = self.svc.replicator
        for s in list(rep.streams.values()):
            for lane in (0, 1):
                if (id(s), lane) in self.in_flight:
                    continue
                with rep.cond:
                    request = rep.core.request(s, lane)
                if request is None:
                    continue
                target = self.servers.get(s.target_id)
                if target is None:
                    continue
                self.in_flight.add((id(s), lane))
                self.net.call(self.name, s.target_id, lambda t=target, r=request: t.receive(self.name, r),
                              lambda reply, error, s=s, lane=lane, svc=self.svc:
                              self._answered(svc, s, lane, reply, error))
        self.svc.hand_over(0.0)
        if self.real_sender:
            self.svc.replicator.expire()  # the deadline sweeper's pass
        self._settle_acks()

    def push(self, request: pb.PushRequest) -> Any:
        """The ``Push`` handler: applied now (or refused, raising), answered once its copies have it. With
        ``real_sender`` the answer is made by whoever settles the wait, as on the daemon's streams
        (``Replicator.when_done``: an acknowledgement, a map, the deadline); else when a step finds it settled."""
        svc = self.svc
        self._touched(request.table)
        pushed = svc.writes.push_apply(request)
        self.pushed.append((request, pushed))
        answer = Deferred()
        if not self.real_sender or not pushed.marks:
            self.acks.append((pushed, answer, self.clock() + self.config.ack_timeout_s))
            return answer
        now: list[Any] = []  # the outcome, when the wait was settled already (before the handler returned)
        returned = [False]

        def done(ok: bool) -> None:
            if svc is not self.svc or not self.alive:
                return  # a process that is gone answers nothing
            try:
                result, error = svc.writes.push_answer(pushed, ok), None
            except Exception as exc:  # noqa: BLE001 - the error answer the client gets
                result, error = None, exc
            if returned[0]:
                answer.resolve(result, error)
            else:
                now.append((result, error))
        svc.replicator.when_done(pushed.marks, self.config.ack_timeout_s, done)
        returned[0] = True
        if now:
            result, error = now[0]
            if error is not None:
                raise error
            return result
        return answer

    def pull(self, request: pb.PullRequest) -> np.ndarray:
        """The ``Pull`` handler: the rows read (and, when inserting, the new rows replicated)."""
        if not request.read_only:  # a read-only pull changes no row, position or window
            self._touched(request.table)
        return self.svc.writes.pull(request)[1]

    def _settle_acks(self) -> None:
        keep = []
        for pushed, answer, deadline in self.acks:
            if not pushed.marks or self.svc.replicator.wait(pushed.marks, 0.0) or self.clock() >= deadline:
                try:
                    answer.resolve(self.svc.writes.push_ack(pushed, 0.0))
                except Exception as exc:  # noqa: BLE001 - the error answer the client gets
                    answer.resolve(None, exc)
            else:
                keep.append((pushed, answer, deadline))
        self.acks = keep

    def _answered(self, svc: ShardService, s: Any, lane: int, reply: pb.ReplicateResponse | None,
                  error: BaseException | None) -> None:
        key = (id(s), lane)
        if svc is not self.svc or not self.up or s.closed:
            self.in_flight.discard(key)
            return  # an answer to a process that is gone, or to a stream replaced meanwhile
        failure = "" if error is None else f"{type(error).__name__}: {error}"
        pause = svc.replicator.sent(s, lane, None if error is not None else reply, failure)
        if self.real_sender and pause > 0:  # the lane's sender thread waits (its backoff, the core's pause)
            self.world.at(pause, lambda: self.in_flight.discard(key))
        else:
            self.in_flight.discard(key)

    def receive(self, source: str, request: bytes) -> pb.ReplicateResponse:
        """The ``Replicate`` handler's body (``Receiver.receive``), without gRPC."""
        decoded = cluster_wire.decode_replicate_request(request)
        for item in decoded.items:
            self._touched(cluster_wire.item_header(item)[0])
        return self.svc.receiver.receive(decoded)

    def maintain(self) -> None:
        if self.up:
            self.writes += 1
            self.svc.maintain()
            self.agent.beat()
