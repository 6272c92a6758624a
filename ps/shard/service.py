"""``ShardService``: the gRPC face of one shard server, assembled from its rooms (``hosted``, ``ownership``,
``writes``, ``export``, ``persistence``), with the table RPCs, the data path's handlers (``Pull``, ``Push``,
the ``Exchange`` stream), ``Snapshot``, ``Restore``, ``InstallMap`` and ``Replicate``; and ``add_to_server``.

Each handler decodes the request with ``tigana.ps.wire.data``, checks it against the table and the shard map, calls
the table, and encodes the answer; every exception becomes a status in one place (``_guard._rpc``, over ``rpc.guard``).
Thread-safety: handlers run on gRPC's thread pool (see the ``tigana.ps.shard`` docstring for the locks).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from tigana.proto import shard_pb2 as pb
from tigana.proto import shard_pb2_grpc
from tigana.ps import rpc
from tigana.ps.catalog import Catalog
from tigana.ps.config import ServerConfig
from tigana.ps.errors import DeadlineExceeded, InvalidArgument, TableExists
from tigana.ps.metrics import ServerMetrics
from tigana.ps.replication import Inbound, Replicator, apply_item, copy_lane_ready
from tigana.ps.replication.actions import RefreshMap
from tigana.ps.security import NONE, Security
from tigana.ps.shard import streams
from tigana.ps.shard._guard import _rpc, check_serving
from tigana.ps.shard.cuts import Cuts
from tigana.ps.shard.export import Exports
from tigana.ps.shard.hosted import Hosting, _Hosted
from tigana.ps.shard.ownership import Ownership, _View
from tigana.ps.shard.persistence import Persistence
from tigana.ps.shard.writes import Writes
from tigana.ps.wire import cluster as cluster_wire
from tigana.ps.wire import data as wire
from tigana.ps.wire import frames

log = logging.getLogger("tigana.ps.server")  # one logger for the whole shard server

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Shard"].full_name  # "tigana.v1.Shard"
_BAD_NAME = re.compile(r"[\x00-\x1f\x7f]")


class ShardService(Ownership, Writes, Exports, Cuts, Persistence, Hosting, shard_pb2_grpc.ShardServicer):
    """The tables and slot copies of one shard server. ``state`` is loading -> serving -> closed.

    ``agent`` (set by the daemon in cluster mode) is the link to the scheduler: ``refresh(epoch)``,
    ``report_copy_failure(target, slots, reason, epoch)``, ``copy_caught_up(target, slots)``.

    Assembled from one room per concept (see the ``tigana.ps.shard`` docstring); this module holds the
    remaining handlers."""

    def __init__(self, config: ServerConfig, metrics: ServerMetrics | None = None, *,
                 security: Security = NONE, clock: Callable[[], float] = time.monotonic,
                 spawn: Callable[[str, Callable[[], None]], None] | None = None, boot: str | None = None,
                 generation: int | None = None) -> None:
        self.config = config
        self.security = security
        self.metrics = metrics or ServerMetrics(self.table_sizes, self.cluster_figures)
        self.state = "loading"
        self.num_slots = config.num_slots
        self.data_dir = Path(config.data_dir) if config.data_dir else None
        self.catalog = Catalog(self.data_dir) if self.data_dir is not None else None
        self.server_id = (self.catalog.server_id(config.server_id) if self.catalog is not None
                          else config.server_id or uuid.uuid4().hex[:12])
        # This process's incarnation (a simulator names its own, so that a seed replays to the byte).
        self.boot = boot or uuid.uuid4().hex[:12]
        self.clustered = config.scheduler is not None
        self.corrupt_stores = 0  # stores found corrupt at start and quarantined (clustered servers)
        self.agent: Any = None
        self.on_install: Callable[[], None] | None = None  # the daemon's health update
        self.wall_clock: Callable[[], float] = lambda: time.time()  # a cut's server_time (tables stamp their rows)
        self._tables: dict[str, _Hosted] = {}
        self._registry_lock = threading.RLock()
        self._install_lock = threading.Lock()
        self._inbound: dict[str, tuple[Inbound, threading.Lock]] = {}
        self._inbound_lock = threading.Lock()
        self._handover_wake = threading.Event()
        self._drop_lock = threading.Lock()
        self._drop_wanted = self._drop_running = False  # rows of slots no longer held to delete; a worker at it
        self._handover_started = False
        self.clock = clock  # request-rate decay (the replicator's events read it too)
        self._last_decay = clock()
        self._cuts: dict[str, Any] = {}
        self._cuts_lock = threading.Lock()
        self._streams = 0  # Exchange streams open
        self._streams_lock = threading.Lock()
        self._frame_pool = futures.ThreadPoolExecutor(max_workers=config.max_workers,
                                                      thread_name_prefix="tigana-frame")
        # ``Replicate`` and ``InstallMap`` run here, not on the gRPC server's pool (``add_to_server``): a unary
        # sync push or ``ImportRows`` holds a thread of that pool while it waits for its copies, and a paused
        # copy could then hold every one of them, starving the replication and the maps into this server.
        self._control_pool = futures.ThreadPoolExecutor(max_workers=config.max_workers,
                                                        thread_name_prefix="tigana-control")
        if self.clustered:
            self._view = _View.waiting(self.num_slots)
            self.replicator: Replicator | None = Replicator(
                self.server_id, self.boot, self.num_slots, max_message_bytes=config.max_message_bytes,
                refresh_map=self._refresh, report_failure=self._report_failure, caught_up=self._caught_up,
                copy_rows=self._copy_rows, failure_timeout_s=config.replication_timeout_s,
                max_queue_bytes=config.replication_queue_bytes, copy_rate=config.copy_rate,
                channel=security.channel, clock=clock, spawn=spawn,
                generation=generation)
        else:
            self._view = _View.static(config.owned_slots())
            self.replicator = None

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

    @_rpc("Pull")
    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> pb.PullResponse:
        _, rows, codec = self._pull(request, context.time_remaining())
        return pb.PullResponse(rows=wire.encode_rows(rows, codec))

    @_rpc("Pull")
    def pull_serialized(self, request: pb.PullRequest, context: grpc.ServicerContext) -> bytes:
        """``Pull`` answering the serialized ``PullResponse`` (written in one copy by ``wire``), for the
        bytes response serializer ``add_to_server`` registers."""
        _, rows, codec = self._pull(request, context.time_remaining())
        return wire.encode_pull_response(rows, codec)

    @_rpc("Push")
    def Push(self, request: pb.PushRequest | wire.RawPush, context: grpc.ServicerContext) -> pb.PushResponse:
        """Apply a gradient block; ``request`` is the protobuf message or ``wire.decode_push_request``'s views."""
        return self._push(request, context.time_remaining())

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

    def _answer_frame(self, frame: frames.Frame, received: float) -> bytes | Callable[[], bytes]:
        """One frame of an ``Exchange`` stream, answered as the unary call would be (never raises). Handled on
        the stream's reader thread: a pull, an async push or a sync push with no copy to wait for returns its
        answer; a sync push returns, once applied, the wait for its copies' acknowledgements (a callable the
        stream runs on the frame pool), so a stream's frames never queue behind a replication round trip."""
        return self._frame_step(frame, time.perf_counter(), lambda: self._apply_frame(frame, received))

    def _apply_frame(self, frame: frames.Frame, received: float) -> bytes | Callable[[], bytes]:
        method = frames.KINDS[frame.kind]
        rpc.check(frame.request)
        check_serving(self, method)
        left = frame.timeout_ms / 1000 - (time.monotonic() - received) if frame.timeout_ms else None
        if left is not None and left < 0:
            raise DeadlineExceeded(f"table {frame.request.table!r}: {method} frame waited past its "
                                   f"deadline ({frame.timeout_ms} ms) before it was handled; not applied")
        if frame.kind == frames.PULL:
            _, rows, codec = self._pull(frame.request, left)
            return frames.pull_answer(frame.id, rows, codec)
        pushed = self._push_apply(frame.request, left)
        if not pushed.marks or self.replicator is None:
            return frames.push_answer(frame.id, self._push_ack(pushed, self.config.ack_timeout_s))
        replicator = self.replicator

        def start(finish: Callable[[Callable[[], bytes]], None]) -> None:
            # the answer is made by whoever settles the wait (an acknowledgement, a map, the deadline)
            replicator.when_done(pushed.marks, self.config.ack_timeout_s, lambda done: finish(
                lambda: frames.push_answer(frame.id, self._push_answer(pushed, done))))
        return streams.Deferred(start)

    def _frame_step(self, frame: frames.Frame, start: float, step: Callable[[], bytes | Callable[[], bytes]]
                    ) -> bytes | Callable[[], bytes]:
        """Run one step of a frame: its answer (an error becomes the frame's error answer, and the frame's
        time is observed), or the next step, wrapped the same way."""
        method = frames.KINDS[frame.kind]
        status: grpc.StatusCode | None = None
        try:
            out = step()
        except Exception as exc:  # noqa: BLE001 - a frame never takes the stream or the daemon down
            status = rpc.answer_status(exc, f"{method} frame", log)[0]
            out = frames.error_answer(frame.id, exc, self._view.epoch)
        if isinstance(out, streams.Deferred):
            inner = out
            return streams.Deferred(lambda finish: inner.start(
                lambda step: finish(lambda: self._frame_step(frame, start, step))))  # type: ignore[arg-type,return-value]
        if not isinstance(out, bytes):
            later = out
            return lambda: self._frame_step(frame, start, later)  # type: ignore[return-value]
        self.metrics.observe(method, status.name if status else "OK", time.perf_counter() - start)
        return out

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

    @_rpc("InstallMap")
    def InstallMap(self, request: pb.InstallMapRequest, context: grpc.ServicerContext) -> pb.InstallMapResponse:
        if not self.clustered:
            raise InvalidArgument("InstallMap: this server was started without --scheduler")
        self.install(cluster_wire.map_from_pb(request.map))
        return pb.InstallMapResponse(epoch=self._view.epoch)

    @_rpc("Replicate")
    def Replicate(self, request: pb.ReplicateRequest | cluster_wire.RawReplicate, context: grpc.ServicerContext
                  ) -> pb.ReplicateResponse:
        """Apply a primary's stream in order (``replication.apply``: invariant I3), one lane at a time: the
        change lane, and the copy lane (a slot copy's rows), whose items wait for the change lane (S11)."""
        source, lane = request.source, int(getattr(request, "lane", 0))
        with self._inbound_lock:
            change = self._inbound.setdefault(source, (Inbound(source), threading.Lock()))[0]
            st, lock = self._inbound.setdefault(f"{source}\0copy" if lane else source,
                                                (Inbound(source), threading.Lock()))

        ready = copy_lane_ready(change, request.source_boot, request.generation)

        def apply_one(msg: Any, epoch: int) -> Any:
            return apply_item(msg, source, epoch, self._tables.get, lambda: self._view, self.num_slots,
                              generation=request.generation, copy_ready=ready if lane else None)

        with lock:  # one stream's requests apply one at a time, in order
            out = st.receive(request, self.server_id, lambda: self._view, apply_one)
            if isinstance(out, RefreshMap):  # the source's map is newer: learn it, then apply (or refuse BEHIND)
                self._refresh(out.epoch, 2.0)
                out = st.receive(request, self.server_id, lambda: self._view, apply_one, may_refresh=False)
        return out

    def close_tables(self) -> None:
        self._frame_pool.shutdown(wait=False, cancel_futures=True)
        self._control_pool.shutdown(wait=False, cancel_futures=True)
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
    A request that does not parse answers INVALID_ARGUMENT (``rpc.register``). ``Replicate`` and
    ``InstallMap`` run on the service's control pool, apart from the data path's (``_on_control_pool``)."""
    rpc.register(server, pb.DESCRIPTOR.services_by_name["Shard"], service, {
        "Pull": (service.pull_serialized, pb.PullRequest.FromString, wire.identity),
        "Push": (service.Push, wire.decode_push_request, pb.PushResponse.SerializeToString),
        "Exchange": (service.Exchange, frames.read_request, wire.identity),
        "Replicate": (_on_control_pool(service, service.Replicate), cluster_wire.decode_replicate_request,
                      pb.ReplicateResponse.SerializeToString),
        "InstallMap": (_on_control_pool(service, service.InstallMap), pb.InstallMapRequest.FromString,
                       pb.InstallMapResponse.SerializeToString),
    })


def _on_control_pool(service: ShardService, handler: Callable[[Any, grpc.ServicerContext], Any]
                     ) -> Callable[[Any, grpc.ServicerContext], Any]:
    """``handler``, run by gRPC on ``service``'s control pool instead of the server's thread pool (gRPC's
    per-method pool: a handler's ``experimental_thread_pool``; ``tests/ps/test_shard_pools.py`` holds it)."""
    def run(request: Any, context: grpc.ServicerContext) -> Any:
        return handler(request, context)

    run.experimental_thread_pool = service._control_pool  # type: ignore[attr-defined]
    return run
