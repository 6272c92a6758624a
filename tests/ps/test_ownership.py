"""What a shard server holds under a map (``ps/shard/ownership.py``): a map that declares this very server
dead while it runs takes nothing from it (invariant S10 in docs/replication.md).

A real ``ShardService`` installs maps built here (its scheduler address listens nowhere: the maps are what a
scheduler would have sent)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tigana.embeddings import SGD, TableConfig, Zeros
from tigana.proto import shard_pb2 as pb
from tigana.ps.errors import WrongShard
from tigana.ps.routing import HANDING_OVER, IN_SYNC, NO_SERVER, ServerEntry, ShardMap, TableDef
from tigana.ps.shard import ShardService
from tigana.ps.shard.config import ServerConfig
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


def _map(svc: ShardService, epoch: int, *, up: bool, holds: bool, handing_over: np.ndarray | None = None
         ) -> ShardMap:
    spec = TableDef(TableConfig("t", dim=4, optimizer=SGD(lr=1.0), initializer=Zeros()), durability="sync",
                    created_epoch=1)
    servers = (ServerEntry(svc.server_id, "127.0.0.1:2", svc.boot, up),)
    copies = np.full((SLOTS, 1), 0 if holds else NO_SERVER, np.int32)
    states = np.full(copies.shape, IN_SYNC, np.uint8)
    if handing_over is not None:
        states[handing_over, 0] = HANDING_OVER
    return ShardMap(epoch, SLOTS, 0, servers, copies, states, np.ones(SLOTS, np.uint64), {"t": spec})


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
    service.writes.push(_push(ids, 1, 2))
    before, positions = service.tables.get("t").table.pull(ids, insert=False).copy(), _positions(service)
    assert len(positions) > 0
    assert service.install(_map(service, 3, up=False, holds=False))
    service.ownership.drop_unheld()  # a drop pass, as the drop worker would run one (it must find nothing to drop)
    np.testing.assert_array_equal(service.tables.get("t").table.pull(ids, insert=False), before)
    assert _positions(service) == positions
    assert not service.owned_slots().any()
    with pytest.raises(WrongShard):  # it leads nothing under that map
        service.writes.push(_push(ids, 2, 3))
    # registered again, the map says what it holds: here nothing (its slots were elected elsewhere)
    service.install(_map(service, 4, up=True, holds=False))
    service.ownership.drop_unheld()
    assert not service.tables.get("t").table.stored_ids().size


def test_a_hand_over_is_reported_for_the_slots_still_fenced_when_maps_came_during_its_wait() -> None:
    """Seen in ``bench nemesis``: a failover during a rebalance sent a map every ~0.2 s, and the primary's
    report that its fenced slots were drained needed the very map it waited under, so it was never made until
    the maps stopped: its slots refused every write for 2.7 s. The wait stands for the slots still fenced in
    the newer map (they refused writes all along); the scheduler takes it only for slots unchanged since."""
    spawned: list[str] = []  # this test makes the tries itself: no thread is started (no hand-over loop)
    service = ShardService(ServerConfig(num_slots=SLOTS, scheduler="127.0.0.1:1", ack_timeout_s=0.5),
                           spawn=lambda name, fn: spawned.append(name))
    service.state = "serving"
    try:
        _hand_over_with_maps_coming(service)
    finally:
        service.close_tables()
    assert "tigana-hand-over" in spawned


def _hand_over_with_maps_coming(service: ShardService) -> None:
    reports: list[tuple[list[int], int]] = []
    service.agent = SimpleNamespace(handover_ready=lambda slots, epoch: reports.append((slots.tolist(), epoch)))
    fenced = np.arange(8)
    service.install(_map(service, 2, up=True, holds=True, handing_over=fenced))
    wait = service.replicator.wait

    def wait_while_a_map_comes(marks, timeout_s):  # the copies acknowledge while a newer map is installed
        service.install(_map(service, 3, up=True, holds=True, handing_over=fenced[:4]))
        return wait(marks, timeout_s)

    service.replicator.wait = wait_while_a_map_comes
    assert service.hand_over(1.0)
    assert reports == [(list(range(4)), 2)]  # the slots still fenced, at the epoch the wait began under


def test_a_drop_pass_over_a_table_closed_meanwhile_ends_quietly(service) -> None:
    """The drop worker runs at background priority, so it may reach a table after it was closed (dropped, or the
    server shutting down): make test's teardown met it as a traceback in the worker's thread. A closed table's
    rows are gone with it; the pass raises nothing."""
    ids = np.arange(1000, dtype=np.int64)
    service.install(_map(service, 2, up=True, holds=True))
    service.writes.push(_push(ids, 1, 2))
    service.install(_map(service, 3, up=True, holds=False))
    service.tables.get("t").table.close()
    service.ownership.drop_unheld()  # nothing raised
    assert service.tables.get("t").table.closed
