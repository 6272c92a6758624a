"""The shard server's objects driven through their public API, without gRPC or sockets (``ps/shard``): the
write path over a table registry and a view, the registry, the view's leads check, a map install, a cluster cut,
and the replicator's callbacks bound to the scheduler link, not to the server.

Unit tier: each test builds the objects it needs from their constructors (no ``ShardService`` where the
object stands alone) and asserts what a caller sees."""

from __future__ import annotations

import numpy as np
import pytest

from tigana.embeddings import SGD, TableConfig, Zeros
from tigana.proto import shard_pb2 as pb
from tigana.ps.errors import InvalidArgument, TableExists, TableNotFound, Unavailable, WrongShard
from tigana.ps.metrics import ServerMetrics
from tigana.ps.routing import IN_SYNC, NO_SERVER, ServerEntry, ShardMap, TableDef, slot_of
from tigana.ps.shard import ShardService
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.cuts import Cuts
from tigana.ps.shard.hosted import HostedTables
from tigana.ps.shard.links import ServerLinks
from tigana.ps.shard.ownership import Ownership
from tigana.ps.shard.persistence import Persistence
from tigana.ps.shard.view import Holdings
from tigana.ps.shard.writes import WritePath
from tigana.ps.wire import data as wire

SLOTS = 64


def _spec(name: str = "t", dim: int = 4, created_epoch: int = 0) -> TableDef:
    return TableDef(TableConfig(name, dim=dim, optimizer=SGD(lr=1.0), initializer=Zeros()),
                    created_epoch=created_epoch)


class _Static:
    """The objects of a static server (no scheduler, no replicator), wired as ``ShardService`` wires them."""

    def __init__(self, owned: np.ndarray | None = None) -> None:
        self.config = ServerConfig(num_slots=SLOTS)
        self.links = ServerLinks()
        self.holdings = Holdings("s0", SLOTS, self.links, clustered=False,
                                 owned=np.ones(SLOTS, bool) if owned is None else owned)
        self.tables = HostedTables(self.config, None, clustered=False, epoch=lambda: self.holdings.epoch,
                                   leads_ids=self.holdings.leads_ids)
        self.writes = WritePath(self.config, self.tables, self.holdings, None, ServerMetrics(), self.links, "s0")

    def close(self) -> None:
        self.tables.close_all()


@pytest.fixture
def static():
    objects = _Static()
    try:
        yield objects
    finally:
        objects.close()


def _push(ids: np.ndarray, seq: int, table: str = "t", client: str = "c") -> pb.PushRequest:
    return pb.PushRequest(table=table, ids=wire.encode_ids(ids), grads=wire.encode_rows(-np.ones((ids.size, 4),
                                                                                                  np.float32)),
                          client_id=client, seq=seq)


def _pull(ids: np.ndarray, table: str = "t") -> np.ndarray:
    return pb.PullRequest(table=table, ids=wire.encode_ids(ids), read_only=True)


def test_the_write_path_applies_a_push_once_per_client_and_seq(static: _Static) -> None:
    static.tables.create_table(_spec(), exist_ok=False)
    ids = np.arange(100, dtype=np.int64)
    first = static.writes.push(_push(ids, 1))
    again = static.writes.push(_push(ids, 1))  # a retry: the same (client id, seq)
    later = static.writes.push(_push(ids, 2))
    assert (first.applied_rows, first.duplicate) == (100, False)
    assert again.duplicate and again.applied_rows == 0
    assert not later.duplicate
    name, rows, _ = static.writes.pull(_pull(ids))
    assert name == "t"
    np.testing.assert_array_equal(rows, np.full((100, 4), 2.0, np.float32))  # SGD lr 1: two pushes of -1


def test_a_push_applied_then_acknowledged_in_two_steps(static: _Static) -> None:
    """``push_apply`` changes the rows under the table's lock; ``push_ack`` answers it (a simulator drives
    the two apart); with no copies to wait for the answer is immediate."""
    static.tables.create_table(_spec(), exist_ok=False)
    ids = np.array([3, 5, 7], np.int64)
    pushed = static.writes.push_apply(_push(ids, 1))
    assert pushed.marks == [] and pushed.applied == 3
    np.testing.assert_array_equal(static.writes.pull(_pull(ids))[1], np.ones((3, 4), np.float32))
    answer = static.writes.push_ack(pushed, 0.0)
    assert answer.applied_rows == 3 and not answer.duplicate and not answer.under_replicated


def test_a_push_to_a_slot_not_led_or_with_bad_grads_changes_nothing() -> None:
    owned = np.zeros(SLOTS, bool)
    owned[: SLOTS // 2] = True
    objects = _Static(owned)
    try:
        objects.tables.create_table(_spec(), exist_ok=False)
        ids = np.arange(1000, dtype=np.int64)
        mine, other = ids[owned[slot_of(ids, SLOTS)]][:5], ids[~owned[slot_of(ids, SLOTS)]][:1]
        with pytest.raises(WrongShard, match=r"table 't': field 'ids' has 1 id\(s\) in slots"):
            objects.writes.push(_push(np.concatenate([mine, other]), 1))
        bad = _push(mine, 2)
        bad.grads.data = bad.grads.data[:-4]
        with pytest.raises(InvalidArgument, match="'t'.*grads"):
            objects.writes.push(bad)
        rows = objects.tables.get("t").table.pull(mine, insert=False)
        np.testing.assert_array_equal(rows, np.zeros((5, 4), np.float32))
        assert len(objects.tables.get("t").table) == 0  # nothing inserted either
    finally:
        objects.close()


def test_the_registry_creates_accepts_refuses_and_drops_tables(static: _Static) -> None:
    spec, created = static.tables.create_table(_spec(), exist_ok=False)
    assert created and spec == _spec()
    assert static.tables.create_table(_spec(), exist_ok=True) == (_spec(), False)
    with pytest.raises(TableExists, match="pass exist_ok"):
        static.tables.create_table(_spec(), exist_ok=False)
    with pytest.raises(TableExists, match=r"field\(s\) dim differ"):
        static.tables.create_table(_spec(dim=8), exist_ok=True)
    with pytest.raises(InvalidArgument, match="field 'name'"):
        static.tables.create_table(_spec("bad\nname"), exist_ok=False)
    assert static.tables.names() == ["t"] and "t" in static.tables
    hosted = static.tables.get("t")
    assert static.tables.drop_table("t") and not static.tables.drop_table("t")
    assert hosted.table.closed and static.tables.find("t") is None
    with pytest.raises(TableNotFound, match="table 't' not found"):
        static.tables.get("t")


def test_the_view_refuses_every_request_before_the_first_map_and_fences_hand_overs() -> None:
    holdings = Holdings("s0", SLOTS, ServerLinks(), clustered=True)
    ids = np.arange(10, dtype=np.int64)
    with pytest.raises(Unavailable, match="not in the cluster yet"):
        holdings.check_leads("t", ids, 0)
    with pytest.raises(InvalidArgument, match="scheduler's map"):
        holdings.set_owned_slots(np.ones(SLOTS, bool))
    static = Holdings("s0", SLOTS, ServerLinks(), clustered=False, owned=np.ones(SLOTS, bool))
    view, slots = static.check_leads("t", ids, 0)
    np.testing.assert_array_equal(slots, slot_of(ids, SLOTS))
    assert view is static.view and view.leads.all()
    with pytest.raises(Unavailable, match="created at epoch 3"):
        static.check_leads("t", ids, 0, created_epoch=3)
    with pytest.raises(InvalidArgument, match="expected a mask of 64 slots"):
        static.set_owned_slots(np.ones(8, bool))


def _map(epoch: int, tables: dict[str, TableDef], me: str = "s0", boot: str = "b0") -> ShardMap:
    copies = np.zeros((SLOTS, 1), np.int32)
    copies[SLOTS // 2:, 0] = NO_SERVER
    return ShardMap(epoch, SLOTS, 0, (ServerEntry(me, "127.0.0.1:2", boot),), copies,
                    np.full(copies.shape, IN_SYNC, np.uint8), np.ones(SLOTS, np.uint64), tables)


def test_ownership_installs_a_map_creating_and_dropping_its_tables() -> None:
    """A clustered server's ``Ownership`` with no replicator: a map creates its tables and sets the view; an
    older map is refused; a map without a table drops it."""
    config = ServerConfig(num_slots=SLOTS, scheduler="127.0.0.1:1")
    links = ServerLinks()
    installs: list[int] = []
    holdings = Holdings("s0", SLOTS, links, clustered=True)
    tables = HostedTables(config, None, clustered=True, epoch=lambda: holdings.epoch,
                          leads_ids=holdings.leads_ids)
    ownership = Ownership(config, "s0", "b0", holdings, tables, Persistence(config, tables, holdings, None,
                                                                            clustered=True), None, links)
    links.on_install = lambda: installs.append(holdings.epoch)
    try:
        assert ownership.install(_map(2, {"t": _spec(created_epoch=1)}))
        view = holdings.view
        assert view.valid and view.epoch == 2 and tables.names() == ["t"]
        np.testing.assert_array_equal(view.leads, np.arange(SLOTS) < SLOTS // 2)
        assert not ownership.install(_map(2, {}))  # not newer: nothing changes
        assert tables.names() == ["t"] and installs == [2]
        assert ownership.install(_map(3, {}))
        assert tables.names() == [] and holdings.epoch == 3 and installs == [2, 3]
        assert ownership.cluster_figures()["slots_led"] == SLOTS // 2
        other = _map(4, {}, boot="another-boot")  # the map names a previous life of this server
        assert ownership.install(other) and not holdings.view.valid
    finally:
        links.state = "closed"
        tables.close_all()


def test_a_cluster_cut_through_the_cuts_object(static: _Static) -> None:
    """Prepare holds the table's write lock, commit cuts it and lets writes go on, the part is read once."""
    static.tables.create_table(_spec(), exist_ok=False)
    static.writes.push(_push(np.arange(10, dtype=np.int64), 1))
    cuts = Cuts(static.tables, static.holdings, lambda: 123.0)
    cuts.prepare(pb.PrepareCutRequest(cut="c1", tables=["t"], hold_ms=5000))
    assert static.tables.get("t").lock.locked() and len(cuts) == 1
    answer = cuts.commit(pb.CommitCutRequest(cut="c1"))
    assert answer.server_time == 123.0 and not static.tables.get("t").lock.locked()
    static.writes.push(_push(np.arange(10, dtype=np.int64), 2))  # after the cut: not in it
    chunks = list(cuts.chunks(pb.ExportRowsRequest(table="t", cut="c1")))
    rows = sum(len(c.rows.ids) // 8 for c in chunks)
    assert rows == 10
    with pytest.raises(Unavailable, match="no part of cut"):
        list(cuts.chunks(pb.ExportRowsRequest(table="t", cut="c1")))
    cuts.release("c1")
    assert len(cuts) == 0


def test_the_replicator_reports_to_the_scheduler_link_never_back_into_the_server() -> None:
    """The replicator's callbacks (refresh the map, report a failure, report a copy caught up) are bound to
    ``ServerLinks`` (the agent), so running its actions never re-enters the server's objects."""
    service = ShardService(ServerConfig(num_slots=SLOTS, scheduler="127.0.0.1:1"))
    try:
        rep = service.replicator
        assert rep is not None
        for callback in (rep.refresh_map, rep.report_failure, rep.caught_up):
            assert callback.__self__ is service.links
        calls: list[tuple] = []

        class Agent:
            def report_copy_failure(self, *args: object) -> None:
                calls.append(("failure", *args))

            def copy_caught_up(self, *args: object) -> bool:
                calls.append(("caught_up", *args))
                return True

        service.agent = Agent()
        assert service.links.agent is service.agent
        rep.report_failure("x", np.array([1]), "why", 3)
        assert rep.caught_up("x", np.array([2]), 4) is True
        assert [c[0] for c in calls] == ["failure", "caught_up"]
    finally:
        service.close_tables()
