"""The trainers of the simulated cluster: ``tigana.ps.Client`` on the world's network, event queue and clock.

Nothing of the trainer's side is re-implemented here: routing, the parts in flight, re-routing on
``WrongShard`` and on a newer map (``sentparts``), retries under the same (client id, seq), new sessions on
``UnknownClient``, the backoff and the failover deadline are ``tigana.ps.client``'s own code. Only its ports
(``tigana.ps.client.ports``) are the world's:

- ``SimTransport``: a part travels over the ``Net`` to the ``SimServer`` its address names (the server's own
  ``Push``/``Pull`` handlers); a lost request or answer reaches the client as ``Unavailable`` (not answered),
  a deferred answer that never comes as ``DeadlineExceeded`` at the call's deadline.
- ``SimMapSource``: the scheduler's map, fetched over the ``Net`` when the client asks (``refresh``) and
  every ``poll_s`` (the long poll's answer comes as soon as the epoch moves); ``report_unreachable`` reaches
  the scheduler's core.
- ``describe_table``: the table's definition in the scheduler's map, answered at once (the client asks once
  per table, for its width; answered without the ``Net``, it draws nothing from the world's random source).
- ``on_push``: each exactly-once key a push takes (as it starts, and for a part sent again under a new
  session) keys it in the ledger's pushes in doubt.
- timers are the world's events, the clock its ``now``, and session ids are stamped from the seed, so a
  seed replays exactly.

Every push adds 1 and its own weight to its ids' rows (``ledger``): ``sent`` when it is issued, ``acked``
for its ids once the client's future succeeds (ids whose slot lost every copy after the push began excepted:
that acknowledgement promises nothing, ``disk.lose_slots``). Runs on the world's one thread: nothing here
blocks, and the client's callbacks run from world events.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures as cf
from typing import Any

import numpy as np

from tigana.proto import shard_pb2 as pb
from tigana.ps.client import Client, ClientConfig
from tigana.ps.client.ports import ClientPorts, PushKeyed
from tigana.ps.client.tables import TableInfo
from tigana.ps.errors import DeadlineExceeded, PSError, TableNotFound, Unavailable
from tigana.ps.routing import ShardMap
from tigana.ps.wire import data as wire
from tigana.ps.wire import frames
from tigana.tools.testing.sim.ledger import Ledger, Push, push_weight
from tigana.tools.testing.sim.world import Lost, Net, World

__all__ = ["RealSimClient", "SimMapSource", "SimTransport"]

SCHEDULER = "scheduler"
LOST_AFTER_S = 1.0  # a lost request or answer is noticed this long after the call


class _Permits:
    """A server's push permits on one thread: taking one that is not there would block the world forever,
    so it is a failure of the run's settings, raised at once."""

    def __init__(self, n: int) -> None:
        self.left = n

    def acquire(self) -> bool:
        if self.left <= 0:
            raise RuntimeError("sim: a push would wait for a permit on the world's only thread; raise "
                               "max_pushes_in_flight")
        self.left -= 1
        return True

    def release(self) -> None:
        self.left += 1


class SimTransport:
    """The client's ``Transport`` to the ``SimServer`` named ``address``, over the world's ``Net``."""

    def __init__(self, world: World, net: Net, src: str, address: str, servers: dict[str, Any],
                 max_pushes_in_flight: int) -> None:
        self.world, self.net, self.src, self.address, self.servers = world, net, src, address, servers
        self.permits = _Permits(max_pushes_in_flight)
        self._open: dict[int, Callable[[Any, PSError | None], None]] = {}
        self._next = 0

    def send(self, kind: int, parts: list, timeout_s: float, done: Callable[[Any, PSError | None], None],
             on_retry: Callable[[], None]) -> None:
        raw = b"".join(parts)  # the frame as the wire carries it (bytes and memoryviews: join takes both)
        server = self.servers[self.address]
        if kind == frames.PUSH:
            push = pb.PushRequest.FromString(raw)

            def handler() -> Any:
                return server.push(push)
        else:
            pull = pb.PullRequest.FromString(raw)

            def handler() -> Any:  # the rows as the server encodes them, read as the client decodes them
                return wire.decode_pull_response(wire.encode_pull_response(server.pull(pull), pull.codec))

        self._next += 1
        key = self._next
        deadline: list = []  # the deadline's event, cancelled once the call settles (it would do nothing)

        def finish(result: Any, error: BaseException | None) -> None:
            if self._open.pop(key, None) is None:  # settled already (deadline, cancel, or the answer)
                return
            self.world.cancel(deadline[0])
            if isinstance(error, Lost):
                error = Unavailable(f"{self.address}: {error}", answered=False)
            elif isinstance(error, PSError):
                error.answered = True  # the server answered with it (raised in-process, not from gRPC)
            elif error is not None:  # a bug in the server: a test failure, not a retry
                raise error
            done(result, error)

        self._open[key] = finish
        self.net.call(self.src, self.address, handler, finish, timeout_s=min(LOST_AFTER_S, timeout_s))
        # a deferred answer from a server that died or lost its copies never comes: the call's deadline
        deadline.append(self.world.at(timeout_s, lambda: finish(None, DeadlineExceeded(
            f"{self.address}: no answer within {timeout_s:g}s (deadline exceeded)"))))

    def send_many(self, items: list[tuple[int, list, Callable[[Any, PSError | None], None]]], timeout_s: float,
                  on_retry: Callable[[], None]) -> None:
        for kind, parts, done in items:
            self.send(kind, parts, timeout_s, done, on_retry)

    def cancel_all(self) -> int:
        calls = list(self._open.values())
        for finish in calls:
            finish(None, Unavailable(f"{self.address}: call cancelled (the server was declared dead)",
                                     answered=True))
        return len(calls)

    def close(self) -> None:
        self.cancel_all()


class SimMapSource:
    """The client's ``MapSource``: the scheduler's map over the world's ``Net``."""

    def __init__(self, world: World, net: Net, src: str, scheduler: Any, on_map: Callable[[ShardMap], None],
                 poll_s: float = 0.1) -> None:
        self.world, self.net, self.src, self.scheduler, self.on_map = world, net, src, scheduler, on_map
        self.poll_s = poll_s
        self.addresses = [SCHEDULER]
        self.epoch = 0
        self.refreshes = 0
        self._fetching = False
        self._closed = False
        self._reported: dict[str, float] = {}

    def _map(self) -> ShardMap:
        return self.scheduler.core.map

    def _deliver(self, m: ShardMap | None) -> None:
        if m is not None and m.epoch > self.epoch and m.servers and not self._closed:
            self.epoch = m.epoch
            self.refreshes += 1
            self.on_map(m)

    def fetch(self, timeout_s: float) -> ShardMap:
        """The map now (the world cannot wait here): ``Unavailable`` when the scheduler does not answer or no
        server has registered yet; the caller tries again later."""
        try:
            m = self.net.now_call(self.src, SCHEDULER, self._map)
        except Lost:
            raise Unavailable(f"scheduler: no answer to {self.src}") from None
        if not m.servers:
            raise Unavailable("scheduler: no shard server has registered with the scheduler yet")
        self._deliver(m)
        return m

    def start(self) -> None:
        self.world.at(self.poll_s, self._poll)

    def _poll(self) -> None:
        if self._closed:
            return
        self.net.call(self.src, SCHEDULER, self._map, lambda m, e: self._deliver(m), timeout_s=LOST_AFTER_S)
        self.world.at(self.poll_s, self._poll)

    def refresh(self, min_epoch: int = 0) -> None:
        if (min_epoch and self.epoch >= min_epoch) or self._fetching or self._closed:
            return
        self._fetching = True

        def answered(m: ShardMap | None, error: BaseException | None) -> None:
            self._fetching = False
            self._deliver(m)

        self.net.call(self.src, SCHEDULER, self._map, answered, timeout_s=LOST_AFTER_S)

    def report_unreachable(self, address: str) -> None:
        now = self.world.now
        if now - self._reported.get(address, -1e9) < 1.0 or self._closed:
            return
        self._reported[address] = now
        self.net.call(self.src, SCHEDULER, lambda: self.scheduler.core.unreachable(address), lambda r, e: None,
                      timeout_s=LOST_AFTER_S)

    def close(self) -> None:
        self._closed = True


class RealSimClient:
    """One trainer of the simulated cluster: the real ``Client`` (``push``, ``pull`` and the counters the run
    reads)."""

    def __init__(self, world: World, net: Net, name: str, stamp: int, scheduler: Any, servers: dict[str, Any],
                 ledger: Ledger, num_slots: int, give_up_s: float = 30.0) -> None:
        self.world, self.net, self.name, self.scheduler, self.servers = world, net, name, scheduler, servers
        self.ledger, self.num_slots, self.stamp = ledger, num_slots, stamp
        self.config = ClientConfig(num_slots=num_slots, timeout_s=8.0, failover_timeout_s=give_up_s,
                                   max_pushes_in_flight=64, tune_allocator=False)
        self.client: Client | None = None
        self.sessions = 0
        self.pending = 0  # pushes issued and not settled
        self._pushes = 0  # pushes issued: each its own weight
        self._key: tuple[str, int] | None = None  # the (client id, seq) the push just started took
        self.failed = 0  # pushes the client gave up on (neither acknowledged nor known lost)
        self.to_dropped_tables = 0  # pushes whose (scratch) table was dropped under them
        self.acked = 0
        self.pulls = 0  # pulls answered
        self.doubled: list[str] = []  # pulls that read a row above the pushes ever sent to it (S6)

    # --- the ports ---
    def _session(self, above: int) -> str:
        """A client id stamped from the seed (``tigana.ps.session``'s format), above ``above``."""
        self.sessions += 1
        stamp = max(above + 1, self.stamp + self.sessions - 1)
        return f"{stamp:016x}.{self.name:0>32}"[:49]

    def _ports(self) -> ClientPorts:
        w = self.world
        return ClientPorts(
            clock=w.clock, call_later=lambda delay, fn: w.at(delay, fn),
            transport=lambda address: SimTransport(w, self.net, self.name, address, self.servers,
                                                   self.config.max_pushes_in_flight),
            map_source=lambda _, on_map: SimMapSource(w, self.net, self.name, self.scheduler, on_map),
            new_session=self._session, describe_table=self._describe, on_push=self._keyed)

    def _describe(self, table: str) -> TableInfo:
        spec = self.scheduler.core.map.tables.get(table)
        if spec is None:
            raise TableNotFound(f"table {table!r} does not exist (not in the scheduler's map)")
        return TableInfo(spec.config, {})

    def _keyed(self, k: PushKeyed) -> None:
        if k.of is None:
            self._key = (k.client_id, k.seq)  # the push ``push`` is starting (this frame)
        else:
            self.ledger.rekeyed(k.table, k.of, k.client_id, k.seq, k.ids)

    def _connected(self) -> Client | None:
        """The client, connected on first use (``None`` while the scheduler has no map for it yet)."""
        if self.client is None:
            try:
                self.client = Client(config=self.config, scheduler=SCHEDULER, ports=self._ports())
            except Unavailable:
                return None
        return self.client

    # --- the workload ---
    def push(self, table: str, ids: np.ndarray) -> None:
        c = self._connected()
        if c is None:
            return
        self._pushes += 1
        weight = push_weight(self.stamp, self._pushes)  # column 1: this push's own weight (exact S6)
        grads = np.repeat(np.array([[-1.0, -weight]], np.float32), ids.size, 0)
        self._key = None
        try:
            fut = c.push(table, ids, grads)
        except PSError:  # an earlier push's failure, raised once by the next call: nothing was sent
            fut = c.push(table, ids, grads)
        assert self._key is not None, "the client started a push without telling its key (ports.on_push)"
        client_id, seq = self._key
        p = Push(table, ids, seq, started=self.world.now, client_id=client_id, weight=weight)
        self.ledger.sent_push(p)
        self.pending += 1
        fut.add_done_callback(lambda f: self._settled(f, p))

    def _settled(self, fut: cf.Future, p: Push) -> None:
        """A push's outcome: acknowledged (every id at once: the client answers for the whole push), or still
        in doubt in the ledger (a failed push may have applied on some slots)."""
        table, ids = p.table, p.ids
        self.pending -= 1
        error = fut.exception()
        if error is None:
            self.acked += 1
            assert self.ledger.lost_at is not None
            self.ledger.acked_part(p, ids, ids[self.ledger.lost_at[ids] < p.started])
        elif isinstance(error, TableNotFound) and table.startswith("scratch"):
            self.to_dropped_tables += 1  # its table was dropped meanwhile: the push ends there
        else:
            self.failed += 1

    def pull(self, table: str, ids: np.ndarray, read_only: bool) -> None:
        """One pull (the client re-routes it until its failover deadline); every answer is checked against the
        ledger: no row above the pushes sent."""
        c = self._connected()
        if c is None or c.shard_map is None or table not in c.shard_map.tables:
            return
        try:
            fut = c.pull_async(table, ids, insert=not read_only)
        except PSError:  # an earlier push's failure, raised once by the next call
            return
        fut.add_done_callback(lambda f: self._read(f, table, ids))

    def _read(self, fut: cf.Future, table: str, ids: np.ndarray) -> None:
        if fut.exception() is not None:
            return
        self.pulls += 1
        sent = self.ledger.sent[table]
        values = np.rint(fut.result()[:, 0]).astype(np.int64)
        inside = ids < sent.size
        over = values[inside] > sent[ids[inside]]
        if over.any() or (values[~inside] != 0).any():
            where = int(ids[inside][over][0]) if over.any() else int(ids[~inside][0])
            self.doubled.append(f"S6: a pull of {table} by {self.name} (the real client) read id {where} above "
                                "the pushes sent")

    @property
    def in_flight(self) -> int:
        return self.pending
