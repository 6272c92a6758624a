"""The replication queue is bounded: past ``replication_queue_bytes`` a primary's writers wait, then get
UNAVAILABLE with nothing applied (it used to grow without bound: ``max_queue_bytes`` was stored, never read).
Every enqueuer waits: pushes, pulls that insert, ``ImportRows``; and a slot copy's export never runs past its
copy lane's window (it used to give up waiting after 30 s and queue anyway).

A real ``ShardService`` installs a map in which it leads every slot and a second server, at an address where
nothing listens, holds their copies: nothing it queues is ever acknowledged."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from tigana.embeddings import SGD, RowBatch, TableConfig, Zeros
from tigana.proto import shard_pb2 as pb
from tigana.ps.errors import Unavailable
from tigana.ps.replication.copy import FAILED
from tigana.ps.routing import CATCHING_UP, IN_SYNC, ServerEntry, ShardMap, TableDef
from tigana.ps.shard import ShardService
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.writes import COPY_CHUNK
from tigana.ps.wire import cluster as cluster_wire
from tigana.ps.wire import data as wire

SLOTS = 64


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: connections are refused


def _push(ids: np.ndarray, seq: int) -> pb.PushRequest:
    return pb.PushRequest(table="t", ids=wire.encode_ids(ids), grads=wire.encode_rows(-np.ones((ids.size, 4),
                                                                                               np.float32)),
                          client_id="c", seq=seq)


@pytest.fixture
def service():
    config = ServerConfig(num_slots=SLOTS, scheduler="127.0.0.1:1", replication_queue_bytes=4096,
                          ack_timeout_s=0.5, replication_timeout_s=60.0)
    svc = ShardService(config)
    svc.state = "serving"
    spec = TableDef(TableConfig("t", dim=4, optimizer=SGD(lr=1.0), initializer=Zeros()), durability="async",
                    created_epoch=1)
    servers = (ServerEntry(svc.server_id, "127.0.0.1:2", svc.boot), ServerEntry("dead", f"127.0.0.1:{_closed_port()}",
                                                                               "b"))
    copies = np.stack([np.zeros(SLOTS, np.int32), np.ones(SLOTS, np.int32)], axis=1)
    m = ShardMap(5, SLOTS, 1, servers, copies, np.full(copies.shape, IN_SYNC, np.uint8),
                 np.zeros(SLOTS, np.uint64), {"t": spec})
    svc.install(m)
    svc.test_map = m
    try:
        yield svc
    finally:
        svc.close_tables()


def test_writers_wait_past_the_bound_then_are_refused_with_nothing_applied(service) -> None:
    ids = np.arange(2000, dtype=np.int64)
    service.writes.push(_push(ids, 1))  # queued for the copy that never answers: past the 4 KiB bound
    assert service.replicator.stats()["replication_lag_bytes"] > 4096
    before = service.tables.get("t").table.pull(ids, insert=False).copy()
    with pytest.raises(Unavailable, match="behind.*nothing applied"):
        service.writes.push(_push(ids, 2))
    np.testing.assert_array_equal(service.tables.get("t").table.pull(ids, insert=False), before)
    np.testing.assert_array_equal(before, np.ones((ids.size, 4)))  # the first push, once


def test_writes_waiting_for_a_silent_copy_hold_no_thread_and_are_answered_at_their_deadline(service) -> None:
    """``Replicator.when_done``: a sync write waiting for its copies is called back by the event that settles it
    (or the deadline sweeper), with no thread blocked meanwhile. Each such wait used to hold one of the server's
    16 frame-pool threads for up to ``ack_timeout_s``: a few dozen writes waiting on a paused copy held every
    other sync acknowledgement of the server behind them (``bench nemesis`` stalls)."""
    rep = service.replicator
    service.writes.push(_push(np.array([3], np.int64), 1))  # queued for the copy that never answers
    marks = rep.tail_marks(np.array([3]))
    assert marks, "the copy never answers: a write of slot 3 waits for it"
    answers: list[tuple[bool, str]] = []
    threads_before = threading.active_count()
    started = time.monotonic()
    for _ in range(200):
        rep.when_done(marks, 0.5, lambda ok: answers.append((ok, threading.current_thread().name)))
    assert time.monotonic() - started < 0.5 and answers == []  # nobody waited in when_done
    assert threading.active_count() <= threads_before + 1  # at most the deadline sweeper
    deadline = time.monotonic() + 10
    while len(answers) < 200:
        assert time.monotonic() < deadline, f"{len(answers)} of 200 answered"
        time.sleep(0.05)
    assert answers == [(False, "tigana-ack-deadlines")] * 200  # past the deadline: not acknowledged by the copy
    done: list[bool] = []
    rep.when_done([], 0.5, done.append)  # nothing to wait for: answered at once, on the caller's thread
    assert done == [True]


def _rows(ids: np.ndarray, value: float) -> RowBatch:
    n = ids.size
    return RowBatch(ids, np.full((n, 4), value, np.float32), np.zeros((n, 0), np.float32), np.ones(n, np.int64),
                    np.ones(n, np.int64), np.zeros(n))


def test_pulls_that_insert_and_imports_wait_past_the_bound_then_are_refused_with_nothing_applied(service) -> None:
    """A pull of new ids inserts them, and their rows go to the copies; ``ImportRows`` writes rows through the
    primary: both enqueued without waiting for room, so the queue grew past its bound while pushes waited."""
    service.writes.push(_push(np.arange(2000, dtype=np.int64), 1))  # past the 4 KiB bound, never acknowledged
    queued = service.replicator.stats()["replication_lag_bytes"]
    assert queued > 4096
    new = np.arange(10_000, 12_000, dtype=np.int64)
    with pytest.raises(Unavailable, match="behind.*nothing applied"):
        service.writes.pull(pb.PullRequest(table="t", ids=wire.encode_ids(new), epoch=5))
    with pytest.raises(Unavailable, match="behind.*nothing applied"):
        service.exports.import_rows(pb.ImportRowsRequest(table="t", rows=cluster_wire.rows_to_pb(_rows(new, 7.0)), epoch=5))
    table = service.tables.get("t").table
    assert not table.contains(new).any()
    assert service.replicator.stats()["replication_lag_bytes"] == queued
    # a read-only pull enqueues nothing: it is served
    rows = service.writes.pull(pb.PullRequest(table="t", ids=wire.encode_ids(new[:3]), epoch=5, read_only=True))[1]
    np.testing.assert_array_equal(rows, np.zeros((3, 4)))


def test_a_slot_copy_whose_copy_lane_stays_full_fails_instead_of_running_past_the_window(service) -> None:
    """The copy lane of a slot copy to a target that applies nothing fills its window; the export waits for room
    and, when none comes within ``copy_stall_s``, the copy fails (the upkeep starts it again). It used to wait 30
    s and then queue the next chunk anyway, and the next, past the window."""
    rep = service.replicator
    rep.core.copy_window_bytes = 1  # any chunk queued fills it
    rep.copy_stall_s = 0.3
    ids = np.arange(3 * COPY_CHUNK, dtype=np.int64)
    service.tables.get("t").table.import_rows(_rows(ids, 1.0))
    m = service.test_map
    states = m.states.copy()
    states[:, 1] = CATCHING_UP  # the copies on "dead" are to be built: a slot copy starts
    service.install(m.evolve(states=states))
    (stream,) = rep.streams.values()
    (sess,) = stream.sessions
    deadline = time.monotonic() + 10
    while sess.state != FAILED:
        assert time.monotonic() < deadline, f"the copy still runs: {sess.rows_sent} of {ids.size} rows queued"
        time.sleep(0.02)
    assert sess.rows_sent == COPY_CHUNK  # one chunk: the window was never exceeded by a second
