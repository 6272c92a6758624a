"""The copy rate (``ps/replication/pacing.py``, ``tigana server --copy-rate``): the pacer against what a token
bucket promises, which copies the primary paces (planned moves) and which it never holds back (a copy restoring
a missing replica)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.ps.replication import Primary
from tigana.ps.replication.actions import StartCopy
from tigana.ps.replication.pacing import CopyPacer
from tigana.ps.routing import CATCHING_UP, IN_SYNC, NO_SERVER, ServerEntry, ShardMap

SLOTS = 8


@settings(max_examples=300, deadline=None)
@given(rate=st.floats(1e3, 1e9), burst_s=st.floats(0.0, 2.0),
       sends=st.lists(st.tuples(st.floats(0.0, 5.0), st.integers(0, 10**7)), min_size=1, max_size=40))
def test_the_pacer_keeps_any_window_within_rate_times_its_length_plus_a_burst(rate, burst_s, sends) -> None:
    """A sender that asks at ``t`` (after an idle ``gap``) and waits the delay it is given sends at ``s``; bytes
    whose sends fall in [s_i, s_k] never exceed rate * (s_k - s_i) + the burst + the first send's bytes."""
    pacer = CopyPacer(rate, burst_s)
    t, starts, sizes = 0.0, [], []
    for gap, n in sends:
        t += gap
        wait = pacer.delay(t, n)
        assert wait >= 0.0
        t += wait
        starts.append(t)
        sizes.append(n)
    for i in range(len(starts)):
        total = 0
        for k in range(i, len(starts)):
            total += sizes[k]
            assert total <= rate * (starts[k] - starts[i]) + rate * burst_s + sizes[i] + 1e-6 * total + 1
    assert pacer.paced_s >= 0.0


def test_an_idle_pacer_lets_a_burst_through_and_then_holds_the_rate() -> None:
    pacer = CopyPacer(1000.0, burst_s=0.5)
    assert pacer.delay(10.0, 500) == 0.0  # within the burst: at once
    assert pacer.delay(10.0, 1000) == pytest.approx(1.0)  # 1,500 bytes by 10.0: the last 1,000 wait a second
    assert pacer.delay(100.0, 400) == 0.0  # idle long enough: the bucket is full again
    assert pacer.paced_s == pytest.approx(1.0)


def test_no_rate_means_no_cap_and_a_bad_rate_is_refused() -> None:
    pacer = CopyPacer(None)
    assert all(pacer.delay(0.0, 10**9) == 0.0 for _ in range(5)) and pacer.paced_s == 0.0
    with pytest.raises(ValueError):
        CopyPacer(0.0)


def _map(states: list[tuple[int | None, int | None]]) -> ShardMap:
    """Server a (index 0) leads every slot; servers b and c hold a copy of slot s in ``states[s]`` (None: none);
    the cluster keeps one replica."""
    copies = np.full((SLOTS, 3), NO_SERVER, np.int32)
    st_ = np.zeros((SLOTS, 3), np.uint8)
    copies[:, 0] = 0
    for s, (b, c) in enumerate(states):
        for col, state in ((1, b), (2, c)):
            if state is not None:
                copies[s, col], st_[s, col] = col, state
    servers = (ServerEntry("a", "a:1"), ServerEntry("b", "b:1"), ServerEntry("c", "c:1"))
    return ShardMap(1, SLOTS, 1, servers, copies, st_, np.zeros(SLOTS, np.uint64))


def test_a_move_is_paced_and_a_copy_restoring_a_replica_is_not() -> None:
    """Slots 0-3 are protected (b in sync) and get a new copy on c: a move, paced. Slots 4-7 lost their replica
    (b holds none) and get one on c: a restore, never held back (it is the slot's only other copy)."""
    p = Primary("a", "boot-a", SLOTS, generation=100, batch_bytes=1 << 20)
    m = _map([(IN_SYNC, CATCHING_UP)] * 4 + [(None, CATCHING_UP)] * 4)
    actions = p.on_map(m, 0, ["t"], lambda name, slots: np.zeros((slots.size, 2), np.uint64),
                       lambda name, slots: [], 0.0)
    copies = {a.stream.target_id: a.session for a in actions if isinstance(a, StartCopy)}
    assert set(copies) == {"c"}
    sess = copies["c"]
    assert sess.slots.tolist() == list(range(SLOTS)) and not sess.paced  # one session: any restore unpaces it
    p2 = Primary("a", "boot-a", SLOTS, generation=200, batch_bytes=1 << 20)
    actions = p2.on_map(_map([(IN_SYNC, CATCHING_UP)] * 4 + [(IN_SYNC, None)] * 4), 0, ["t"],
                        lambda name, slots: np.zeros((slots.size, 2), np.uint64), lambda name, slots: [], 0.0)
    (move,) = [a.session for a in actions if isinstance(a, StartCopy)]
    assert move.slots.tolist() == [0, 1, 2, 3] and move.paced
