"""The shard service through a real in-process gRPC server: tables, pull/push against the engine, exactly-once,
slot ownership, large messages, concurrent pushes."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from tigana.embeddings import EmbeddingTable, TableConfig
from tigana.embeddings import config as cfg
from tigana.proto import shard_pb2 as pb
from tigana.ps.routing import slot_of
from tigana.ps.wire import data as wire

OPTIMIZERS = [cfg.SGD(lr=0.1), cfg.Adagrad(lr=0.05), cfg.RowWiseAdagrad(lr=0.05), cfg.Adam(lr=0.01),
              cfg.FTRL(alpha=0.05, l1=0.001)]


def create(stub, config: TableConfig, exist_ok: bool = False) -> pb.CreateTableResponse:
    return stub.CreateTable(pb.CreateTableRequest(spec=wire.spec_to_pb(config), exist_ok=exist_ok))


def pull(stub, table: str, ids: np.ndarray, dim: int, codec: int = pb.CODEC_FP32) -> np.ndarray:
    reply = stub.Pull(pb.PullRequest(table=table, ids=wire.encode_ids(ids), codec=codec))
    return wire.decode_rows(reply.rows, len(ids), dim, table=table)


def push(stub, table: str, ids: np.ndarray, grads: np.ndarray, client_id: str = "", seq: int = 0,
         part: int = 0) -> pb.PushResponse:
    return stub.Push(pb.PushRequest(table=table, ids=wire.encode_ids(ids), grads=wire.encode_rows(grads),
                                    client_id=client_id, seq=seq, part=part))


def stats(stub, table: str) -> dict[str, float]:
    (entry,) = stub.Stats(pb.StatsRequest(table=table)).tables
    return dict(entry.values)


def test_create_describe_list_drop(shard_server, shard_stub) -> None:
    stub = shard_stub(shard_server.address)
    config = TableConfig("user_id", dim=8, optimizer=cfg.Adagrad(lr=0.05), initializer=cfg.Normal(std=0.01), seed=3)
    reply = create(stub, config)
    assert reply.created and wire.spec_from_pb(reply.spec) == config
    again = create(stub, config, exist_ok=True)
    assert not again.created and wire.spec_from_pb(again.spec) == config

    with pytest.raises(grpc.RpcError) as err:
        create(stub, config)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "user_id" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        create(stub, TableConfig("user_id", dim=16, optimizer=cfg.Adagrad(lr=0.05)), exist_ok=True)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "user_id" in err.value.details() and "dim" in err.value.details()

    described = stub.DescribeTable(pb.DescribeTableRequest(table="user_id"))
    assert wire.spec_from_pb(described.spec) == config and described.stats.values["dim"] == 8
    assert [s.name for s in stub.ListTables(pb.ListTablesRequest()).tables] == ["user_id"]
    assert stub.DropTable(pb.DropTableRequest(table="user_id")).dropped
    assert not stub.DropTable(pb.DropTableRequest(table="user_id")).dropped
    assert list(stub.ListTables(pb.ListTablesRequest()).tables) == []
    with pytest.raises(grpc.RpcError) as err:
        stub.DescribeTable(pb.DescribeTableRequest(table="user_id"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "user_id" in err.value.details()


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.kind)
def test_pull_after_push_equals_the_engine(shard_server, shard_stub, optimizer) -> None:
    """Pushes through the server give bit-identical rows to the same pushes on an in-process table."""
    stub = shard_stub(shard_server.address)
    config = TableConfig(f"t_{optimizer.kind}", dim=8, optimizer=optimizer, initializer=cfg.Normal(std=0.1), seed=7)
    create(stub, config)
    reference = EmbeddingTable(config)
    rng = np.random.default_rng(0)
    try:
        for step in range(4):
            ids = rng.integers(-(1 << 62), 1 << 62, 300) if step == 0 else rng.integers(0, 200, 300)
            grads = rng.normal(size=(len(ids), 8)).astype(np.float32)
            np.testing.assert_array_equal(pull(stub, config.name, ids, 8), reference.pull(ids))
            reply = push(stub, config.name, ids, grads)
            assert reply.applied_rows == reference.push(ids, grads) and not reply.duplicate
        probe = np.concatenate([rng.integers(0, 200, 500), [5, 5, 5, -1, 1 << 62]])  # duplicates, any values
        got = pull(stub, config.name, probe, 8)
        np.testing.assert_array_equal(got, reference.pull(probe))
        np.testing.assert_array_equal(got[-5], got[-4])
        assert stats(stub, config.name)["rows"] == len(reference)
    finally:
        reference.close()


@pytest.mark.parametrize(("codec", "tol"), [(pb.CODEC_FP16, 1e-3), (pb.CODEC_BF16, 1e-2), (pb.CODEC_INT8, 1e-2)])
def test_pull_codecs(shard_server, shard_stub, codec, tol) -> None:
    stub = shard_stub(shard_server.address)
    create(stub, TableConfig("emb", dim=16, initializer=cfg.Uniform(low=-1, high=1)))
    ids = np.arange(1000, dtype=np.int64)
    exact = pull(stub, "emb", ids, 16)
    lossy = pull(stub, "emb", ids, 16, codec)
    np.testing.assert_allclose(lossy, exact, atol=tol)
    assert not np.array_equal(lossy, exact)


def test_replayed_push_applies_once(shard_server, shard_stub) -> None:
    stub = shard_stub(shard_server.address)
    create(stub, TableConfig("clicks", dim=4, optimizer=cfg.SGD(lr=1.0), initializer=cfg.Zeros()))
    ids = np.array([1, 2, 3, 2], dtype=np.int64)
    grads = np.ones((4, 4), dtype=np.float32)
    first = push(stub, "clicks", ids, grads, client_id="trainer-0", seq=1)
    assert first.applied_rows == 3 and not first.duplicate
    after_first = pull(stub, "clicks", ids, 4)
    checksum = stats(stub, "clicks")["checksum"]
    for _ in range(2):
        replay = push(stub, "clicks", ids, grads, client_id="trainer-0", seq=1)
        assert replay.duplicate and replay.applied_rows == 0
    assert stats(stub, "clicks")["checksum"] == checksum
    np.testing.assert_array_equal(pull(stub, "clicks", ids, 4), after_first)
    np.testing.assert_array_equal(after_first, -np.array([[1] * 4, [2] * 4, [1] * 4, [2] * 4], np.float32))
    # the same seq cut into another part is still a duplicate (exactly-once is per routing slot)
    assert push(stub, "clicks", ids[:1], grads[:1], "trainer-0", 1, 1).duplicate
    # another seq, another client: applied
    for key in (("trainer-0", 2, 0), ("trainer-1", 1, 0)):
        assert not push(stub, "clicks", ids[:1], grads[:1], *key).duplicate
    np.testing.assert_array_equal(pull(stub, "clicks", ids[:1], 4), -3 * np.ones((1, 4), np.float32))
    # no client id: no deduplication
    assert not push(stub, "clicks", ids[:1], grads[:1]).duplicate
    assert not push(stub, "clicks", ids[:1], grads[:1]).duplicate
    np.testing.assert_array_equal(pull(stub, "clicks", ids[:1], 4), -5 * np.ones((1, 4), np.float32))


def test_foreign_slots_are_refused_and_nothing_applied(make_shard_server, shard_stub) -> None:
    handle = make_shard_server(slots="0-2047")
    stub = shard_stub(handle.address)
    create(stub, TableConfig("ads", dim=4, optimizer=cfg.SGD(lr=1.0)))
    ids = np.arange(64, dtype=np.int64)
    mine = ids[slot_of(ids) < 2048]
    foreign = ids[slot_of(ids) >= 2048]
    assert len(mine) and len(foreign)
    push(stub, "ads", mine, np.ones((len(mine), 4), np.float32))
    before = stats(stub, "ads")
    for call in (lambda: pull(stub, "ads", ids, 4),
                 lambda: push(stub, "ads", ids, np.ones((len(ids), 4), np.float32))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "'ads'" in err.value.details() and f"{len(foreign)} id(s)" in err.value.details()
    assert stats(stub, "ads") == before
    # ownership is data: owning every slot makes the same request valid
    handle.service.set_owned_slots(np.ones(handle.config.num_slots, dtype=bool))
    assert pull(stub, "ads", ids, 4).shape == (64, 4)


def test_messages_above_4mib(shard_server, shard_stub) -> None:
    stub = shard_stub(shard_server.address)
    create(stub, TableConfig("big", dim=64, optimizer=cfg.SGD(lr=0.5), initializer=cfg.Zeros()))
    ids = np.arange(32768, dtype=np.int64)  # 8 MiB of fp32 rows each way
    grads = np.full((len(ids), 64), 2.0, np.float32)
    assert push(stub, "big", ids, grads).applied_rows == len(ids)
    np.testing.assert_array_equal(pull(stub, "big", ids, 64), np.full((len(ids), 64), -1.0, np.float32))


def test_concurrent_pushes_all_apply(shard_server, shard_stub) -> None:
    stub = shard_stub(shard_server.address)
    create(stub, TableConfig("conc", dim=4, optimizer=cfg.SGD(lr=1.0), initializer=cfg.Zeros()))
    ids = np.arange(50, dtype=np.int64)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for seq in range(10):
                push(stub, "conc", ids, np.ones((50, 4), np.float32), client_id=f"w{w}", seq=seq)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    np.testing.assert_array_equal(pull(stub, "conc", ids, 4), np.full((50, 4), -40.0, np.float32))


def test_pull_above_the_message_limit_is_refused_before_inserting(make_shard_server, shard_stub) -> None:
    handle = make_shard_server(max_message_bytes=1 << 20)
    stub = shard_stub(handle.address)
    create(stub, TableConfig("wide", dim=8))
    ids = np.arange(65536, dtype=np.int64)  # 2 MiB of fp32 rows
    with pytest.raises(grpc.RpcError) as err:
        pull(stub, "wide", ids, 8)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "'wide'" in err.value.details() and "'ids'" in err.value.details()
    assert stats(stub, "wide")["rows"] == 0
    assert pull(stub, "wide", ids[:16384], 8, pb.CODEC_FP16).shape == (16384, 8)  # 256 KiB fits


def test_generated_registration_serves_the_same_rows() -> None:
    """The service also works registered the generated way (protobuf objects in and out, no raw codecs):
    pushes and pulls through it match the engine, as through ``add_to_server``."""
    from concurrent import futures

    from tigana.proto import shard_pb2_grpc
    from tigana.ps.shard import ShardService
    from tigana.ps.shard.config import ServerConfig

    service = ShardService(ServerConfig())
    service.state = "serving"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    shard_pb2_grpc.add_ShardServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = shard_pb2_grpc.ShardStub(channel)
            config = TableConfig("gen", dim=4, optimizer=cfg.Adagrad(lr=0.05))
            create(stub, config)
            ids = np.array([5, -2, 9], np.int64)
            grads = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
            reference = EmbeddingTable(config)
            np.testing.assert_array_equal(pull(stub, "gen", ids, 4), reference.pull(ids))
            assert push(stub, "gen", ids, grads, client_id="c", seq=1).applied_rows == 3
            reference.push(ids, grads)
            np.testing.assert_array_equal(pull(stub, "gen", ids, 4), reference.pull(ids))
            assert push(stub, "gen", ids, grads, client_id="c", seq=1).duplicate
            reference.close()
    finally:
        server.stop(0).wait()
        service.close_tables()
        service.metrics.close()
