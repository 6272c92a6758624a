"""A push whose eviction pass meets a bad spilled record is acknowledged, recorded for exactly-once and applied
once: the engine never raises after applying (issue 16)."""

from __future__ import annotations

import numpy as np
from spill_records import corrupt_spilled

from tigana.embeddings import SGD, Eviction, TableConfig, Zeros
from tigana.proto import shard_pb2 as pb
from tigana.ps.wire import data as wire

DIM = 4


def test_push_meeting_a_bad_spilled_record_is_acknowledged_once(make_shard_server, shard_stub) -> None:
    handle = make_shard_server()
    stub = shard_stub(handle.address)
    config = TableConfig("clicks", dim=DIM, optimizer=SGD(lr=1.0), initializer=Zeros(),
                         memory_budget=20 * (DIM * 4 + 29 + 18), eviction=Eviction(max_rows=150))
    stub.CreateTable(pb.CreateTableRequest(spec=wire.spec_to_pb(config)))

    def push(ids: np.ndarray, seq: int) -> pb.PushResponse:
        grads = np.ones((len(ids), DIM), np.float32)
        return stub.Push(pb.PushRequest(table="clicks", ids=wire.encode_ids(ids), grads=wire.encode_rows(grads),
                                        client_id="c1", seq=seq))

    push(np.arange(100, dtype=np.int64), 1)
    table = handle.service.tables.get("clicks").table
    victim = corrupt_spilled(table)

    fresh = np.arange(1000, 1100, dtype=np.int64)
    first = push(fresh, 2)  # over max_rows: the eviction pass reads the spilled rows
    assert first.applied_rows == 100 and not first.duplicate
    retry = push(fresh, 2)
    assert retry.duplicate and retry.applied_rows == 0
    kept = fresh[table.contains(fresh)]
    reply = stub.Pull(pb.PullRequest(table="clicks", ids=wire.encode_ids(kept)))
    rows = wire.decode_rows(reply.rows, len(kept), DIM, table="clicks")
    np.testing.assert_array_equal(rows, np.full((len(kept), DIM), -1.0, np.float32))  # applied once
    described = stub.DescribeTable(pb.DescribeTableRequest(table="clicks"))
    assert described.stats.values["corrupt_rows"] == 1
    table.delete(np.array([victim]))  # so that the shutdown snapshot can read every row
