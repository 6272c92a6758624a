"""The scheduler's gRPC face: ``SchedulerService``, a thin adapter that converts each request at this one
boundary (``cluster_wire``) and calls the leading ``SchedulerDriver``. Every domain error is answered with its
gRPC status (``errors.to_status``, through ``rpc.guard``) and the current epoch in the trailing metadata; a bug
is logged and answered INTERNAL, never taking the scheduler down. Thread-safety: called on gRPC's worker threads; the core locks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from tigana.proto import scheduler_pb2 as spb
from tigana.proto import scheduler_pb2_grpc as spb_grpc
from tigana.proto import shard_pb2 as pb
from tigana.ps import rpc
from tigana.ps.errors import InvalidArgument, PSError
from tigana.ps.scheduler import placement
from tigana.ps.scheduler.driver import SchedulerDriver
from tigana.ps.wire import cluster as cluster_wire

log = logging.getLogger("tigana.ps.scheduler")  # one logger for the whole scheduler

SERVICE_NAME = spb.DESCRIPTOR.services_by_name["Scheduler"].full_name


def _handler(method: str) -> Callable[[Callable], Callable]:
    """The scheduler's settings of ``rpc.guard``: the current epoch in the trailing metadata."""
    return rpc.guard(method, log, epoch=lambda service: service.epoch())


def _positions(infos) -> dict[str, dict[int, tuple[int, int]]]:
    out: dict[str, dict[int, tuple[int, int]]] = {}
    for t in infos:
        slots = cluster_wire.array(t.slots, "<i4", field="positions.slots")
        ep = cluster_wire.array(t.lsn_epochs, "<u8", field="positions.lsn_epochs", count=slots.shape[0])
        ix = cluster_wire.array(t.lsn_indexes, "<u8", field="positions.lsn_indexes", count=slots.shape[0])
        out[t.table] = {int(s): (int(e), int(i)) for s, e, i in zip(slots, ep, ix, strict=True)}
    return out


class SchedulerService(spb_grpc.SchedulerServicer):
    """The gRPC face of a ``SchedulerDriver``: ``core`` is the driven core, or a function that returns the leading one
    (raising ``NotLeader`` on a standby, so every call there answers UNAVAILABLE naming the leader)."""

    def __init__(self, core: SchedulerDriver | Callable[[], SchedulerDriver]) -> None:
        self._core = core if not isinstance(core, SchedulerDriver) else (lambda: core)

    @property
    def core(self) -> SchedulerDriver:
        return self._core()

    def epoch(self) -> int:
        try:
            return self.core.map.epoch
        except PSError:
            return 0

    @_handler("Register")
    def Register(self, request, context):
        m = self.core.register(request.server_id, request.address, request.boot, _positions(request.positions),
                               cluster_wire.domain_from_pb(request.domain))
        return spb.RegisterResponse(map=cluster_wire.map_to_pb(m))

    @_handler("Heartbeat")
    def Heartbeat(self, request, context):
        m, again = self.core.heartbeat(request.server_id, request.boot, request.epoch, dict(request.stats))
        out = spb.HeartbeatResponse(reregister=again)
        if m is not None:
            out.map.CopyFrom(cluster_wire.map_to_pb(m))
        return out

    @_handler("GetMap")
    def GetMap(self, request, context):
        m = self.core.wait_map(request.known_epoch, min(float(request.wait_s), 30.0))
        out = spb.GetMapResponse(epoch=self.core.map.epoch)
        if m is not None:
            out.map.CopyFrom(cluster_wire.map_to_pb(m))
        return out

    @_handler("ReportCopyFailure")
    def ReportCopyFailure(self, request, context):
        slots = cluster_wire.array(request.slots, "<i4", field="slots")
        ok, msg = self.core.copy_failed(request.reporter, request.target, slots, request.reason, int(request.epoch))
        return spb.ReportResponse(epoch=self.core.map.epoch, accepted=ok, message=msg)

    @_handler("CopyCaughtUp")
    def CopyCaughtUp(self, request, context):
        slots = cluster_wire.array(request.slots, "<i4", field="slots")
        ok, msg = self.core.copy_caught_up(request.reporter, request.target, slots, int(request.since_epoch))
        return spb.ReportResponse(epoch=self.core.map.epoch, accepted=ok, message=msg)

    @_handler("HandoverReady")
    def HandoverReady(self, request, context):
        slots = cluster_wire.array(request.slots, "<i4", field="slots")
        ok, msg = self.core.handover_ready(request.reporter, slots, int(request.epoch))
        return spb.ReportResponse(epoch=self.core.map.epoch, accepted=ok, message=msg)

    @_handler("ReportUnreachable")
    def ReportUnreachable(self, request, context):
        self.core.unreachable(request.address)
        return spb.ReportResponse(epoch=self.core.map.epoch, accepted=True)

    @_handler("CreateTable")
    def CreateTable(self, request, context):
        spec = cluster_wire.table_def_from_pb(request.spec)
        if spec.durability == "sync" and request.spec.durability == pb.DURABILITY_DEFAULT \
                and self.core.config.replicas == 0:
            spec = dataclasses.replace(spec, durability="async")  # nothing to wait for without replicas
        if spec.min_copies > 1 + self.core.config.replicas:
            raise InvalidArgument(f"table {spec.config.name!r}: field 'min_copies' is {spec.min_copies}, but the "
                                  f"cluster keeps {1 + self.core.config.replicas} cop(ies) of a slot")
        held, created = self.core.create_table(spec, request.exist_ok)
        return pb.CreateTableResponse(spec=cluster_wire.table_def_to_pb(held), created=created)

    @_handler("DropTable")
    def DropTable(self, request, context):
        return pb.DropTableResponse(dropped=self.core.drop_table(request.table))

    @_handler("ListTables")
    def ListTables(self, request, context):
        return pb.ListTablesResponse(tables=[cluster_wire.table_def_to_pb(t)
                                             for _, t in sorted(self.core.map.tables.items())])

    @_handler("Status")
    def Status(self, request, context):
        return self.core.status()

    @_handler("MoveSlot")
    def MoveSlot(self, request, context):
        plan = self.core.move_slot(int(request.slot), request.to, from_=getattr(request, "from"),
                                   primary=request.primary)
        return self._plan(plan, applied=True)

    @_handler("Drain")
    def Drain(self, request, context):
        return self._plan(self.core.drain(request.server, undrain=request.undrain), applied=True)

    @_handler("Rebalance")
    def Rebalance(self, request, context):
        n = self.core.map.num_slots
        load = request.load
        rows = cluster_wire.array(load.rows, "<i8", field="load.rows", count=n) if load.rows else None
        bytes_ = cluster_wire.array(load.bytes, "<i8", field="load.bytes", count=n) if load.bytes else None
        rates = cluster_wire.array(load.rates, "<f8", field="load.rates", count=n) if load.rates else None
        c = request.cost
        cost = placement.CostModel(row_weight=c.row_weight or 1.0, rate_weight=c.rate_weight or None,
                                   link_bytes_per_s=c.link_bytes_per_s or 100e6)
        plan = self.core.rebalance(plan_only=request.plan_only, rows=rows, bytes_=bytes_, rates=rates, cost=cost)
        return self._plan(plan, applied=not request.plan_only)

    def _plan(self, plan: placement.Plan, *, applied: bool) -> spb.PlanResponse:
        m = self.core.map
        ids = [s.id for s in m.servers]
        out = spb.PlanResponse(bytes_moved=plan.bytes_moved, predicted_seconds=plan.seconds, applied=applied,
                               epoch=m.epoch, note=plan.note)
        for slot, add, remove, p_from, p_to, nbytes in plan.moves:
            out.moves.add(slot=slot, add=[ids[i] for i in add], remove=[ids[i] for i in remove],
                          primary_from=ids[p_from] if p_from >= 0 else "", primary_to=ids[p_to] if p_to >= 0 else "",
                          bytes=nbytes)
        for field_, load in (("before", plan.load_before), ("after", plan.load_after)):
            fig = getattr(out, field_)
            up = [i for i, s in enumerate(m.servers) if s.up and i < load.shape[0]]
            if up:
                fig.max = float(max(load[i] for i in up))
                fig.mean = float(np.mean([load[i] for i in up]))
                fig.per_server.update({ids[i]: float(load[i]) for i in up})
        return out
