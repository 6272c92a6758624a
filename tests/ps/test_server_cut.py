"""Whole-table reads of the shard service do not hold a table's write lock for the table's size (issue 16): a
push is acknowledged while a snapshot of its table is being written, and the snapshot holds the rows and the
exactly-once window of the moment its cut was opened, not the push."""

from __future__ import annotations

import threading
from pathlib import Path
from unittest import mock

import numpy as np

from tigana.embeddings import SGD, EmbeddingTable, TableConfig, Zeros, cut
from tigana.embeddings import snapshot as snapshot_module
from tigana.proto import shard_pb2 as pb
from tigana.ps.routing import slot_of
from tigana.ps.shard.catalog import DEDUP_FILE
from tigana.ps.shard.dedup import DedupWindow
from tigana.ps.wire import data as wire

DIM = 4


def test_a_push_is_acknowledged_while_its_table_is_snapshotted(make_shard_server, shard_stub) -> None:
    handle = make_shard_server()
    stub = shard_stub(handle.address)
    config = TableConfig("clicks", dim=DIM, optimizer=SGD(lr=1.0), initializer=Zeros())
    stub.CreateTable(pb.CreateTableRequest(spec=wire.spec_to_pb(config)))

    def push(ids: np.ndarray, seq: int) -> pb.PushResponse:
        grads = np.ones((len(ids), DIM), np.float32)
        return stub.Push(pb.PushRequest(table="clicks", ids=wire.encode_ids(ids), grads=wire.encode_rows(grads),
                                        client_id="c1", seq=seq), timeout=120)

    ids = np.arange(50_000, dtype=np.int64)
    push(ids, 1)
    reading, pushed = threading.Event(), threading.Event()
    real = snapshot_module.write_snapshot

    def paused(root, *, rows, **kw):  # stops after the first batch of rows until the push below is answered
        def gated():
            for k, batch in enumerate(rows):
                yield batch
                if k == 0:
                    reading.set()
                    assert pushed.wait(120)
        return real(root, rows=gated(), **kw)

    out: list[tuple[list[Path], int]] = []
    with mock.patch.object(snapshot_module, "write_snapshot", paused), \
            mock.patch.object(cut, "ORDERED_ROWS", 1000):
        snapper = threading.Thread(target=lambda: out.append(handle.service.snapshot_all()))
        snapper.start()
        assert reading.wait(120)
        reply = push(ids[:10], 2)  # under the old code this waited for the whole snapshot
        assert reply.applied_rows == 10
        pushed.set()
        snapper.join(120)
    assert out and not snapper.is_alive()
    (path,), rows = out[0]
    assert rows == len(ids)
    restored = EmbeddingTable.restore(path)
    np.testing.assert_array_equal(restored.pull(ids[:10]), np.full((10, DIM), -1.0, np.float32))  # before it
    num_slots = handle.service.num_slots
    window = DedupWindow.from_bytes(snapshot_module.read_extra(path, DEDUP_FILE), num_slots=num_slots)
    slots = np.unique(slot_of(ids[:10], num_slots))
    assert window.applied("c1", 1, np.unique(slot_of(ids, num_slots))).all()
    assert not window.applied("c1", 2, slots).any()  # the window of the same moment as the rows
    restored.close()
