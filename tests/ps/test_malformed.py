"""Hostile bytes: random payloads to every method of the shard service and the scheduler, on real servers.

Every request is answered with a status a client can act on (INVALID_ARGUMENT and friends), never INTERNAL or
UNKNOWN; no server dies; no table changes (per-slot checksums equal before and after)."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tigana import ps
from tigana.proto import scheduler_pb2 as spb
from tigana.proto import shard_pb2 as pb
from tigana.ps.scheduler import SchedulerConfig, start_scheduler
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.daemon import start_server

SHARD = [(m.name, m.server_streaming) for m in pb.DESCRIPTOR.services_by_name["Shard"].methods]
SCHED = [(m.name, m.server_streaming) for m in spb.DESCRIPTOR.services_by_name["Scheduler"].methods]
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("malformed")
    sched = start_scheduler(SchedulerConfig(data_dir=str(tmp / "sched"), replicas=1, expect_servers=2))
    servers = []
    try:
        for i in range(2):
            servers.append(start_server(ServerConfig(port=0, data_dir=str(tmp / f"s{i}"), scheduler=sched.address,
                                                     drain_grace_s=1.0)))
        for h in servers:
            assert h.wait_ready(30)
        while (sched.core.map.copies < 0).any():
            time.sleep(0.05)
        with ps.connect(scheduler=sched.address) as client:
            client.create_table("target", dim=4, optimizer=ps.Adagrad(lr=0.1))
            client.push("target", np.arange(500), np.ones((500, 4), np.float32)).result()
        yield sched, servers
    finally:
        for h in servers:
            h.close(grace=1.0)
        sched.close()


def _checksums(servers) -> list[bytes]:
    out = []
    for h in servers:
        hosted = h.service.tables.get("target")
        out.append(h.service.slot_info("target", hosted, checksums=True).checksums)
    return out


def _call(channel: grpc.Channel, service: str, method: str, streaming: bool, payload: bytes) -> grpc.StatusCode:
    path = f"/tigana.v1.{service}/{method}"
    try:
        if streaming:
            for _ in channel.unary_stream(path)(payload, timeout=10):
                pass
        else:
            channel.unary_unary(path)(payload, timeout=10)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_random_bytes_to_every_method_are_rejected_cleanly(cluster, data) -> None:
    sched, servers = cluster
    payload = data.draw(st.one_of(st.binary(max_size=300), st.binary(min_size=1, max_size=8).map(lambda b: b * 40)))
    before = _checksums(servers)
    seen = []
    with grpc.insecure_channel(servers[0].address) as shard, grpc.insecure_channel(sched.address) as schd:
        for name, streaming in SHARD:
            seen.append((name, _call(shard, "Shard", name, streaming, payload)))
        for name, streaming in SCHED:
            seen.append((name, _call(schd, "Scheduler", name, streaming, payload)))
        for channel in (shard, schd):  # gRPC's health service answered INTERNAL to these once
            try:
                channel.unary_unary("/grpc.health.v1.Health/Check")(payload, timeout=10)
            except grpc.RpcError as err:
                seen.append(("Health/Check", err.code()))
    bad = [(n, c) for n, c in seen if c in BAD]
    assert not bad, (payload[:40], bad)
    assert _checksums(servers) == before
    assert all(h.service.state == "serving" for h in servers)


def test_a_truncated_push_names_the_method(cluster) -> None:
    sched, servers = cluster
    with grpc.insecure_channel(servers[0].address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/tigana.v1.Shard/InstallMap")(b"\x0a\xff\xff\xff", timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "InstallMap: malformed request" in err.value.details()
