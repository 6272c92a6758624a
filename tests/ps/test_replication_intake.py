"""The copy lane on a target (``replication.intake`` and ``apply``): a slot copy's rows land only where no change
since the copy began wrote or removed the id, and only once the change lane was applied through the seq they
were read after (invariant S11 in docs/replication.md).

``CopyIntake`` is checked against a reference model (hypothesis); the lane rules are driven through the real
``Inbound`` and ``apply_item`` on a real ``EmbeddingTable``, as ``ShardService.Replicate`` drives them.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.embeddings import SGD, EmbeddingTable, RowBatch, TableConfig, Zeros
from tigana.proto import shard_pb2 as pb
from tigana.ps.replication import CopyIntake, Inbound, SlotLog, apply_item, copy_lane_ready
from tigana.ps.replication.apply import DROP_CHUNK
from tigana.ps.routing import CATCHING_UP, NO_SERVER, ServerEntry, ShardMap, TableDef, slot_of
from tigana.ps.shard.dedup import DedupWindow
from tigana.ps.shard.hosted import _Hosted
from tigana.ps.wire import cluster as cluster_wire
from tigana.ps.wire.cluster import CHANGES, SNAPSHOT_BEGIN, SNAPSHOT_END, SNAPSHOT_ROWS, Item

SLOTS = 8


# --- CopyIntake against a reference model ---------------------------------------------------------------------
_ops = st.lists(st.one_of(
    st.tuples(st.just("begin"), st.lists(st.integers(0, SLOTS - 1), min_size=1, max_size=3), st.integers(1, 3)),
    st.tuples(st.just("removed"), st.lists(st.integers(0, 40), max_size=6), st.just(0)),
    st.tuples(st.just("end"), st.lists(st.integers(0, SLOTS - 1), min_size=1, max_size=3), st.integers(1, 3)),
    st.tuples(st.just("drop"), st.lists(st.integers(0, SLOTS - 1), min_size=1, max_size=3), st.just(0)),
    st.tuples(st.just("admit"), st.lists(st.integers(0, 40), max_size=8, unique=True), st.integers(1, 3)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(_ops, st.integers(0, 2**32))
def test_copy_intake_matches_a_reference_model(ops, seed) -> None:
    intake = CopyIntake(SLOTS)
    token: dict[int, int] = {}  # slot -> copy building it
    removed: set[int] = set()   # ids removed while their slot was being built, since that copy began
    rng = np.random.default_rng(seed)
    slot = {i: int(slot_of(np.array([i], np.int64), SLOTS)[0]) for i in range(41)}
    for op, arg, t in ops:
        if op == "begin":
            intake.begin(np.array(arg, np.int64), t)
            for s in arg:
                token[s] = t
            removed = {i for i in removed if slot[i] not in arg}
        elif op == "end":
            mine = [s for s in arg if token.get(s) == t]
            intake.end(np.array(arg, np.int64), t)
            for s in mine:
                token.pop(s, None)
            removed = {i for i in removed if slot[i] not in mine}
        elif op == "drop":
            intake.drop(np.array(arg, np.int64))
            for s in arg:
                token.pop(s, None)
            removed = {i for i in removed if slot[i] not in arg}
        elif op == "removed":
            intake.removed(np.array(arg, np.int64))
            removed |= {i for i in arg if slot[i] in token}
        else:
            ids = np.array(arg, np.int64)
            present = rng.random(ids.size) < 0.3
            want = [token.get(slot[i]) == t and not p and i not in removed for i, p in zip(arg, present, strict=True)]
            assert intake.admit(ids, t, present).tolist() == want
        assert intake.active() == bool(token)


# --- the lanes, through Inbound and apply_item ----------------------------------------------------------------
class _Target:
    """One target server's apply side for one table: a copy of every slot catching up from source "p"."""

    def __init__(self) -> None:
        copies = np.full((SLOTS, 2), NO_SERVER, np.int32)
        copies[:, 0], copies[:, 1] = 0, 1
        states = np.zeros((SLOTS, 2), np.uint8)
        states[:, 1] = CATCHING_UP
        spec = TableDef(TableConfig(name="t", dim=2, optimizer=SGD(lr=1.0), initializer=Zeros()), created_epoch=1)
        m = ShardMap(3, SLOTS, 1, (ServerEntry("p", "p:1"), ServerEntry("t", "t:1")), copies, states,
                     np.zeros(SLOTS, np.uint64), {"t": spec})
        self.view = SimpleNamespace(epoch=3, map=m, holds=np.ones(SLOTS, bool), valid=True, me=1)
        self.hosted = _Hosted(spec, EmbeddingTable(spec.config), DedupWindow(SLOTS), SlotLog(SLOTS))
        self.change, self.copy = Inbound("p"), Inbound("p")

    def send(self, lane: int, first_seq: int, items: list[Item]) -> pb.ReplicateResponse:
        raw = cluster_wire.encode_replicate_request("p", "boot", 7, 3, first_seq, items, lane)
        request = cluster_wire.decode_replicate_request(raw)
        assert request.lane == lane
        ready = copy_lane_ready(self.change, request.source_boot, request.generation)

        def apply_one(msg, epoch):
            return apply_item(msg, "p", epoch, {"t": self.hosted}.get, lambda: self.view, SLOTS, generation=7,
                              copy_ready=ready if lane else None)
        return (self.copy if lane else self.change).receive(request, "t", lambda: self.view, apply_one)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return self.hosted.table.pull(ids, insert=False)

    def contains(self, ids: np.ndarray) -> np.ndarray:
        return self.hosted.table.contains(ids)


def _rows(ids: list[int], value: float) -> RowBatch:
    n = len(ids)
    return RowBatch(np.array(ids, np.int64), np.full((n, 2), value, np.float32), np.zeros((n, 0), np.float32),
                    np.ones(n, np.int64), np.ones(n, np.int64), np.zeros(n))


def _ids_of_slot(slot: int, n: int) -> list[int]:
    ids = np.arange(10_000, dtype=np.int64)
    return ids[slot_of(ids, SLOTS) == slot][:n].tolist()


def _slots(*s: int) -> np.ndarray:
    return np.array(s, np.int32)


def test_copied_rows_never_overwrite_or_bring_back_what_a_later_change_wrote_or_removed() -> None:
    """The copy's chunk was read after change-lane seq 1 (its SNAPSHOT_BEGIN); a change at seq 2, made after the
    read, writes x and removes y. Whatever order they reach the target in, x keeps the change's value, y stays
    gone, and z, which no change touched, lands from the copy."""
    t = _Target()
    x, y, z = _ids_of_slot(2, 3)
    begin = Item(SNAPSHOT_BEGIN, "t", _slots(2), prev=np.zeros((1, 2), np.uint64), copy_id=1, table_epoch=1)
    chunk = Item(SNAPSHOT_ROWS, "t", _slots(2), rows=_rows([x, y, z], 1.0), copy_id=1, after=1, table_epoch=1)
    change = Item(CHANGES, "t", _slots(2), (3, 1), np.zeros((1, 2), np.uint64), _rows([x], 5.0),
                  np.array([y], np.int64), table_epoch=1)
    # the chunk before its change lane got there: WAIT, nothing applied
    reply = t.send(1, 1, [chunk])
    assert reply.reject == pb.REJECT_WAIT and reply.applied_through == 0 and not t.contains(np.array([x, y, z])).any()
    assert t.send(0, 1, [begin]).applied_through == 1
    # y existed on the target before the change removed it (a row the change lane itself wrote earlier)
    t.hosted.table.import_rows(_rows([y], 9.0))
    assert t.send(0, 2, [change]).applied_through == 2
    reply = t.send(1, 1, [chunk])
    assert reply.reject == pb.REJECT_NONE and reply.applied_through == 1
    np.testing.assert_array_equal(t.rows(np.array([x, z])), [[5.0, 5.0], [1.0, 1.0]])
    assert not t.contains(np.array([y]))[0]
    # SNAPSHOT_END ends the copy; the intake forgets it
    assert t.send(1, 2, [Item(SNAPSHOT_END, "t", _slots(2), copy_id=1, table_epoch=1)]).applied_through == 2
    assert not t.hosted.intake.active()


def test_rows_of_a_copy_started_again_are_moot() -> None:
    """A slot copy started again (a new SNAPSHOT_BEGIN, a new copy id): rows of the old one still on the copy lane
    land nowhere, and the new one's do."""
    t = _Target()
    (x,) = _ids_of_slot(5, 1)
    zero = np.zeros((1, 2), np.uint64)
    assert t.send(0, 1, [Item(SNAPSHOT_BEGIN, "t", _slots(5), prev=zero, copy_id=1, table_epoch=1),
                         Item(SNAPSHOT_BEGIN, "t", _slots(5), prev=zero, copy_id=2, table_epoch=1)]
                  ).applied_through == 2
    old = Item(SNAPSHOT_ROWS, "t", _slots(5), rows=_rows([x], 1.0), copy_id=1, after=1, table_epoch=1)
    new = Item(SNAPSHOT_ROWS, "t", _slots(5), rows=_rows([x], 2.0), copy_id=2, after=2, table_epoch=1)
    assert t.send(1, 1, [old]).reject == pb.REJECT_NONE and not t.contains(np.array([x]))[0]
    assert t.send(1, 2, [new]).reject == pb.REJECT_NONE
    np.testing.assert_array_equal(t.rows(np.array([x])), [[2.0, 2.0]])


def test_an_item_on_the_wrong_lane_is_refused_and_changes_nothing() -> None:
    t = _Target()
    (x,) = _ids_of_slot(1, 1)
    rows = Item(SNAPSHOT_ROWS, "t", _slots(1), rows=_rows([x], 1.0), copy_id=1, table_epoch=1)
    reply = t.send(0, 1, [rows])
    assert reply.reject == pb.REJECT_DIVERGED and "change lane" in reply.message and not t.contains(np.array([x]))[0]
    change = Item(CHANGES, "t", _slots(1), (3, 1), np.zeros((1, 2), np.uint64), _rows([x], 5.0), table_epoch=1)
    reply = t.send(1, 1, [change])
    assert reply.reject == pb.REJECT_DIVERGED and "copy lane" in reply.message and not t.contains(np.array([x]))[0]


def test_the_copy_lane_of_another_stream_generation_waits() -> None:
    """Copied rows of a stream whose change lane the target has not seen (or has replaced) are never applied."""
    t = _Target()
    (x,) = _ids_of_slot(3, 1)
    assert t.send(0, 1, [Item(SNAPSHOT_BEGIN, "t", _slots(3), prev=np.zeros((1, 2), np.uint64), copy_id=1,
                              table_epoch=1)]).applied_through == 1
    t.change.generation = 8  # the change lane moved on to a newer stream
    reply = t.send(1, 1, [Item(SNAPSHOT_ROWS, "t", _slots(3), rows=_rows([x], 1.0), copy_id=1, after=1,
                               table_epoch=1)])
    assert reply.reject == pb.REJECT_WAIT and not t.contains(np.array([x]))[0]


def _apply_while_dropped(view_after) -> tuple[pb.ReplicateResponse, bool]:
    """A change-lane item waits for its table's lock while the table is dropped (taken out of the served tables
    and closed, as ``_drop_local`` does); then ``view_after`` is the server's view. The reply, and whether the
    item really waited for the lock (the race, not the check before it)."""
    t = _Target()
    served = {"t": t.hosted}
    (x,) = _ids_of_slot(4, 1)
    change = Item(CHANGES, "t", _slots(4), (3, 1), np.zeros((1, 2), np.uint64), _rows([x], 5.0), table_epoch=1)
    raw = cluster_wire.encode_replicate_request("p", "boot", 7, 3, 1, [change], 0)
    request = cluster_wire.decode_replicate_request(raw)
    replies: list[pb.ReplicateResponse] = []

    def apply_one(msg, epoch):
        return apply_item(msg, "p", epoch, served.get, lambda: t.view, SLOTS, generation=7)

    worker = threading.Thread(target=lambda: replies.append(t.change.receive(request, "t", lambda: t.view,
                                                                             apply_one)))
    with t.hosted.lock:
        worker.start()
        deadline = time.monotonic() + 10
        while not t.hosted.lock.waiting and worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        waited = t.hosted.lock.waiting == 1
        served.pop("t")
        t.hosted.table.close()
        t.view = view_after(t.view)
    worker.join(10)
    return replies[0], waited


def test_an_item_that_waited_while_its_table_was_dropped_is_moot_never_diverged() -> None:
    """The nemesis's planned drop under a loaded machine: the copy refused such an item as DIVERGED ("table
    closed") and the primary demoted it. Once the map without the table is installed the item is moot (applied
    through, nothing reported); before, or for a server closing its tables to stop, it is resent later (BEHIND,
    no slots: the primary reports nothing)."""
    def dropped(view):
        gone = view.map.evolve(tables={})
        return SimpleNamespace(**{**vars(view), "epoch": gone.epoch, "map": gone})

    reply, waited = _apply_while_dropped(dropped)
    assert waited
    assert reply.reject == pb.REJECT_NONE and reply.applied_through == 1, reply
    reply, waited = _apply_while_dropped(lambda view: view)  # the map dropping it not installed yet
    assert waited
    assert reply.reject == pb.REJECT_BEHIND and not reply.slots and reply.applied_through == 0, reply
    assert "closed here" in reply.message


def test_snapshot_begin_empties_a_large_slot_a_chunk_per_lock_hold_and_a_pull_is_served_meanwhile() -> None:
    """``SNAPSHOT_BEGIN`` on a copy emptied its slots with one delete under one hold of the table's lock, every
    pull and push of the slots it leads waiting behind it. It goes through the chunked drop (``DROP_CHUNK`` rows
    per hold, entered after the data-path callers waiting): a pull that comes during the first chunk is served
    before the last, and every row of the slot is gone before the item is acknowledged."""
    t = _Target()
    ids = np.arange(800_000, dtype=np.int64)
    big = ids[slot_of(ids, SLOTS) == 2][:4 * DROP_CHUNK]
    other = ids[slot_of(ids, SLOTS) == 6][:10]
    t.hosted.table.import_rows(_rows(big.tolist(), 1.0))
    t.hosted.table.import_rows(_rows(other.tolist(), 3.0))
    calls: list[int] = []
    served: list[int] = []
    real_delete = t.hosted.table.delete

    def pull() -> None:
        with t.hosted.lock:  # a pull's hold (of a slot this server leads), as ``Writes._pull`` takes it
            served.append(len(calls))
            np.testing.assert_array_equal(t.hosted.table.pull(other, insert=False), np.full((10, 2), 3.0))

    puller = threading.Thread(target=pull)

    def delete(chunk: np.ndarray) -> int:
        calls.append(int(chunk.size))
        if len(calls) == 1:  # the pull comes while the first chunk is deleted, the lock held
            puller.start()
            deadline = time.monotonic() + 10
            while not t.hosted.lock.waiting and time.monotonic() < deadline:
                time.sleep(0.001)
            assert t.hosted.lock.waiting == 1
        return real_delete(chunk)

    t.hosted.table.delete = delete
    begin = Item(SNAPSHOT_BEGIN, "t", _slots(2), prev=np.zeros((1, 2), np.uint64), copy_id=1, table_epoch=1)
    assert t.send(0, 1, [begin]).applied_through == 1
    puller.join(10)
    # served between two chunks (after the first, as a rule: a loaded machine may let the next one go first)
    assert len(served) == 1 and served[0] < len(calls), f"the pull was served after delete call {served} of {calls}"
    assert len(calls) == 4 and max(calls) <= DROP_CHUNK and sum(calls) == big.size
    assert not t.contains(big).any() and t.contains(other).all()
