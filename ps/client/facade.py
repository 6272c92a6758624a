"""The ``Client`` facade and ``connect``: a connection to a cluster, how it routes, and its lifecycle.

``connect`` picks how to route: by a scheduler's shard map (``scheduler=``, or a single address that answers
as a scheduler), followed by a ``MapFollower``, or by a static shard list (contiguous slot ranges). Each map
becomes a ``Route`` (``routes``) that new operations take; operations in flight keep theirs, except that
their parts sent to a server the new map no longer names as primary of their slots are given up and routed
again at once (``sentparts``), and calls to servers a new map declares dead are cancelled. Its I/O (transports,
the map source, timers, the clock, session ids) goes through ``ports.ClientPorts``: gRPC and threads by
default, the world's network and events in the simulator (``tigana.tools.testing.sim.realclient``).

Thread-safety: a ``Client`` may be shared by threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc

from tigana.ps import routing
from tigana.ps.allocator import tune_allocator
from tigana.ps.channels import channel_options
from tigana.ps.client.config import ClientConfig
from tigana.ps.client.datapath import DataPath
from tigana.ps.client.mapfollower import MapFollower
from tigana.ps.client.operations import Operations
from tigana.ps.client.ports import ClientPorts
from tigana.ps.client.routes import Route, Server
from tigana.ps.client.sentparts import SentParts
from tigana.ps.client.tables import Tables
from tigana.ps.client.tablestate import TableState
from tigana.ps.errors import InvalidArgument, PSError, Unavailable
from tigana.ps.health import check_health
from tigana.ps.security import Security

log = logging.getLogger("tigana.ps.client")


class Client(DataPath, Tables, Operations):
    """A connection to a cluster: a scheduler (``scheduler=``: its shard map routes every id, and follows
    failovers and moves) or a static list of shard servers (contiguous slot ranges, ``routing.static_assignment``).

    Use ``connect``. Also a context manager: leaving it flushes pushes and closes the channels. One class,
    assembled from one room per concept: this module (connection, routing, lifecycle), ``datapath`` (pull,
    push, flush), ``tables`` (create, describe, drop, list, per-table settings, checkpoints) and
    ``operations`` (snapshots, restores, counters), over the fields declared in ``_fields``.
    """

    def __init__(self, addresses: Sequence[str] | None = None, config: ClientConfig | None = None, *,
                 scheduler: str | None = None, ports: ClientPorts | None = None) -> None:
        self.config = config or ClientConfig()
        self._ports = ports or ClientPorts()  # the I/O: gRPC, threads and time.monotonic unless given others
        if self.config.tune_allocator:
            tune_allocator()
        self.client_id = self._ports.new_session(-1)  # a session: pushes are keyed (client_id, seq), see tigana.ps.session
        self.security = self.config.security()
        self._options = channel_options(self.config.max_message_bytes, self.config.keepalive_time_s,
                                        self.config.keepalive_timeout_s, self.config.reconnect_backoff_s)
        self._server_cache: dict[str, Server] = {}
        self._retry = self.config.retry
        self._seq = itertools.count(1)
        self._seq_lock = threading.Lock()
        self._tables: dict[str, TableState] = {}
        self._tables_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._counters = {"pulls": 0, "pushes": 0, "rows_pulled": 0, "rows_pushed": 0, "retries": 0,
                          "push_errors": 0, "pull_errors": 0, "pushes_under_replicated": 0,
                          "parts_rerouted_by_map": 0}
        self._warned_under_replicated = -1e9
        self._push_errors: list[PSError] = []
        self._unraised: list[PSError] = []
        self._closed = False
        self._map: routing.ShardMap | None = None
        self._dropped: set[str] = set()  # tables a map this client installed dropped (until one creates them)
        self._maps: MapFollower | None = None
        self._waiters: list[tuple[int, Callable[[], None]]] = []
        self._waiters_lock = threading.Lock()
        self._hold = threading.local()
        self._parts = SentParts(lambda: self._route, lambda n: self._count(parts_rerouted_by_map=n))
        if scheduler is not None:
            if self._ports.map_source is not None:
                self._maps = self._ports.map_source(scheduler, self._on_map)
            else:
                self._maps = MapFollower(scheduler, self._on_map, self._options, self.config.map_poll_s,
                                         channel=self.security.channel)
            try:
                self._maps.fetch(self.config.timeout_s)
            except BaseException:
                self._maps.close()
                raise
            self._maps.start()
        else:
            if isinstance(addresses, str):
                addresses = [a for a in addresses.split(",") if a.strip()]
            addresses = [a.strip() for a in addresses or []]
            if not addresses:
                raise InvalidArgument("connect: field 'addresses' is empty; expected host:port of every shard "
                                      "or scheduler=host:port")
            servers = [self._server(a) for a in addresses]
            self._route = Route(0, servers, routing.static_assignment(len(addresses), self.config.num_slots))
            self._servers = servers

    # --- routing ------------------------------------------------------------------------------------------
    def _server(self, address: str) -> Server:
        s = self._server_cache.get(address)
        if s is None and self._ports.transport is not None:
            s = self._server_cache[address] = self._ports.transport(address)  # type: ignore[assignment]
        elif s is None:
            s = self._server_cache[address] = Server(address, self._options, self.config.max_pushes_in_flight,
                                                     self.security, stream=self.config.transport == "stream")
        return s

    def _on_map(self, m: routing.ShardMap) -> None:
        """A newer map: route by its primaries from now on (operations in flight keep their route; their parts
        whose slots the map moved are routed again by it)."""
        if m.num_slots != self.config.num_slots:
            log.warning("shard map has %d slots, the client expects %d", m.num_slots, self.config.num_slots)
        servers = [self._server(s.address) for s in m.servers]
        old = self._map
        if old is not None:
            self._dropped = (self._dropped | (set(old.tables) - set(m.tables))) - set(m.tables)
        self._map = m
        self._route = route = Route(m.epoch, servers, m.primary_of_slot())
        self._servers = [servers[i] for i, s in enumerate(m.servers) if s.up]
        if old is not None:
            dead = [servers[i] for i, s in enumerate(m.servers)
                    if not s.up and (old.index_of(s.id) < 0 or old.servers[old.index_of(s.id)].up)]

            def reroute() -> None:  # parts sent to a server that no longer leads their slots go again now, then
                self._parts.on_route(route)  # the calls still open to servers this map declared dead are cancelled
                for server in dead:
                    server.cancel_all()
            self._ports.call_later(0.0, reroute)  # another thread: a re-route asks the map follower, whose lock this runs under
        with self._waiters_lock:
            due = [fn for epoch, fn in self._waiters if epoch <= m.epoch]
            self._waiters = [(epoch, fn) for epoch, fn in self._waiters if epoch > m.epoch]
        for fn in due:
            self._ports.call_later(0.0, fn)

    def _when_epoch(self, epoch: int, fn: Callable[[], None]) -> None:
        """Run ``fn`` (on another thread) once the map's epoch reaches ``epoch`` (at once if it has)."""
        with self._waiters_lock:
            if self._route.epoch < epoch:
                self._waiters.append((epoch, fn))
                if len(self._waiters) > 4096:  # each also has a backoff timer: the oldest may go
                    del self._waiters[:1024]
                return
        self._ports.call_later(0.0, fn)

    @property
    def epoch(self) -> int:
        """The epoch of the map this client routes by (0: a static shard list)."""
        return self._route.epoch

    @property
    def parts_stranded(self) -> int:
        """Parts in flight still waiting on a server the map this client routes by no longer names as the primary
        of every slot they carry (0 once the map's re-route has run: docs/replication.md L7)."""
        return self._parts.stranded(self._route)

    @property
    def shard_map(self) -> routing.ShardMap | None:
        """The scheduler's map as this client last saw it (None for a static shard list)."""
        return self._map

    @property
    def scheduler(self) -> str | None:
        return ",".join(self._maps.addresses) if self._maps is not None else None

    # --- lifecycle ----------------------------------------------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        """The shard servers: the static list, or the servers up in the current map."""
        return [s.address for s in self._servers]

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until every slot has a primary (with a scheduler) and every server's channel is connected;
        ``Unavailable`` naming the first that is not."""
        deadline = time.monotonic() + timeout_s
        if self._maps is not None:
            while self._map is None or (self._map.primary_of_slot() < 0).any():
                if time.monotonic() >= deadline:
                    raise Unavailable(f"scheduler {self.scheduler}: slots without a primary after {timeout_s}s")
                self._maps.refresh()
                time.sleep(0.05)
        for s in self._servers:
            try:
                grpc.channel_ready_future(s.channel).result(timeout=max(0.01, deadline - time.monotonic()))
            except grpc.FutureTimeoutError:
                raise Unavailable(f"{s.address}: not reachable within {timeout_s}s") from None

    def close(self) -> None:
        """Wait for pushes in flight (raising the first push error), then close every channel. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            if self._maps is not None:
                self._maps.close()
            for s in self._server_cache.values():
                s.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            with contextlib.suppress(PSError):  # the exception already propagating matters more
                self.close()


def connect(addresses: str | Iterable[str] | None = None, config: ClientConfig | None = None, *,
            scheduler: str | None = None, **overrides: Any) -> Client:
    """A ``Client`` for a cluster.

    ``scheduler="host:port"`` (or a comma-separated list of schedulers) routes by the scheduler's shard map.
    ``addresses`` is a static shard list (``["host:port", ...]`` or ``"host:port,host:port"``); a single
    address is asked whether it is a scheduler, and used as one if it is.
    ``overrides`` replace ``ClientConfig`` fields, e.g. ``connect(addrs, timeout_s=5, max_attempts=2)``."""
    base = config or ClientConfig()
    if overrides:
        unknown = sorted(set(overrides) - set(ClientConfig.__dataclass_fields__))
        if unknown:
            raise InvalidArgument(f"connect: unknown config field(s) {unknown}")
        base = dataclasses.replace(base, **overrides)
    if scheduler is not None:
        if addresses is not None:
            raise InvalidArgument("connect: give either shard 'addresses' or a 'scheduler', not both")
        return Client(config=base, scheduler=scheduler)
    if addresses is None:
        raise InvalidArgument("connect: expected shard addresses or scheduler=host:port")
    addrs = [addresses] if isinstance(addresses, str) else list(addresses)
    if len(addrs) == 1 and "," in addrs[0]:
        addrs = addrs[0].split(",")
    addrs = [a.strip() for a in addrs if a.strip()]
    # One address (the README's ``connect("host:port")``) may be a scheduler started a moment ago: its port is
    # waited for, up to the deadline (used by nothing else: it serves as nothing until it answers); in a list,
    # an address that does not answer within 5 s is taken for a shard server.
    wait = len(addrs) == 1
    ask_s = base.timeout_s if wait else min(base.timeout_s, 5.0)
    if addrs and any(_is_scheduler(a, ask_s, base.security(), wait) for a in addrs[:3]):
        return Client(config=base, scheduler=",".join(addrs))  # schedulers: a leader and its standbys
    return Client(addrs, base)


def _is_scheduler(address: str, timeout_s: float, security: Security, wait_for_ready: bool = False) -> bool:
    """Whether ``address`` serves the scheduler: its health service knows the Scheduler service (SERVING on
    the leader, NOT_SERVING on a standby; a shard server answers NOT_FOUND). ``wait_for_ready``: a port not
    open yet is waited for up to ``timeout_s``."""
    return check_health(address, "tigana.v1.Scheduler", timeout_s=timeout_s, security=security,
                        wait_for_ready=wait_for_ready).answered
