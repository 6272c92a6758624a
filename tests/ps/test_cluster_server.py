"""A shard server in a cluster, in process: a real scheduler and real servers on loopback ports.

Covers what the fault suite does not pin down: the copies' health, min_copies, map installs fencing
replication items, the replication wire codec against protobuf, and Prometheus figures.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tigana import ps
from tigana.embeddings import RowBatch
from tigana.proto import scheduler_pb2 as spb
from tigana.proto import scheduler_pb2_grpc as spb_grpc
from tigana.proto import shard_pb2 as pb
from tigana.proto import shard_pb2_grpc
from tigana.ps.routing import CATCHING_UP, IN_SYNC
from tigana.ps.scheduler import SchedulerConfig, start_scheduler
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.daemon import COPIES_HEALTH_NAME, start_server
from tigana.ps.wire import cluster as cluster_wire
from tigana.ps.wire.cluster import BARRIER, CHANGES, Item


@pytest.fixture
def cluster(tmp_path):
    """A scheduler (1 replica) and two in-process servers registered with it; closed at teardown."""
    sched = start_scheduler(SchedulerConfig(data_dir=str(tmp_path / "sched"), replicas=1, expect_servers=2,
                                            heartbeat_timeout_s=5.0))
    servers = []
    try:
        for i in range(2):
            handle = start_server(ServerConfig(port=0, data_dir=str(tmp_path / f"s{i}"), scheduler=sched.address,
                                               drain_grace_s=1.0))
            servers.append(handle)
        for h in servers:
            assert h.wait_ready(30)
        deadline = time.monotonic() + 30
        while (sched.core.map.copies < 0).any() or sched.core.map.summary()["degraded_slots"]:
            assert time.monotonic() < deadline, sched.core.map.summary()
            time.sleep(0.05)
        yield sched, servers
    finally:
        for h in servers:
            h.close(grace=1.0)
        sched.close()


def _health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=10).status


def _wait_installed(handles, epoch: int) -> None:
    deadline = time.monotonic() + 20
    while any(h.service.epoch < epoch for h in handles):
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_copies_health_is_not_serving_while_a_copy_catches_up(cluster) -> None:
    sched, servers = cluster
    for h in servers:
        assert _health(h.address, COPIES_HEALTH_NAME) == health_pb2.HealthCheckResponse.SERVING
    # Mark every replica copy on server 1 catching up in a newer map, installed directly (no primary streams
    # a copy to it in this test: the map says so, and the health must follow the map).
    m = servers[1].service.holdings.view.map
    states = m.states.copy()
    me = m.index_of(servers[1].service.server_id)
    states[(m.copies == me) & (np.arange(m.width) > 0)] = CATCHING_UP
    servers[1].service.install(dataclasses.replace(m.evolve(states=states)))
    assert servers[1].service.catching_up() > 0
    assert _health(servers[1].address, COPIES_HEALTH_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert _health(servers[1].address, "") == health_pb2.HealthCheckResponse.SERVING  # it still serves
    figures = servers[1].service.metrics.render().decode()
    assert "tigana_slots_catching_up" in figures and "tigana_replication_lag_items" in figures


def test_min_copies_rejects_pushes_instead_of_weakening_durability(cluster) -> None:
    sched, servers = cluster
    with ps.connect(scheduler=sched.address, failover_timeout_s=1.0, max_backoff_s=0.2) as client:
        client.create_table("mc", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros(), min_copies=2)
        ids = np.arange(200, dtype=np.int64)
        client.push("mc", ids, -np.ones((200, 4), np.float32)).result()
        # Server 1 stops: once the scheduler has taken its copies out, every slot has one in-sync copy, and
        # pushes are rejected with NotEnoughReplicas instead of being acknowledged by one copy alone.
        core = sched.core
        servers[1].close(grace=0.5)
        deadline = time.monotonic() + 30
        while core.map.servers[1].up if core.map.index_of(servers[1].service.server_id) == 1 else \
                core.map.servers[0].up:
            assert time.monotonic() < deadline, "the scheduler did not notice the stopped server"
            core.unreachable(servers[1].address)
            time.sleep(0.1)
        _wait_installed(servers[:1], core.map.epoch)
        live = core.map.index_of(servers[0].service.server_id)
        assert (core.map.in_sync_count() == 1).all()
        victims = ids[np.isin(ps.routing.slot_of(ids), np.flatnonzero(core.map.leads(live)))]
        assert victims.size == ids.size
        with pytest.raises(ps.NotEnoughReplicas, match=r"table 'mc'.*min_copies is 2"):
            client.push("mc", victims, -np.ones((victims.size, 4), np.float32)).result()
        with pytest.raises(ps.NotEnoughReplicas):
            client.flush()
        np.testing.assert_array_equal(client.pull("mc", victims, insert=False), np.ones((victims.size, 4)))


def test_replication_items_from_a_server_that_does_not_lead_are_refused(cluster) -> None:
    """Fencing is checked by the target: an item claiming a slot its source does not lead (a deposed or
    confused primary) is refused STALE and changes nothing; a CHANGES item whose prev position is not the
    target's is refused DIVERGED."""
    sched, servers = cluster
    with ps.connect(scheduler=sched.address) as client:
        client.create_table("fence", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
    m = sched.core.map
    _wait_installed(servers, m.epoch)
    s0, s1 = servers
    i0 = m.index_of(s0.service.server_id)
    slot = int(np.flatnonzero(m.leads(1 - i0) & m.holds(i0))[0])  # led by server 1, copied on server 0
    ids = np.arange(100_000, dtype=np.int64)
    ids = ids[ps.routing.slot_of(ids) == slot][:3]
    rows = RowBatch(ids, np.full((3, 4), 7.0, np.float32), np.zeros((3, 0), np.float32), np.ones(3, np.int64),
                    np.ones(3, np.int64), np.zeros(3))
    prev = np.zeros((1, 2), np.uint64)
    before = s0.service.slot_info("fence", s0.service.tables.get("fence"), checksums=True).checksums
    incarnation = m.tables["fence"].created_epoch
    stale = cluster_wire.encode_replicate_request(s0.service.server_id, "x", 1, m.epoch, 1, [
        Item(CHANGES, "fence", np.array([slot], np.int32), (m.epoch, 99), prev, rows, table_epoch=incarnation)])
    with grpc.insecure_channel(s0.address) as channel:
        call = channel.unary_unary("/tigana.v1.Shard/Replicate", response_deserializer=pb.ReplicateResponse.FromString)
        reply = call(stale, timeout=10)  # the source claims to be server 0 itself, which does not lead the slot
        assert reply.reject == pb.REJECT_STALE and reply.applied_through == 0
        diverged = cluster_wire.encode_replicate_request(s1.service.server_id, "y", 1, m.epoch, 1, [
            Item(BARRIER, "fence", np.array([slot], np.int32), (m.epoch, 1), np.array([[123, 456]], np.uint64),
                 table_epoch=incarnation)])
        reply = call(diverged, timeout=10)
        assert reply.reject == pb.REJECT_DIVERGED
    after = s0.service.slot_info("fence", s0.service.tables.get("fence"), checksums=True).checksums
    assert before == after


@pytest.mark.parametrize("n", [3, 5000])  # small: protobuf's coder; over 64 KiB: the hand-written one
def test_replication_codec_matches_protobuf(n: int) -> None:
    rng = np.random.default_rng(0)
    ids = np.concatenate([[5, -9, 2**62], np.arange(10, 10 + n - 3)]).astype(np.int64)
    rows = RowBatch(ids, rng.normal(size=(n, 4)).astype(np.float32), rng.normal(size=(n, 4)).astype(np.float32),
                    np.arange(1, n + 1, dtype=np.int64), np.arange(4, n + 4, dtype=np.int64), np.arange(n) + 0.5)
    item = Item(CHANGES, "t", np.array([1, 7], np.int32), (3, 11), np.array([[1, 2], [3, 4]], np.uint64), rows,
                np.array([8, 9], np.int64), (np.array([10], np.int64), np.array([2], np.int64)), 42,
                [("c1", 5, np.array([1], np.int32))])
    raw = cluster_wire.encode_replicate_request("src", "boot", 9, 12, 3, [item, item])
    msg = pb.ReplicateRequest.FromString(raw)
    assert (msg.source, msg.source_boot, msg.generation, msg.epoch, msg.first_seq) == ("src", "boot", 9, 12, 3)
    assert msg == pb.ReplicateRequest(source="src", source_boot="boot", generation=9, epoch=12, first_seq=3,
                                      items=[item.to_pb(), item.to_pb()])
    assert raw == msg.SerializeToString()  # the same bytes, whichever coder wrote them
    fast = cluster_wire.decode_replicate_request(raw)  # small: parsed by protobuf whole; large: item views
    assert isinstance(fast, pb.ReplicateRequest if n == 3 else cluster_wire.RawReplicate) and len(fast.items) == 2
    for view in (fast.items[0], msg.items[0]):
        back = cluster_wire.decode_item(view, dim=4, state_width=4)
        assert back.kind == CHANGES and back.table == "t" and back.lsn == (3, 11) and back.step == 42
        np.testing.assert_array_equal(back.slots, item.slots)
        np.testing.assert_array_equal(back.prev, item.prev)
        for f in ("ids", "weights", "state", "update_count", "last_step", "last_time"):
            np.testing.assert_array_equal(getattr(back.rows, f), getattr(rows, f))
        np.testing.assert_array_equal(back.deletes, item.deletes)
        assert back.dedup[0][:2] == ("c1", 5)
    with pytest.raises(ps.InvalidArgument, match="dim"):
        cluster_wire.decode_item(fast.items[0], dim=8, state_width=4)
    assert IN_SYNC == 0


def test_a_small_request_with_a_malformed_item_keeps_its_good_items() -> None:
    """A small request is parsed by protobuf whole; one protobuf refuses (here its second item) is read as a
    large one is, so the good item still applies and only the bad one is refused (``Inbound.receive``)."""
    item = Item(CHANGES, "t", np.array([1], np.int32), (3, 1), np.array([[1, 2]], np.uint64), table_epoch=2)
    raw = cluster_wire.encode_replicate_request("src", "boot", 9, 12, 1, [item])
    bad = raw + bytes([6 << 3 | 2, 2, 0xFF, 0xFF])  # a second item: a truncated varint
    request = cluster_wire.decode_replicate_request(bad)
    assert isinstance(request, cluster_wire.RawReplicate) and len(request.items) == 2
    assert cluster_wire.item_header(request.items[0]) == ("t", 2)
    with pytest.raises(DecodeError):  # the item alone is refused ("malformed replication item")
        cluster_wire.item_header(request.items[1])


def test_a_push_to_a_table_another_client_dropped_fails_at_once(cluster) -> None:
    """Client a pushes to a table client b dropped. Its servers answer TableNotFound, which a clustered client
    retries (a server may not have installed the map that creates a table yet): once a map that client a
    installed has dropped the table, it fails with TableNotFound at once, not after retrying for its failover
    deadline (30 s; ``bench sim`` seeds 65 and 91 waited 20 and 25 s to settle such a push)."""
    sched, servers = cluster
    ids = np.arange(64, dtype=np.int64)
    with ps.connect(scheduler=sched.address) as a, ps.connect(scheduler=sched.address) as b:
        a.create_table("scratch", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        a.push("scratch", ids, np.ones((64, 4), np.float32)).result(timeout=30)
        assert b.drop_table("scratch")
        dropped_at = sched.core.map.epoch
        _wait_installed(servers, dropped_at)  # no server applies a push to it any more
        while a.epoch < dropped_at:  # client a follows the map (a push racing the drop may still be applied)
            time.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(ps.TableNotFound, match="dropped: the map at epoch .* has no table 'scratch'"):
            a.push("scratch", ids, np.ones((64, 4), np.float32)).result(timeout=60)
        assert time.monotonic() - started < 10
        with pytest.raises(ps.TableNotFound):  # a failed push is raised at the next call too
            a.flush()
        assert "scratch" not in b.list_tables()


def test_items_of_a_dropped_table_are_moot_and_never_wedge_the_stream(cluster) -> None:
    """A table dropped (or dropped and created again) while its items are in flight: the target skips the
    items of the incarnation its map dropped and goes on with the stream. It used to answer BEHIND for ever,
    wedging every later item of that primary-to-copy stream."""
    sched, servers = cluster
    with ps.connect(scheduler=sched.address) as client:
        client.create_table("gone", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        old = sched.core.map.tables["gone"].created_epoch
        client.drop_table("gone")
        client.create_table("gone", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        client.create_table("dropped", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        dropped = sched.core.map.tables["dropped"].created_epoch
        client.drop_table("dropped")
    m = sched.core.map
    _wait_installed(servers, m.epoch)
    s0, s1 = servers
    i0, i1 = m.index_of(s0.service.server_id), m.index_of(s1.service.server_id)
    slot = int(np.flatnonzero(m.leads(i1) & m.holds(i0))[0])
    ids = np.arange(100_000, dtype=np.int64)
    ids = ids[ps.routing.slot_of(ids) == slot][:3]
    rows = RowBatch(ids, np.full((3, 4), 7.0, np.float32), np.zeros((3, 0), np.float32), np.ones(3, np.int64),
                    np.ones(3, np.int64), np.zeros(3))
    hosted = s0.service.tables.get("gone")
    prev = hosted.log.positions[[slot]].copy()
    items = [Item(CHANGES, "gone", np.array([slot], np.int32), (m.epoch, 10**6), prev, rows, table_epoch=old),
             Item(CHANGES, "dropped", np.array([slot], np.int32), (m.epoch, 10**6), prev, rows,
                  table_epoch=dropped)]
    request = cluster_wire.encode_replicate_request(s1.service.server_id, "boot-z", 7, m.epoch, 1, items)
    with grpc.insecure_channel(s0.address) as channel:
        call = channel.unary_unary("/tigana.v1.Shard/Replicate", response_deserializer=pb.ReplicateResponse.FromString)
        reply = call(request, timeout=10)
        assert reply.reject == pb.REJECT_NONE and reply.applied_through == 2  # skipped, the stream goes on
        np.testing.assert_array_equal(hosted.table.pull(ids, insert=False), np.zeros((3, 4)))  # nothing applied
        # an incarnation newer than the target's map: the target is behind, and says so
        newer = cluster_wire.encode_replicate_request(s1.service.server_id, "boot-z", 7, m.epoch, 3, [
            Item(CHANGES, "gone", np.array([slot], np.int32), (m.epoch, 10**6), prev, rows,
                 table_epoch=m.epoch + 50)])
        reply = call(newer, timeout=10)
        assert reply.reject == pb.REJECT_BEHIND and reply.applied_through == 2


def test_a_new_table_takes_writes_only_once_the_map_that_created_it_is_installed(cluster) -> None:
    """Regression (a soak under load lost acknowledged updates): ``install`` creates a new map's tables, then
    waits for every table's lock before it switches to the new view. A push in between was applied under the
    old view and replicated as an item of no table incarnation (0), which the copy skipped as moot but
    acknowledged: the push was acknowledged by a copy that did not have it, the copies diverged (REJECT_DIVERGED
    on the next write, a demotion with no failure), and a kill of the primary lost it."""
    sched, servers = cluster
    primary, copy = servers[0].service, servers[1].service
    with ps.connect(scheduler=sched.address) as client:
        client.create_table("first", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        _wait_installed(servers, sched.core.map.epoch)
        led = np.flatnonzero(primary.holdings.view.leads)
        ids = np.arange(20_000, dtype=np.int64)
        ids = ids[np.isin(ps.routing.slot_of(ids, primary.num_slots), led)][:64]
        lock = primary.tables.get("first").lock
        lock.acquire()  # the primary's next install creates its tables, then waits for this lock: the window
        try:
            client.create_table("late", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
            created = sched.core.map.tables["late"].created_epoch
            deadline = time.monotonic() + 20
            while "late" not in primary.tables:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert primary.holdings.view.epoch < created  # in the window
            fut = client.push("late", ids, np.ones((ids.size, 4), np.float32))
            time.sleep(0.5)
            assert not fut.done()  # refused (UNAVAILABLE, retried by the client) while the window lasts
            assert primary.tables.get("late").table.pull(ids, insert=False).sum() == 0  # nothing applied
        finally:
            lock.release()
        fut.result(timeout=30)
        client.push("late", ids, np.ones((ids.size, 4), np.float32)).result(timeout=30)
    want = np.full((ids.size, 4), -2.0, np.float32)  # two pushes of 1 at lr 1
    np.testing.assert_array_equal(primary.tables.get("late").table.pull(ids, insert=False), want)
    np.testing.assert_array_equal(copy.tables.get("late").table.pull(ids, insert=False), want)
    assert sched.core.metrics.copies_demoted.labels("replication_failed")._value.get() == 0


def _all_in_sync(sched, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while (sched.core.map.states != IN_SYNC)[sched.core.map.copies >= 0].any():
        assert time.monotonic() < deadline, sched.core.map.summary()
        time.sleep(0.05)


def test_a_stale_copy_failure_report_on_the_wire_leaves_the_rebuilt_copy_in_sync(cluster) -> None:
    """A primary's failure report carries the epoch at which it saw the failure. Sent again after the copy was
    demoted and rebuilt (a retry whose first answer was lost), it is refused as stale and the copy stays in
    sync; a report that names no epoch (an older sender) is taken as current."""
    sched, servers = cluster
    m = sched.core.map
    primary, replica = (h.service.server_id for h in servers)
    led = np.flatnonzero(m.leads(m.index_of(primary))).astype("<i4")
    report = spb.ReportCopyFailureRequest(reporter=primary, epoch=m.epoch, target=replica, slots=led.tobytes(),
                                          reason="stream broke")
    with grpc.insecure_channel(sched.address) as channel:
        stub = spb_grpc.SchedulerStub(channel)
        reply = stub.ReportCopyFailure(report, timeout=10)
        assert reply.accepted and reply.epoch > m.epoch
        assert (sched.core.map.copy_state(m.index_of(replica))[led] == CATCHING_UP).all()
        _all_in_sync(sched)  # the primary rebuilt its copies on the replica
        rebuilt = sched.core.map
        reply = stub.ReportCopyFailure(report, timeout=10)
        assert not reply.accepted and reply.message.startswith(f"stale report: seen at epoch {m.epoch}")
        assert sched.core.map.epoch == rebuilt.epoch
        assert (sched.core.map.copy_state(m.index_of(replica))[led] == IN_SYNC).all()
        report.epoch = 0
        assert stub.ReportCopyFailure(report, timeout=10).accepted
        assert (sched.core.map.copy_state(m.index_of(replica))[led] == CATCHING_UP).all()
    _all_in_sync(sched)


def _export(address: str, table: str, epoch: int) -> int:
    """The rows a full export (not a cut) of ``table`` routed at map ``epoch`` streams from ``address``."""
    with grpc.insecure_channel(address) as channel:
        chunks = shard_pb2_grpc.ShardStub(channel).ExportRows(pb.ExportRowsRequest(table=table, epoch=epoch),
                                                              timeout=10)
        return sum(len(c.rows.ids) // 8 for c in chunks)


def test_an_export_never_reads_an_incarnation_its_map_does_not_name(cluster, tmp_path) -> None:
    """A table dropped and created again while a server has not installed that map yet (its install held up):
    a full export routed by the new map must not stream the dropped incarnation's rows from it (it did: the
    request's epoch and the table's incarnation were not checked). It answers Unavailable until it installs the
    map, then exports the new, empty incarnation; an export routed by the old map is refused by a server that
    holds the new one."""
    sched, servers = cluster
    s0 = servers[0]
    with ps.connect(scheduler=sched.address) as client:
        client.create_table("t", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        ids = np.arange(4096, dtype=np.int64)
        client.push("t", ids, -np.ones((ids.size, 4), np.float32)).result()
        old = sched.core.map.epoch
        _wait_installed(servers, old)
        assert _export(s0.address, "t", old) > 0  # it leads some of the rows
        s0.service.ownership.install_lock.acquire()  # s0's installs wait: it stays at the old map
        try:
            client.drop_table("t")
            client.create_table("t", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
            new = sched.core.map.epoch
            assert s0.service.epoch < new
            with pytest.raises(grpc.RpcError) as err:
                _export(s0.address, "t", new)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "behind the export's" in err.value.details()
            # the client's export retries by the newest map until the server has installed it
            exported: list = []
            exporter = threading.Thread(target=lambda: exported.append(client.export("t", str(tmp_path / "x"))))
            exporter.start()
            time.sleep(0.5)
        finally:
            s0.service.ownership.install_lock.release()
        exporter.join(30)
        assert exported and exported[0]["rows"] == 0
        _wait_installed(servers, new)
        assert _export(s0.address, "t", new) == 0  # the new incarnation: empty
        with pytest.raises(grpc.RpcError) as err:
            _export(s0.address, "t", old)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "newer than the export's map" in err.value.details()
