"""Every bad request answers the right status, names the table and field, and changes nothing; the server keeps
serving afterwards."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from tigana.embeddings import TableConfig
from tigana.embeddings import config as cfg
from tigana.proto import shard_pb2 as pb
from tigana.ps.wire import data as wire

DIM = 8
IDS = np.arange(10, dtype=np.int64)
GRADS = np.ones((10, DIM), np.float32)


def _push(table: str = "feat", ids: bytes | None = None, grads: pb.Rows | None = None) -> pb.PushRequest:
    return pb.PushRequest(table=table, ids=wire.encode_ids(IDS) if ids is None else ids,
                          grads=wire.encode_rows(GRADS) if grads is None else grads)


def _with_value(value: float) -> pb.Rows:
    g = GRADS.copy()
    g[3, 5] = value
    return wire.encode_rows(g)


def _spec(**fields) -> pb.TableSpec:
    spec = wire.spec_to_pb(TableConfig("other", dim=4))
    for key, value in fields.items():
        if key in ("optimizer", "initializer"):
            getattr(spec, key).CopyFrom(value)
        else:
            setattr(spec, key, value)
    return spec


# (rpc, request, expected code, words the message must contain)
BAD = {
    "unknown table (pull)": ("Pull", pb.PullRequest(table="nope", ids=wire.encode_ids(IDS)),
                             grpc.StatusCode.NOT_FOUND, ["'nope'"]),
    "unknown table (push)": ("Push", _push(table="nope"), grpc.StatusCode.NOT_FOUND, ["'nope'"]),
    "unknown table (describe)": ("DescribeTable", pb.DescribeTableRequest(table="nope"),
                                 grpc.StatusCode.NOT_FOUND, ["'nope'"]),
    "empty table name": ("Pull", pb.PullRequest(table="", ids=wire.encode_ids(IDS)),
                         grpc.StatusCode.INVALID_ARGUMENT, ["'table'"]),
    "dim mismatch": ("Push", _push(grads=wire.encode_rows(np.ones((10, DIM + 1), np.float32))),
                     grpc.StatusCode.INVALID_ARGUMENT, ["'feat'", "grads", "dim"]),
    "ids/grads length mismatch": ("Push", _push(grads=wire.encode_rows(GRADS[:7])),
                                  grpc.StatusCode.INVALID_ARGUMENT, ["'feat'", "grads", "ids"]),
    "NaN gradient": ("Push", _push(grads=_with_value(np.nan)), grpc.StatusCode.INVALID_ARGUMENT,
                     ["feat", "grads"]),
    "Inf gradient": ("Push", _push(grads=_with_value(np.inf)), grpc.StatusCode.INVALID_ARGUMENT,
                     ["feat", "grads"]),
    "-Inf gradient (fp16)": ("Push", _push(grads=wire.encode_rows(np.where(np.eye(10, DIM) > 0, -np.inf, 0.0),
                                                                  pb.CODEC_FP16)),
                             grpc.StatusCode.INVALID_ARGUMENT, ["feat", "grads"]),
    "ids bytes not a multiple of 8 (pull)": ("Pull", pb.PullRequest(table="feat", ids=b"\x01" * 13),
                                             grpc.StatusCode.INVALID_ARGUMENT, ["'feat'", "'ids'", "13 bytes"]),
    "ids bytes not a multiple of 8 (push)": ("Push", _push(ids=wire.encode_ids(IDS) + b"\x00\x00"),
                                             grpc.StatusCode.INVALID_ARGUMENT, ["'feat'", "'ids'"]),
    "grads bytes not a multiple of 4": ("Push", _push(grads=pb.Rows(codec=pb.CODEC_FP32, dim=DIM,
                                                                    data=wire.encode_rows(GRADS).data[:-3])),
                                        grpc.StatusCode.INVALID_ARGUMENT, ["'feat'", "'grads'", "bytes"]),
    "int8 grads without scales": ("Push", _push(grads=pb.Rows(codec=pb.CODEC_INT8, dim=DIM,
                                                              data=bytes(10 * DIM))),
                                  grpc.StatusCode.INVALID_ARGUMENT, ["'feat'", "grads", "scales"]),
    "unknown grads codec": ("Push", _push(grads=pb.Rows(codec=9, dim=DIM, data=bytes(10 * DIM))),
                            grpc.StatusCode.INVALID_ARGUMENT, ["'feat'", "grads", "codec"]),
    "unknown unseen policy (read-only pull)": ("Pull", pb.PullRequest(table="feat", ids=wire.encode_ids(IDS + 100),
                                                                     read_only=True, unseen="median"),
                                               grpc.StatusCode.INVALID_ARGUMENT, ["'feat'", "'unseen'", "median"]),
    "unknown pull codec": ("Pull", pb.PullRequest(table="feat", ids=wire.encode_ids(IDS), codec=7),
                           grpc.StatusCode.INVALID_ARGUMENT, ["'feat'", "codec"]),
    "spec dim 0": ("CreateTable", pb.CreateTableRequest(spec=_spec(dim=0)), grpc.StatusCode.INVALID_ARGUMENT,
                   ["'other'", "dim"]),
    "spec unknown optimizer": ("CreateTable",
                               pb.CreateTableRequest(spec=_spec(optimizer=pb.Component(kind="lion"))),
                               grpc.StatusCode.INVALID_ARGUMENT, ["'other'", "optimizer", "lion"]),
    "spec unknown optimizer param": ("CreateTable", pb.CreateTableRequest(
        spec=_spec(optimizer=pb.Component(kind="sgd", params={"momentum": 0.9}))),
        grpc.StatusCode.INVALID_ARGUMENT, ["'other'", "optimizer", "momentum"]),
    "spec NaN learning rate": ("CreateTable", pb.CreateTableRequest(
        spec=_spec(optimizer=pb.Component(kind="adagrad", params={"lr": float("nan")}))),
        grpc.StatusCode.INVALID_ARGUMENT, ["'other'", "optimizer.lr"]),
    "spec negative std": ("CreateTable", pb.CreateTableRequest(
        spec=_spec(initializer=pb.Component(kind="normal", params={"std": -1.0}))),
        grpc.StatusCode.INVALID_ARGUMENT, ["'other'", "initializer.std"]),
    "spec bad dtype": ("CreateTable", pb.CreateTableRequest(spec=_spec(dtype="int4")),
                       grpc.StatusCode.INVALID_ARGUMENT, ["'other'", "dtype"]),
    "spec name with a newline": ("CreateTable", pb.CreateTableRequest(spec=_spec(name="bad\nname")),
                                 grpc.StatusCode.INVALID_ARGUMENT, ["'bad\\nname'", "name"]),
    "restore of a missing snapshot": ("Restore", pb.RestoreRequest(path="/nonexistent/snapshot"),
                                      grpc.StatusCode.NOT_FOUND, ["/nonexistent/snapshot"]),
}


@pytest.fixture
def server_with_table(shard_server, shard_stub):
    stub = shard_stub(shard_server.address)
    config = TableConfig("feat", dim=DIM, optimizer=cfg.Adagrad(lr=0.1), initializer=cfg.Normal(std=0.1))
    stub.CreateTable(pb.CreateTableRequest(spec=wire.spec_to_pb(config)))
    stub.Push(pb.PushRequest(table="feat", ids=wire.encode_ids(IDS), grads=wire.encode_rows(GRADS)))
    return shard_server, stub


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_is_rejected_and_changes_nothing(server_with_table, case) -> None:
    handle, stub = server_with_table
    method, request, code, words = BAD[case]
    rows_before = wire.decode_rows(stub.Pull(pb.PullRequest(table="feat", ids=wire.encode_ids(IDS))).rows,
                                   len(IDS), DIM, table="feat")
    before = {t.table: dict(t.values) for t in stub.Stats(pb.StatsRequest()).tables}
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, method)(request, timeout=30)
    assert err.value.code() == code, err.value.details()
    for word in words:
        assert word in err.value.details(), (word, err.value.details())
    after = {t.table: dict(t.values) for t in stub.Stats(pb.StatsRequest()).tables}
    assert after == before  # includes each table's checksum and row count
    rows_after = wire.decode_rows(stub.Pull(pb.PullRequest(table="feat", ids=wire.encode_ids(IDS))).rows,
                                  len(IDS), DIM, table="feat")
    np.testing.assert_array_equal(rows_after, rows_before)
    # the server keeps serving valid requests
    assert stub.Push(_push(), timeout=30).applied_rows == len(IDS)
    rejected = handle.metrics.render().decode()
    assert f'tigana_rejected_requests_total{{code="{code.name}",method="{method}"}} 1.0' in rejected
