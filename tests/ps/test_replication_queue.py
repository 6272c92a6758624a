"""The replication queue is bounded: past ``replication_queue_bytes`` a primary's writers wait, then get
UNAVAILABLE with nothing applied (it used to grow without bound: ``max_queue_bytes`` was stored, never read).

A real ``ShardService`` installs a map in which it leads every slot and a second server, at an address where
nothing listens, holds their copies: nothing it queues is ever acknowledged."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from tigana.embeddings import SGD, TableConfig, Zeros
from tigana.proto import shard_pb2 as pb
from tigana.ps.config import ServerConfig
from tigana.ps.errors import Unavailable
from tigana.ps.routing import IN_SYNC, ServerEntry, ShardMap, TableDef
from tigana.ps.shard import ShardService
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
    try:
        yield svc
    finally:
        svc.close_tables()


def test_writers_wait_past_the_bound_then_are_refused_with_nothing_applied(service) -> None:
    ids = np.arange(2000, dtype=np.int64)
    service._push(_push(ids, 1))  # queued for the copy that never answers: past the 4 KiB bound
    assert service.replicator.stats()["replication_lag_bytes"] > 4096
    before = service._tables["t"].table.pull(ids, insert=False).copy()
    with pytest.raises(Unavailable, match="behind.*nothing applied"):
        service._push(_push(ids, 2))
    np.testing.assert_array_equal(service._tables["t"].table.pull(ids, insert=False), before)
    np.testing.assert_array_equal(before, np.ones((ids.size, 4)))  # the first push, once


def test_writes_waiting_for_a_silent_copy_hold_no_thread_and_are_answered_at_their_deadline(service) -> None:
    """``Replicator.when_done``: a sync write waiting for its copies is called back by the event that settles it
    (or the deadline sweeper), with no thread blocked meanwhile. Each such wait used to hold one of the server's
    16 frame-pool threads for up to ``ack_timeout_s``: a few dozen writes waiting on a paused copy held every
    other sync acknowledgement of the server behind them (``bench nemesis`` stalls)."""
    rep = service.replicator
    service._push(_push(np.array([3], np.int64), 1))  # queued for the copy that never answers
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
