"""``ShardService``: the gRPC face of one shard server, a thin adapter over its objects (``HostedTables``,
``Persistence``, ``Holdings``, ``Ownership``, ``WritePath``, ``Exports``, ``Cuts``, ``Receiver``): each handler
decodes the request, calls them, and encodes the answer; and ``add_to_server``.

Every exception becomes a status in one place (``_guard._rpc``, over ``rpc.guard``). Thread-safety: handlers
run on gRPC's thread pool (see the ``tigana.ps.shard`` docstring for the locks).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tigana.proto import shard_pb2 as pb
from tigana.proto import shard_pb2_grpc
from tigana.ps import rpc
from tigana.ps.errors import DeadlineExceeded, InvalidArgument
from tigana.ps.metrics import ServerMetrics
from tigana.ps.replication import Replicator
from tigana.ps.routing import ShardMap
from tigana.ps.security import NONE, Security
from tigana.ps.shard import multitable, streams
from tigana.ps.shard._guard import _rpc, check_serving
from tigana.ps.shard.catalog import Catalog
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.cuts import Cuts
from tigana.ps.shard.export import Exports
from tigana.ps.shard.hosted import HostedTables, _Hosted
from tigana.ps.shard.links import ServerLinks
from tigana.ps.shard.ownership import Ownership
from tigana.ps.shard.persistence import Persistence
from tigana.ps.shard.receiver import Receiver
from tigana.ps.shard.view import Holdings
from tigana.ps.shard.writes import WritePath, copy_slot_rows
from tigana.ps.wire import cluster as cluster_wire
from tigana.ps.wire import data as wire
from tigana.ps.wire import frames

log = logging.getLogger("tigana.ps.server")  # one logger for the whole shard server

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Shard"].full_name  # "tigana.v1.Shard"


class ShardService(shard_pb2_grpc.ShardServicer):
    """One shard server: its objects, and the gRPC handlers over them. ``state`` is loading -> serving -> closed.

    ``agent`` (set by the daemon in cluster mode) is the link to the scheduler: ``refresh(epoch)``,
    ``report_copy_failure(target, slots, reason, epoch)``, ``copy_caught_up(target, slots)``.

    The objects (each documented in its module; a simulator or a test drives them without gRPC):
    ``tables`` (``HostedTables``), ``persistence``, ``holdings`` (the view), ``ownership`` (map installs,
    hand-overs), ``writes`` (``WritePath``), ``exports``, ``cuts``, ``receiver`` (the replication streams in),
    ``replicator`` (None on a static server) and ``links`` (state and agent)."""

    def __init__(self, config: ServerConfig, metrics: ServerMetrics | None = None, *,
                 security: Security = NONE, clock: Callable[[], float] = time.monotonic,
                 spawn: Callable[[str, Callable[[], None]], None] | None = None, boot: str | None = None,
                 generation: int | None = None, wall_clock: Callable[[], float] | None = None) -> None:
        """``clock``: monotonic time (replication deadlines, request-rate decay); ``wall_clock``: the time rows
        and cuts are stamped with (default ``time.time``, looked up at each call); a simulator passes its world's."""
        self.config = config
        self.security = security
        self.num_slots = config.num_slots
        data_dir = Path(config.data_dir) if config.data_dir else None
        self.catalog = Catalog(data_dir) if data_dir is not None else None
        self.server_id = (self.catalog.server_id(config.server_id) if self.catalog is not None
                          else config.server_id or uuid.uuid4().hex[:12])
        # This process's incarnation (a simulator names its own, so that a seed replays to the byte).
        self.boot = boot or uuid.uuid4().hex[:12]
        self.clustered = config.scheduler is not None
        self.links = ServerLinks()
        self.holdings = Holdings(self.server_id, self.num_slots, self.links, clustered=self.clustered,
                                 owned=None if self.clustered else config.owned_slots())
        self.tables = HostedTables(config, self.catalog, clustered=self.clustered,
                                   epoch=lambda: self.holdings.epoch, leads_ids=self.holdings.leads_ids,
                                   wall_clock=wall_clock)
        self.persistence = Persistence(config, self.tables, self.holdings, self.catalog, clustered=self.clustered)
        self.replicator: Replicator | None = None
        if self.clustered:
            tables, links = self.tables, self.links

            def copy_rows(stream: Any, sess: Any) -> None:  # the replicator's slot copies read the tables
                copy_slot_rows(replicator, tables, stream, sess)

            # the replicator's callbacks go to the agent (``links``), never back into this server's objects
            replicator = self.replicator = Replicator(
                self.server_id, self.boot, self.num_slots, max_message_bytes=config.max_message_bytes,
                refresh_map=links.refresh, report_failure=links.report_failure, caught_up=links.caught_up,
                copy_rows=copy_rows, failure_timeout_s=config.replication_timeout_s,
                max_queue_bytes=config.replication_queue_bytes, copy_rate=config.copy_rate,
                channel=security.channel, clock=clock, spawn=spawn, generation=generation)
        self.ownership = Ownership(config, self.server_id, self.boot, self.holdings, self.tables, self.persistence,
                                   self.replicator, self.links, clock=clock)
        self.metrics = metrics or ServerMetrics(self.tables.sizes, self.ownership.cluster_figures)
        self.writes = WritePath(config, self.tables, self.holdings, self.replicator, self.metrics, self.links,
                                self.server_id)
        # a cut's server_time: the clock the tables stamp their rows with
        self.cuts = Cuts(self.tables, self.holdings, self.tables.wall_clock)
        self.exports = Exports(self.tables, self.holdings, self.writes, self.cuts, self.replicator, self.links,
                               server_id=self.server_id, data_dir=data_dir, ack_timeout_s=config.ack_timeout_s)
        self.receiver = Receiver(self.server_id, self.tables, self.holdings, self.links)
        self._streams = 0  # Exchange streams open
        self._streams_lock = threading.Lock()
        self._frame_pool = futures.ThreadPoolExecutor(max_workers=config.max_workers,
                                                      thread_name_prefix="tigana-frame")
        # ``Replicate`` and ``InstallMap`` run here, not on the gRPC server's pool (``add_to_server``): a unary
        # sync push or ``ImportRows`` holds a thread of that pool while it waits for its copies, and a paused
        # copy could then hold every one of them, starving the replication and the maps into this server.
        self._control_pool = futures.ThreadPoolExecutor(max_workers=config.max_workers,
                                                        thread_name_prefix="tigana-control")

    # --- what the daemon (and a simulator) reads and sets ---------------------------------------------------
    @property
    def state(self) -> str:
        """loading -> serving -> closed (or failed); every RPC is refused while not serving."""
        return self.links.state

    @state.setter
    def state(self, value: str) -> None:
        self.links.state = value

    @property
    def agent(self) -> Any:
        """The membership agent (the link to the scheduler), None until the daemon sets it."""
        return self.links.agent

    @agent.setter
    def agent(self, value: Any) -> None:
        self.links.agent = value

    @property
    def on_install(self) -> Callable[[], None] | None:
        """Called after each map install (the daemon's health update)."""
        return self.links.on_install

    @on_install.setter
    def on_install(self, value: Callable[[], None] | None) -> None:
        self.links.on_install = value

    @property
    def epoch(self) -> int:
        return self.holdings.epoch

    def table_names(self) -> list[str]:
        return self.tables.names()

    def table_sizes(self) -> dict[str, dict[str, float]]:
        return self.tables.sizes()

    def load_figures(self) -> dict[str, float]:
        return self.tables.load_figures()

    def cluster_figures(self) -> dict[str, float]:
        return self.ownership.cluster_figures()

    def catching_up(self) -> int:
        return self.ownership.catching_up()

    def install(self, m: ShardMap) -> bool:
        return self.ownership.install(m)

    def maintain(self) -> None:
        self.ownership.maintain()

    def hand_over(self, timeout_s: float) -> bool:
        return self.ownership.hand_over(timeout_s)

    def positions(self) -> list[pb.SlotTableInfo]:
        return self.ownership.positions()

    def owned_slots(self) -> np.ndarray:
        return self.holdings.owned_slots()

    def set_owned_slots(self, mask: np.ndarray) -> None:
        self.holdings.set_owned_slots(mask)

    def snapshot_all(self, *, incremental: bool = False) -> tuple[list[Path], int]:
        return self.persistence.snapshot_all(incremental=incremental)

    def restore(self, path: str | None = None) -> int:
        return self.persistence.restore(path)

    def load(self) -> None:
        self.persistence.load()

    def slot_info(self, name: str, hosted: _Hosted, *, checksums: bool, slots: np.ndarray | None = None
                  ) -> pb.SlotTableInfo:
        return self.exports.slot_info(name, hosted, checksums=checksums, slots=slots)

    # --- handlers -------------------------------------------------------------------------------------------
    @_rpc("CreateTable")
    def CreateTable(self, request: pb.CreateTableRequest, context: grpc.ServicerContext) -> pb.CreateTableResponse:
        spec, created = self.tables.create_table(cluster_wire.table_def_from_pb(request.spec),
                                                 exist_ok=request.exist_ok)
        return pb.CreateTableResponse(spec=cluster_wire.table_def_to_pb(spec), created=created)

    @_rpc("DescribeTable")
    def DescribeTable(self, request: pb.DescribeTableRequest, context: grpc.ServicerContext
                      ) -> pb.DescribeTableResponse:
        hosted = self.tables.get(request.table)
        stats = pb.TableStats(table=request.table, values=self.exports.values(request.table, hosted, checksum=False))
        return pb.DescribeTableResponse(spec=cluster_wire.table_def_to_pb(hosted.spec), stats=stats)

    @_rpc("DropTable")
    def DropTable(self, request: pb.DropTableRequest, context: grpc.ServicerContext) -> pb.DropTableResponse:
        return pb.DropTableResponse(dropped=self.tables.drop_table(request.table))

    @_rpc("ListTables")
    def ListTables(self, request: pb.ListTablesRequest, context: grpc.ServicerContext) -> pb.ListTablesResponse:
        hosted = [self.tables.find(n) for n in self.tables.names()]
        return pb.ListTablesResponse(tables=[cluster_wire.table_def_to_pb(h.spec) for h in hosted if h is not None])

    @_rpc("Pull")
    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> pb.PullResponse:
        _, rows, codec = self.writes.pull(request, context.time_remaining())
        return pb.PullResponse(rows=wire.encode_rows(rows, codec))

    @_rpc("Pull")
    def pull_serialized(self, request: pb.PullRequest, context: grpc.ServicerContext) -> bytes:
        """``Pull`` answering the serialized ``PullResponse`` (written in one copy by ``wire``), for the
        bytes response serializer ``add_to_server`` registers."""
        _, rows, codec = self.writes.pull(request, context.time_remaining())
        return wire.encode_pull_response(rows, codec)

    @_rpc("Push")
    def Push(self, request: pb.PushRequest | wire.RawPush, context: grpc.ServicerContext) -> pb.PushResponse:
        """Apply a gradient block; ``request`` is the protobuf message or ``wire.decode_push_request``'s views."""
        return self.writes.push(request, context.time_remaining())

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
            what = f"table {frame.request.table!r}" if frame.kind in (frames.PULL, frames.PUSH) else \
                f"tables {[r.table for r in frame.request]}"
            raise DeadlineExceeded(f"{what}: {method} frame waited past its deadline ({frame.timeout_ms} ms) "
                                   "before it was handled; not applied")
        if frame.kind == frames.PULLS:
            return multitable.pull_many(self.writes, frame.id, frame.request, left)
        if frame.kind == frames.PUSHES:
            return multitable.push_many(self.writes, self.replicator, frame.id, frame.request, left,
                                        self.config.ack_timeout_s)
        if frame.kind == frames.PULL:
            _, rows, codec = self.writes.pull(frame.request, left)
            return frames.pull_answer(frame.id, rows, codec)
        pushed = self.writes.push_apply(frame.request, left)
        if not pushed.marks or self.replicator is None:
            return frames.push_answer(frame.id, self.writes.push_ack(pushed, self.config.ack_timeout_s))
        replicator = self.replicator

        def start(finish: Callable[[Callable[[], bytes]], None]) -> None:
            # the answer is made by whoever settles the wait (an acknowledgement, a map, the deadline)
            replicator.when_done(pushed.marks, self.config.ack_timeout_s, lambda done: finish(
                lambda: frames.push_answer(frame.id, self.writes.push_answer(pushed, done))))
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
            out = frames.error_answer(frame.id, exc, self.holdings.epoch)
        if isinstance(out, streams.Deferred):
            inner = out
            return streams.Deferred(lambda finish: inner.start(
                lambda step: finish(lambda: self._frame_step(frame, start, step))))  # type: ignore[arg-type,return-value]
        if not isinstance(out, bytes):
            later = out
            return lambda: self._frame_step(frame, start, later)  # type: ignore[return-value]
        self.metrics.observe(method, status.name if status else "OK", time.perf_counter() - start)
        return out

    @_rpc("Stats")
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        return pb.StatsResponse(tables=self.exports.stats(request.table))

    @_rpc("SlotInfo")
    def SlotInfo(self, request: pb.SlotInfoRequest, context: grpc.ServicerContext) -> pb.SlotInfoResponse:
        return self.exports.slot_infos(request.table, checksums=request.checksums)

    @_rpc("ExportRows")
    def ExportRows(self, request: pb.ExportRowsRequest, context: grpc.ServicerContext) -> Any:
        """Stream a consistent cut of the slots this server leads (``Exports.export_rows``)."""
        yield from self.exports.export_rows(request)

    @_rpc("ImportRows")
    def ImportRows(self, request: pb.ImportRowsRequest, context: grpc.ServicerContext) -> pb.ImportRowsResponse:
        """Write complete rows (a restore) through this primary: replicated to the slots' copies like a push."""
        return self.exports.import_rows(request, context.time_remaining())

    @_rpc("PrepareCut")
    def PrepareCut(self, request: pb.PrepareCutRequest, context: grpc.ServicerContext) -> pb.PrepareCutResponse:
        return self.cuts.prepare(request)

    @_rpc("CommitCut")
    def CommitCut(self, request: pb.CommitCutRequest, context: grpc.ServicerContext) -> pb.CommitCutResponse:
        return self.cuts.commit(request)

    @_rpc("ReleaseCut")
    def ReleaseCut(self, request: pb.ReleaseCutRequest, context: grpc.ServicerContext) -> pb.ReleaseCutResponse:
        self.cuts.release(request.cut)
        return pb.ReleaseCutResponse()

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
        return pb.InstallMapResponse(epoch=self.holdings.epoch)

    @_rpc("Replicate")
    def Replicate(self, request: pb.ReplicateRequest | cluster_wire.RawReplicate, context: grpc.ServicerContext
                  ) -> pb.ReplicateResponse:
        """Apply a primary's stream in order (``Receiver.receive``)."""
        return self.receiver.receive(request)

    def close_tables(self) -> None:
        """Shut down: the pools, the replication streams, then every table."""
        self._frame_pool.shutdown(wait=False, cancel_futures=True)
        self._control_pool.shutdown(wait=False, cancel_futures=True)
        if self.replicator is not None:
            self.replicator.close()
        self.tables.close_all()


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
