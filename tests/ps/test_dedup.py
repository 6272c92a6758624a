"""DedupWindow (exactly-once per routing slot) against a reference model: a dict (client, seq) -> set of slots."""

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.ps.errors import InvalidArgument, PushExpired, UnknownClient
from tigana.ps.session import client_stamp, new_client_id
from tigana.ps.shard.dedup import DedupWindow

SLOTS = 64


def _slots(*s: int) -> np.ndarray:
    return np.array(s, np.int64)


def test_applied_per_slot_and_empty_client_opts_out() -> None:
    w = DedupWindow(SLOTS, size=4)
    assert not w.applied("a", 1, _slots(3, 5)).any()
    w.record("a", 1, _slots(3, 5))
    assert w.applied("a", 1, _slots(3, 5, 7)).tolist() == [True, True, False]  # re-split push: slot 7 is new
    assert not w.applied("b", 1, _slots(3)).any()  # another client
    w.record("", 5, _slots(1))
    assert not w.applied("", 5, _slots(1)).any()
    assert len(w) == 1


def test_a_first_arrival_is_never_called_a_duplicate() -> None:
    """Regression (review of issue 7): a seq at or below the floor that was never applied used to be reported
    as a duplicate, acknowledged and never applied. Now: above the floor it is new; at or below the floor and
    not in the window it raises PushExpired (it cannot be told from a replay), never 'duplicate'."""
    w = DedupWindow(SLOTS, size=3)
    for seq in (10, 11, 12, 13):  # 10 falls out of the window: floor 10
        w.record("a", seq, _slots(1))
    assert not w.applied("a", 14, _slots(1)).any()       # a new seq above the floor
    with pytest.raises(PushExpired, match="seq 9"):      # never seen, below the floor: refused, not 'duplicate'
        w.applied("a", 9, _slots(1))
    with pytest.raises(PushExpired):
        w.applied("a", 10, _slots(1))                    # dropped from the window
    assert w.applied("a", 12, _slots(1)).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sets(st.integers(0, SLOTS - 1), min_size=1,
                                                                     max_size=6)), min_size=1, max_size=150),
       st.integers(1, 40))
def test_recent_keys_applied_new_keys_not(steps, size) -> None:
    """Clients push increasing seqs; the last ``size`` seqs of a client report exactly the slots recorded,
    a seq never recorded above the floor reports none."""
    w = DedupWindow(SLOTS, size=size)
    ref: dict[str, list[tuple[int, set[int]]]] = {}
    next_seq: dict[str, int] = {}
    for client, slots in steps:
        seq = next_seq.get(client, 0)
        next_seq[client] = seq + 1
        arr = np.array(sorted(slots), np.int64)
        assert not w.applied(client, seq, arr).any()
        w.record(client, seq, arr)
        ref.setdefault(client, []).append((seq, slots))
    probe = np.arange(SLOTS)
    for client, keys in ref.items():
        for seq, slots in keys[-size:]:
            assert set(np.flatnonzero(w.applied(client, seq, probe)).tolist()) == slots
        assert not w.applied(client, next_seq[client], probe).any()
    back = DedupWindow.from_bytes(w.to_bytes(), num_slots=SLOTS)
    for client, keys in ref.items():
        for seq, _ in keys[-size:]:
            np.testing.assert_array_equal(back.applied(client, seq, probe), w.applied(client, seq, probe))


def test_records_travel_with_their_slots() -> None:
    """A slot copy carries the window of its slots: merged on the target, the same keys are applied there
    for those slots and only those."""
    src = DedupWindow(SLOTS, size=8)
    src.record("a", 1, _slots(1, 2, 3))
    src.record("a", 2, _slots(3, 4))
    src.record("b", 7, _slots(9))
    moved = src.records_for(_slots(3, 9))
    dst = DedupWindow(SLOTS, size=8)
    dst.merge(moved)
    assert dst.applied("a", 1, _slots(1, 3)).tolist() == [False, True]
    assert dst.applied("a", 2, _slots(3, 4)).tolist() == [True, False]
    assert dst.applied("b", 7, _slots(9)).all()
    dst.forget_slots(_slots(3))
    assert not dst.applied("a", 1, _slots(3)).any()


def test_client_count_is_bounded() -> None:
    w = DedupWindow(SLOTS, size=2, max_clients=3)
    for c in range(10):
        w.record(f"c{c}", 0, _slots(0))
    assert len(w) == 3
    assert w.applied("c9", 0, _slots(0)).all()
    with pytest.raises(UnknownClient):  # dropped: it may have applied seq 0, so it is not told "not applied"
        w.applied("c0", 0, _slots(0))


def test_merged_old_records_never_push_recent_ones_out() -> None:
    """Regression (seen under live moves): the window dropped the oldest *arrival*, so records merged from a
    slot copy (old seqs arriving late) pushed out a recent seq and raised the floor above it; a retry of that
    recent push then failed with PushExpired. The lowest seq is dropped now, whatever the arrival order."""
    w = DedupWindow(SLOTS, size=8)
    for seq in range(100, 108):
        w.record("a", seq, _slots(1))
    w.merge([("a", seq, np.array([2], np.int32)) for seq in range(90, 100)])  # a slot copy's older records
    assert w.applied("a", 107, _slots(1)).all() and w.applied("a", 100, _slots(1)).all()
    assert not w.applied("a", 108, _slots(1)).any()  # a first arrival above the window is new
    w.record("a", 108, _slots(1))
    with pytest.raises(PushExpired):
        w.applied("a", 100, _slots(1))  # the lowest seq was dropped to make room for 108
    with pytest.raises(PushExpired):
        w.applied("a", 95, _slots(2))  # merged, but below the window: cannot be told, refused


def test_the_floor_travels_with_a_slot_copy() -> None:
    """Regression: a slot copy carried the window's records but not its floor, so a retry of a push the
    source could no longer tell (dropped from its window) was a first arrival on the copy, and applied twice."""
    src = DedupWindow(SLOTS, size=4)
    for seq in range(10, 20):
        src.record("a", seq, _slots(3))  # seqs 10..15 dropped: floor 15
    dst = DedupWindow(SLOTS, size=4)
    dst.merge(src.records_for(_slots(3)))
    with pytest.raises(PushExpired):
        dst.applied("a", 12, _slots(3))  # the source could not tell: neither can the copy
    assert dst.applied("a", 19, _slots(3)).all() and not dst.applied("a", 20, _slots(3)).any()


def _cid(stamp: int, k: int = 0) -> str:
    return f"{stamp:016x}.{k:032x}"


def test_an_evicted_clients_late_retry_is_refused_not_applied_twice() -> None:
    """Regression (issue 16): dropping a client past ``max_clients`` dropped its records and floor, so a late
    retry of a push it had applied was a first arrival and was applied twice. Now the window keeps a horizon
    (the highest session stamp it dropped): the retry is refused with UnknownClient, nothing applied."""
    w = DedupWindow(SLOTS, size=4, max_clients=2)
    old = _cid(100)
    w.record(old, 7, _slots(3))
    w.record(_cid(200, 1), 1, _slots(3))
    w.record(_cid(300, 2), 1, _slots(3))  # the third client: the least recently seen (old) is dropped
    with pytest.raises(PushExpired) as caught:  # UnknownClient is a PushExpired: older clients fail the same way
        w.applied(old, 7, _slots(3))
    assert isinstance(caught.value, UnknownClient) and caught.value.horizon == 100
    # a new session above the horizon is new everywhere; a client never dropped is unaffected
    fresh = new_client_id(above=caught.value.horizon)
    assert client_stamp(fresh) > 100 and not w.applied(fresh, 7, _slots(3)).any()
    assert not w.applied(_cid(300, 2), 2, _slots(3)).any()
    back = DedupWindow.from_bytes(w.to_bytes(), num_slots=SLOTS)  # the horizon is in the snapshot
    with pytest.raises(UnknownClient):
        back.applied(old, 7, _slots(3))


def test_a_slot_copy_from_a_window_that_dropped_a_client_blinds_it_on_the_target() -> None:
    """The target knew the client (from other slots) but the copied slot's records were dropped at the source:
    the horizon travels with the copy and the target no longer says "not applied" for that client."""
    a = _cid(100)
    src = DedupWindow(SLOTS, size=4, max_clients=1)
    src.record(a, 5, _slots(3))
    src.record(_cid(200, 1), 1, _slots(4))  # a dropped at the source
    dst = DedupWindow(SLOTS, size=4)
    dst.record(a, 6, _slots(9))  # the target knows a, for another slot
    dst.forget_slots(_slots(3))
    dst.merge(src.records_for(_slots(3)))
    assert dst.applied(a, 6, _slots(9)).all()  # what it holds, it still answers
    with pytest.raises(UnknownClient):
        dst.applied(a, 5, _slots(3))  # applied at the source, dropped there: refused, not applied twice
    blind = DedupWindow.from_bytes(dst.to_bytes(), num_slots=SLOTS)
    with pytest.raises(UnknownClient):
        blind.applied(a, 5, _slots(3))
    again = DedupWindow(SLOTS, size=4)
    again.merge(dst.records_for(_slots(9)))  # the blind mark travels too
    with pytest.raises(UnknownClient):
        again.applied(a, 99, _slots(9))


def test_a_copy_from_a_window_that_dropped_a_client_blinds_its_slots_even_under_an_equal_horizon() -> None:
    """Found by the property test below: a slot copy's horizon blinded the target's clients only when it
    raised the target's own horizon. Here both windows' horizons are 2; the source dropped client c (stamp 2)
    with a record for slot 2, the target knew c from before: after the copy, slot 2's record is gone on the
    target and c's retry must be refused, not applied."""
    c, d, e = _cid(1, 0), _cid(2, 1), _cid(2, 2)
    a, b = DedupWindow(SLOTS, size=1, max_clients=1), DedupWindow(SLOTS, size=1, max_clients=1)
    a.record(c, 1, _slots(0))
    a.record(d, 1, _slots(0))   # drops c: a's horizon 1
    a.record(e, 1, _slots(2))   # drops d: a's horizon 2; a keeps e (made when its horizon was 1)
    b.merge(a.records_for(_slots(0, 2)))
    b.record(_cid(3, 3), 1, _slots(0))  # drops e on b
    a.forget_slots(_slots(2))
    a.merge(b.records_for(_slots(2)))  # slot 2 comes back from b, which dropped e's record of it
    with pytest.raises(UnknownClient):
        a.applied(e, 1, _slots(2))


def test_reserved_client_ids_are_refused() -> None:
    from tigana.ps.shard.dedup import HORIZON_ID
    with pytest.raises(InvalidArgument):
        DedupWindow(SLOTS).applied(HORIZON_ID, 1, _slots(1))


_SMALL = 8
_CLIENTS = [_cid(stamp, k) for k, stamp in enumerate((1, 2, 2, 3, 4, 5))] + ["legacy"]
_slot_sets = st.sets(st.integers(0, _SMALL - 1), min_size=1, max_size=4).map(lambda s: np.array(sorted(s), np.int64))
_ops = st.one_of(
    st.tuples(st.just("push"), st.integers(0, 1), st.integers(0, len(_CLIENTS) - 1), st.integers(0, 6),
              _slot_sets, st.booleans()),
    st.tuples(st.just("copy"), st.integers(0, 1), _slot_sets),
    st.tuples(st.just("forget"), st.integers(0, 1), _slot_sets),
    st.tuples(st.just("restart"), st.integers(0, 1)),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_ops, min_size=1, max_size=80), st.integers(1, 4), st.integers(1, 3))
def test_a_recorded_key_is_never_reported_not_applied(ops, size, max_clients) -> None:
    """Two windows (a primary and its copy) against a reference model, ``known[w]``: the (client, seq, slot)
    keys window w has applied. Through any mix of pushes (new seqs and late retries), replicated records,
    evictions (``max_clients`` of 1-3 among 7 clients), floors (``size`` 1-4), slot copies, forgotten slots
    and restarts from ``to_bytes``, a known key is answered "applied" or refused (PushExpired/UnknownClient),
    never "not applied"; and a client the window never saw, above its horizon, with a new seq, is never
    refused."""
    windows = [DedupWindow(_SMALL, size=size, max_clients=max_clients) for _ in range(2)]
    known: list[set[tuple[str, int, int]]] = [set(), set()]
    next_seq = dict.fromkeys(_CLIENTS, 1)
    for op in ops:
        kind, w = op[0], op[1]
        win, other = windows[w], windows[1 - w]
        if kind == "push":
            _, _, k, back, slots, replicate = op
            cid = _CLIENTS[k]
            seq = max(1, next_seq[cid] - back)  # back 0: a new seq; else a late retry of an older one
            is_new = seq == next_seq[cid]
            if is_new:
                next_seq[cid] += 1
            unseen = cid not in win._clients and getattr(win, "horizon", -1) < client_stamp(cid) and \
                not any(t[0] == cid for t in known[w])
            try:
                done = win.applied(cid, seq, slots)
            except PushExpired:
                assert not (is_new and unseen), "a never-seen client above the horizon, with a new seq, was refused"
                continue
            for s, d in zip(slots.tolist(), done.tolist(), strict=True):
                assert d or (cid, seq, s) not in known[w], f"({cid}, {seq}, slot {s}) applied twice"
            new = slots[~done]
            if new.size:
                win.record(cid, seq, new)
                known[w] |= {(cid, seq, s) for s in new.tolist()}
                if replicate:
                    other.merge([(cid, seq, new.astype(np.int32))])
                    known[1 - w] |= {(cid, seq, s) for s in new.tolist()}
        elif kind == "copy":  # a slot copy from the other window into this one, as SNAPSHOT_BEGIN does
            slots = op[2]
            win.forget_slots(slots)
            win.merge(other.records_for(slots))
            moved = set(slots.tolist())
            known[w] = {t for t in known[w] if t[2] not in moved} | {t for t in known[1 - w] if t[2] in moved}
        elif kind == "forget":
            slots = op[2]
            win.forget_slots(slots)
            gone = set(slots.tolist())
            known[w] = {t for t in known[w] if t[2] not in gone}
        else:
            windows[w] = DedupWindow.from_bytes(win.to_bytes(), num_slots=_SMALL)
        for i in (0, 1):
            for cid, seq, s in known[i]:
                with contextlib.suppress(PushExpired):  # refused: never applied twice
                    assert windows[i].applied(cid, seq, np.array([s], np.int64)).all(), \
                        f"window {i}: ({cid}, {seq}, slot {s}) was applied, reported not applied"
