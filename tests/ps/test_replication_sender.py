"""The outcome of one send on a stream lane (``Replicator.sent``), as the daemon's sender threads and the
simulator both handle it: the failure reported to the core, then the lane's backoff."""

from __future__ import annotations

from tigana.proto import shard_pb2 as pb
from tigana.ps.replication.replicator import Replicator
from tigana.ps.replication.stream import Stream


def _replicator() -> Replicator:
    return Replicator("s0", "s0-boot1", 4, max_message_bytes=1 << 20, refresh_map=lambda epoch: None,
                      report_failure=lambda target, slots, reason, epoch: None,
                      caught_up=lambda target, slots, since: True, copy_rows=lambda s, sess: None,
                      clock=lambda: 0.0, spawn=lambda name, fn: None, generation=1)


def test_a_lane_backs_off_after_failed_sends_doubling_up_to_a_second_each_lane_apart() -> None:
    rep = _replicator()
    s = Stream("s1", "s1", 4, generation=1, now=0.0)
    assert [rep.sent(s, 0, None, "UNAVAILABLE: down") for _ in range(7)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert s.last_error == "UNAVAILABLE: down"  # the failure reached the core
    assert rep.sent(s, 1, None, "UNAVAILABLE: down") == 0.05  # the copy lane keeps its own


def test_a_closed_stream_keeps_no_backoff() -> None:
    rep = _replicator()
    s = Stream("s1", "s1", 4, generation=1, now=0.0)
    s.closed = True
    assert rep.sent(s, 0, None, "CANCELLED") == 0.05
    assert rep._backoff == {}


def test_an_answer_resets_the_backoff() -> None:
    rep = _replicator()
    s = Stream("s1", "s1", 4, generation=1, now=0.0)
    rep.sent(s, 0, None, "UNAVAILABLE: down")
    rep.sent(s, 0, None, "UNAVAILABLE: down")
    rep.sent(s, 0, pb.ReplicateResponse())
    assert rep.sent(s, 0, None, "UNAVAILABLE: down") == 0.05
