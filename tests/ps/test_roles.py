"""Every method of every gRPC service, read from the proto descriptors, needs the role this table says. A
method added to a ``.proto`` without a row here fails the test: no RPC lands without a decision on who may call
it (and ``security.role_needed`` gives a method it does not name the admin role, so it lands closed)."""

from __future__ import annotations

import importlib
import pkgutil

import tigana.proto
from tigana.ps.security import role_needed

EXPECTED = {
    # the data path: trainers
    "/tigana.v1.Shard/CreateTable": "trainer",
    "/tigana.v1.Shard/DescribeTable": "trainer",
    "/tigana.v1.Shard/ListTables": "trainer",
    "/tigana.v1.Shard/Pull": "trainer",
    "/tigana.v1.Shard/Push": "trainer",
    "/tigana.v1.Shard/Exchange": "trainer",
    "/tigana.v1.Shard/Stats": "trainer",
    # operators and the cluster's own calls: admin
    "/tigana.v1.Shard/DropTable": "admin",
    "/tigana.v1.Shard/Snapshot": "admin",
    "/tigana.v1.Shard/Restore": "admin",
    "/tigana.v1.Shard/InstallMap": "admin",
    "/tigana.v1.Shard/Replicate": "admin",
    "/tigana.v1.Shard/SlotInfo": "admin",
    "/tigana.v1.Shard/ExportRows": "admin",
    "/tigana.v1.Shard/ImportRows": "admin",
    "/tigana.v1.Shard/PrepareCut": "admin",
    "/tigana.v1.Shard/CommitCut": "admin",
    "/tigana.v1.Shard/ReleaseCut": "admin",
    # the scheduler: a client follows the map, creates and lists tables, reads the status, and reports a
    # server it cannot reach (which only makes the scheduler probe it)
    "/tigana.v1.Scheduler/GetMap": "trainer",
    "/tigana.v1.Scheduler/CreateTable": "trainer",
    "/tigana.v1.Scheduler/ListTables": "trainer",
    "/tigana.v1.Scheduler/Status": "trainer",
    "/tigana.v1.Scheduler/ReportUnreachable": "trainer",
    # what servers tell the scheduler about themselves and their copies, and the operator's commands
    "/tigana.v1.Scheduler/Register": "admin",
    "/tigana.v1.Scheduler/Heartbeat": "admin",
    "/tigana.v1.Scheduler/ReportCopyFailure": "admin",
    "/tigana.v1.Scheduler/CopyCaughtUp": "admin",
    "/tigana.v1.Scheduler/HandoverReady": "admin",
    "/tigana.v1.Scheduler/DropTable": "admin",
    "/tigana.v1.Scheduler/MoveSlot": "admin",
    "/tigana.v1.Scheduler/Drain": "admin",
    "/tigana.v1.Scheduler/Rebalance": "admin",
    # serving: read-only lookups and predictions
    "/tigana.v1.Serving/Lookup": "trainer",
    "/tigana.v1.Serving/Info": "trainer",
    "/tigana.v1.Serving/Predict": "trainer",
}


def _every_method() -> list[str]:
    out = []
    for info in pkgutil.iter_modules(tigana.proto.__path__):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(f"tigana.proto.{info.name}")
        for service in module.DESCRIPTOR.services_by_name.values():
            out += [f"/{service.full_name}/{method.name}" for method in service.methods]
    return out


def test_every_method_of_every_service_needs_the_role_in_the_table() -> None:
    methods = _every_method()
    assert len(methods) == len(set(methods))
    assert {m.split("/")[1] for m in methods} == {"tigana.v1.Shard", "tigana.v1.Scheduler", "tigana.v1.Serving"}
    missing = sorted(set(methods) - set(EXPECTED))
    assert not missing, f"methods with no role decided in this table: {missing}"
    gone = sorted(set(EXPECTED) - set(methods))
    assert not gone, f"the table names methods no service has: {gone}"
    wrong = {m: (role_needed(m), EXPECTED[m]) for m in methods if role_needed(m) != EXPECTED[m]}
    assert not wrong, f"(needs, expected): {wrong}"


def test_a_method_nobody_decided_on_needs_the_admin_role() -> None:
    assert role_needed("/tigana.v1.Shard/SomethingNew") == "admin"
    assert role_needed("/grpc.health.v1.Health/Check") == "none"
