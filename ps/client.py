"""The client trainers use: pull rows from and push gradients to the shard servers that own them.

A batch of ids is deduplicated, routed id -> slot -> server, sent to every owner in parallel (one RPC per
server, more only when a batch is above ``ClientConfig.chunk_bytes``) and reassembled in the order of the ids.
Pushes are asynchronous and bounded per server; pulls honour the table's staleness bound against this
client's own pushes. Every call has a deadline; idempotent calls are retried on UNAVAILABLE only; every
gRPC error reaches the user as a ``tigana.ps`` exception.

Thread-safety: a ``Client`` may be shared by threads; results are delivered through
``concurrent.futures.Future`` objects completed on gRPC callback threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures as cf
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from tigana.embeddings import config as cfg
from tigana.embeddings.errors import InvalidArgument as StorageInvalidArgument
from tigana.proto import shard_pb2 as pb
from tigana.proto import shard_pb2_grpc as pb_grpc
from tigana.ps import _kernels, routing, wire
from tigana.ps.channels import Call, RetryPolicy, channel_options
from tigana.ps.config import parse_bytes
from tigana.ps.daemon import tune_allocator
from tigana.ps.errors import Internal, InvalidArgument, PSError, Unavailable

MiB = 1 << 20
_PULL = "/tigana.v1.Shard/Pull"
_PUSH = "/tigana.v1.Shard/Push"
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

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidArgument:
            return InvalidArgument(f"client config: field {name!r} {why}, got {getattr(self, name)!r}")

        for name in ("timeout_s", "admin_timeout_s", "keepalive_time_s", "keepalive_timeout_s",
                     "reconnect_backoff_s"):
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
        if self.max_pushes_in_flight < 1:
            raise bad("max_pushes_in_flight", "must be >= 1")
        if self.num_slots < 1:
            raise bad("num_slots", "must be >= 1")

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


class _Server:
    __slots__ = ("address", "channel", "stub", "pull", "push", "slots")

    def __init__(self, address: str, options: list, max_pushes_in_flight: int) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=options)
        self.stub = pb_grpc.ShardStub(self.channel)
        self.pull = self.channel.unary_unary(_PULL, request_serializer=wire.identity,
                                             response_deserializer=wire.decode_pull_response)
        self.push = self.channel.unary_unary(_PUSH, request_serializer=wire.identity,
                                             response_deserializer=pb.PushResponse.FromString)
        self.slots = threading.BoundedSemaphore(max_pushes_in_flight)


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


def _new_future() -> cf.Future:
    fut: cf.Future = cf.Future()
    fut.set_running_or_notify_cancel()  # results come from the wire; cancel() cannot stop a sent push
    return fut


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


class _Fanout:
    """Counts the parts of one pull or push in flight and keeps the first error."""

    def __init__(self, parts: int) -> None:
        self.left = parts
        self.error: PSError | None = None
        self.lock = threading.Lock()

    def part_done(self, error: PSError | None) -> bool:
        """Record one part; True when this was the last part and every part succeeded."""
        with self.lock:
            self.left -= 1
            if error is not None and self.error is None:
                self.error = error
                first_error = True
            else:
                first_error = False
            last = self.left == 0
        if first_error:
            return False
        return last and self.error is None


class Client:
    """A connection to a static list of shard servers (slot ranges by ``routing.static_assignment``).

    Use ``connect``. Also a context manager: leaving it flushes pushes and closes the channels.
    """

    def __init__(self, addresses: Sequence[str], config: ClientConfig | None = None) -> None:
        if isinstance(addresses, str):
            addresses = [a for a in addresses.split(",") if a.strip()]
        addresses = [a.strip() for a in addresses]
        if not addresses:
            raise InvalidArgument("connect: field 'addresses' is empty; expected host:port of every shard")
        self.config = config or ClientConfig()
        if self.config.tune_allocator:
            tune_allocator()
        self.client_id = uuid.uuid4().hex
        options = channel_options(self.config.max_message_bytes, self.config.keepalive_time_s,
                                  self.config.keepalive_timeout_s, self.config.reconnect_backoff_s)
        self._servers = [_Server(a, options, self.config.max_pushes_in_flight) for a in addresses]
        self._owner_of_slot = routing.static_assignment(len(addresses), self.config.num_slots)
        self._retry = self.config.retry
        self._seq = itertools.count(1)
        self._seq_lock = threading.Lock()
        self._tables: dict[str, _Table] = {}
        self._tables_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._counters = {"pulls": 0, "pushes": 0, "rows_pulled": 0, "rows_pushed": 0, "retries": 0,
                          "push_errors": 0, "pull_errors": 0}
        self._push_errors: list[PSError] = []
        self._closed = False

    # --- lifecycle ----------------------------------------------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self._servers]

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until every server's channel is connected; ``Unavailable`` naming the first that is not."""
        for s in self._servers:
            try:
                grpc.channel_ready_future(s.channel).result(timeout=timeout_s)
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
            for s in self._servers:
                s.channel.close()

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
                     compression: Any = None, exist_ok: bool = True) -> cfg.TableConfig:
        """Create ``name`` on every shard (an identical existing table is fine when ``exist_ok``).

        ``memory_budget`` is per shard (bytes of resident rows, or a size such as ``"1GiB"``). ``staleness``:
        k = a pull waits until this client's pushes older than its last k are applied (0: read your writes;
        None: fully asynchronous).
        ``compression``: a codec name for both directions, ``{"pull": .., "push": ..}`` or ``Compression``.
        Returns the config the servers hold."""
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
        request = pb.CreateTableRequest(spec=spec, exist_ok=exist_ok)
        replies = self._call_all("CreateTable", lambda _: request, retry=exist_ok)
        held = wire.spec_from_pb(replies[0].spec) if replies[0].HasField("spec") else config
        with self._tables_lock:
            self._tables[name] = _Table(name, held.dim, comp, staleness)
        return held

    def describe_table(self, name: str) -> TableInfo:
        """The table's config and stats (summed over shards; ``shards`` per address)."""
        replies = self._call_all("DescribeTable", lambda _: pb.DescribeTableRequest(table=name), retry=True)
        config = wire.spec_from_pb(replies[0].spec)
        shards = {s.address: dict(r.stats.values) for s, r in zip(self._servers, replies, strict=True)}
        total: dict[str, float] = {}
        for values in shards.values():
            for k, v in values.items():
                if k in _PER_SHARD_ONLY:
                    continue
                total[k] = v if k in _SAME_ON_EVERY_SHARD else total.get(k, 0.0) + v
        return TableInfo(config, total, shards)

    def drop_table(self, name: str) -> bool:
        """Drop ``name`` on every shard after this client's pushes to it finish; True if any shard had it."""
        st = self._tables.get(name)
        if st is not None:
            with st.lock:
                pending = list(st.pending.values())
            cf.wait(pending)
        replies = self._call_all("DropTable", lambda _: pb.DropTableRequest(table=name), retry=False)
        with self._tables_lock:
            self._tables.pop(name, None)
        return any(r.dropped for r in replies)

    def list_tables(self) -> list[str]:
        """Names of the tables on any shard, sorted."""
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
    def pull(self, table: str, ids: Any) -> np.ndarray:
        """Rows of ``ids`` (int64 numpy array or torch tensor; any values, duplicates allowed) as float32
        ``ids.shape + (dim,)``, in the order of ids. Waits for this client's pushes per the staleness bound."""
        return self.pull_async(table, ids).result()

    def pull_async(self, table: str, ids: Any) -> cf.Future:
        """Like ``pull`` but returns at once a future of the rows (to prefetch the next batch)."""
        st = self._state(table)
        ids = _as_ids(ids, table)
        fut = _new_future()
        if ids.size == 0:
            fut.set_result(np.empty(ids.shape + (st.dim,), np.float32))
            return fut
        uniq, starts, src = self._group(np.ascontiguousarray(ids.reshape(-1)))
        op = _PullOp(self, st, fut, uniq, starts, src, ids.shape)
        self._after_own_pushes(st, op.start)
        return fut

    def push(self, table: str, ids: Any, grads: Any) -> cf.Future:
        """Send gradients of ``ids`` ((n,) ints) as ``grads`` ((n, dim) float, numpy or torch; duplicates are
        summed). Returns at once a future of the rows applied; blocks only while ``max_pushes_in_flight``
        messages to a server are outstanding. Inputs are checked (dtype, shape, NaN/Inf) before anything is
        sent, so a bad batch changes nothing."""
        st = self._state(table)
        ids = _as_ids(ids, table).reshape(-1)
        grads = _as_grads(grads, ids, st.dim, table)
        fut = _new_future()
        if ids.size == 0:
            fut.set_result(0)
            return fut
        uniq, summed, starts, finite = self._group(np.ascontiguousarray(ids), grads)
        if not finite:
            _check_finite(grads, table)
        _PushOp(self, st, fut, uniq, summed, starts).start()
        return fut

    def flush(self) -> None:
        """Wait for every push in flight; raise the first push error since the last flush."""
        with self._tables_lock:
            tables = list(self._tables.values())
        pending: list[cf.Future] = []
        for st in tables:
            with st.lock:
                pending.extend(st.pending.values())
        cf.wait(pending)
        with self._stats_lock:
            errors, self._push_errors = self._push_errors, []
        if errors:
            raise errors[0]

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
                fut = _new_future()
                Call(s.stub.Restore, pb.RestoreRequest(path=p), s.address, self.config.admin_timeout_s, None,
                     _settle_into(fut), self._note_retry).start()
                rows[s.address] += int(fut.result().rows)
        return rows

    def server_stats(self, table: str = "") -> dict[str, dict[str, dict[str, float]]]:
        """Per address, per table, the server's counters (rows, bytes, requests...)."""
        replies = self._call_all("Stats", lambda _: pb.StatsRequest(table=table), retry=True)
        return {s.address: {t.table: dict(t.values) for t in r.tables} for s, r in zip(self._servers, replies, strict=True)}

    def stats(self) -> dict[str, Any]:
        """This client's counters: pulls, pushes, rows, retries, errors, pushes in flight, and per table the
        bytes sent/received by direction and the staleness observed (unacknowledged own pushes when a pull
        was sent: last and max) with the bound, the table's step (pushes issued) and how many pulls waited."""
        with self._stats_lock:
            out: dict[str, Any] = dict(self._counters)
        out["client_id"] = self.client_id
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

    def _group(self, ids: np.ndarray, grads: np.ndarray | None = None) -> tuple:
        """One pass over a batch: its unique ids grouped by owning server (``starts`` bounds each server's
        contiguous range) with ``src`` (ids == uniq[src]) for a pull, or their summed ``grads`` for a push."""
        owner, n = self._owner_of_slot, len(self._servers)
        if grads is None:
            return _kernels.dedup_grouped(ids, owner, n)
        return _kernels.dedup_sum_grouped(ids, grads, owner, n)

    def _parts(self, starts: np.ndarray, row_bytes: int) -> list[tuple[_Server, int, int]]:
        """(server, lo, hi) of every message: each server's range of the grouped batch, in chunks of at most
        ``chunk_bytes`` of ids and rows."""
        per = max(1, self.config.chunk_bytes // (8 + row_bytes))
        return [(s, lo, min(lo + per, int(starts[i + 1])))
                for i, s in enumerate(self._servers) for lo in range(int(starts[i]), int(starts[i + 1]), per)]

    def _after_own_pushes(self, st: _Table, fn: Callable[[], None]) -> None:
        """Run ``fn`` once this client's pushes to ``st`` from more than ``staleness`` steps back are acked."""
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

    def _note_retry(self) -> None:
        with self._stats_lock:
            self._counters["retries"] += 1

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._counters[k] += v

    def _call_all(self, method: str, request_for: Callable[[_Server], Any], *, retry: bool,
                  timeout_s: float | None = None) -> list[Any]:
        """The same RPC on every server in parallel; replies in server order; the first error raised."""
        futs = []
        for s in self._servers:
            fut = _new_future()
            futs.append(fut)
            Call(getattr(s.stub, method), request_for(s), s.address, timeout_s or self.config.timeout_s,
                 self._retry if retry else None, _settle_into(fut), self._note_retry).start()
        cf.wait(futs)
        for f in futs:
            if f.exception() is not None:
                raise f.exception()
        return [f.result() for f in futs]


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


class _PullOp:
    """One pull in flight: the unique ids grouped by owner and split in chunks, one message each; the replies
    are kept as decoded blocks (fp32: views of the received bytes) and the last one to arrive gathers the
    batch's rows from them by ``src`` in one pass."""

    def __init__(self, client: Client, st: _Table, fut: cf.Future, uniq: np.ndarray, starts: np.ndarray,
                 src: np.ndarray, shape: tuple[int, ...]) -> None:
        self.client, self.st, self.fut, self.uniq, self.starts = client, st, fut, uniq, starts
        self.src, self.shape = src, shape
        self.codec = st.pull_codec
        self.dim = st.dim
        self.blocks: list[np.ndarray | None] = []
        self.fanout: _Fanout | None = None

    def start(self) -> None:
        try:
            self._start()
        except Exception as exc:  # noqa: BLE001 - may run on a callback thread; the future carries it
            if not self.fut.done():
                self.fut.set_exception(exc)

    def _start(self) -> None:
        c, st = self.client, self.st
        parts = c._parts(self.starts, wire.rows_nbytes(1, self.dim, self.codec))
        self.fanout = _Fanout(len(parts))
        self.blocks = [None] * len(parts)
        with st.lock:
            st.stale_last = len(st.pending)
            st.stale_max = max(st.stale_max, st.stale_last)
        sent = 0
        calls = []
        for k, (s, lo, hi) in enumerate(parts):
            request = wire.encode_pull_request(st.name, self.uniq[lo:hi], self.codec)
            sent += len(request)
            calls.append(Call(s.pull, request, s.address, c.config.timeout_s, c._retry,
                              self._done_for(k, hi - lo), c._note_retry))
        with st.lock:
            st.bytes["sent"]["pull"] += sent
        for call in calls:
            call.start()

    def _gather(self) -> np.ndarray:
        """The batch's rows, (n, dim) float32, from the unique rows in ``blocks`` (consecutive ranges)."""
        blocks = self.blocks
        out = np.empty((self.src.size, self.dim), np.float32)
        words = _kernels.row_words
        if len(blocks) == 2:
            _kernels.gather_rows2(words(blocks[0]), words(blocks[1]), self.src, words(out))
        else:
            rows = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
            _kernels.gather_rows(words(rows), self.src, words(out))
        return out

    def _done_for(self, k: int, n: int) -> Callable[[Any, PSError | None], None]:
        def done(response: wire.RawRows | None, error: PSError | None) -> None:
            if error is None:
                try:
                    with self.st.lock:
                        self.st.bytes["received"]["pull"] += response.nbytes
                    self.blocks[k] = wire.decode_block(response, n, self.dim, table=self.st.name,
                                                       field="PullResponse.rows")
                except PSError as exc:
                    error = exc
                except Exception as exc:  # noqa: BLE001
                    error = InvalidArgument(f"table {self.st.name!r}: bad pull reply: {exc}")
            assert self.fanout is not None
            if self.fanout.part_done(error):
                self.client._count(pulls=1, rows_pulled=int(self.src.size))
                try:
                    rows = self._gather()
                except Exception as exc:  # noqa: BLE001 - a callback thread must never raise
                    self.fut.set_exception(Internal(f"table {self.st.name!r}: pull reassembly: {exc}"))
                    return
                finally:
                    self.blocks = []  # free the replies
                self.fut.set_result(rows.reshape(self.shape + (self.dim,)))
            elif error is not None and self.fanout.error is error:
                self.client._count(pull_errors=1)
                self.fut.set_exception(error)
        return done


class _PushOp:
    """One push in flight: its step in the table's pending set, one message per (owner, chunk) under the
    owner's in-flight semaphore, all with this push's (client_id, seq) and their own part index."""

    def __init__(self, client: Client, st: _Table, fut: cf.Future, uniq: np.ndarray, summed: np.ndarray,
                 starts: np.ndarray) -> None:
        self.client, self.st, self.fut, self.uniq, self.summed, self.starts = client, st, fut, uniq, summed, starts
        self.applied = 0
        self.fanout: _Fanout | None = None
        self.step = 0

    def start(self) -> None:
        c, st = self.client, self.st
        codec, dim = st.push_codec, st.dim
        parts = []
        for s, lo, hi in c._parts(self.starts, wire.rows_nbytes(1, dim, codec)):
            part = parts[-1][1] + 1 if parts and parts[-1][0] is s else 0  # chunk index within the server
            parts.append((s, part, lo, hi))
        self.fanout = _Fanout(len(parts))
        seq = c._next_seq()
        with st.lock:
            st.step += 1
            self.step = st.step
            st.pending[self.step] = self.fut
        for i, (s, part, lo, hi) in enumerate(parts):
            try:
                data, scales = wire.encode_block(self.summed[lo:hi], codec)
                request = wire.encode_push_request(st.name, self.uniq[lo:hi], codec, dim, data, scales,
                                                   c.client_id, seq, part)
            except Exception as exc:  # noqa: BLE001 - settle every part not sent, so flush cannot hang
                error = exc if isinstance(exc, PSError) else Internal(f"table {st.name!r}: push encoding: {exc}")
                for _ in parts[i:]:
                    self._done_for(None)(None, error)
                break
            del data, scales
            with st.lock:
                st.bytes["sent"]["push"] += len(request)
            s.slots.acquire()  # back-pressure: at most max_pushes_in_flight messages per server
            Call(s.push, request, s.address, c.config.timeout_s, c._retry, self._done_for(s),
                 c._note_retry).start()
        self.summed = None  # the encoded messages own the payload now

    def _done_for(self, server: _Server | None) -> Callable[[Any, PSError | None], None]:
        def done(response: pb.PushResponse | None, error: PSError | None) -> None:
            if server is not None:
                server.slots.release()
            if error is None:
                with self.st.lock:
                    self.st.bytes["received"]["push"] += response.ByteSize()
                    self.applied += int(response.applied_rows)
            assert self.fanout is not None
            ok = self.fanout.part_done(error)
            first_error = error is not None and self.fanout.error is error
            if not ok and not first_error:
                return
            with self.st.lock:
                self.st.pending.pop(self.step, None)
            if ok:
                self.client._count(pushes=1, rows_pushed=int(self.uniq.size))
                self.fut.set_result(self.applied)
            else:
                self.client._count(push_errors=1)
                with self.client._stats_lock:
                    self.client._push_errors.append(error)
                self.fut.set_exception(error)
        return done


def connect(addresses: str | Iterable[str], config: ClientConfig | None = None, **overrides: Any) -> Client:
    """A ``Client`` for a static shard list (``["host:port", ...]`` or ``"host:port,host:port"``).

    ``overrides`` replace ``ClientConfig`` fields, e.g. ``connect(addrs, timeout_s=5, max_attempts=2)``."""
    base = config or ClientConfig()
    if overrides:
        unknown = sorted(set(overrides) - set(ClientConfig.__dataclass_fields__))
        if unknown:
            raise InvalidArgument(f"connect: unknown config field(s) {unknown}")
        base = dataclasses.replace(base, **overrides)
    addrs = [addresses] if isinstance(addresses, str) else list(addresses)
    if len(addrs) == 1 and "," in addrs[0]:
        addrs = addrs[0].split(",")
    return Client(addrs, base)
