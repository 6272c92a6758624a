"""The daemon around the service: health, reflection, metrics, snapshots and restart, port handling."""

from __future__ import annotations

import socket
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tigana.embeddings import CorruptStore, TableConfig
from tigana.embeddings import config as cfg
from tigana.proto import shard_pb2 as pb
from tigana.proto import shard_pb2_grpc
from tigana.ps.errors import InvalidArgument
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.daemon import start_server
from tigana.ps.wire import data as wire

IDS = np.arange(-50, 250, dtype=np.int64)


def _health(address: str, service: str = "tigana.v1.Shard") -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=10).status


def _setup(stub, name: str = "items", optimizer=None) -> np.ndarray:
    config = TableConfig(name, dim=8, optimizer=optimizer or cfg.Adam(lr=0.01), initializer=cfg.Normal(std=0.1),
                         seed=11)
    stub.CreateTable(pb.CreateTableRequest(spec=wire.spec_to_pb(config)))
    rng = np.random.default_rng(1)
    for seq in range(3):
        grads = rng.normal(size=(len(IDS), 8)).astype(np.float32)
        stub.Push(pb.PushRequest(table=name, ids=wire.encode_ids(IDS), grads=wire.encode_rows(grads),
                                 client_id="c", seq=seq))
    return _pull(stub, name)


def _pull(stub, name: str = "items") -> np.ndarray:
    reply = stub.Pull(pb.PullRequest(table=name, ids=wire.encode_ids(IDS)))
    return wire.decode_rows(reply.rows, len(IDS), 8, table=name)


def test_health_not_serving_until_loaded(tmp_path) -> None:
    handle = start_server(ServerConfig(port=0, data_dir=str(tmp_path / "d")), autoload=False)
    try:
        assert _health(handle.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert _health(handle.address, "") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not handle.wait_ready(0.05)
        with grpc.insecure_channel(handle.address) as channel, pytest.raises(grpc.RpcError) as err:
            shard_pb2_grpc.ShardStub(channel).ListTables(pb.ListTablesRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()
        handle.load_tables()
        assert handle.wait_ready(30)
        assert _health(handle.address) == health_pb2.HealthCheckResponse.SERVING
        assert _health(handle.address, "") == health_pb2.HealthCheckResponse.SERVING
    finally:
        handle.close()


def test_reflection_lists_the_services(shard_server) -> None:
    with grpc.insecure_channel(shard_server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"tigana.v1.Shard", "grpc.health.v1.Health"} <= names


def test_metrics_endpoint(make_shard_server, shard_stub) -> None:
    handle = make_shard_server(metrics_port=-1)
    assert handle.metrics_port
    stub = shard_stub(handle.address)
    _setup(stub)
    with pytest.raises(grpc.RpcError):
        stub.Pull(pb.PullRequest(table="missing", ids=wire.encode_ids(IDS)))
    text = urllib.request.urlopen(f"http://127.0.0.1:{handle.metrics_port}/metrics", timeout=10).read().decode()
    assert 'tigana_requests_total{code="OK",method="Push"} 3.0' in text
    assert 'tigana_requests_total{code="OK",method="Pull"} 1.0' in text
    assert 'tigana_rejected_requests_total{code="NOT_FOUND",method="Pull"} 1.0' in text
    assert f'tigana_rows_pulled_total{{table="items"}} {float(len(IDS))}' in text
    assert f'tigana_rows_pushed_total{{table="items"}} {float(3 * len(IDS))}' in text
    assert 'tigana_request_seconds_bucket{le="0.1",method="Push"}' in text
    assert f'tigana_table_rows{{table="items"}} {float(len(IDS))}' in text
    assert 'tigana_table_bytes{table="items"}' in text
    handle.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{handle.metrics_port}/metrics", timeout=5)


def test_close_snapshots_and_restart_restores(make_shard_server, shard_stub, tmp_path) -> None:
    data_dir = str(tmp_path / "persist")
    first = make_shard_server(data_dir=data_dir)
    stub = shard_stub(first.address)
    rows = _setup(stub)
    _setup(stub, "untouched", cfg.SGD())
    stub.CreateTable(pb.CreateTableRequest(spec=wire.spec_to_pb(TableConfig("empty", dim=3))))
    checksums = {t.table: t.values["checksum"] for t in stub.Stats(pb.StatsRequest()).tables}
    first.close()
    assert (tmp_path / "persist" / "tables.json").exists()

    second = make_shard_server(data_dir=data_dir)
    stub = shard_stub(second.address)
    assert sorted(s.name for s in stub.ListTables(pb.ListTablesRequest()).tables) == ["empty", "items", "untouched"]
    assert {t.table: t.values["checksum"] for t in stub.Stats(pb.StatsRequest()).tables} == checksums
    np.testing.assert_array_equal(_pull(stub), rows)
    # the exactly-once window survives the restart
    replay = stub.Push(pb.PushRequest(table="items", ids=wire.encode_ids(IDS),
                                      grads=wire.encode_rows(np.ones((len(IDS), 8), np.float32)),
                                      client_id="c", seq=2))
    assert replay.duplicate
    np.testing.assert_array_equal(_pull(stub), rows)


def test_snapshot_and_restore_rpcs(shard_server, shard_stub) -> None:
    stub = shard_stub(shard_server.address)
    rows = _setup(stub)
    full = stub.Snapshot(pb.SnapshotRequest())
    assert len(full.paths) == 1 and full.rows == len(IDS)
    stub.Push(pb.PushRequest(table="items", ids=wire.encode_ids(IDS[:10]),
                             grads=wire.encode_rows(np.ones((10, 8), np.float32))))
    changed = _pull(stub)
    assert not np.array_equal(changed, rows)
    incremental = stub.Snapshot(pb.SnapshotRequest(incremental=True))
    assert len(incremental.paths) == 1 and incremental.paths[0] != full.paths[0]
    stub.Push(pb.PushRequest(table="items", ids=wire.encode_ids(IDS[:10]),
                             grads=wire.encode_rows(np.ones((10, 8), np.float32))))
    assert stub.Restore(pb.RestoreRequest()).rows == len(IDS)  # the newest chain: full + incremental
    np.testing.assert_array_equal(_pull(stub), changed)
    assert stub.Restore(pb.RestoreRequest(path=full.paths[0])).rows == len(IDS)
    np.testing.assert_array_equal(_pull(stub), rows)


def test_dropped_table_stays_dropped_after_restart(make_shard_server, shard_stub, tmp_path) -> None:
    data_dir = str(tmp_path / "drop")
    first = make_shard_server(data_dir=data_dir)
    stub = shard_stub(first.address)
    _setup(stub)
    stub.Snapshot(pb.SnapshotRequest())
    stub.DropTable(pb.DropTableRequest(table="items"))
    first.close()
    second = make_shard_server(data_dir=data_dir)
    assert list(shard_stub(second.address).ListTables(pb.ListTablesRequest()).tables) == []


def test_in_memory_server_refuses_snapshots(make_shard_server, shard_stub) -> None:
    handle = make_shard_server(data_dir=None)
    stub = shard_stub(handle.address)
    with pytest.raises(grpc.RpcError) as err:
        stub.Snapshot(pb.SnapshotRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "data dir" in err.value.details()


def test_busy_port_is_an_error_and_bad_config_too() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(OSError, match="cannot bind"):
            start_server(ServerConfig(port=sock.getsockname()[1]))
    with pytest.raises(InvalidArgument, match="slots"):
        start_server(ServerConfig(slots="5-1"))


def test_old_snapshots_are_pruned(make_shard_server, shard_stub, tmp_path) -> None:
    handle = make_shard_server(data_dir=str(tmp_path / "prune"), keep_snapshots=2)
    stub = shard_stub(handle.address)
    rows = _setup(stub)
    for incremental in (False, True, False, True, False):
        stub.Snapshot(pb.SnapshotRequest(incremental=incremental))
    kept = sorted(p.name for p in (tmp_path / "prune" / "snapshots" / "items").iterdir())
    assert [name.split("-")[1] for name in kept] == ["full", "incr", "full"]
    # the exactly-once window lives inside each snapshot (written atomically with its rows)
    from tigana.embeddings.snapshot import read_extra
    assert all(read_extra(tmp_path / "prune" / "snapshots" / "items" / k, "dedup") for k in kept)
    assert stub.Restore(pb.RestoreRequest(path=str(tmp_path / "prune" / "snapshots" / "items"))).rows == len(IDS)
    np.testing.assert_array_equal(_pull(stub), rows)


def test_any_table_name_is_one_folder_inside_the_data_dir(make_shard_server, shard_stub, tmp_path) -> None:
    data_dir = tmp_path / "names"
    first = make_shard_server(data_dir=str(data_dir))
    stub = shard_stub(first.address)
    names = ["../escape", "model/user id", ".", "ünïcode"]
    for name in names:
        _setup(stub, name, cfg.SGD())
    rows = {name: _pull(stub, name) for name in names}
    stub.Snapshot(pb.SnapshotRequest())
    first.close()
    assert not (tmp_path / "escape").exists()
    assert len(list((data_dir / "snapshots").iterdir())) == len(names)
    second = make_shard_server(data_dir=str(data_dir))
    stub = shard_stub(second.address)
    for name in names:
        np.testing.assert_array_equal(_pull(stub, name), rows[name])


def test_close_drains_in_flight_pushes_into_the_snapshot(make_shard_server, shard_stub, tmp_path) -> None:
    """Every push acknowledged before or during shutdown is in the snapshot the restart restores."""
    data_dir = str(tmp_path / "drain")
    first = make_shard_server(data_dir=data_dir)
    stub = shard_stub(first.address)
    stub.CreateTable(pb.CreateTableRequest(spec=wire.spec_to_pb(
        TableConfig("drain", dim=4, optimizer=cfg.SGD(lr=1.0), initializer=cfg.Zeros()))))
    n, per = 200, 64
    futures = [stub.Push.future(pb.PushRequest(table="drain", ids=wire.encode_ids(np.arange(i * per, (i + 1) * per)),
                                               grads=wire.encode_rows(np.ones((per, 4), np.float32)),
                                               client_id="c", seq=i), timeout=30) for i in range(n)]
    first.close(grace=10)
    acked = np.zeros(n, bool)
    for i, fut in enumerate(futures):
        try:
            acked[i] = fut.result().applied_rows == per
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), exc
    assert acked.any()
    second = make_shard_server(data_dir=data_dir)
    stub = shard_stub(second.address)
    ids = np.arange(n * per, dtype=np.int64)
    reply = stub.Pull(pb.PullRequest(table="drain", ids=wire.encode_ids(ids)))
    applied = (wire.decode_rows(reply.rows, len(ids), 4, table="drain")[:, 0] == -1.0).reshape(n, per)
    assert applied.all(axis=1)[acked].all()            # acknowledged -> applied and persisted
    assert (applied.all(axis=1) | ~applied.any(axis=1)).all()  # each push applied whole or not at all


def test_corrupt_snapshot_fails_the_start_and_is_kept(make_shard_server, shard_stub, tmp_path) -> None:
    data_dir = tmp_path / "corrupt"
    first = make_shard_server(data_dir=str(data_dir))
    _setup(shard_stub(first.address))
    first.close()
    (snap,) = (data_dir / "snapshots" / "items").iterdir()
    victim = max((p for p in snap.rglob("*") if p.is_file() and p.name != "manifest.json"),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    handle = start_server(ServerConfig(port=0, data_dir=str(data_dir)))
    try:
        with pytest.raises(CorruptStore):
            handle.wait_ready(30)
        assert _health(handle.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            shard_stub(handle.address).ListTables(pb.ListTablesRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "failed to load" in err.value.details()
    finally:
        handle.close()
    assert [p.name for p in (data_dir / "snapshots" / "items").iterdir()] == [snap.name]  # nothing overwritten


def test_one_server_per_data_dir(make_shard_server, tmp_path) -> None:
    data_dir = str(tmp_path / "shared")
    first = make_shard_server(data_dir=data_dir)
    with pytest.raises(OSError, match="in use by another server"):
        start_server(ServerConfig(port=0, data_dir=data_dir))
    first.close()
    make_shard_server(data_dir=data_dir)  # free again once the first is closed


def test_server_memory_budget_spills_under_the_data_dir(make_shard_server, shard_stub, tmp_path) -> None:
    data_dir = tmp_path / "budget"
    handle = make_shard_server(data_dir=str(data_dir), memory_budget=64 << 10)
    stub = shard_stub(handle.address)
    rows = _setup(stub, "spilly", cfg.Adagrad(lr=0.1))
    ids = np.arange(10_000, 14_000, dtype=np.int64)
    stub.Pull(pb.PullRequest(table="spilly", ids=wire.encode_ids(ids)))
    (entry,) = stub.Stats(pb.StatsRequest(table="spilly")).tables
    assert entry.values["rows_spilled"] > 0 and entry.values["rows"] == len(IDS) + len(ids)
    assert any((data_dir / "spill" / "spilly").iterdir())
    np.testing.assert_array_equal(_pull(stub, "spilly"), rows)  # spilled rows come back unchanged
    handle.close()
    again = make_shard_server(data_dir=str(data_dir), memory_budget=64 << 10)
    np.testing.assert_array_equal(_pull(shard_stub(again.address), "spilly"), rows)
