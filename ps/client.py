"""The client trainers use: pull rows from and push gradients to the shard servers that lead them.

A batch of ids is deduplicated, routed id -> slot -> server, sent to every primary in parallel (one RPC per
server, more only when a batch is above ``ClientConfig.chunk_bytes``) and reassembled in the order of the ids
(``datapath``). With a scheduler the client follows its shard map (``mapfollower``): a message refused with
``WrongShard``, or sent to a server that died, is routed again by the newest map, transparently, with the
same (client id, seq), which the servers apply exactly once. Pushes are asynchronous and bounded per server;
pulls honour the table's staleness bound against this client's own pushes. Every call has a deadline; every
gRPC error reaches the user as a ``tigana.ps`` exception.

Thread-safety: a ``Client`` may be shared by threads; results are delivered through
``concurrent.futures.Future`` objects completed on gRPC callback threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures as cf
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tigana.embeddings import config as cfg
from tigana.embeddings.errors import InvalidArgument as StorageInvalidArgument
from tigana.proto import shard_pb2 as pb
from tigana.ps import routing, wire
from tigana.ps.channels import Call, RetryPolicy, channel_options
from tigana.ps.config import parse_bytes
from tigana.ps.daemon import tune_allocator
from tigana.ps.datapath import Attempt, PullOp, PushOp, Route, Server, new_future
from tigana.ps.errors import InvalidArgument, PSError, TableNotFound, Unavailable, from_rpc_error
from tigana.ps.mapfollower import MapFollower
from tigana.ps.security import Security
from tigana.ps.session import client_stamp, new_client_id

log = logging.getLogger("tigana.ps.client")

MiB = 1 << 20
# describe_table sums shard stats except these (kept per shard in TableInfo.shards / taken from one shard).
_PER_SHARD_ONLY = frozenset({"checksum"})
_SAME_ON_EVERY_SHARD = frozenset({"dim", "state_width"})


@dataclass(frozen=True)
class ClientConfig:
    """Settings of a ``Client``; the defaults work for a local cluster and for training.

    timeout_s: deadline of each data-path RPC attempt (pull, push, describe...); admin_timeout_s: of
    snapshot and restore. Retries (UNAVAILABLE only, idempotent calls only): ``max_attempts`` tries with
    exponential backoff from ``initial_backoff_s`` up to ``max_backoff_s``. ``chunk_bytes``: the largest
    payload of one message; bigger batches are split (kept under the 4 MiB that many gRPC peers accept by
    default). ``max_message_bytes``: channel send/receive limit. ``max_pushes_in_flight``: push messages
    outstanding per server before ``push`` blocks (back-pressure). ``num_slots`` must match the servers'.
    ``tune_allocator``: at connect, raise glibc's mmap/trim thresholds for this process (process-wide, as
    ``tigana server`` does) so multi-MiB message buffers are reused instead of mapped and faulted in per call.
    With a scheduler: a data-path call is re-routed until ``failover_timeout_s`` passes; the map is
    long-polled ``map_poll_s`` at a time. Security: ``tls_ca`` verifies the servers (TLS), ``tls_cert``/
    ``tls_key`` is this client's certificate (mutual TLS), ``auth_token_file`` holds the token it sends
    (a trainer's, or the admin one for admin operations); a token needs TLS unless
    ``allow_insecure_loopback``. ``transport``: ``"stream"`` sends pulls and pushes as frames of one
    bidirectional stream per server (``tigana.ps.streams``; falls back to unary calls for a server without
    it), ``"unary"`` as one RPC per message.
    """

    timeout_s: float = 60.0
    admin_timeout_s: float = 600.0
    max_attempts: int = 5
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    chunk_bytes: int = 4_000_000
    max_message_bytes: int = 64 * MiB
    max_pushes_in_flight: int = 8
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    reconnect_backoff_s: float = 0.1
    num_slots: int = routing.DEFAULT_NUM_SLOTS
    tune_allocator: bool = True
    failover_timeout_s: float = 60.0
    map_poll_s: float = 10.0
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token_file: str | None = None
    allow_insecure_loopback: bool = False
    transport: str = "stream"

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidArgument:
            return InvalidArgument(f"client config: field {name!r} {why}, got {getattr(self, name)!r}")

        for name in ("timeout_s", "admin_timeout_s", "keepalive_time_s", "keepalive_timeout_s",
                     "reconnect_backoff_s", "failover_timeout_s", "map_poll_s"):
            if not getattr(self, name) > 0:
                raise bad(name, "must be > 0")
        if self.max_attempts < 1:
            raise bad("max_attempts", "must be >= 1")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise bad("initial_backoff_s", "must be in [0, max_backoff_s]")
        if self.chunk_bytes < 4096:
            raise bad("chunk_bytes", "must be >= 4096")
        if self.max_message_bytes < self.chunk_bytes + 64 * 1024:
            raise bad("max_message_bytes", "must exceed chunk_bytes by at least 64KiB")
        if self.transport not in ("stream", "unary"):
            raise bad("transport", "must be 'stream' or 'unary'")
        if self.max_pushes_in_flight < 1:
            raise bad("max_pushes_in_flight", "must be >= 1")
        if self.num_slots < 1:
            raise bad("num_slots", "must be >= 1")

    def security(self) -> Security:
        return Security.of_files(tls_cert=self.tls_cert, tls_key=self.tls_key, tls_ca=self.tls_ca,
                                 token_file=self.auth_token_file, allow_insecure=self.allow_insecure_loopback)

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy(self.max_attempts, self.initial_backoff_s, self.max_backoff_s)


@dataclass(frozen=True)
class Compression:
    """Wire codec of a table per direction: ``pull`` for the rows servers send, ``push`` for the gradients
    the client sends. One of none (fp32), fp16, bf16, int8 (row-wise scale)."""

    pull: str = "none"
    push: str = "none"

    @classmethod
    def of(cls, value: Any, *, table: str) -> Compression:
        """Accepts None, a codec name for both directions, a dict {pull:, push:}, or a Compression."""
        if value is None:
            out = cls()
        elif isinstance(value, Compression):
            out = value
        elif isinstance(value, str):
            out = cls(value, value)
        elif isinstance(value, dict):
            unknown = sorted(set(value) - {"pull", "push"})
            if unknown:
                raise InvalidArgument(f"table {table!r}: field 'compression' has unknown keys {unknown}; "
                                      "expected 'pull' and/or 'push'")
            out = cls(value.get("pull", "none"), value.get("push", "none"))
        else:
            raise InvalidArgument(f"table {table!r}: field 'compression' must be a codec name, a dict or "
                                  f"Compression, got {type(value).__name__}")
        for direction in ("pull", "push"):
            name = getattr(out, direction)
            if name not in wire.CODECS:
                raise InvalidArgument(f"table {table!r}: field 'compression.{direction}' is {name!r}; "
                                      f"expected one of {sorted(wire.CODECS)}")
        return out


@dataclass(frozen=True)
class TableInfo:
    """What ``describe_table`` returns: the table's config, its stats summed over shards (counts such as rows
    and bytes; a checksum only per shard), and every shard's own stats by address."""

    config: cfg.TableConfig
    stats: dict[str, float]
    shards: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(self.stats.get("rows", 0))


class _Table:
    """Client-side state of one table: dim, codecs, staleness bound, this client's unacknowledged pushes."""

    def __init__(self, name: str, dim: int, compression: Compression, staleness: int | None) -> None:
        self.name, self.dim = name, dim
        self.pull_codec = wire.codec_of(compression.pull)
        self.push_codec = wire.codec_of(compression.push)
        self.staleness = staleness
        self.lock = threading.Lock()
        self.step = 0  # pushes issued (each push call is one step)
        self.pending: dict[int, cf.Future] = {}  # step -> future, unacknowledged, in step order
        self.stale_last = 0
        self.stale_max = 0
        self.stale_waits = 0
        self.bytes = {"sent": {"pull": 0, "push": 0}, "received": {"pull": 0, "push": 0}}


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor, without importing torch
        t = x.detach()
        if t.is_floating_point() and str(t.dtype) not in ("torch.float32", "torch.float64", "torch.float16"):
            t = t.float()
        return t.cpu().numpy()
    return np.asarray(x)


def _as_ids(ids: Any, table: str) -> np.ndarray:
    a = _to_numpy(ids)
    if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):
        raise InvalidArgument(f"table {table!r}: field 'ids' must be an integer array, got dtype {a.dtype}")
    if a.dtype == np.uint64:
        return a.view(np.int64)  # the same 64 bits
    return a.astype(np.int64, copy=False)


def _as_grads(grads: Any, ids: np.ndarray, dim: int, table: str) -> np.ndarray:
    g = _to_numpy(grads)
    if g.dtype.kind != "f":
        raise InvalidArgument(f"table {table!r}: field 'grads' must be a float array, got dtype {g.dtype}")
    if g.shape not in (ids.shape + (dim,), (ids.size, dim)):
        raise InvalidArgument(f"table {table!r}: field 'grads' has shape {tuple(g.shape)}, expected "
                              f"{ids.shape + (dim,)} (ids shape + dim {dim})")
    return np.ascontiguousarray(g.reshape(ids.size, dim), dtype=np.float32)


def _check_finite(grads: np.ndarray, table: str) -> None:
    """Element-wise NaN/Inf check, run when the summed rows are not all finite (a NaN or Inf in the input, or
    finite values whose sum overflows: those are sent, and the server rejects the Inf sum)."""
    bad = ~np.isfinite(grads).all(axis=1)
    if bad.any():
        raise InvalidArgument(f"table {table!r}: field 'grads' has NaN or Inf in {int(bad.sum())} row(s), "
                              f"first at position {int(np.flatnonzero(bad)[0])}; nothing was pushed")


class _Countdown:
    """Calls ``fn`` once after ``n`` futures are done (in the thread that completes the last)."""

    def __init__(self, futs: Sequence[cf.Future], fn: Callable[[], None]) -> None:
        self._left = len(futs)
        self._lock = threading.Lock()
        self._fn = fn
        for f in futs:
            f.add_done_callback(self._one)

    def _one(self, _: cf.Future) -> None:
        with self._lock:
            self._left -= 1
            fire = self._left == 0
        if fire:
            self._fn()


class Client:
    """A connection to a cluster: a scheduler (``scheduler=``: its shard map routes every id, and follows
    failovers and moves) or a static list of shard servers (contiguous slot ranges, ``routing.static_assignment``).

    Use ``connect``. Also a context manager: leaving it flushes pushes and closes the channels.
    """

    def __init__(self, addresses: Sequence[str] | None = None, config: ClientConfig | None = None, *,
                 scheduler: str | None = None) -> None:
        self.config = config or ClientConfig()
        if self.config.tune_allocator:
            tune_allocator()
        self.client_id = new_client_id()  # a session: pushes are keyed (client_id, seq), see tigana.ps.session
        self.security = self.config.security()
        self._options = channel_options(self.config.max_message_bytes, self.config.keepalive_time_s,
                                        self.config.keepalive_timeout_s, self.config.reconnect_backoff_s)
        self._server_cache: dict[str, Server] = {}
        self._retry = self.config.retry
        self._seq = itertools.count(1)
        self._seq_lock = threading.Lock()
        self._tables: dict[str, _Table] = {}
        self._tables_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._counters = {"pulls": 0, "pushes": 0, "rows_pulled": 0, "rows_pushed": 0, "retries": 0,
                          "push_errors": 0, "pull_errors": 0, "pushes_under_replicated": 0}
        self._warned_under_replicated = -1e9
        self._push_errors: list[PSError] = []
        self._unraised: list[PSError] = []
        self._closed = False
        self._map: routing.ShardMap | None = None
        self._maps: MapFollower | None = None
        self._waiters: list[tuple[int, Callable[[], None]]] = []
        self._waiters_lock = threading.Lock()
        if scheduler is not None:
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
        if s is None:
            s = self._server_cache[address] = Server(address, self._options, self.config.max_pushes_in_flight,
                                                     self.security, stream=self.config.transport == "stream")
        return s

    def _on_map(self, m: routing.ShardMap) -> None:
        """A newer map: route by its primaries from now on (operations in flight keep their route)."""
        if m.num_slots != self.config.num_slots:
            log.warning("shard map has %d slots, the client expects %d", m.num_slots, self.config.num_slots)
        servers = [self._server(s.address) for s in m.servers]
        old = self._map
        self._map = m
        self._route = Route(m.epoch, servers, m.primary_of_slot())
        self._servers = [servers[i] for i, s in enumerate(m.servers) if s.up]
        if old is not None:  # calls to servers this map declared dead are routed again now
            for i, s in enumerate(m.servers):
                if not s.up and (old.index_of(s.id) < 0 or old.servers[old.index_of(s.id)].up):
                    servers[i].cancel_all()
        with self._waiters_lock:
            due = [fn for epoch, fn in self._waiters if epoch <= m.epoch]
            self._waiters = [(epoch, fn) for epoch, fn in self._waiters if epoch > m.epoch]
        for fn in due:
            _start_soon(fn)

    def _when_epoch(self, epoch: int, fn: Callable[[], None]) -> None:
        """Run ``fn`` (on another thread) once the map's epoch reaches ``epoch`` (at once if it has)."""
        with self._waiters_lock:
            if self._route.epoch < epoch:
                self._waiters.append((epoch, fn))
                if len(self._waiters) > 4096:  # each also has a backoff timer: the oldest may go
                    del self._waiters[:1024]
                return
        _start_soon(fn)

    @property
    def epoch(self) -> int:
        """The epoch of the map this client routes by (0: a static shard list)."""
        return self._route.epoch

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

    # --- tables -------------------------------------------------------------------------------------------
    def create_table(self, name: str, dim: int, optimizer: cfg.Optimizer | None = None,
                     initializer: cfg.Initializer | None = None, *, seed: int = 0, dtype: str = "float32",
                     admission: cfg.Admission | None = None, eviction: cfg.Eviction | None = None,
                     memory_budget: int | None = None, staleness: int | None = 0,
                     compression: Any = None, exist_ok: bool = True, durability: str | None = None,
                     min_copies: int = 1) -> cfg.TableConfig:
        """Create ``name`` on every shard (an identical existing table is fine when ``exist_ok``).

        ``memory_budget`` is per shard (bytes of resident rows, or a size such as ``"1GiB"``). ``staleness``:
        k = a pull waits until this client's pushes older than its last k are applied (0: read your writes;
        None: fully asynchronous).
        ``compression``: a codec name for both directions, ``{"pull": .., "push": ..}`` or ``Compression``.
        ``durability`` (with a scheduler): "sync" (the default when the cluster has replicas: a push is
        acknowledged once every in-sync copy has it) or "async" (acknowledged at once; replicas follow, the
        lag is in ``server_stats``). ``min_copies``: with sync, pushes to a slot with fewer in-sync copies
        are rejected with ``NotEnoughReplicas`` (never silently weakened). Returns the config the servers hold."""
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"create_table: field 'name' must be a non-empty string, got {name!r}")
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
            raise InvalidArgument(f"table {name!r}: field 'dim' must be an integer >= 1, got {dim!r}")
        optimizer = cfg.SGD() if optimizer is None else optimizer
        initializer = cfg.Normal() if initializer is None else initializer
        if not isinstance(optimizer, tuple(cfg.OPTIMIZERS.values())):
            raise InvalidArgument(f"table {name!r}: field 'optimizer' must be one of "
                                  f"{sorted(c.__name__ for c in cfg.OPTIMIZERS.values())}, got {optimizer!r}")
        if not isinstance(initializer, tuple(cfg.INITIALIZERS.values())):
            raise InvalidArgument(f"table {name!r}: field 'initializer' must be one of "
                                  f"{sorted(c.__name__ for c in cfg.INITIALIZERS.values())}, got {initializer!r}")
        _check_staleness(name, staleness)
        comp = Compression.of(compression, table=name)
        if durability not in (None, "sync", "async"):
            raise InvalidArgument(f"table {name!r}: field 'durability' must be 'sync' or 'async', got {durability!r}")
        if isinstance(min_copies, bool) or not isinstance(min_copies, (int, np.integer)) or min_copies < 1:
            raise InvalidArgument(f"table {name!r}: field 'min_copies' must be an integer >= 1, got {min_copies!r}")
        if memory_budget is not None:  # bytes or a size such as "8GiB"; 0 is no budget
            memory_budget = parse_bytes(memory_budget, field=f"table {name!r}: field 'memory_budget'") or None
        if not 0 <= int(seed) < 1 << 64:
            raise InvalidArgument(f"table {name!r}: field 'seed' must be in [0, 2**64), got {seed}")
        try:
            config = cfg.TableConfig(name=name, dim=int(dim), optimizer=optimizer, initializer=initializer,
                                     seed=int(seed), dtype=dtype,  # type: ignore[arg-type]
                                     admission=admission or cfg.Admission(), eviction=eviction or cfg.Eviction(),
                                     memory_budget=memory_budget)
        except StorageInvalidArgument as exc:
            raise InvalidArgument(str(exc)) from None
        spec = wire.spec_to_pb(config)
        wire.spec_from_pb(spec)  # validates kinds, dtype, policy here, naming the field
        spec.durability = {None: pb.DURABILITY_DEFAULT, "sync": pb.DURABILITY_SYNC,
                           "async": pb.DURABILITY_ASYNC}[durability]
        spec.min_copies = int(min_copies)
        request = pb.CreateTableRequest(spec=spec, exist_ok=exist_ok)
        if self._maps is not None:
            reply = self._scheduler_call("CreateTable", request)
            held = wire.spec_from_pb(reply.spec)
            self._await_table(name)
        else:
            replies = self._call_all("CreateTable", lambda _: request, retry=exist_ok)
            held = wire.spec_from_pb(replies[0].spec) if replies[0].HasField("spec") else config
        with self._tables_lock:
            self._tables[name] = _Table(name, held.dim, comp, staleness)
        return held

    def _await_table(self, name: str, timeout_s: float = 30.0) -> None:
        """Wait until every server of the map serves ``name`` (they create it when they install the map)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._call_all("DescribeTable", lambda _: pb.DescribeTableRequest(table=name), retry=True)
                return
            except (TableNotFound, Unavailable):
                if time.monotonic() >= deadline:
                    raise
                self._maps.refresh()  # type: ignore[union-attr]
                time.sleep(0.05)

    def _scheduler_call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        assert self._maps is not None
        deadline = time.monotonic() + (timeout_s or self.config.timeout_s)
        while True:
            try:
                return getattr(self._maps.stub, method)(request, timeout=max(0.5, deadline - time.monotonic()))
            except grpc.RpcError as err:
                error = from_rpc_error(err, self._maps.address)
                if not isinstance(error, Unavailable) or time.monotonic() >= deadline:
                    raise error from None
                self._maps._failover()
                self._note_retry()
                time.sleep(0.1)

    def _spec_pb(self, name: str) -> pb.TableSpec:
        """The table's spec as the servers hold it (with durability and min_copies)."""
        if self._maps is not None:
            for t in self._scheduler_call("ListTables", pb.ListTablesRequest()).tables:
                if t.name == name:
                    return t
            raise TableNotFound(f"table {name!r} not found")
        reply = self._call_all("DescribeTable", lambda _: pb.DescribeTableRequest(table=name), retry=True)[0]
        return reply.spec

    def _create_from_spec(self, spec: pb.TableSpec) -> None:
        request = pb.CreateTableRequest(spec=spec, exist_ok=False)
        if self._maps is not None:
            self._scheduler_call("CreateTable", request)
            self._await_table(spec.name)
        else:
            self._call_all("CreateTable", lambda _: request, retry=False)
        with self._tables_lock:
            self._tables.pop(spec.name, None)

    def checkpoint(self, directory: str, tables: list[str] | None = None) -> dict[str, Any]:
        """Write a consistent checkpoint of ``tables`` (default: all) into ``directory``: one cut per table on
        every primary, rows and optimizer state, with a manifest and checksums (``tigana.ps.checkpoint``).
        Flushes this client's pushes first. Returns the manifest."""
        from tigana.ps.checkpoint import write_checkpoint

        return write_checkpoint(self, directory, tables)

    def restore_checkpoint(self, directory: str, tables: list[str] | None = None) -> dict[str, int]:
        """Recreate the checkpoint's tables and load their rows and optimizer state onto the servers the
        cluster has now (any number). Returns rows restored per table."""
        from tigana.ps.checkpoint import restore_checkpoint

        return restore_checkpoint(self, directory, tables)

    def export(self, table: str, out: str, since: str | None = None) -> dict[str, Any]:
        """Write ``table``'s ids and float32 rows (no optimizer state) as ``out/ids.npy``, ``out/rows.npy`` and
        ``out/export.json``; with ``since`` (an earlier export) only the rows updated after it."""
        from tigana.ps.checkpoint import export_table

        return export_table(self, table, out, since)

    def describe_table(self, name: str) -> TableInfo:
        """The table's config and stats (summed over shards; ``shards`` per address). With replicas, ``rows``
        counts each row once (at its primary)."""
        replies = self._call_all("DescribeTable", lambda _: pb.DescribeTableRequest(table=name), retry=True)
        config = wire.spec_from_pb(replies[0].spec)
        shards = {s.address: dict(r.stats.values) for s, r in zip(self._servers, replies, strict=True)}
        total: dict[str, float] = {}
        for values in shards.values():
            for k, v in values.items():
                if k in _PER_SHARD_ONLY:
                    continue
                total[k] = v if k in _SAME_ON_EVERY_SHARD else total.get(k, 0.0) + v
        if "rows_led" in total:
            total["rows"] = total["rows_led"]
        return TableInfo(config, total, shards)

    def drop_table(self, name: str) -> bool:
        """Drop ``name`` on every shard after this client's pushes to it finish; True if any shard had it."""
        st = self._tables.get(name)
        if st is not None:
            with st.lock:
                pending = list(st.pending.values())
            cf.wait(pending)
        if self._maps is not None:
            dropped = bool(self._scheduler_call("DropTable", pb.DropTableRequest(table=name)).dropped)
        else:
            replies = self._call_all("DropTable", lambda _: pb.DropTableRequest(table=name), retry=False)
            dropped = any(r.dropped for r in replies)
        with self._tables_lock:
            self._tables.pop(name, None)
        return dropped

    def list_tables(self) -> list[str]:
        """Names of the tables on any shard, sorted."""
        if self._maps is not None:
            reply = self._scheduler_call("ListTables", pb.ListTablesRequest())
            return sorted(t.name for t in reply.tables)
        replies = self._call_all("ListTables", lambda _: pb.ListTablesRequest(), retry=True)
        return sorted({t.name for r in replies for t in r.tables})

    def set_staleness(self, table: str, staleness: int | None) -> None:
        """Change the table's staleness bound for this client (see ``create_table``)."""
        _check_staleness(table, staleness)
        self._state(table).staleness = staleness

    def set_compression(self, table: str, compression: Any) -> None:
        """Change the table's wire codecs for this client (see ``Compression.of``)."""
        comp = Compression.of(compression, table=table)
        st = self._state(table)
        st.pull_codec, st.push_codec = wire.codec_of(comp.pull), wire.codec_of(comp.push)

    # --- data path ----------------------------------------------------------------------------------------
    def pull(self, table: str, ids: Any, *, insert: bool = True) -> np.ndarray:
        """Rows of ``ids`` (int64 numpy array or torch tensor; any values, duplicates allowed) as float32
        ``ids.shape + (dim,)``, in the order of ids. Waits for this client's pushes per the staleness bound.
        ``insert=False`` (evaluation, serving): missing ids read as their initial row and nothing is
        inserted or counted toward admission."""
        return self.pull_async(table, ids, insert=insert).result()

    def pull_async(self, table: str, ids: Any, *, insert: bool = True) -> cf.Future:
        """Like ``pull`` but returns at once a future of the rows (to prefetch the next batch)."""
        self._raise_stored()
        st = self._state(table)
        ids = _as_ids(ids, table)
        fut = new_future()
        if ids.size == 0:
            fut.set_result(np.empty(ids.shape + (st.dim,), np.float32))
            return fut
        op = PullOp(self, st, fut, np.ascontiguousarray(ids.reshape(-1)), ids.shape, self._attempt(),
                    read_only=not insert)
        self._after_own_pushes(st, op.start)
        return fut

    def push(self, table: str, ids: Any, grads: Any) -> cf.Future:
        """Send gradients of ``ids`` ((n,) ints) as ``grads`` ((n, dim) float, numpy or torch; duplicates are
        summed). Returns at once a future of the rows applied; blocks only while ``max_pushes_in_flight``
        messages to a server are outstanding. Inputs are checked (dtype, shape, NaN/Inf) before anything is
        sent, so a bad batch changes nothing. A failed earlier push raises here (and at ``flush``)."""
        self._raise_stored()
        st = self._state(table)
        ids = _as_ids(ids, table).reshape(-1)
        grads = _as_grads(grads, ids, st.dim, table)
        fut = new_future()
        if ids.size == 0:
            fut.set_result(0)
            return fut
        route = self._route
        uniq, summed, starts, finite = route.group(np.ascontiguousarray(ids), grads)
        if not finite:
            _check_finite(grads, table)
        PushOp(self, st, fut, uniq, summed, starts, route, self._next_seq(), self._attempt()).start()
        return fut

    def flush(self) -> None:
        """Wait for every push in flight; raise the first push error not raised yet."""
        with self._tables_lock:
            tables = list(self._tables.values())
        pending: list[cf.Future] = []
        for st in tables:
            with st.lock:
                pending.extend(st.pending.values())
        cf.wait(pending)
        with self._stats_lock:
            errors, self._push_errors = self._push_errors, []
            self._unraised = []
        if errors:
            raise errors[0]

    def _raise_stored(self) -> None:
        """Raise (once) a push error that arrived since the last call, instead of only at ``flush``."""
        if not self._unraised:
            return
        with self._stats_lock:
            errors, self._unraised = self._unraised, []
            self._push_errors = [e for e in self._push_errors if e not in errors]
        if errors:
            raise errors[0]

    def _push_failed(self, error: PSError) -> None:
        with self._stats_lock:
            self._counters["push_errors"] += 1
            self._push_errors.append(error)
            self._unraised.append(error)

    def _attempt(self) -> Attempt:
        limit = self.config.failover_timeout_s if self._maps is not None else self.config.timeout_s * \
            self.config.max_attempts
        return Attempt(1, time.monotonic() + limit)

    # --- operations ---------------------------------------------------------------------------------------
    def snapshot(self, incremental: bool = False) -> dict[str, list[str]]:
        """Flush, then have every shard write a (full or incremental) snapshot; paths per address."""
        self.flush()
        replies = self._call_all("Snapshot", lambda _: pb.SnapshotRequest(incremental=incremental),
                                 retry=False, timeout_s=self.config.admin_timeout_s)
        return {s.address: list(r.paths) for s, r in zip(self._servers, replies, strict=True)}

    def restore(self, path: str | Mapping[str, Sequence[str]] = "") -> dict[str, int]:
        """Every shard restores ``path`` (empty: its newest snapshot); rows restored per address.

        ``path`` may also be what ``snapshot`` returned ({address: [table snapshot paths]}): each shard then
        restores exactly its own listed snapshots (one Restore per path), e.g. to resume a checkpoint."""
        if self._maps is not None:
            raise InvalidArgument("restore: a cluster with a scheduler keeps its copies by replication; restore "
                                  "a cluster checkpoint through `tigana admin restore`")
        if not isinstance(path, str):
            return self._restore_each(path)
        replies = self._call_all("Restore", lambda _: pb.RestoreRequest(path=path), retry=False,
                                 timeout_s=self.config.admin_timeout_s)
        return {s.address: int(r.rows) for s, r in zip(self._servers, replies, strict=True)}

    def _restore_each(self, paths: Mapping[str, Sequence[str]]) -> dict[str, int]:
        by_address = {str(a): [str(p) for p in ps] for a, ps in paths.items()}
        unknown = sorted(set(by_address) - set(self.addresses))
        if unknown:
            raise InvalidArgument(f"restore: field 'path' names shard(s) {unknown} this client does not have")
        rows = {s.address: 0 for s in self._servers}
        for s in self._servers:
            for p in by_address.get(s.address, []):
                fut = new_future()
                Call(s.stub.Restore, pb.RestoreRequest(path=p), s.address, self.config.admin_timeout_s, None,
                     _settle_into(fut), self._note_retry).start()
                rows[s.address] += int(fut.result().rows)
        return rows

    def server_stats(self, table: str = "") -> dict[str, dict[str, dict[str, float]]]:
        """Per address, per table, the server's counters (rows, bytes, requests, replication lag...)."""
        replies = self._call_all("Stats", lambda _: pb.StatsRequest(table=table), retry=True)
        return {s.address: {t.table: dict(t.values) for t in r.tables} for s, r in zip(self._servers, replies, strict=True)}

    def stats(self) -> dict[str, Any]:
        """This client's counters: pulls, pushes, rows, retries, errors, pushes in flight, the map epoch and
        refreshes, and per table the bytes sent/received by direction and the staleness observed
        (unacknowledged own pushes when a pull was sent: last and max) with the bound, the table's step
        (pushes issued) and how many pulls waited."""
        with self._stats_lock:
            out: dict[str, Any] = dict(self._counters)
        out["client_id"] = self.client_id
        out["epoch"] = self.epoch
        out["map_refreshes"] = self._maps.refreshes if self._maps is not None else 0
        with self._tables_lock:
            tables = list(self._tables.values())
        out["bytes_sent"], out["bytes_received"], out["staleness"] = {}, {}, {}
        in_flight = 0
        for st in tables:
            with st.lock:
                out["bytes_sent"][st.name] = dict(st.bytes["sent"])
                out["bytes_received"][st.name] = dict(st.bytes["received"])
                out["staleness"][st.name] = {"bound": st.staleness, "step": st.step, "last": st.stale_last,
                                             "max": st.stale_max, "waits": st.stale_waits}
                in_flight += len(st.pending)
        out["pushes_in_flight"] = in_flight
        return out

    # --- internals ----------------------------------------------------------------------------------------
    def _state(self, table: str) -> _Table:
        st = self._tables.get(table)
        if st is not None:
            return st
        if not isinstance(table, str) or not table:
            raise InvalidArgument(f"field 'table' must be a non-empty string, got {table!r}")
        info = self.describe_table(table)  # TableNotFound names the table
        with self._tables_lock:
            return self._tables.setdefault(table, _Table(table, info.config.dim, Compression(), 0))

    def _next_seq(self) -> int:
        with self._seq_lock:
            return next(self._seq)

    def _new_session(self, refused_id: str, horizon: int) -> str:
        """The client id to send under after ``refused_id`` was refused as unknown (``UnknownClient``) at a
        window whose horizon is ``horizon``: a new session stamped above it, made once however many parts
        were refused (pushes already in flight keep their own ids)."""
        with self._seq_lock:
            if self.client_id == refused_id or client_stamp(self.client_id) <= horizon:
                self.client_id = new_client_id(above=max(horizon, client_stamp(self.client_id)))
            return self.client_id

    def _after_own_pushes(self, st: _Table, fn: Callable[[], None]) -> None:
        """Run ``fn`` once this client's pushes to ``st`` from more than ``staleness`` steps back are done."""
        k = st.staleness
        if k is None:
            fn()
            return
        with st.lock:
            threshold = st.step - k
            waits = [f for s, f in st.pending.items() if s <= threshold]
            if waits:
                st.stale_waits += 1
        if waits:
            _Countdown(waits, fn)
        else:
            fn()

    def _under_replicated(self, table: str) -> None:
        """A sync push was acknowledged with fewer in-sync copies than the cluster keeps: counted in
        ``stats()["pushes_under_replicated"]`` and logged at most once a minute (never silent)."""
        now = time.monotonic()
        with self._stats_lock:
            self._counters["pushes_under_replicated"] += 1
            warn = now - self._warned_under_replicated > 60.0
            if warn:
                self._warned_under_replicated = now
        if warn:
            log.warning("table %r: a sync push was acknowledged while a slot of it had fewer in-sync copies than the "
                        "cluster keeps (a copy is being built, or too few servers are up): losing its primary now "
                        "may lose it. create_table(min_copies=2) refuses such pushes instead.", table)

    def _note_retry(self) -> None:
        with self._stats_lock:
            self._counters["retries"] += 1

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._counters[k] += v

    def _call_all(self, method: str, request_for: Callable[[Server], Any], *, retry: bool,
                  timeout_s: float | None = None) -> list[Any]:
        """The same RPC on every server in parallel; replies in server order; the first error raised."""
        futs = []
        for s in self._servers:
            fut = new_future()
            futs.append(fut)
            Call(getattr(s.stub, method), request_for(s), s.address, timeout_s or self.config.timeout_s,
                 self._retry if retry else None, _settle_into(fut), self._note_retry).start()
        cf.wait(futs)
        for f in futs:
            if f.exception() is not None:
                raise f.exception()
        return [f.result() for f in futs]


def _start_soon(fn: Callable[[], None]) -> None:
    t = threading.Timer(0.0, fn)
    t.daemon = True
    t.start()


def _check_staleness(table: str, staleness: Any) -> None:
    if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, (int, np.integer))
                                  or staleness < 0):
        raise InvalidArgument(f"table {table!r}: field 'staleness' must be None or an integer >= 0, "
                              f"got {staleness!r}")


def _settle_into(fut: cf.Future) -> Callable[[Any, PSError | None], None]:
    def done(response: Any, error: PSError | None) -> None:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(response)
    return done


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
    if addrs and any(_is_scheduler(a, min(base.timeout_s, 5.0), base.security()) for a in addrs[:3]):
        return Client(config=base, scheduler=",".join(addrs))  # schedulers: a leader and its standbys
    return Client(addrs, base)


def _is_scheduler(address: str, timeout_s: float, security: Security) -> bool:
    """Whether ``address`` serves the scheduler: its health service knows the Scheduler service (SERVING on
    the leader, NOT_SERVING on a standby; a shard server answers NOT_FOUND)."""
    channel = security.channel(address)
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="tigana.v1.Scheduler"),
                                                  timeout=timeout_s)
        return True
    except grpc.RpcError:
        return False
    finally:
        channel.close()
