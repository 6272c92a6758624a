"""DedupWindow (exactly-once per routing slot) against a reference model: a dict (client, seq) -> set of slots."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.ps.dedup import DedupWindow
from tigana.ps.errors import PushExpired

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
    assert w.applied("c9", 0, _slots(0)).all() and not w.applied("c0", 0, _slots(0)).any()


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
