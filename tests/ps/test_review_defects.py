"""Regression tests for the defects found in the review of the reworked shard server, client, exactly-once
window and catalog. One test per defect; each docstring names it. Real servers only (in-process handles and
``LocalCluster`` daemons), no mocks."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from tigana import ps
from tigana.embeddings import EmbeddingTable, TableConfig
from tigana.embeddings import config as cfg
from tigana.embeddings import snapshot as snap
from tigana.proto import shard_pb2 as pb
from tigana.ps import routing
from tigana.ps.routing import DEFAULT_NUM_SLOTS, slot_of
from tigana.ps.shard import checksum_value
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.daemon import start_server
from tigana.ps.shard.dedup import DedupWindow
from tigana.ps.wire import data as wire

DIM = 4


# --- helpers -----------------------------------------------------------------------------------------------
def create(stub, config: TableConfig) -> None:
    stub.CreateTable(pb.CreateTableRequest(spec=wire.spec_to_pb(config)))


def pull(stub, table: str, ids: np.ndarray, dim: int = DIM) -> np.ndarray:
    reply = stub.Pull(pb.PullRequest(table=table, ids=wire.encode_ids(ids), codec=pb.CODEC_FP32))
    return wire.decode_rows(reply.rows, len(ids), dim, table=table)


def push_request(table: str, ids: np.ndarray, grads: np.ndarray, client_id: str, seq: int,
                 part: int = 0) -> pb.PushRequest:
    """The PushRequest the client sends (``wire.encode_push_request``), parsed for the generated stub."""
    data, scales = wire.encode_block(np.ascontiguousarray(grads, np.float32), pb.CODEC_FP32)
    raw = wire.encode_push_request(table, np.asarray(ids, np.int64), pb.CODEC_FP32, grads.shape[1], data, scales,
                                   client_id, seq, part)
    return pb.PushRequest.FromString(raw)


def table_stats(stub, table: str) -> dict[str, float]:
    (entry,) = stub.Stats(pb.StatsRequest(table=table)).tables
    return dict(entry.values)


def ids_in_slots(slots: list[int], per_slot: int, num_slots: int = DEFAULT_NUM_SLOTS) -> list[np.ndarray]:
    """``per_slot`` distinct ids lying in each of ``slots`` (found by scanning 0, 1, 2, ...)."""
    candidates = np.arange(200_000, dtype=np.int64)
    of = slot_of(candidates, num_slots)
    out = []
    for s in slots:
        found = candidates[of == s][:per_slot]
        assert found.size == per_slot, f"slot {s}: only {found.size} ids below 200000"
        out.append(found)
    return out


# --- a ------------------------------------------------------------------------------------------------------
def test_exactly_once_window_is_part_of_the_snapshot(make_shard_server, shard_stub) -> None:
    """Defect: the exactly-once window was kept in a separate ``dedup/`` folder instead of inside the snapshot,
    so a server restarted from a snapshot applied a replayed push a second time. Now the window is an extra
    file of the snapshot itself: a push replayed to the restarted server is a duplicate and changes nothing."""
    first = make_shard_server(snapshot_on_shutdown=False)  # the explicit Snapshot below is all there is
    data_dir = Path(first.config.data_dir)
    stub = shard_stub(first.address)
    create(stub, TableConfig("once", DIM, optimizer=cfg.SGD(lr=1.0), initializer=cfg.Zeros()))
    ids = np.array([3, 17, 3, 99], np.int64)
    grads = np.arange(16, dtype=np.float32).reshape(4, DIM)
    request = push_request("once", ids, grads, "trainer-a", 41)
    reply = stub.Push(request)
    assert (reply.applied_rows, reply.duplicate) == (3, False)
    rows = pull(stub, "once", np.unique(ids))
    checksum = table_stats(stub, "once")["checksum"]

    (path,) = stub.Snapshot(pb.SnapshotRequest()).paths
    path = Path(path)
    assert data_dir in path.parents
    raw = snap.read_extra(path, "dedup")
    assert raw is not None, f"snapshot {path} has no exactly-once window"
    window = DedupWindow.from_bytes(raw, num_slots=DEFAULT_NUM_SLOTS)
    assert window.applied("trainer-a", 41, np.unique(slot_of(ids))).all()
    first.close()
    assert not (data_dir / "dedup").exists(), "the window must live inside the snapshot, not beside it"

    second = make_shard_server(data_dir=str(data_dir))
    stub = shard_stub(second.address)
    replay = stub.Push(request)
    assert (replay.applied_rows, replay.duplicate) == (0, True)
    np.testing.assert_array_equal(pull(stub, "once", np.unique(ids)), rows)
    assert table_stats(stub, "once")["checksum"] == checksum
    # the restarted server still applies what it has not seen
    fresh = stub.Push(push_request("once", ids[:1], grads[:1], "trainer-a", 42))
    assert (fresh.applied_rows, fresh.duplicate) == (1, False)
    assert not (data_dir / "dedup").exists()


# --- b ------------------------------------------------------------------------------------------------------
def test_exactly_once_survives_a_different_split(shard_server, shard_stub) -> None:
    """Defect: exactly-once was keyed per message (client_id, seq, part), so a retried push split differently
    across messages after re-routing was applied again. Now it is per routing slot: the slots a seq already
    applied are skipped, only the new slot's ids are applied (and counted in ``applied_rows``)."""
    stub = shard_stub(shard_server.address)
    config = TableConfig("split", DIM, optimizer=cfg.SGD(lr=1.0), initializer=cfg.Normal(std=0.1), seed=3)
    create(stub, config)
    s1, s2, s3 = ids_in_slots([5, 700, 3000], per_slot=3)
    rng = np.random.default_rng(0)
    grad = {int(i): rng.normal(size=DIM).astype(np.float32) for i in np.concatenate([s1, s2, s3])}

    def g(ids: np.ndarray) -> np.ndarray:
        return np.stack([grad[int(i)] for i in ids])

    reference = EmbeddingTable(config)
    try:
        once = np.concatenate([s1, s2])
        first = stub.Push(push_request("split", once, g(once), "trainer-b", 7))
        assert (first.applied_rows, first.duplicate) == (6, False)
        reference.push(once, g(once))
        assert table_stats(stub, "split")["checksum"] == checksum_value(reference.checksum())

        # the same seq, re-routed: part 0 carries s1's ids, part 1 carries s2's ids and a new slot's (s3)
        a = stub.Push(push_request("split", s1, g(s1), "trainer-b", 7, part=0))
        assert (a.applied_rows, a.duplicate) == (0, True)
        mixed = np.concatenate([s2[::-1], s3, s2[:1]])  # another order, a duplicate id too
        b = stub.Push(push_request("split", mixed, g(mixed), "trainer-b", 7, part=1))
        assert (b.applied_rows, b.duplicate) == (s3.size, False)
        reference.push(s3, g(s3))
        assert table_stats(stub, "split")["checksum"] == checksum_value(reference.checksum())
        probe = np.concatenate([s1, s2, s3])
        np.testing.assert_array_equal(pull(stub, "split", probe), reference.pull(probe))
        # and a third split of the same seq is now a duplicate everywhere
        c = stub.Push(push_request("split", probe, g(probe), "trainer-b", 7, part=2))
        assert (c.applied_rows, c.duplicate) == (0, True)
        assert table_stats(stub, "split")["checksum"] == checksum_value(reference.checksum())
    finally:
        reference.close()


# --- c ------------------------------------------------------------------------------------------------------
def test_a_failed_part_does_not_settle_a_push_still_in_flight(make_shard_cluster, shard_stub) -> None:
    """Defect: a push whose part failed on one server settled its future (and left the pending set) at once,
    while its parts to other servers were still in flight, so ``flush`` and the staleness waits returned
    early. Now the future settles, with the first error, only when every part has."""
    cluster = make_shard_cluster(2, replicas=None)
    with ps.connect(cluster.addresses, timeout_s=30) as client:
        client.create_table("half", dim=DIM, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        # shard 0 re-creates the table with another dim behind the client's back: it rejects its part at once
        stub0 = shard_stub(cluster.addresses[0])
        assert stub0.DropTable(pb.DropTableRequest(table="half")).dropped
        create(stub0, TableConfig("half", DIM + 2))
        ids = np.arange(400, dtype=np.int64)
        owners = routing.static_assignment(2)[slot_of(ids)]
        assert set(owners.tolist()) == {0, 1}
        cluster.pause(1)
        try:
            fut = client.push("half", ids, np.ones((ids.size, DIM), np.float32))
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                assert not fut.done(), "the push settled while its part to the paused shard was in flight"
                assert client.stats()["pushes_in_flight"] >= 1
                time.sleep(0.05)
        finally:
            cluster.resume(1)
        with pytest.raises(ps.InvalidArgument, match="half"):
            fut.result(timeout=30)
        assert client.stats()["pushes_in_flight"] == 0
        # shard 1 applied its part meanwhile (only the rejected part is lost)
        stub1 = shard_stub(cluster.addresses[1])
        assert table_stats(stub1, "half")["rows"] == int((owners == 1).sum())
        with pytest.raises(ps.InvalidArgument, match="half"):
            client.flush()
        client.flush()  # raised once


# --- d ------------------------------------------------------------------------------------------------------
def test_a_stored_push_error_is_raised_at_the_next_call(shard_server, shard_stub) -> None:
    """Defect: a failed asynchronous push was reported only by ``flush``, so a trainer that never flushed kept
    pushing into a table that rejects it. Now the next ``push`` or ``pull`` raises it (once, without sending
    that call's own request), and the call after that works."""
    stub = shard_stub(shard_server.address)
    with ps.connect([shard_server.address], timeout_s=20) as client:
        client.create_table("dimcheck", dim=DIM)
        client.create_table("good", dim=DIM, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        stub.DropTable(pb.DropTableRequest(table="dimcheck"))
        create(stub, TableConfig("dimcheck", DIM + 2))
        ids = np.arange(3, dtype=np.int64)
        ones = np.ones((3, DIM), np.float32)

        for call in ("push", "pull"):
            fut = client.push("dimcheck", ids, ones)
            with pytest.raises(ps.InvalidArgument, match="dimcheck"):
                fut.result(timeout=20)
            before = table_stats(stub, "good")["checksum"]
            with pytest.raises(ps.InvalidArgument, match="dimcheck"):
                if call == "push":
                    client.push("good", ids, ones)
                else:
                    client.pull("good", ids)
            assert table_stats(stub, "good")["checksum"] == before  # the raising call sent nothing
            assert table_stats(stub, "good")["rows"] == (0 if call == "push" else 3)
            if call == "push":
                assert client.push("good", ids, ones).result(timeout=20) == 3
            else:
                np.testing.assert_array_equal(client.pull("good", ids), -ones)
            client.flush()  # the error was raised once: flush has nothing left to raise
        fut = client.push("dimcheck", ids, ones)
        with pytest.raises(ps.InvalidArgument, match="dimcheck"):
            fut.result(timeout=20)
        with pytest.raises(ps.InvalidArgument, match="dimcheck"):
            client.pull_async("good", ids)  # also the asynchronous calls, at the call
        assert client.pull_async("good", ids).result(timeout=20).shape == (3, DIM)
        client.flush()


# --- e ------------------------------------------------------------------------------------------------------
def test_ownership_is_checked_under_the_write_lock(shard_server, shard_stub) -> None:
    """Defect: Push checked slot ownership before taking the table's write lock, so a push waiting on the lock
    while the server gave its slots away applied rows this server no longer owns. Now the check runs under
    the lock, against the view the apply sees: the push fails with WrongShard and nothing is applied."""
    stub = shard_stub(shard_server.address)
    create(stub, TableConfig("own", DIM, optimizer=cfg.SGD(lr=1.0)))
    ids = np.arange(64, dtype=np.int64)
    pull(stub, "own", ids)
    before = table_stats(stub, "own")
    request = push_request("own", ids, np.ones((ids.size, DIM), np.float32), "trainer-e", 1)
    lock = shard_server.service.tables.get("own").lock
    lock.acquire()
    try:
        call = stub.Push.future(request, timeout=30)
        time.sleep(0.3)
        assert not call.done(), "the push did not wait for the table's write lock"
        shard_server.service.set_owned_slots(np.zeros(shard_server.config.num_slots, bool))
    finally:
        lock.release()
    with pytest.raises(grpc.RpcError) as err:
        call.result(timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'own'" in err.value.details() and "does not lead" in err.value.details()
    after = table_stats(stub, "own")
    assert after["checksum"] == before["checksum"] and after["rows"] == before["rows"]


# --- f ------------------------------------------------------------------------------------------------------
def test_read_only_pulls_insert_nothing_and_count_no_admission(shard_servers) -> None:
    """Defect: ``pull(insert=False)`` (evaluation, serving) inserted rows, and counted a sighting toward
    admission, like a training pull. Now it stores nothing and counts nothing: rows stay 0, and a later
    training pull still needs ``min_count`` sightings of its own."""
    ids = np.arange(0, 3000, 7, dtype=np.int64)  # on both shards
    with ps.connect([h.address for h in shard_servers], timeout_s=20) as client:
        client.create_table("gated", dim=DIM, admission=ps.Admission(min_count=2), seed=5)
        initial = client.pull("gated", ids, insert=False)
        assert initial.shape == (ids.size, DIM) and np.abs(initial).sum() > 0
        assert client.describe_table("gated").rows == 0
        np.testing.assert_array_equal(client.pull("gated", ids), initial)  # the first counted sighting
        assert client.describe_table("gated").rows == 0, "the read-only pull counted toward admission"
        np.testing.assert_array_equal(client.pull("gated", ids, insert=False), initial)
        assert client.describe_table("gated").rows == 0, "the read-only pull admitted the ids"
        np.testing.assert_array_equal(client.pull("gated", ids), initial)  # the second: admitted now
        assert client.describe_table("gated").rows == ids.size

        client.create_table("open", dim=DIM, initializer=ps.Uniform(low=-1, high=1), seed=9)
        read_only = client.pull_async("open", ids, insert=False).result(timeout=20)
        assert client.describe_table("open").rows == 0
        np.testing.assert_array_equal(client.pull("open", ids), read_only)  # the deterministic initial rows
        assert client.describe_table("open").rows == ids.size
        # stored rows are read as they are, and a read-only pull mixing stored and new ids stores nothing new
        client.push("open", ids, np.ones((ids.size, DIM), np.float32)).result(timeout=20)
        more = np.concatenate([ids, ids + 1])
        mixed = client.pull("open", more, insert=False)
        np.testing.assert_array_equal(mixed[:ids.size], client.pull("open", ids))
        assert client.describe_table("open").rows == ids.size
        np.testing.assert_array_equal(mixed[ids.size:], client.pull("open", ids + 1))


# --- g ------------------------------------------------------------------------------------------------------
def test_slots_and_num_slots_are_persisted(tmp_path, shard_stub) -> None:
    """Defect: the data dir did not record the slots a static server held, nor ``num_slots``, so a server
    restarted with other settings answered for slots whose rows it does not have. Now both are in the
    catalog: a restart with other slots or another num_slots fails naming them; the original settings serve
    the rows."""
    base = ServerConfig(port=0, data_dir=str(tmp_path / "shard"), slots="0-2047", drain_grace_s=1.0)

    def started(config: ServerConfig) -> ps.ServerHandle:
        handle = start_server(config)
        try:
            assert handle.wait_ready(60)
        except BaseException:
            handle.close(grace=1.0)  # frees the data dir's lock for the next start
            raise
        return handle

    handle = started(base)
    try:
        stub = shard_stub(handle.address)
        create(stub, TableConfig("kept", DIM, optimizer=cfg.SGD(lr=1.0), seed=2))
        ids = np.arange(2000, dtype=np.int64)
        ids = ids[slot_of(ids) < 2048]
        assert stub.Push(push_request("kept", ids, np.ones((ids.size, DIM), np.float32), "g", 1)).applied_rows
        rows = pull(stub, "kept", ids)
        checksum = table_stats(stub, "kept")["checksum"]
    finally:
        handle.close(grace=1.0)  # snapshots on close

    with pytest.raises(ps.InvalidArgument, match=r"slots '0-2047'.*--slots '0-4095'"):
        started(dataclasses.replace(base, slots="0-4095"))
    with pytest.raises(ps.InvalidArgument, match=r"4096 slots.*--num-slots 1024"):
        started(dataclasses.replace(base, slots="all", num_slots=1024))

    handle = started(base)
    try:
        stub = shard_stub(handle.address)
        np.testing.assert_array_equal(pull(stub, "kept", ids), rows)
        stats = table_stats(stub, "kept")
        assert stats["checksum"] == checksum and stats["rows"] == ids.size
    finally:
        handle.close(grace=1.0)
