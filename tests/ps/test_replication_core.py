"""The sans-IO cores of replication and membership, driven by hand: events in, actions out, no thread.

These are the decisions the daemon's adapters and the simulator both drive (docs/replication.md): a slot copy's
steps and its report (I5), a refusal that demotes only the in-sync copies it names, a failed stream reported
only past its timeout, a sync write's marks released by an acknowledgement or by the map (I1), the lease
counted from when a heartbeat was sent.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from tigana.proto import shard_pb2 as pb
from tigana.ps.membership import HEARTBEAT, REGISTER, Membership, caught_up_answer
from tigana.ps.replication import Primary
from tigana.ps.replication.actions import (
    CloseStream,
    OpenStream,
    Pause,
    RefreshMap,
    ReportCaughtUp,
    ReportFailure,
    StartCopy,
)
from tigana.ps.replication.copy import FAILED, REPORTED, ROWS_SENT, SWITCHED
from tigana.ps.routing import CATCHING_UP, IN_SYNC, NO_SERVER, ServerEntry, ShardMap
from tigana.ps.wire.cluster import CHANGES, SNAPSHOT_BEGIN, SNAPSHOT_END, Item

SLOTS = 8
ROOT = Path(__file__).resolve().parents[2]


def _map(epoch: int, states_b: list[int | None]) -> ShardMap:
    """Server a (index 0) leads every slot; server b (index 1) holds a copy of slot s in ``states_b[s]``
    (None: no copy)."""
    copies = np.full((SLOTS, 2), NO_SERVER, np.int32)
    states = np.zeros((SLOTS, 2), np.uint8)
    copies[:, 0] = 0
    for s, st in enumerate(states_b):
        if st is not None:
            copies[s, 1], states[s, 1] = 1, st
    servers = (ServerEntry("a", "a:1"), ServerEntry("b", "b:1"))
    return ShardMap(epoch, SLOTS, 1, servers, copies, states, np.zeros(SLOTS, np.uint64))


def _primary(**kw) -> Primary:
    return Primary("a", "boot-a", SLOTS, generation=100, batch_bytes=1 << 20, **kw)


def _install(p: Primary, m: ShardMap, now: float = 0.0, tables: tuple[str, ...] = ("t",)) -> list:
    return p.on_map(m, 0, list(tables), lambda name, slots: np.zeros((slots.size, 2), np.uint64),
                    lambda name, slots: [], now)


def _reply(through: int, reject: int = pb.REJECT_NONE, slots: list[int] | None = None, epoch: int = 1
           ) -> pb.ReplicateResponse:
    return pb.ReplicateResponse(applied_through=through, reject=reject, epoch=epoch,
                                slots=np.asarray(slots or [], "<i4").tobytes())


def _write(slots: list[int]) -> Item:
    return Item(CHANGES, "t", np.asarray(slots, np.int32), prev=np.zeros((len(slots), 2), np.uint64))


def test_a_slot_copy_steps_through_its_states_and_reports_once_its_switch_is_acknowledged() -> None:
    p = _primary()
    actions = _install(p, _map(1, [CATCHING_UP] * 2 + [None] * 6))
    assert [type(a) for a in actions] == [OpenStream, StartCopy]
    s, sess = actions[1].stream, actions[1].session
    assert sess.slots.tolist() == [0, 1] and s.queue[0].item.kind == SNAPSHOT_BEGIN
    assert p.request(s) is not None  # SNAPSHOT_BEGIN is sendable at once
    # rows exported (none here): SNAPSHOT_END queued on the copy lane; nothing acknowledged yet, nothing to report
    assert p.rows_copied(s, sess, now=1.0) == []
    assert sess.state == ROWS_SENT and s.copies[-1].item.kind == SNAPSHOT_END and s.queue[-1].item.kind != SNAPSHOT_END
    assert sess.end_seq == s.copies[-1].seq and p.request(s, 1) is not None
    # a write to slot 0 meanwhile: sent to the copy, but not yet required (the copy is not in sync)
    assert p.enqueue(_write([0])) == []
    # the copy lane applied through SNAPSHOT_END, the change lane's lag small: the copy switches; its switch
    # seq acknowledged on the change lane, it reports caught up
    assert p.copy_answered(s, _reply(sess.end_seq), now=2.0) == [] and sess.state == SWITCHED
    out = p.answered(s, _reply(s.next_seq - 1), now=2.0)
    assert [type(a) for a in out] == [ReportCaughtUp] and out[0].session is sess and sess.state == REPORTED
    assert s.required[[0, 1]].all() and not s.required[2:].any()
    # from now on a sync write to slot 0 waits for the target
    marks = p.enqueue(_write([0]))
    assert len(marks) == 1 and not p.mark_done(marks[0])
    assert p.answered(s, _reply(s.next_seq - 1), now=3.0) == [] and p.mark_done(marks[0])


def test_a_copy_switches_a_second_after_its_rows_were_applied_whatever_the_lag() -> None:
    p = _primary()
    start = _install(p, _map(1, [CATCHING_UP] + [None] * 7))[1]
    s, sess = start.stream, start.session
    p.rows_copied(s, sess, now=0.0)
    end = sess.end_seq
    for _ in range(20):  # writes faster than the target applies them
        p.enqueue(_write([0]))
    assert p.copy_answered(s, _reply(end), now=0.5) == [] and sess.state == ROWS_SENT  # lag 21 > 8: not yet
    assert p.answered(s, _reply(2), now=1.6) == []  # a second after the rows: switched
    assert sess.state == SWITCHED and sess.switch_seq == s.next_seq - 1
    out = p.answered(s, _reply(sess.switch_seq), now=1.7)
    assert [type(a) for a in out] == [ReportCaughtUp]


def test_a_refusal_cuts_only_its_slots_and_reports_only_in_sync_copies() -> None:
    p = _primary()
    _install(p, _map(1, [IN_SYNC] * 4 + [CATCHING_UP] * 2 + [None] * 2))
    s = p.streams["b@b:1#"]
    p.enqueue(_write([0, 1, 4]))
    # the target refuses slots 1 (in sync) and 4 (catching up): only slot 1 is reported
    out = p.answered(s, _reply(0, pb.REJECT_DIVERGED, [1, 4]), now=1.0)
    assert len(out) == 1 and isinstance(out[0], ReportFailure) and out[0].slots.tolist() == [1]
    assert s.excluded[[1, 4]].all() and not s.excluded[[0, 2, 3, 5]].any()
    assert s.queue[-1].item.slots.tolist() == [0]  # the queued write was cut to its other slots
    assert all(x.state == FAILED for x in s.sessions)  # the copy of slots 4 and 5 starts again
    # a sync write to slot 1 now waits for the map (no acknowledgement stands in for the cut item) ...
    marks = p.enqueue(_write([1]))
    assert marks and not p.mark_done(marks[0])
    assert p.answered(s, _reply(s.next_seq - 1), now=2.0) == [] and not p.mark_done(marks[0])
    # ... which takes the copy out of the in-sync set: released (I1)
    _install(p, _map(2, [IN_SYNC, None, IN_SYNC, IN_SYNC] + [None] * 4))
    assert p.mark_done(marks[0])


def test_an_item_cut_by_a_refusal_does_not_acknowledge_the_writes_it_lost() -> None:
    """A sync write queued before the target refused one of its slots: the refusal cuts the slot's part out of
    the queued item, and the target's acknowledgement of what is left says nothing of that part. The write
    waits for the map to take the copy out of the in-sync set (bench sim seeds 23, 24 and 28: a deposed primary,
    refused by its old replica after a partition, acknowledged sync writes that only it had applied)."""
    p = _primary()
    _install(p, _map(1, [IN_SYNC] * 4 + [None] * 4))
    s = p.streams["b@b:1#"]
    before = p.enqueue(_write([0, 1]))  # waits for its seq, slots 0 and 1
    other = p.enqueue(_write([2]))      # waits for its seq, slot 2 only
    assert p.answered(s, _reply(0, pb.REJECT_STALE, [1]), now=1.0)  # slot 1 refused: reported
    assert [q.item.slots.tolist() for q in s.queue][-2:] == [[0], [2]]  # the first write was cut to slot 0
    assert p.answered(s, _reply(s.next_seq - 1), now=2.0) == []  # all applied (what is left of them)
    assert p.mark_done(other[0])  # a write the cut did not touch: acknowledged
    assert not p.mark_done(before[0])  # slot 1's part never reached the target
    _install(p, _map(2, [IN_SYNC, None, IN_SYNC, IN_SYNC] + [None] * 4))
    assert p.mark_done(before[0])  # the map took the copy of slot 1 out of the in-sync set (I1)


def test_a_failure_report_carries_the_epoch_at_which_it_was_seen() -> None:
    """The scheduler ignores a report for slots that changed after the epoch it carries (a late retry must not
    demote a copy rebuilt since): a report says the map the primary held when it saw the failure."""
    p = _primary(failure_timeout_s=0.0)
    _install(p, _map(3, [IN_SYNC] * 2 + [None] * 6))
    s = p.streams["b@b:1#"]
    assert [(a.slots.tolist(), a.epoch) for a in p.send_failed(s, "UNAVAILABLE", now=1.0)] == [([0, 1], 3)]
    refused = _primary()
    _install(refused, _map(4, [IN_SYNC] * 2 + [None] * 6))
    out = refused.answered(refused.streams["b@b:1#"], _reply(0, pb.REJECT_DIVERGED, [1], epoch=4), now=1.0)
    assert [(a.slots.tolist(), a.epoch) for a in out] == [([1], 4)]
    assert [a.epoch for a in refused.retry() if isinstance(a, ReportFailure)] == [4]


def test_a_refusal_about_slots_led_elsewhere_now_demotes_nothing() -> None:
    p = _primary()
    _install(p, _map(1, [CATCHING_UP] * 2 + [None] * 6))
    s = p.streams["b@b:1#"]
    assert p.answered(s, _reply(0, pb.REJECT_STALE, [0, 1], epoch=1), now=1.0) == []


def test_a_refusal_from_a_newer_map_is_learned_first() -> None:
    p = _primary()
    _install(p, _map(1, [IN_SYNC] + [None] * 7))
    assert p.newer_map(_reply(0, pb.REJECT_STALE, [0], epoch=5)) == [RefreshMap(5)]
    assert p.newer_map(_reply(0, pb.REJECT_STALE, [0], epoch=1)) == []
    assert p.newer_map(_reply(3, epoch=9)) == []  # not a refusal: nothing to learn


def test_a_failing_stream_is_reported_only_past_its_timeout_and_once() -> None:
    p = _primary(failure_timeout_s=2.0)
    _install(p, _map(1, [IN_SYNC] * 3 + [None] * 5))
    s = p.streams["b@b:1#"]
    assert p.send_failed(s, "UNAVAILABLE", now=10.0) == []
    assert p.send_failed(s, "UNAVAILABLE", now=11.0) == []
    out = p.send_failed(s, "UNAVAILABLE", now=12.0)
    assert len(out) == 1 and out[0].slots.tolist() == [0, 1, 2]
    assert p.send_failed(s, "UNAVAILABLE", now=13.0) == []  # reported once ...
    assert [type(a) for a in p.retry()] == [ReportFailure]  # ... and again by the upkeep timer
    # REJECT_BEHIND (the target lacks our map) is a failure of the same kind, with a pause
    p2 = _primary()
    _install(p2, _map(1, [IN_SYNC] + [None] * 7))
    out = p2.answered(p2.streams["b@b:1#"], _reply(0, pb.REJECT_BEHIND), now=0.0)
    assert out == [Pause(0.05)]
    # applying again makes the stream whole: the failure no longer stands
    s2 = p2.streams["b@b:1#"]
    p2.enqueue(_write([0]))
    p2.answered(s2, _reply(1), now=1.0)
    assert s2.broken_since is None and not s2.reported


def test_a_broken_stream_nothing_depends_on_is_restarted_by_the_next_map() -> None:
    p = _primary(failure_timeout_s=0.0)
    _install(p, _map(1, [CATCHING_UP] + [None] * 7))
    s = p.streams["b@b:1#"]
    p.send_failed(s, "UNAVAILABLE", now=1.0)
    assert p.needs_restart()
    actions = _install(p, _map(1, [CATCHING_UP] + [None] * 7), now=2.0)
    assert [type(a) for a in actions] == [CloseStream, OpenStream, StartCopy]
    assert actions[0].stream is s and actions[1].stream is not s
    assert actions[1].stream.generation > s.generation
    # a server that no longer holds a copy: its stream closes
    assert [type(a) for a in _install(p, _map(2, [None] * 8), now=3.0)] == [CloseStream]
    assert p.streams == {}


def test_a_stale_caught_up_report_restarts_the_copy() -> None:
    p = _primary()
    s = _install(p, _map(1, [CATCHING_UP] + [None] * 7))[0].stream
    sess = s.sessions[0]
    p.rows_copied(s, sess, 0.0)
    p.copy_answered(s, _reply(sess.end_seq), now=0.1)
    (report,) = p.answered(s, _reply(s.next_seq - 1), now=0.1)
    p.report_refused(report.stream, report.session)
    assert sess.state == FAILED and not s.required[0] and p.needs_restart()


def test_a_restarted_target_gets_a_new_stream_and_its_copies_start_again() -> None:
    """b restarts (a new boot) while a's copies into it are catching up: the copy into the old process may have
    sent every row and wait for nothing more, so no refusal would ever tell a that the rows are gone. The map
    with b's new boot closes the old stream and opens one to the new process (a new generation, from seq 1),
    and every copy into it starts again (``bench sim`` seed 147: copies that never finished, and a report of the
    old copy that the scheduler took)."""
    p = _primary()
    m = _map(1, [CATCHING_UP, CATCHING_UP] + [None] * 6)
    (opened, started) = _install(p, m)
    old = opened.stream
    assert isinstance(started, StartCopy) and old.sessions[0].slots.tolist() == [0, 1]
    p.rows_copied(old, old.sessions[0], 0.0)  # every row sent to the old process
    restarted = ShardMap(2, SLOTS, 1, (m.servers[0], ServerEntry("b", "b:1", boot="b-boot2")), m.copies, m.states,
                         np.zeros(SLOTS, np.uint64))
    actions = _install(p, restarted, now=1.0)
    kinds = [type(a) for a in actions]
    assert CloseStream in kinds and OpenStream in kinds and StartCopy in kinds
    (new,) = p.streams.values()
    assert new is not old and new.generation > old.generation and new.key == "b@b:1#b-boot2"
    assert new.sessions[0].slots.tolist() == [0, 1] and new.sessions[0].epoch == 2


def test_the_queue_bound_names_the_full_stream() -> None:
    p = _primary(max_queue_bytes=1000)
    _install(p, _map(1, [IN_SYNC] * 2 + [None] * 6))
    s = p.streams["b@b:1#"]
    assert p.full_stream(None) is None
    for _ in range(20):
        p.enqueue(_write([0]))
    assert p.full_stream(None) is s and p.full_stream(np.array([0])) is s
    assert p.full_stream(np.array([5])) is None  # slot 5 has no copy on b: its writes do not wait for room
    p.answered(s, _reply(s.next_seq - 1), now=1.0)
    assert p.full_stream(None) is None and s.queued_bytes == 0


def test_the_lease_counts_from_when_a_heartbeat_was_sent() -> None:
    m = Membership(interval_s=0.5, lease_s=2.0)
    assert m.next_call() == REGISTER and not m.lease_ok(0.0)
    m.registered_ok(sent=10.0)
    assert m.next_call() == HEARTBEAT and m.lease_ok(11.9) and not m.lease_ok(12.0)
    assert m.heartbeat_answered(sent=11.0, reregister=False) is False and m.lease_ok(12.9)
    # failures back off, but a registered server never waits longer than its interval
    assert [m.call_failed() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    assert m.heartbeat_answered(sent=20.0, reregister=True) is True and m.next_call() == REGISTER
    assert not m.lease_ok(20.5)  # a re-register does not renew the lease
    assert [m.call_failed() for _ in range(6)][-1] == 2.0


def test_heartbeats_keep_their_cadence_without_waiting_for_answers() -> None:
    m = Membership(interval_s=0.5, lease_s=2.0)
    m.registered_ok(sent=10.0)
    assert m.beat_due(10.2) == pytest.approx(0.3) and m.beat_due(10.5) == 0.0
    sent = []
    for k in range(m.max_in_flight):  # a slow link: none answered yet, the cadence goes on
        now = 10.5 + 0.5 * k
        assert m.beat_due(now) == 0.0
        m.beat_sent(now)
        sent.append(now)
    assert m.beat_due(100.0) == m.interval_s  # the bound of unanswered heartbeats holds the next one
    # answers out of order: the lease counts from the latest send answered, never back
    assert m.heartbeat_answered(sent=sent[2], reregister=False) is False and m.lease_ok(sent[2] + 1.9)
    m.heartbeat_answered(sent=sent[0], reregister=False)
    assert m.lease_ok(sent[2] + 1.9) and not m.lease_ok(sent[2] + 2.0)
    assert m.beat_due(100.0) == 0.0  # answers freed room
    assert m.heartbeat_failed(now=12.0) == 0.1 and m.in_flight == m.max_in_flight - 3


def test_a_failed_heartbeat_searches_every_scheduler_and_keeps_the_one_that_answers() -> None:
    """A leader paused: its heartbeats hang until their deadline, the standby refuses until it leads. Going
    round the schedulers one at a time sent the server back to the paused one after every refusal, for another
    whole deadline (seen: a new leader heard no server for 3.2 s and declared both dead). Once the current one
    fails, every heartbeat goes to all of them until one answers; that one is kept."""
    m = Membership(interval_s=0.5, lease_s=2.0, schedulers=3)
    m.registered_ok(sent=10.0)
    assert m.targets() == [0]
    m.beat_sent(10.5)
    m.heartbeat_failed(now=12.5, which=0)  # the paused leader: the deadline ran out
    assert m.searching and m.targets() == [0, 1, 2]
    m.beat_sent(12.6, calls=3)
    assert m.beat_due(12.6) > 0 and m.in_flight == 3
    m.heartbeat_failed(now=12.61, which=1)  # a standby refuses at once: still searching, all of them
    assert m.targets() == [0, 1, 2]
    assert m.heartbeat_answered(sent=12.6, reregister=False, which=2) is False  # the new leader
    assert not m.searching and m.targets() == [2] and m.lease_ok(14.5)
    m.heartbeat_failed(now=14.6, which=0)  # a late failure on the old leader says nothing new
    assert not m.searching and m.targets() == [2]
    one = Membership(interval_s=0.5, lease_s=2.0)  # one address (a Service): nothing to search
    one.registered_ok(sent=0.0)
    one.heartbeat_failed(now=2.0, which=0)
    assert not one.searching and one.targets() == [0]
    m.next_scheduler()  # a register or report failed: the next one
    assert m.targets() == [0]


def test_refreshes_coalesce_to_the_highest_epoch_wanted() -> None:
    m = Membership()
    assert m.want(5) and not m.want(5) and not m.want(3) and m.want(6)
    assert m.wants_more(5) and not m.wants_more(6)
    assert caught_up_answer(False, "stale: the copy changed at epoch 9") is False
    assert caught_up_answer(False, "not the primary") is True and caught_up_answer(True, "") is True


def test_the_cores_hold_no_thread_socket_or_clock() -> None:
    """Sans-IO: the cores import nothing that blocks, sleeps, reads a clock or opens a socket."""
    forbidden = {"threading", "time", "socket", "grpc", "asyncio", "concurrent", "selectors", "random", "uuid"}
    cores = ["ps/replication/primary.py", "ps/replication/stream.py", "ps/replication/copy.py", "ps/replication/pacing.py",
             "ps/replication/actions.py", "ps/membership/core.py", "ps/scheduler/core.py",
             "ps/scheduler/liveness.py", "ps/scheduler/moves.py", "ps/scheduler/actions.py",
             "ps/scheduler/_fields.py", "ps/scheduler/placement.py"]
    for path in cores:
        tree = ast.parse((ROOT / path).read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] not in forbidden, f"{path} imports {name}"


def test_the_apply_side_applies_each_seq_once_in_order_and_asks_for_a_newer_map() -> None:
    from types import SimpleNamespace

    from tigana.ps.replication import Inbound

    applied: list[str] = []
    view = SimpleNamespace(epoch=3, valid=True)

    def req(first: int, items: list[str], generation: int = 7, epoch: int = 3) -> SimpleNamespace:
        return SimpleNamespace(source_boot="b1", generation=generation, first_seq=first, epoch=epoch, items=items)

    def receive(r: SimpleNamespace, **kw):
        return inbound.receive(r, "me", lambda: view, lambda msg, epoch: applied.append(msg), **kw)

    inbound = Inbound("src")
    assert receive(req(2, ["x"])).reject == pb.REJECT_GAP  # a new stream starts at seq 1
    assert receive(req(1, ["a", "b"])).applied_through == 2
    assert receive(req(2, ["b", "c"])).applied_through == 3  # a retried request: "b" applied once
    assert receive(req(5, ["e"])).reject == pb.REJECT_GAP and applied == ["a", "b", "c"]
    assert receive(req(1, ["z"], generation=6)).reject == pb.REJECT_GAP  # an older generation of the stream
    # the source's map is newer: the core asks for it; the adapter learns it, or the request is refused BEHIND
    assert receive(req(4, ["d"], epoch=5)) == RefreshMap(5)
    assert receive(req(4, ["d"], epoch=5), may_refresh=False).reject == pb.REJECT_BEHIND
    view.epoch = 5
    assert receive(req(4, ["d"], epoch=5)).applied_through == 4 and applied == ["a", "b", "c", "d"]


def test_a_copy_the_map_puts_in_sync_while_a_new_slot_copy_of_it_is_running_is_refused_and_reported() -> None:
    """An earlier copy's report went in while the primary had started the copy again (its answer was lost,
    the scheduler starved): the new copy's SNAPSHOT_BEGIN emptied the target, so when the map now has those
    copies in sync, the primary refuses and reports them instead of cutting the new copy short (which left
    an in-sync copy missing rows: copies differing at the same log position in ``bench reshard``)."""
    p = _primary()
    actions = _install(p, _map(1, [CATCHING_UP] * 3 + [None] * 5))
    s, sess = actions[1].stream, actions[1].session
    assert sess.slots.tolist() == [0, 1, 2] and sess.state not in (FAILED, REPORTED)
    # the map now has slots 0 and 1 in sync (the earlier copy's report); slot 2 still catching up
    actions = _install(p, _map(2, [IN_SYNC, IN_SYNC, CATCHING_UP] + [None] * 5))
    failures = [a for a in actions if isinstance(a, ReportFailure)]
    assert len(failures) == 1 and failures[0].target == "b" and failures[0].slots.tolist() == [0, 1]
    assert sess.state == FAILED and s.excluded[[0, 1]].all() and not s.excluded[2]
    # a write to the refused copies waits for the map to take them out of the in-sync set, never for b
    assert all(m.seq >= (1 << 62) for m in p.enqueue(_write([0])))
    # slot 2 gets a new slot copy of its own (the failed one covered it)
    starts = [a for a in actions if isinstance(a, StartCopy)]
    assert len(starts) == 1 and starts[0].session.slots.tolist() == [2]
    # the retry timer reports the refused in-sync copies again until the map demotes them
    assert any(isinstance(a, ReportFailure) and a.slots.tolist() == [0, 1] for a in p.retry())


def test_a_copy_already_reported_is_not_refused_when_the_map_puts_it_in_sync() -> None:
    p = _primary()
    actions = _install(p, _map(1, [CATCHING_UP] * 2 + [None] * 6))
    s, sess = actions[1].stream, actions[1].session
    p.rows_copied(s, sess, now=1.0)
    p.copy_answered(s, _reply(sess.end_seq), now=1.1)
    p.answered(s, _reply(s.next_seq - 1), now=1.1)
    p.answered(s, _reply(s.next_seq - 1), now=3.0)  # switched, then its switch acknowledged: reported
    assert sess.state == REPORTED
    actions = _install(p, _map(2, [IN_SYNC, IN_SYNC] + [None] * 6))
    assert not [a for a in actions if isinstance(a, ReportFailure)] and not s.excluded.any()


def test_a_slot_copy_cut_to_fewer_slots_goes_on_exporting_the_rest() -> None:
    """The map drops one of a running slot copy's target copies: the session is cut to the slots still catching
    up, and a chunk of rows that also holds the dropped slot's rows is sent without them. Refusing the chunk
    stopped the export, and the session ended with its later chunks never sent (an in-sync copy missing rows:
    ``bench reshard``'s copies differing at the same log position)."""
    from tigana.ps.wire.cluster import SNAPSHOT_ROWS

    p = _primary()
    actions = _install(p, _map(1, [CATCHING_UP] * 3 + [None] * 5))
    s, sess = actions[1].stream, actions[1].session
    _install(p, _map(2, [CATCHING_UP, None, CATCHING_UP] + [None] * 5))  # slot 1's copy on b is dropped
    assert sess.slots.tolist() == [0, 2] and p.session_active(s, sess)
    chunk = Item(SNAPSHOT_ROWS, "t", np.array([0, 1, 2], np.int32), prev=np.zeros((0, 2), np.uint64))
    assert p.enqueue_rows(s, sess, chunk)  # the copy goes on
    assert s.copies[-1].item.kind == SNAPSHOT_ROWS and s.copies[-1].item.slots.tolist() == [0, 2]
    only_dropped = Item(SNAPSHOT_ROWS, "t", np.array([1], np.int32), prev=np.zeros((0, 2), np.uint64))
    queued = len(s.copies)
    assert p.enqueue_rows(s, sess, only_dropped) and len(s.copies) == queued  # nothing of it is sent
    assert p.rows_copied(s, sess, now=1.0) == [] and sess.state == ROWS_SENT
