"""The simulated nodes: the real ``SchedulerCore`` and the real ``ShardService``, driven on the world's clock.

Nothing of the protocol is re-implemented here: a server's pushes, map installs, replication (its
``Primary`` core and its streams, the copies' ``apply_item``), slot copies and hand-overs are the daemon's own code.
These adapters replace only the I/O: threads (the ``Replicator`` adapter's ``spawn`` is collected and run by the world;
each stream lane is sent as its sender thread sends it, waiting the pause ``Replicator.sent`` returns; a sync
push is answered by ``Replicator.when_done``, its deadline by ``Replicator.expire``, as on the daemon's
streams), gRPC (the ``Net``), the scheduler's store (the bytes a real store writes, on the simulated disk; its
tick loop judging its own stalls as the daemon's does) and the membership agent's I/O
(``realagent.RealSimAgent``: the daemon's ``Agent`` itself, its channels over the ``Net``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tigana.proto import shard_pb2 as pb
from tigana.ps.background import DROP_THREAD, SLOT_COPY_THREAD, SLOT_RESTORE_THREAD
from tigana.ps.domains import FailureDomain
from tigana.ps.routing import ShardMap
from tigana.ps.scheduler import SchedulerConfig, SchedulerDriver
from tigana.ps.scheduler.liveness import stalled_between
from tigana.ps.scheduler.stores.file import SchedulerState, decode_state, encode_state
from tigana.ps.shard import ShardService
from tigana.ps.shard.config import ServerConfig
from tigana.ps.wire import cluster as cluster_wire
from tigana.tools.testing.sim.realagent import RealSimAgent
from tigana.tools.testing.sim.world import Deferred, Net, World

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
    """The scheduler: the real ``SchedulerCore`` (in its ``SchedulerDriver``) on the world's clock and its store
    on the simulated disk (``stored``); ``restart`` loads a new core from the store (a crash: nothing but the
    store survives). Its probes answer ``probe(address)`` a network round trip later (None: "unknown")."""

    def __init__(self, world: World, net: Net, config: SchedulerConfig,
                 announce: Callable[[ShardMap], None], saved: Callable[[ShardMap], None] = lambda m: None,
                 probe: Callable[[str], bool | None] | None = None) -> None:
        self.world, self.net, self.config, self.probe = world, net, config, probe
        self._announce, self._saved = announce, saved
        self.up = True
        self.skew = 0.0  # how far this machine's clock is ahead of the world's (a clock jump)
        self.demoted_before = 0.0  # copies the cores replaced by restarts demoted
        self.stored: bytes | None = None  # the store's state on the simulated disk (what survives a crash)
        self.core = self._core()
        self._last_tick: float | None = None  # the tick loop's last pass, on this machine's clock

    def tick(self) -> None:
        """One pass of the daemon's tick loop: a gap since the last pass (this machine's clock jumped) is the
        scheduler's own silence, as the daemon's loop judges it (``stalled_between``)."""
        now = self.clock()
        stalled = self._last_tick is not None and stalled_between(self._last_tick, now,
                                                                  self.config.heartbeat_timeout_s)
        self._last_tick = now
        self.core.tick(stalled)

    def clock(self) -> float:
        return self.world.now + self.skew

    def _core(self) -> SchedulerDriver:
        def spawn(name: str, fn: Callable[[], None], delay: float = -1.0) -> None:
            """A probe's thread: its answer comes back a round trip later, waits out a pause of the scheduler,
            and ends unheard when the scheduler was restarted meanwhile (a new process)."""
            def answered() -> None:
                if self.core is not core:
                    return
                if self.up:
                    fn()
                else:
                    spawn(name, fn, 0.05)
            self.world.at(2 * self.world.rng.uniform(*self.net.delay) if delay < 0 else delay, answered)

        core = SchedulerDriver(self.config, _WatchedStore(self, self._saved), announce=self._announce,
                               probe=self.probe, clock=self.clock, cluster_id=f"sim{self.world.seed}", spawn=spawn)
        return core

    def demotions(self, reason: str = "replication_failed") -> int:
        """Copies taken out of the in-sync set for ``reason`` (the scheduler's counter, over its restarts)."""
        return int(self.demoted_before + self.core.metrics.copies_demoted.labels(reason)._value.get())

    def restart(self) -> None:
        self.demoted_before = self.demotions()
        self.core = self._core()
        self._last_tick = None  # a new process: its loop starts afresh


class SimServer:
    """One shard server process (``start`` makes a new one: a new boot, empty memory) on the machine ``domain``
    names (unknown: a host of its own)."""

    def __init__(self, world: World, net: Net, name: str, scheduler: SchedulerNode, servers: dict[str, SimServer],
                 num_slots: int, late_reports_s: Callable[[], float] = lambda: 0.0,
                 data_dir: Path | None = None, domain: FailureDomain = FailureDomain(), queue_bytes: int = 0) -> None:
        self.world, self.net, self.name, self.scheduler, self.servers = world, net, name, scheduler, servers
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
        if queue_bytes > 0:  # a small bound, so that the writers meet it (L5)
            self.config = dataclasses.replace(self.config, replication_queue_bytes=queue_bytes)
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
        self.boots = getattr(self, "boots", 0) + 1  # boot ids and stream generations from the seed, not uuid4/clock
        self.svc = ShardService(self.config, security=_Security(), clock=self.clock, spawn=self._spawn,
                                boot=f"{self.name}-boot{self.boots}", generation=self.boots << 20,
                                wall_clock=self.wall_clock)
        self.writes += 1
        self.svc.load()  # what its data dir holds: its snapshots, as the daemon does at start (none: nothing)
        self.svc.state = "serving"
        self.agent = RealSimAgent(self)
        self.svc.agent = self.agent
        self.alive, self.paused = True, False

    def crash(self) -> None:
        self.alive = False  # a process that is gone answers nothing (``push``'s answers check it)
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
                if not s.has_batch(lane) or (id(s), lane) in self.in_flight:
                    continue  # nothing to send (its sender thread would be waiting), or a batch on the wire
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
        self.svc.replicator.expire()  # the deadline sweeper's pass

    def push(self, request: pb.PushRequest) -> Any:
        """The ``Push`` handler: applied now (or refused, raising), answered once its copies have it, by
        whoever settles the wait, as on the daemon's streams (``Replicator.when_done``: an acknowledgement, a
        map, the deadline); a push that waits for no copy is answered at once."""
        svc = self.svc
        self._touched(request.table)
        # No wait for room in a full replication queue (a wait would stop the world): a push that finds a
        # stream over ``replication_queue_bytes`` is refused at once, nothing applied, and retried (L5).
        pushed = svc.writes.push_apply(request, 0.0)
        self.pushed.append((request, pushed))
        answer = Deferred()
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
        return self.svc.writes.pull(request, 0.0)[1]  # refused at once by a full queue, as a push is

    def _answered(self, svc: ShardService, s: Any, lane: int, reply: pb.ReplicateResponse | None,
                  error: BaseException | None) -> None:
        key = (id(s), lane)
        if svc is not self.svc or not self.up or s.closed:
            self.in_flight.discard(key)
            return  # an answer to a process that is gone, or to a stream replaced meanwhile
        failure = "" if error is None else f"{type(error).__name__}: {error}"
        pause = svc.replicator.sent(s, lane, None if error is not None else reply, failure)
        if pause > 0:  # the lane's sender thread waits (its backoff, the core's pause)
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
        """The daemon's upkeep timer (the agent runs its own loop)."""
        if self.up:
            self.writes += 1
            self.svc.maintain()
