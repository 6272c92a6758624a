"""The shard service: a gRPC adapter over the storage engine's tables, the copies of slots it holds, and the
replication between copies.

Each handler decodes the request with ``tigana.ps.wire``, checks it against the table and the shard map, calls
the table, and encodes the answer. Every exception a handler raises becomes a gRPC status in one place
(``_rpc``, through ``errors.to_status``); a bug answers INTERNAL and the server keeps serving. Validation
happens before anything changes, so a rejected request leaves every table as it was.

Two modes:

- static (a shard list): the server leads the slots of ``ServerConfig.slots``; no replication; epoch 0.
- cluster (``ServerConfig.scheduler``): the scheduler's ``ShardMap`` says which slots this server leads and
  which it holds as a copy. ``install`` applies a new map under every table's write lock, so a request is
  checked and applied against one map. The server serves only once the map names its current boot: a
  restarted server never serves rows of its previous life before the scheduler has decided about them.

The write path of a cluster table (``Push``; pulls that insert take the same path without waiting):
under the table's write lock, check that this server leads every slot of the request in its current map
(``WrongShard`` otherwise, with the epoch; the ownership check and the apply see the same map), check
``min_copies``, skip slots that already applied this (client id, seq), apply, record the key, stamp the
slots' log positions and enqueue the changed rows to every copy (``replication``). Then, for a sync table,
wait until every in-sync copy applied it (invariant I1 of ``replication``), and acknowledge only if the
slots' copies did not change meanwhile (otherwise the client retries and the retry is answered as a
duplicate once the copies of the new map have it).

Thread-safety: handlers run on gRPC's thread pool. Each table has a write lock (``_Hosted.lock``) held for
check-apply-record-enqueue; ``install`` takes all of them (in name order) after the install lock; the
registry lock serializes create/drop/restore.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tigana.embeddings import (
    Changes,
    CorruptStore,
    EmbeddingTable,
    SnapshotNotFound,
    StorageError,
    TableConfig,
)
from tigana.embeddings.changes import unique
from tigana.proto import shard_pb2 as pb
from tigana.proto import shard_pb2_grpc
from tigana.ps import _kernels, cluster_wire, frames, rpc, streams, wire
from tigana.ps.catalog import Catalog
from tigana.ps.cluster_wire import CHANGES, SNAPSHOT_ROWS, Item
from tigana.ps.config import ServerConfig
from tigana.ps.dedup import DedupWindow
from tigana.ps.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotEnoughReplicas,
    ResourceExhausted,
    TableExists,
    TableNotFound,
    Unavailable,
    WrongShard,
    status_metadata,
    to_status,
)
from tigana.ps.logs import event, slots_text
from tigana.ps.metrics import ServerMetrics
from tigana.ps.replication import NO_POSITION, Inbound, Replicator, SlotLog, Stream, apply_item
from tigana.ps.routing import ShardMap, TableDef, format_slots, parse_slots, slot_of
from tigana.ps.security import NONE, Security

log = logging.getLogger("tigana.ps.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Shard"].full_name  # "tigana.v1.Shard"
_BAD_NAME = re.compile(r"[\x00-\x1f\x7f]")
_CODECS = frozenset(pb.Codec.values())
_STATES = {"loading": "is loading its tables", "failed": "failed to load its tables (see its log)",
           "closed": "is shut down"}
_COPY_CHUNK = 16384  # rows per SNAPSHOT_ROWS item of a slot copy
_RATE_HALF_LIFE_S = 10.0
_TABLE_COUNTERS = ("rows_spilled", "admissions", "rejected_admissions", "evictions", "spills")


def checksum_value(digest: str) -> float:
    """A table checksum (any string) as a float that survives a ``map<string, double>`` exactly (53 bits)."""
    h = hashlib.blake2b(digest.encode(), digest_size=8).digest()
    return float(int.from_bytes(h, "little") >> 11)


@dataclasses.dataclass(eq=False)
class _Hosted:
    """A table as served: its definition, the engine table, its write lock, exactly-once window, log positions
    and per-slot request counters (decayed into rates)."""

    spec: TableDef
    table: EmbeddingTable
    dedup: DedupWindow
    log: SlotLog
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    pulled: np.ndarray | None = None  # rows pulled per slot since the last decay
    pushed: np.ndarray | None = None
    pull_rate: np.ndarray | None = None
    push_rate: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = self.log.positions.shape[0]
        self.pulled, self.pushed = np.zeros(n), np.zeros(n)
        self.pull_rate, self.push_rate = np.zeros(n), np.zeros(n)


@dataclasses.dataclass(frozen=True, eq=False)
class _View:
    """What this server holds under one map: epoch, the slots it leads and holds, whether the map names this
    process (``valid``), per slot the number of in-sync copies, the slots it leads but refuses writes to
    while it hands them over (``fenced``), and the copies the cluster keeps of a slot (``want``)."""

    epoch: int
    map: ShardMap | None
    me: int
    leads: np.ndarray
    holds: np.ndarray
    valid: bool
    in_sync: np.ndarray
    fenced: np.ndarray
    want: int = 1

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


@dataclasses.dataclass(frozen=True, eq=False)
class _Pushed:
    """A push applied (or found a duplicate) under its table's lock, not yet acknowledged: the map it was
    applied under, its slots, and the replication marks a sync push waits for."""

    name: str
    view: _View
    uslots: np.ndarray
    marks: list
    sync: bool
    applied: int
    duplicate: bool
    rows: int


def _rpc(method: str) -> Callable:
    """Wrap a handler: refuse while not serving, time it, count it, turn any exception into a status (with
    the class name and this server's epoch as trailing metadata)."""

    def wrap(handler: Callable) -> Callable:
        @functools.wraps(handler)
        def wrapper(self: ShardService, request: Any, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            status: grpc.StatusCode | None = None
            try:
                rpc.check(request)
                if self.state != "serving":
                    raise Unavailable(f"{method}: server {_STATES.get(self.state, self.state)}")
                return handler(self, request, context)
            except Exception as exc:  # noqa: BLE001 - a request never takes the daemon down
                status, message = to_status(exc)
                if status == grpc.StatusCode.INTERNAL:
                    log.exception("%s failed with a bug", method)
                context.set_trailing_metadata(status_metadata(exc, self._view.epoch))
            finally:
                self.metrics.observe(method, status.name if status else "OK", time.perf_counter() - start)
            context.abort(status, message)

        return wrapper

    return wrap


class ShardService(shard_pb2_grpc.ShardServicer):
    """The tables and slot copies of one shard server. ``state`` is loading -> serving -> closed.

    ``agent`` (set by the daemon in cluster mode) is the link to the scheduler: ``refresh(epoch)``,
    ``report_copy_failure(target, slots, reason)``, ``copy_caught_up(target, slots)``."""

    def __init__(self, config: ServerConfig, metrics: ServerMetrics | None = None, *,
                 security: Security = NONE, clock: Callable[[], float] = time.monotonic,
                 spawn: Callable[[str, Callable[[], None]], None] | None = None) -> None:
        self.config = config
        self.security = security
        self.metrics = metrics or ServerMetrics(self.table_sizes, self.cluster_figures)
        self.state = "loading"
        self.num_slots = config.num_slots
        self.data_dir = Path(config.data_dir) if config.data_dir else None
        self.catalog = Catalog(self.data_dir) if self.data_dir is not None else None
        self.server_id = (self.catalog.server_id(config.server_id) if self.catalog is not None
                          else config.server_id or uuid.uuid4().hex[:12])
        self.boot = uuid.uuid4().hex[:12]
        self.clustered = config.scheduler is not None
        self.corrupt_stores = 0  # stores found corrupt at start and quarantined (clustered servers)
        self.agent: Any = None
        self.on_install: Callable[[], None] | None = None  # the daemon's health update
        self._tables: dict[str, _Hosted] = {}
        self._registry_lock = threading.RLock()
        self._install_lock = threading.Lock()
        self._inbound: dict[str, Inbound] = {}
        self._inbound_lock = threading.Lock()
        self._handover_wake = threading.Event()
        self._handover_thread: threading.Thread | None = None
        self._last_decay = time.monotonic()
        self._streams = 0  # Exchange streams open
        self._streams_lock = threading.Lock()
        self._frame_pool = futures.ThreadPoolExecutor(max_workers=config.max_workers,
                                                      thread_name_prefix="tigana-frame")
        if self.clustered:
            self._view = _View.waiting(self.num_slots)
            self.replicator: Replicator | None = Replicator(
                self.server_id, self.boot, self.num_slots, max_message_bytes=config.max_message_bytes,
                refresh_map=self._refresh, report_failure=self._report_failure, caught_up=self._caught_up,
                copy_rows=self._copy_rows, failure_timeout_s=config.replication_timeout_s,
                max_queue_bytes=config.replication_queue_bytes, channel=security.channel, clock=clock, spawn=spawn)
        else:
            self._view = _View.static(config.owned_slots())
            self.replicator = None

    # --- ownership ----------------------------------------------------------------------------------------
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

    # --- tables -------------------------------------------------------------------------------------------
    def _get(self, name: str) -> _Hosted:
        hosted = self._tables.get(name)
        if hosted is None:
            if not name:
                raise InvalidArgument("request: field 'table' is empty")
            raise TableNotFound(f"table {name!r} not found on this server", epoch=self._view.epoch)
        return hosted

    def _effective(self, spec: TableConfig) -> TableConfig:
        """The config a table runs with: with a daemon budget, a share of it when the spec sets none (re-split
        by ``_rebudget``); spill under data_dir."""
        budget = spec.memory_budget or self.config.memory_budget or None
        spill = spec.spill_dir
        if budget and spill is None and self.catalog is not None:
            spill = self.catalog.spill_dir(spec.name)
        return dataclasses.replace(spec, memory_budget=budget, spill_dir=spill,
                                   spill_max_bytes=spec.spill_max_bytes or self.config.spill_max_bytes)

    def _new_hosted(self, spec: TableDef, table: EmbeddingTable | None = None, dedup: DedupWindow | None = None,
                    slot_log: SlotLog | None = None) -> _Hosted:
        table = table or EmbeddingTable(self._effective(spec.config))
        if self.clustered:  # only the primary of a row decides its eviction; copies apply it (replication)
            table.set_evictable(self._leads_ids)
        return _Hosted(spec, table, dedup or DedupWindow(self.num_slots, self.config.dedup_window),
                       slot_log or SlotLog(self.num_slots))

    def _leads_ids(self, ids: np.ndarray) -> np.ndarray:
        return self._view.leads[slot_of(ids, self.num_slots)]

    def cluster_figures(self) -> dict[str, float]:
        """Epoch, slots led/held/catching up and replication lag (the metrics endpoint and heartbeats)."""
        view = self._view
        out = {"epoch": float(view.epoch), "slots_led": float(view.leads.sum()),
               "slots_held": float(view.holds.sum()), "slots_catching_up": float(self.catching_up()),
               "corrupt_stores": float(self.corrupt_stores)}
        if self.replicator is not None:
            out.update(self.replicator.stats())
        return out

    def load_figures(self) -> dict[str, float]:
        """Rows, resident bytes and request rate (rows/s pulled + pushed, decayed) of every table here."""
        rows = nbytes = rate = 0.0
        for hosted in list(self._tables.values()):
            try:
                rows += len(hosted.table)
                nbytes += float(hosted.table.stats().get("bytes_resident", 0.0))
                rate += float(hosted.pull_rate.sum() + hosted.push_rate.sum())
            except Exception:  # noqa: BLE001 - a closing table must not break a heartbeat
                continue
        return {"rows": rows, "bytes": nbytes, "request_rate": rate}

    def catching_up(self) -> int:
        """Copies on this server that are still being built (not yet in the in-sync set)."""
        view = self._view
        if view.map is None or not view.valid:
            return 0
        return int((view.map.copy_state(view.me) == 1).sum())

    def table_names(self) -> list[str]:
        return sorted(self._tables)

    def table_sizes(self) -> dict[str, dict[str, float]]:
        """{table: {"rows", "bytes", "rows_spilled", "admissions", "rejected_admissions", "evictions", "spills"}}
        for the metrics endpoint (cheap: no checksum)."""
        out = {}
        for name, hosted in list(self._tables.items()):
            try:
                stats = hosted.table.stats()
                out[name] = {"rows": float(len(hosted.table)),
                             "bytes": float(stats.get("bytes_resident", stats.get("bytes", 0.0)))}
                out[name].update({k: float(stats[k]) for k in _TABLE_COUNTERS if k in stats})
            except Exception:  # noqa: BLE001 - a closing table must not break a scrape
                continue
        return out

    def _values(self, name: str, hosted: _Hosted, *, checksum: bool) -> dict[str, float]:
        values: dict[str, float] = {}
        for key, value in hosted.table.stats().items():
            try:
                values[str(key)] = float(value)
            except (TypeError, ValueError):
                continue
        values["rows"] = float(len(hosted.table))
        values["dim"] = float(hosted.table.config.dim)
        values["state_width"] = float(hosted.table.state_width)
        leads = self._view.leads
        if checksum:  # one pass over a cut (the table's lock is held per chunk only): digest and rows per slot
            cut = hosted.table.cut()
            _, counts = cut.checksums_by(lambda ids: slot_of(ids, self.num_slots), self.num_slots)
            values["checksum"] = checksum_value(cut.checksum())
            if self.clustered:  # rows counted once cluster-wide: at their primary
                values["rows_led"] = float(counts[leads].sum())
        elif self.clustered:
            ids = hosted.table.stored_ids()
            values["rows_led"] = float(np.count_nonzero(leads[slot_of(ids, self.num_slots)])) if ids.size else 0.0
        values["dedup_keys"] = float(len(hosted.dedup))
        values["epoch"] = float(self._view.epoch)
        if self.replicator is not None:
            values.update(self.replicator.stats())
        return values

    def _create_local(self, spec: TableDef) -> _Hosted:
        """Create a table (the registry lock is held); leftovers of an older table of the name are removed."""
        if self.catalog is not None:
            self.catalog.remove_table_files(spec.config.name)
        hosted = self._new_hosted(spec)
        self._tables[spec.config.name] = hosted
        self._rebudget()
        return hosted

    def _rebudget(self) -> None:
        """Split ``--memory-budget`` over the tables: it bounds the whole daemon, not each table. Tables with a
        budget of their own keep it (and it counts against the daemon's); the others share what is left."""
        total = self.config.memory_budget
        if not total:
            return
        tables = list(self._tables.values())
        own = sum(h.spec.config.memory_budget or 0 for h in tables)
        shared = [h for h in tables if not h.spec.config.memory_budget]
        if not shared:
            return
        # tables with budgets of their own may take it all: the shared ones still get a floor (1 MiB, or an
        # even share of the daemon's budget when that is smaller)
        each = max(min(1 << 20, total // len(tables)), (total - own) // len(shared), 1)
        for h in shared:
            try:
                h.table.set_memory_budget(each)
            except Exception:  # noqa: BLE001 - a table being closed
                log.debug("re-budgeting table %r failed", h.spec.config.name)

    def _drop_local(self, name: str) -> bool:
        hosted = self._tables.pop(name, None)
        if hosted is None:
            return False
        with hosted.lock:
            hosted.table.close()
        if self.catalog is not None:
            self.catalog.remove_table_files(name)
        self._rebudget()
        return True

    # --- client RPCs ----------------------------------------------------------------------------------------
    @_rpc("CreateTable")
    def CreateTable(self, request: pb.CreateTableRequest, context: grpc.ServicerContext) -> pb.CreateTableResponse:
        spec = cluster_wire.table_def_from_pb(request.spec)
        name = spec.config.name
        if len(name) > 200 or _BAD_NAME.search(name):
            raise InvalidArgument(f"table {name!r}: field 'name' must be at most 200 characters without "
                                  "control characters")
        with self._registry_lock:
            existing = self._tables.get(name)
            if existing is not None:
                if existing.spec != spec:
                    diff = [f.name for f in dataclasses.fields(spec.config)
                            if getattr(spec.config, f.name) != getattr(existing.spec.config, f.name)]
                    diff += [f for f in ("durability", "min_copies") if getattr(spec, f) != getattr(existing.spec, f)]
                    raise TableExists(f"table {name!r} already exists with a different spec "
                                      f"(field(s) {', '.join(diff)} differ)")
                if not request.exist_ok:
                    raise TableExists(f"table {name!r} already exists (pass exist_ok to accept it)")
                return pb.CreateTableResponse(spec=cluster_wire.table_def_to_pb(existing.spec), created=False)
            if self.clustered:
                raise InvalidArgument(f"table {name!r}: this server is part of a cluster; create tables through "
                                      f"its scheduler ({self.config.scheduler})")
            self._create_local(spec)
            try:
                self._save_registry()
            except BaseException:  # a full disk: the table was not created
                self._drop_local(name)
                raise
        log.info("created table %r (dim %d, %s)", name, spec.config.dim, spec.config.optimizer.kind)
        return pb.CreateTableResponse(spec=cluster_wire.table_def_to_pb(spec), created=True)

    @_rpc("DescribeTable")
    def DescribeTable(self, request: pb.DescribeTableRequest, context: grpc.ServicerContext
                      ) -> pb.DescribeTableResponse:
        hosted = self._get(request.table)
        stats = pb.TableStats(table=request.table, values=self._values(request.table, hosted, checksum=False))
        return pb.DescribeTableResponse(spec=cluster_wire.table_def_to_pb(hosted.spec), stats=stats)

    @_rpc("DropTable")
    def DropTable(self, request: pb.DropTableRequest, context: grpc.ServicerContext) -> pb.DropTableResponse:
        if self.clustered:
            raise InvalidArgument(f"table {request.table!r}: this server is part of a cluster; drop tables "
                                  f"through its scheduler ({self.config.scheduler})")
        with self._registry_lock:
            if request.table in self._tables:
                self._save_registry(without=request.table)  # first: a full disk leaves the table as it was
            dropped = self._drop_local(request.table)
        if dropped:
            log.info("dropped table %r", request.table)
        return pb.DropTableResponse(dropped=dropped)

    @_rpc("ListTables")
    def ListTables(self, request: pb.ListTablesRequest, context: grpc.ServicerContext) -> pb.ListTablesResponse:
        hosted = [self._tables.get(n) for n in self.table_names()]
        return pb.ListTablesResponse(tables=[cluster_wire.table_def_to_pb(h.spec) for h in hosted if h is not None])

    def _pull(self, request: pb.PullRequest) -> tuple[str, np.ndarray, int]:
        """Validate a pull and read its rows: (table, (n, dim) float32 rows, reply codec)."""
        name = request.table
        hosted = self._get(name)
        raw_ids = request.ids  # protobuf copies a bytes field on every access: read it once
        ids = wire.decode_ids(raw_ids, table=name)
        self._check_rows(name, ids.size)
        codec = request.codec
        if codec not in _CODECS:
            raise InvalidArgument(f"table {name!r}: field 'codec' has unknown value {codec}")
        reply_bytes = wire.rows_nbytes(len(ids), hosted.table.config.dim, codec)
        if reply_bytes > self.config.max_message_bytes - 1024:  # refuse before pull inserts anything
            raise ResourceExhausted(f"table {name!r}: field 'ids' asks for {len(ids)} rows, {reply_bytes} bytes "
                                    f"as a reply, above the message limit of {self.config.max_message_bytes}; "
                                    "split the pull")
        with hosted.lock:
            view, slots = self._check_leads(name, ids, request.epoch)
            if request.read_only:
                rows = hosted.table.pull(ids, insert=False)
            elif self.replicator is not None and self.replicator.streams:
                changes = Changes()
                rows = hosted.table.pull(ids, changes=changes)
                if changes:
                    self._replicate(hosted, view, changes, None, None)
            else:
                rows = hosted.table.pull(ids)
            hosted.pulled += np.bincount(slots, minlength=self.num_slots)
        self.metrics.rows_pulled.labels(name).inc(len(ids))
        self.metrics.bytes_in.labels("Pull").inc(len(raw_ids))
        self.metrics.bytes_out.labels("Pull").inc(reply_bytes)
        self.metrics.row_bytes_raw.labels("Pull").inc(len(ids) * hosted.table.config.dim * 4)
        self.metrics.row_bytes_wire.labels("Pull").inc(reply_bytes)
        return name, rows, codec

    @_rpc("Pull")
    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> pb.PullResponse:
        _, rows, codec = self._pull(request)
        return pb.PullResponse(rows=wire.encode_rows(rows, codec))

    @_rpc("Pull")
    def pull_serialized(self, request: pb.PullRequest, context: grpc.ServicerContext) -> bytes:
        """``Pull`` answering the serialized ``PullResponse`` (written in one copy by ``wire``), for the
        bytes response serializer ``add_to_server`` registers."""
        _, rows, codec = self._pull(request)
        return wire.encode_pull_response(rows, codec)

    @_rpc("Push")
    def Push(self, request: pb.PushRequest | wire.RawPush, context: grpc.ServicerContext) -> pb.PushResponse:
        """Apply a gradient block; ``request`` is the protobuf message or ``wire.decode_push_request``'s views."""
        return self._push(request)

    def Exchange(self, requests: Any, context: grpc.ServicerContext) -> Any:
        """The streaming data path: this client's pulls and pushes as frames of one stream (``streams``)."""
        with self._streams_lock:
            if self._streams >= self.config.max_streams:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"Exchange: server has {self._streams} streams open, the limit (max_streams); "
                              "use the unary Pull and Push")
            self._streams += 1

        def malformed(item: Any) -> None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item.error()))

        try:
            yield from streams.serve(requests, self._answer_frame, self._frame_pool, self.config.stream_window,
                                     malformed)
        finally:
            with self._streams_lock:
                self._streams -= 1

    def _answer_frame(self, frame: frames.Frame, received: float) -> bytes:
        """One frame of an ``Exchange`` stream, answered as the unary call would be (never raises)."""
        method = frames.KINDS[frame.kind]
        start = time.perf_counter()
        status: grpc.StatusCode | None = None
        try:
            try:
                rpc.check(frame.request)
                if self.state != "serving":
                    raise Unavailable(f"{method}: server {_STATES.get(self.state, self.state)}")
                if frame.timeout_ms and time.monotonic() - received > frame.timeout_ms / 1000:
                    raise DeadlineExceeded(f"table {frame.request.table!r}: {method} frame waited past its "
                                           f"deadline ({frame.timeout_ms} ms) before it was handled; not applied")
                if frame.kind == frames.PULL:
                    _, rows, codec = self._pull(frame.request)
                    return frames.pull_answer(frame.id, rows, codec)
                return frames.push_answer(frame.id, self._push(frame.request))
            except Exception as exc:  # noqa: BLE001 - a frame never takes the stream or the daemon down
                status = to_status(exc)[0]
                if status == grpc.StatusCode.INTERNAL:
                    log.exception("%s frame failed with a bug", method)
                return frames.error_answer(frame.id, exc, self._view.epoch)
        finally:
            self.metrics.observe(method, status.name if status else "OK", time.perf_counter() - start)

    def _push(self, request: pb.PushRequest | wire.RawPush) -> pb.PushResponse:
        """A push: applied (or found a duplicate) under the table's lock, then, for a sync table, acknowledged
        once its in-sync copies have it (``_push_apply`` then ``_push_ack``; a simulator drives the two)."""
        return self._push_ack(self._push_apply(request), self.config.ack_timeout_s)

    def _push_apply(self, request: pb.PushRequest | wire.RawPush) -> _Pushed:
        name = request.table
        hosted = self._get(name)
        raw_ids = request.ids  # protobuf copies a bytes field on every access: read each once
        ids = wire.decode_ids(raw_ids, table=name)
        self._check_rows(name, ids.size)
        dim = hosted.table.config.dim
        g = request.grads
        codec, data, scales = g.codec, g.data, g.scales
        grads_rows = wire.RawRows(codec, g.dim, data, scales, 0)
        nbytes = memoryview(data).nbytes
        if codec in _CODECS and g.dim == dim:
            row_bytes = wire.rows_nbytes(1, dim, codec) - (4 if codec == pb.CODEC_INT8 else 0)
            if nbytes % row_bytes == 0 and nbytes // row_bytes != len(ids):
                raise InvalidArgument(f"table {name!r}: field 'grads' has {nbytes // row_bytes} rows, "
                                      f"field 'ids' has {len(ids)} ids")
        grads = wire.decode_rows(grads_rows, len(ids), dim, table=name, field="grads")
        epoch = getattr(request, "epoch", 0)
        self.metrics.bytes_in.labels("Push").inc(memoryview(raw_ids).nbytes + nbytes + memoryview(scales).nbytes)
        self.metrics.row_bytes_raw.labels("Push").inc(len(ids) * dim * 4)
        self.metrics.row_bytes_wire.labels("Push").inc(nbytes + memoryview(scales).nbytes)
        cid, seq = request.client_id, request.seq
        self._wait_for_room(name)
        with hosted.lock:
            view, slots = self._check_leads(name, ids, epoch)  # under the lock: the map the apply sees
            uslots = unique(slots)
            sync = hosted.spec.durability == "sync"
            if not sync and self.agent is not None and not self.agent.lease_ok():
                raise Unavailable(f"table {name!r}: server {self.server_id} has not reached the scheduler for "
                                  f"{self.config.lease_s}s; async pushes wait until it has (primary lease)",
                                  epoch=view.epoch)
            if sync and self.clustered:
                short = view.in_sync[uslots] < hosted.spec.min_copies
                if short.any():
                    s = int(uslots[short][0])
                    raise NotEnoughReplicas(
                        f"table {name!r}: slot {s} has {int(view.in_sync[s])} in-sync cop(ies), the table's "
                        f"min_copies is {hosted.spec.min_copies}; push rejected, nothing applied", epoch=view.epoch)
            done = hosted.dedup.applied(cid, seq, uslots)
            if done.all():
                applied, duplicate = 0, True
                marks = self.replicator.tail_marks(uslots) if self.replicator is not None and sync else []
            else:
                if done.any():  # a retried push split differently: apply only the slots not applied yet
                    keep = ~np.isin(slots, uslots[done])
                    ids, grads, slots, uslots = ids[keep], grads[keep], slots[keep], uslots[~done]
                changes = Changes() if self.replicator is not None and self.replicator.streams else None
                applied = hosted.table.push(ids, grads, changes=changes)
                hosted.dedup.record(cid, seq, uslots)
                marks = self._replicate(hosted, view, changes, uslots, (cid, seq, uslots))
                duplicate = False
            hosted.pushed += np.bincount(slots, minlength=self.num_slots)
        return _Pushed(name, view, uslots, marks if sync else [], sync, int(applied), duplicate, len(ids))

    def _push_ack(self, p: _Pushed, timeout_s: float) -> pb.PushResponse:
        """Wait (up to ``timeout_s``) until the copies the push waits for have it (I1), then answer."""
        name, view, uslots, marks, sync = p.name, p.view, p.uslots, p.marks, p.sync
        if marks:
            assert self.replicator is not None
            if not self.replicator.wait(marks, timeout_s):
                late = sorted({m.stream.target_id for m in marks})
                raise Unavailable(f"table {name!r}: push applied here but not yet by the in-sync copies on {late} "
                                  f"within {self.config.ack_timeout_s}s; retry it (it is applied once)",
                                  epoch=self._view.epoch)
            self._check_unmoved(name, view, uslots)
        if p.duplicate:
            self.metrics.duplicate_pushes.labels(name).inc()
        else:
            self.metrics.rows_pushed.labels(name).inc(p.rows)
        applied, duplicate = p.applied, p.duplicate
        now = self._view
        # Not silent: a sync push acknowledged while a slot of it has fewer in-sync copies than the cluster
        # keeps says so (the client counts and logs it; ``min_copies`` refuses it instead).
        under = bool(sync and self.clustered and (now.in_sync[uslots] < now.want).any())
        if under:
            self.metrics.under_replicated_pushes.labels(name).inc()
        return pb.PushResponse(applied_rows=int(applied), duplicate=duplicate, epoch=now.epoch,
                               under_replicated=under)

    def _wait_for_room(self, table: str) -> None:
        """Back-pressure on writers: wait while a replication stream holds more than ``max_queue_bytes``
        unacknowledged (``Unavailable``, retryable, when it stays so), before anything is applied."""
        if self.replicator is None or not self.replicator.streams:
            return
        full = self.replicator.room(None, self.config.ack_timeout_s)
        if full is not None:
            raise Unavailable(f"table {table!r}: replication to {full.target_id} is {full.queued_bytes} bytes "
                              f"behind (more than max_queue_bytes); nothing applied, retry", epoch=self._view.epoch)

    def _check_rows(self, table: str, n: int) -> None:
        if n > self.config.max_rows_per_request:
            raise ResourceExhausted(f"table {table!r}: field 'ids' has {n} ids, above the server's limit of "
                                    f"{self.config.max_rows_per_request} per request; split it")

    def _replicate(self, hosted: _Hosted, view: _View, changes: Changes | None, slots: np.ndarray | None,
                   key: tuple[str, int, np.ndarray] | None) -> list:
        """Stamp the write's slots and enqueue its changes to the copies (caller holds the write lock)."""
        if changes is None or self.replicator is None:
            if slots is not None:
                hosted.log.stamp(slots, view.epoch)
            return []
        table = hosted.table
        written = changes.written_ids()
        rows = table.rows_of(written) if written.size else None  # absent ids (evicted) are skipped
        deleted = changes.deleted_ids()
        if deleted.size:
            deleted = deleted[~table.contains(deleted)]
        sightings = changes.sighting_arrays()
        # A push's written rows lie in its own slots; a pull's inserts, removals and sightings name theirs.
        touched = [deleted, sightings[0]] + ([rows.ids] if rows is not None and slots is None else [])
        extra = np.concatenate(touched)
        islots = slots if slots is not None else np.empty(0, np.int64)
        if extra.size:
            islots = unique(np.concatenate([islots, slot_of(extra, self.num_slots)]))
        if islots.size == 0:
            return []
        islots = islots.astype(np.int32)
        lsn, prev = hosted.log.stamp(islots, view.epoch)
        dedup = [(key[0], key[1], key[2].astype(np.int32))] if key is not None and key[0] else []
        item = Item(CHANGES, hosted.spec.config.name, islots, lsn, prev, rows, deleted,
                    sightings if sightings[0].size else None, table.step, dedup)
        return self.replicator.enqueue(item)

    @_rpc("Snapshot")
    def Snapshot(self, request: pb.SnapshotRequest, context: grpc.ServicerContext) -> pb.SnapshotResponse:
        paths, rows = self.snapshot_all(incremental=request.incremental)
        return pb.SnapshotResponse(paths=[str(p) for p in paths], rows=rows)

    @_rpc("Restore")
    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> pb.RestoreResponse:
        if self.clustered:
            raise InvalidArgument("Restore: this server is part of a cluster; its copies are kept by replication "
                                  "(restore a cluster checkpoint through the scheduler)")
        return pb.RestoreResponse(rows=self.restore(request.path or None))

    @_rpc("Stats")
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        names = [request.table] if request.table else self.table_names()
        out = []
        for name in names:
            hosted = self._get(name) if request.table else self._tables.get(name)
            if hosted is not None:
                out.append(pb.TableStats(table=name, values=self._values(name, hosted, checksum=True)))
        return pb.StatsResponse(tables=out)

    # --- cluster RPCs ---------------------------------------------------------------------------------------
    @_rpc("InstallMap")
    def InstallMap(self, request: pb.InstallMapRequest, context: grpc.ServicerContext) -> pb.InstallMapResponse:
        if not self.clustered:
            raise InvalidArgument("InstallMap: this server was started without --scheduler")
        self.install(cluster_wire.map_from_pb(request.map))
        return pb.InstallMapResponse(epoch=self._view.epoch)

    @_rpc("SlotInfo")
    def SlotInfo(self, request: pb.SlotInfoRequest, context: grpc.ServicerContext) -> pb.SlotInfoResponse:
        names = [request.table] if request.table else self.table_names()
        out = []
        for name in names:
            hosted = self._get(name) if request.table else self._tables.get(name)
            if hosted is not None:
                out.append(self.slot_info(name, hosted, checksums=request.checksums))
        stats = self.replicator.stats() if self.replicator is not None else {}
        return pb.SlotInfoResponse(epoch=self._view.epoch, tables=out, server_id=self.server_id, replication=stats)

    def slot_info(self, name: str, hosted: _Hosted, *, checksums: bool, slots: np.ndarray | None = None
                  ) -> pb.SlotTableInfo:
        """Per held slot (or ``slots``): rows, checksums, log positions and request rates of one table."""
        view = self._view
        held = np.flatnonzero(view.holds).astype(np.int32) if slots is None else np.asarray(slots, np.int32)
        with hosted.lock:  # the checksums' cut and the positions of one moment; the cut is read after the lock
            positions = hosted.log.positions[held].copy()
            cut = hosted.table.cut() if checksums else None
            per_row = hosted.table.stats().get("slot_bytes", 0.0)
        sums, counts = None, None
        if cut is not None:
            sums, counts = cut.checksums_by(lambda ids: slot_of(ids, self.num_slots), self.num_slots)
        if counts is None:
            counts = np.bincount(slot_of(hosted.table.stored_ids(), self.num_slots), minlength=self.num_slots)
        msg = pb.SlotTableInfo(table=name, slots=held.astype("<i4").tobytes(),
                               rows=counts[held].astype("<i8").tobytes(),
                               lsn_epochs=positions[:, 0].astype("<u8").tobytes(),
                               lsn_indexes=positions[:, 1].astype("<u8").tobytes(),
                               pull_rates=hosted.pull_rate[held].astype("<f8").tobytes(),
                               push_rates=hosted.push_rate[held].astype("<f8").tobytes(),
                               bytes=(counts[held] * per_row).astype("<i8").tobytes())
        if sums is not None:
            msg.checksums = sums[held].astype("<u8").tobytes()
        return msg

    # --- whole-table reads and writes (checkpoint, restore, export) ----------------------------------------
    def ExportRows(self, request: pb.ExportRowsRequest, context: grpc.ServicerContext):
        """Stream the rows of the slots this server leads, as one consistent cut of the table: the cut is opened
        under its write lock (with every slot's log position; O(1)), written to a temporary snapshot while
        writes go on (copy-on-write, ``tigana.embeddings.Cut``), then streamed from that snapshot."""
        start = time.perf_counter()
        status: grpc.StatusCode | None = None
        try:
            rpc.check(request)
            if self.state != "serving":
                raise Unavailable(f"ExportRows: server {_STATES.get(self.state, self.state)}")
            yield from self._export_rows(request)
        except Exception as exc:  # noqa: BLE001 - a request never takes the daemon down
            status, message = to_status(exc)
            if status == grpc.StatusCode.INTERNAL:
                log.exception("ExportRows failed with a bug")
            context.set_trailing_metadata(status_metadata(exc, self._view.epoch))
            context.abort(status, message)
        finally:
            self.metrics.observe("ExportRows", status.name if status else "OK", time.perf_counter() - start)

    def _export_rows(self, request: pb.ExportRowsRequest):
        from tigana.embeddings import snapshot as snap

        name = request.table
        hosted = self._get(name)
        view = self._view
        if not view.valid:
            raise Unavailable(f"table {name!r}: server {self.server_id} is not in the cluster yet")
        if request.slots:
            slots = cluster_wire.array(request.slots, "<i4", field="slots").astype(np.int64)
            if slots.size and (slots.min() < 0 or slots.max() >= self.num_slots):
                raise InvalidArgument(f"table {name!r}: field 'slots' is out of range [0, {self.num_slots})")
            if not view.leads[slots].all():
                raise WrongShard(f"table {name!r}: field 'slots' names slots this server does not lead at epoch "
                                 f"{view.epoch}", epoch=view.epoch)
        else:
            slots = np.flatnonzero(view.leads)
        want = np.zeros(self.num_slots, bool)
        want[slots] = True
        chunk = int(request.chunk_rows) or 65536
        since = float(request.since_time)
        base = self.data_dir / "export-tmp" if self.data_dir is not None else None
        if base is not None:
            base.mkdir(parents=True, exist_ok=True)
        if since:
            yield from self._export_since(hosted, slots, want, since, chunk, request.weights_only)
            return
        tmp = Path(tempfile.mkdtemp(prefix="cut-", dir=base))
        try:
            with hosted.lock:  # the cut: rows, positions and step at one moment (O(1): copy-on-write)
                cut_time = time.time()
                table = hosted.table
                pending = table.begin_snapshot(tmp, incremental=False, track=False)
                positions = hosted.log.positions[slots].copy()
                step = table.step
            path = pending.write()  # the rows as of the cut, read while pushes go on
            first = True
            buffered: list = []
            count = 0
            for batch in snap.iter_snapshot_rows(path, batch_size=chunk):
                keep = want[slot_of(batch.ids, self.num_slots)]
                if since:
                    keep &= batch.last_time >= since
                if not keep.all():
                    batch = batch.take(keep)
                if not len(batch):
                    continue
                buffered.append(batch)
                count += len(batch)
                if count >= chunk:
                    yield self._chunk(buffered, request.weights_only, step, cut_time if first else 0.0)
                    first, buffered, count = False, [], 0
            out = self._chunk(buffered, request.weights_only, step, cut_time if first else 0.0)
            out.slots = slots.astype("<i4").tobytes()
            out.positions_epochs = positions[:, 0].astype("<u8").tobytes()
            out.positions_indexes = positions[:, 1].astype("<u8").tobytes()
            yield out
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _export_since(self, hosted: _Hosted, slots: np.ndarray, want: np.ndarray, since: float, chunk: int,
                      weights_only: bool):
        """ExportRows with ``since_time`` (serving deltas, ``tigana admin export --since/--follow``): the rows
        updated at or after ``since`` are copied in memory under the lock (the same cut as a snapshot: rows,
        positions, step and time at one moment), then streamed; its cost follows the rows changed, not the
        table's size, and no snapshot is written."""
        with hosted.lock:
            cut_time = time.time()
            rows = hosted.table.export_rows(lambda ids: want[slot_of(ids, self.num_slots)], since=since)
            positions = hosted.log.positions[slots].copy()
            step = hosted.table.step
        starts = range(0, len(rows), chunk) if len(rows) else range(1)
        for k, lo in enumerate(starts):
            part = [rows.take(slice(lo, lo + chunk))] if len(rows) else []
            out = self._chunk(part, weights_only, step, cut_time if k == 0 else 0.0)
            if lo + chunk >= len(rows):
                out.slots = slots.astype("<i4").tobytes()
                out.positions_epochs = positions[:, 0].astype("<u8").tobytes()
                out.positions_indexes = positions[:, 1].astype("<u8").tobytes()
            yield out

    def _chunk(self, batches: list, weights_only: bool, step: int, server_time: float) -> pb.ExportRowsChunk:
        from tigana.embeddings import RowBatch

        out = pb.ExportRowsChunk(step=step, server_time=server_time)
        if batches:
            rows = RowBatch.concat(batches) if len(batches) > 1 else batches[0]
            if weights_only:
                rows = RowBatch(rows.ids, rows.weights, np.zeros((len(rows), 0), np.float32), rows.update_count,
                                rows.last_step, rows.last_time)
            out.rows.CopyFrom(cluster_wire.rows_to_pb(rows))
        return out

    @_rpc("ImportRows")
    def ImportRows(self, request: pb.ImportRowsRequest, context: grpc.ServicerContext) -> pb.ImportRowsResponse:
        """Write complete rows (a restore) through this primary: replicated to the slots' copies like a push."""
        name = request.table
        hosted = self._get(name)
        rows = cluster_wire.rows_from_pb(request.rows, dim=hosted.table.dim, state_width=hosted.table.state_width,
                                         table=name)
        self._check_rows(name, len(rows))
        with hosted.lock:
            view, slots = self._check_leads(name, rows.ids, request.epoch)
            uslots = unique(slots)
            changes = Changes() if self.replicator is not None and self.replicator.streams else None
            hosted.table.import_rows(rows)
            if request.step:
                hosted.table.apply_changes(step=int(request.step))
            if changes is not None:
                changes.written.append(rows.ids)
            marks = self._replicate(hosted, view, changes, uslots, None)
        if marks and self.replicator is not None and not self.replicator.wait(marks, self.config.ack_timeout_s):
            raise Unavailable(f"table {name!r}: rows written here but not yet by the in-sync copies; retry",
                              epoch=self._view.epoch)
        self._check_unmoved(name, view, uslots)
        return pb.ImportRowsResponse(rows=len(rows))

    def _check_unmoved(self, table: str, view: _View, slots: np.ndarray) -> None:
        """After a write waited for its copies: ``Unavailable`` (retry; the write is idempotent or applied
        once) when the copies of its slots changed meanwhile, e.g. a hand-over or a copy removed, since the
        acknowledgements it got may not be those of the copies the current map names."""
        now = self._view
        if now.epoch != view.epoch and (now.map is None or (now.map.slot_epochs[slots] > view.epoch).any()
                                        or not now.leads[slots].all()):
            raise Unavailable(f"table {table!r}: the copies of the write's slots changed while it replicated "
                              f"(epoch {view.epoch} -> {now.epoch}); retry it (it is applied once)",
                              epoch=now.epoch)

    @_rpc("Replicate")
    def Replicate(self, request: pb.ReplicateRequest | cluster_wire.RawReplicate, context: grpc.ServicerContext
                  ) -> pb.ReplicateResponse:
        """Apply a primary's stream in order (``replication.apply``: invariant I3)."""
        with self._inbound_lock:
            st = self._inbound.setdefault(request.source, Inbound(request.source))
        return st.receive(request, self.server_id, lambda: self._view, self._refresh,
                          lambda msg, epoch: apply_item(msg, request.source, epoch, self._tables.get,
                                                        lambda: self._view, self.num_slots))

    # --- the map -----------------------------------------------------------------------------------------------
    def install(self, m: ShardMap) -> bool:
        """Make ``m`` this server's map if it is newer: tables created or dropped as it says, slots no longer
        held forgotten, replication streams and slot copies started or stopped. False when not newer."""
        if m.num_slots != self.num_slots:
            raise InvalidArgument(f"shard map: {m.num_slots} slots, this server runs with {self.num_slots}")
        with self._install_lock:
            old = self._view
            if m.epoch <= old.epoch:
                return False
            me = m.index_of(self.server_id)
            valid = me >= 0 and m.servers[me].boot == self.boot
            with self._registry_lock:
                self._sync_tables(m)
                hosted_all = sorted(self._tables.items())
                for _, h in hosted_all:
                    h.lock.acquire()
                try:
                    new = _View.of(m, me, valid)
                    dropped = np.flatnonzero(old.holds & ~new.holds) if old.valid else np.empty(0, np.int64)
                    self._view = new
                    for _, h in hosted_all:
                        if dropped.size:
                            h.log.reset(dropped)
                            h.dedup.forget_slots(dropped)
                        h.table.set_evictable(self._leads_ids)  # the led slots changed: recount
                    if self.replicator is not None:
                        self.replicator.on_map(m, me if valid else -1, [n for n, _ in hosted_all],
                                               lambda name, slots: self._tables[name].log.positions[slots].copy(),
                                               lambda name, slots: self._tables[name].dedup.records_for(slots))
                finally:
                    for _, h in reversed(hosted_all):
                        h.lock.release()
                if self.catalog is not None:
                    try:
                        self._save_registry()
                    except StorageError as exc:  # a cache of the map's tables: written again at the next change
                        log.warning("saving the table registry failed: %s", exc)
        if new.valid and (not old.valid or dropped.size):
            threading.Thread(target=self._drop_unheld, name="tigana-drop-slots", daemon=True).start()
        if new.fenced.any():
            self._start_hand_over()
        if self.on_install is not None:
            self.on_install()
        was_leading = old.leads if old.valid else np.zeros(self.num_slots, bool)
        was_holding = old.holds if old.valid else np.zeros(self.num_slots, bool)
        gained, lost = np.flatnonzero(new.leads & ~was_leading), np.flatnonzero(was_leading & ~new.leads)
        added = np.flatnonzero(new.holds & ~was_holding & ~new.leads)
        log.info("server %s installed map epoch %d: leads %d slot(s) (new: %s; no longer: %s), holds %d (new copies: "
                 "%s; dropped: %s)%s", self.server_id, m.epoch, int(new.leads.sum()), slots_text(gained),
                 slots_text(lost), int(new.holds.sum()), slots_text(added), slots_text(dropped),
                 "" if valid else " (this process is not in it yet)",
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

    def _drop_unheld(self) -> None:
        """Delete the rows of slots this server no longer holds, checked against the map current at each step:
        the ids are found outside the table's write lock and deleted a chunk per lock hold, so pushes to the
        slots it still leads are not held up by a large delete."""
        for name in self.table_names():
            hosted = self._tables.get(name)
            if hosted is None or not self._view.valid:
                continue
            ids = hosted.table.stored_ids()
            if not ids.size:
                continue
            gone = ids[~self._view.holds[slot_of(ids, self.num_slots)]]
            deleted = 0
            for lo in range(0, gone.size, _COPY_CHUNK * 4):
                chunk = gone[lo:lo + _COPY_CHUNK * 4]
                with hosted.lock:
                    view = self._view
                    if not view.valid or self._tables.get(name) is not hosted:
                        break
                    chunk = chunk[~view.holds[slot_of(chunk, self.num_slots)]]  # not taken back meanwhile
                    if chunk.size:
                        deleted += hosted.table.delete(chunk)
            if deleted:
                view = self._view
                slots = unique(slot_of(gone, self.num_slots))
                log.info("server %s at epoch %d: table %r: deleted %d row(s) of slots no longer held (slots %s)",
                         self.server_id, view.epoch, name, deleted, slots_text(slots),
                         extra=event("rows_dropped", slots=slots, epoch=view.epoch, server=self.server_id, table=name,
                                     rows=deleted))

    def _copy_rows(self, stream: Stream, sess: Any) -> None:
        """The rows of a slot copy: each chunk exported and enqueued under the table's write lock, so it sits
        in the stream after every write it reflects and before every later one."""
        assert self.replicator is not None
        want = np.zeros(self.num_slots, bool)
        want[sess.slots] = True
        for name in sess.tables:
            hosted = self._tables.get(name)
            if hosted is None:
                continue
            ids = hosted.table.stored_ids()
            ids = np.sort(ids[want[slot_of(ids, self.num_slots)]]) if ids.size else ids
            sess.rows_total += int(ids.size)  # progress of the copy (heartbeats carry it to the scheduler)
            for start in range(0, ids.shape[0], _COPY_CHUNK):
                self.replicator.wait_for_room(stream)
                chunk = ids[start:start + _COPY_CHUNK]
                with hosted.lock:
                    rows = hosted.table.export_rows(ids=chunk)
                    if not len(rows):
                        continue
                    item = Item(SNAPSHOT_ROWS, name, np.unique(slot_of(rows.ids, self.num_slots)).astype(np.int32),
                                rows=rows)
                    if not self.replicator.enqueue_rows(stream, sess, item):
                        return

    def maintain(self) -> None:
        """Periodic work (the daemon calls it about once a second): decay request rates, restart broken
        streams nothing depends on, report again what the scheduler missed."""
        now = time.monotonic()
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
                self.replicator.on_map(view.map, view.me if view.valid else -1, [n for n, _ in hosted_all],
                                       lambda name, slots: self._tables[name].log.positions[slots].copy(),
                                       lambda name, slots: self._tables[name].dedup.records_for(slots))
            finally:
                for _, h in reversed(hosted_all):
                    h.lock.release()

    # --- links to the scheduler (the daemon's agent) ------------------------------------------------------
    def _refresh(self, epoch: int, wait_s: float = 0.0) -> None:
        if self.agent is not None:
            self.agent.refresh(epoch, wait_s)

    def _report_failure(self, target: str, slots: np.ndarray, reason: str) -> None:
        if self.agent is not None:
            self.agent.report_copy_failure(target, slots, reason)

    def _start_hand_over(self) -> None:
        with self._install_lock:
            if self._handover_thread is None:
                self._handover_thread = threading.Thread(target=self._hand_over_loop, name="tigana-hand-over",
                                                         daemon=True)
                self._handover_thread.start()
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
        if self.replicator.wait(self.replicator.tail_marks(fenced), timeout_s) and self._view is view \
                and self.state != "closed":
            self.agent.handover_ready(fenced.astype(np.int32), view.epoch)
            return True
        return False

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

    # --- persistence ----------------------------------------------------------------------------------------
    def _need_catalog(self, what: str) -> Catalog:
        if self.catalog is None:
            raise InvalidArgument(f"{what}: this server has no data dir (start it with --data-dir)")
        return self.catalog

    def _save_registry(self, without: str | None = None) -> None:
        """Persist the table registry (less ``without``); ``StorageFull`` when the disk is full."""
        if self.catalog is None:
            return
        self.catalog.save_tables([h.spec for n, h in self._tables.items() if n != without], self.num_slots,
                                 None if self.clustered else self.config.slots)

    def _complete_slots(self) -> np.ndarray:
        """Slots whose copy here is complete (led, or in sync): the only positions a snapshot keeps, since an
        unclean election trusts them."""
        view = self._view
        if view.map is None:
            return view.holds
        return view.leads | (view.map.copy_state(view.me) == 0) if view.valid else view.holds

    def snapshot_all(self, *, incremental: bool = False) -> tuple[list[Path], int]:
        """Snapshot every table with its exactly-once window and log positions; (paths, rows)."""
        catalog = self._need_catalog("Snapshot")
        paths: list[Path] = []
        rows = 0
        with self._registry_lock:
            hosted_tables = sorted(self._tables.items())
            self._save_registry()
        for name, hosted in hosted_tables:
            # The cut is opened under the write lock with the window and positions (one moment), and written
            # after it is released: pushes go on while the rows are read (copy-on-write, ``Cut``).
            with hosted.table.snapshot_turn():  # a snapshot of this table in progress: waited for without the lock
                with hosted.lock:
                    if self._tables.get(name) is not hosted:  # dropped or replaced meanwhile
                        continue
                    pending = catalog.begin_snapshot(hosted.table, hosted.dedup, hosted.log, incremental=incremental,
                                                     complete=self._complete_slots())
                    rows += len(hosted.table)
                try:
                    path = pending.write()
                except Exception:
                    if self._tables.get(name) is not hosted:  # dropped while it was written
                        continue
                    raise
            paths.append(path)
            if not incremental:
                catalog.prune(name, self.config.keep_snapshots)
        log.info("snapshot (%s) of %d table(s), %d rows", "incremental" if incremental else "full",
                 len(paths), rows)
        return paths, rows

    def _restore_one(self, path: Path, spec: TableDef | None) -> _Hosted:
        catalog = self.catalog or Catalog(path)

        def configure(stored: TableConfig) -> TableConfig:  # this daemon's memory settings, not the writer's
            own = spec.config if spec is not None else None
            return self._effective(dataclasses.replace(
                stored, memory_budget=own.memory_budget if own else None, spill_dir=own.spill_dir if own else None,
                spill_max_bytes=own.spill_max_bytes if own else None))

        restored = catalog.restore(path, num_slots=self.num_slots, dedup_size=self.config.dedup_window,
                                   configure=configure)
        if spec is None:
            spec = TableDef(dataclasses.replace(restored.table.config, spill_dir=None))
        return self._new_hosted(spec, restored.table, restored.dedup, restored.log)

    def restore(self, path: str | os.PathLike | None = None) -> int:
        """Static mode: replace tables by snapshots: ``path`` None restores every registered table from its
        newest snapshot chain in the data dir; a path restores the one table snapshot there. Rows restored."""
        with self._registry_lock:
            fresh: dict[str, _Hosted] = {}
            try:
                if path is None:
                    catalog = self._need_catalog("Restore")
                    for name, hosted in self._tables.items():
                        latest = catalog.latest(name)
                        if latest is not None:
                            fresh[name] = self._restore_one(latest, hosted.spec)
                else:
                    restored = self._restore_one(Path(path), None)
                    old = self._tables.get(restored.spec.config.name)
                    if old is not None:
                        restored.spec = old.spec
                    fresh[restored.spec.config.name] = restored
            except BaseException:
                for hosted in fresh.values():  # all or nothing: the served tables stay as they were
                    hosted.table.close()
                raise
            replaced = {name: self._tables.get(name) for name in fresh}
            self._tables.update(fresh)
            self._save_registry()
            for old in replaced.values():
                if old is not None:
                    with old.lock:
                        old.table.close()
        rows = sum(len(h.table) for h in fresh.values())
        log.info("restored %d table(s), %d rows", len(fresh), rows)
        return rows

    def load(self) -> None:
        """At start: re-create every table of the catalog from its newest snapshot chain when there is one.

        The catalog's ``num_slots`` (and, for a static shard list, its slots) must match the config: a server
        must never answer for slots whose rows it does not have."""
        if self.catalog is None:
            return
        try:
            tables, num_slots, slots = self.catalog.load_tables()
        except CorruptStore as exc:
            if not self.clustered:
                raise
            self._quarantine(None, exc)  # the scheduler's map names the tables again
            tables, num_slots, slots = [], None, None
        if num_slots is not None and int(num_slots) != self.num_slots:
            raise InvalidArgument(f"data dir {str(self.data_dir)!r} holds tables of {num_slots} slots; the server "
                                  f"was started with --num-slots {self.num_slots}")
        if tables and not self.clustered and slots is not None and not self._same_slots(slots):
            raise InvalidArgument(f"data dir {str(self.data_dir)!r} holds the rows of slots {slots!r}; the server "
                                  f"was started with --slots {self.config.slots!r} and would answer for slots it "
                                  "has no rows of (move slots with a scheduler instead)")
        for spec in tables:
            name = spec.config.name
            latest = self.catalog.latest(name)
            shutil.rmtree(self.catalog.dir("spill", name), ignore_errors=True)  # a dead process's spill tier
            hosted = None
            if latest is not None:
                try:
                    hosted = self._restore_one(latest, spec)
                    log.info("restored table %r from %s (%d rows)", name, latest, len(hosted.table))
                except (CorruptStore, SnapshotNotFound) as exc:
                    if not self.clustered:  # no replica to rebuild from: the operator decides
                        raise
                    self._quarantine(name, exc)
            if hosted is None:
                hosted = self._new_hosted(spec)
                log.info("re-created table %r (no snapshot)", name)
            self._tables[name] = hosted
        self._rebudget()
        self._save_registry()

    def _quarantine(self, table: str | None, exc: Exception) -> None:
        """A clustered server that finds a store corrupt at start moves it aside and starts that table empty.

        Safe because a restarted server never serves its old rows: the scheduler demotes every copy of a new
        boot and rebuilds it from the slot's primary, and an empty table has no log positions, so it can
        never win an election over a copy that has rows."""
        where = self.catalog.quarantine(table)
        self.corrupt_stores += 1
        log.error("%s: %s; moved to %s; starting %s empty, to be rebuilt from replicas",
                  "table registry" if table is None else f"table {table!r}", exc, where,
                  "with no tables" if table is None else "it")

    def _same_slots(self, saved: str) -> bool:
        try:
            return bool(np.array_equal(parse_slots(saved, self.num_slots), self.config.owned_slots()))
        except ValueError:
            return False

    def close_tables(self) -> None:
        self._frame_pool.shutdown(wait=False, cancel_futures=True)
        if self.replicator is not None:
            self.replicator.close()
        with self._registry_lock:
            for hosted in self._tables.values():
                with hosted.lock:
                    try:
                        hosted.table.close()
                    except Exception:  # noqa: BLE001 - close the others regardless
                        log.exception("closing table %r failed", hosted.spec.config.name)
            self._tables.clear()


def add_to_server(service: ShardService, server: grpc.Server) -> None:
    """Register ``service`` on ``server`` (every method of proto/shard.proto), with the data path's own
    (de)serializers: Push requests parsed into zero-copy views (``wire.decode_push_request``), Pull replies
    written as bytes in one copy (``ShardService.pull_serialized``), replication streams decoded as views.
    A request that does not parse answers INVALID_ARGUMENT (``rpc.register``)."""
    rpc.register(server, pb.DESCRIPTOR.services_by_name["Shard"], service, {
        "Pull": (service.pull_serialized, pb.PullRequest.FromString, wire.identity),
        "Push": (service.Push, wire.decode_push_request, pb.PushResponse.SerializeToString),
        "Exchange": (service.Exchange, frames.read_request, wire.identity),
        "Replicate": (service.Replicate, cluster_wire.decode_replicate_request,
                      pb.ReplicateResponse.SerializeToString),
    })
