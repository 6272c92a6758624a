"""What a shard server holds under a map (``ps/shard/ownership.py``): a map that declares this very server
dead while it runs takes nothing from it (invariant S10 in docs/replication.md).

A real ``ShardService`` installs maps built here (its scheduler address listens nowhere: the maps are what a
scheduler would have sent)."""

from __future__ import annotations

import numpy as np
import pytest

from tigana.embeddings import SGD, TableConfig, Zeros
from tigana.proto import shard_pb2 as pb
from tigana.ps.config import ServerConfig
from tigana.ps.errors import WrongShard
from tigana.ps.routing import IN_SYNC, NO_SERVER, ServerEntry, ShardMap, TableDef
from tigana.ps.shard import ShardService
from tigana.ps.wire import data as wire

SLOTS = 64


def _push(ids: np.ndarray, seq: int, epoch: int) -> pb.PushRequest:
    return pb.PushRequest(table="t", ids=wire.encode_ids(ids), grads=wire.encode_rows(-np.ones((ids.size, 4),
                                                                                               np.float32)),
                          client_id="c", seq=seq, epoch=epoch)


@pytest.fixture
def service():
    svc = ShardService(ServerConfig(num_slots=SLOTS, scheduler="127.0.0.1:1", ack_timeout_s=0.5))
    svc.state = "serving"
    try:
        yield svc
    finally:
        svc.close_tables()


def _map(svc: ShardService, epoch: int, *, up: bool, holds: bool) -> ShardMap:
    spec = TableDef(TableConfig("t", dim=4, optimizer=SGD(lr=1.0), initializer=Zeros()), durability="sync",
                    created_epoch=1)
    servers = (ServerEntry(svc.server_id, "127.0.0.1:2", svc.boot, up),)
    copies = np.full((SLOTS, 1), 0 if holds else NO_SERVER, np.int32)
    return ShardMap(epoch, SLOTS, 0, servers, copies, np.full(copies.shape, IN_SYNC, np.uint8),
                    np.ones(SLOTS, np.uint64), {"t": spec})


def _positions(svc: ShardService) -> dict[int, tuple[int, int]]:
    info = svc.positions()[0]
    slots = np.frombuffer(info.slots, "<i4")
    return dict(zip(slots.tolist(), zip(np.frombuffer(info.lsn_epochs, "<u8").tolist(),
                                        np.frombuffer(info.lsn_indexes, "<u8").tolist(), strict=True), strict=True))


def test_a_map_that_declares_this_server_dead_keeps_its_rows_and_positions(service) -> None:
    """Seen in a fault test: a new scheduler leader declared both servers dead while they ran; the one that
    installed a map without its copies deleted their rows, and the election then found rows of those slots
    nowhere. Declared dead, a running server leads nothing but keeps every row and log position until it
    registers again, when the scheduler elects the newest rows."""
    ids = np.arange(1000, dtype=np.int64)
    service.install(_map(service, 2, up=True, holds=True))
    service._push(_push(ids, 1, 2))
    before, positions = service._tables["t"].table.pull(ids, insert=False).copy(), _positions(service)
    assert len(positions) > 0
    assert service.install(_map(service, 3, up=False, holds=False))
    service._drop_unheld()  # a drop pass, as the drop worker would run one (it must find nothing to drop)
    np.testing.assert_array_equal(service._tables["t"].table.pull(ids, insert=False), before)
    assert _positions(service) == positions
    assert not service.owned_slots().any()
    with pytest.raises(WrongShard):  # it leads nothing under that map
        service._push(_push(ids, 2, 3))
    # registered again, the map says what it holds: here nothing (its slots were elected elsewhere)
    service.install(_map(service, 4, up=True, holds=False))
    service._drop_unheld()
    assert not service._tables["t"].table.stored_ids().size
