"""Placement (``tigana.ps.scheduler.placement``): pure functions over (num_slots, width) copy matrices.

Property tests draw small clusters (1-7 servers, 16-128 slots, 0-3 replicas) and check the invariants the
scheduler relies on: copies on distinct alive servers, a primary is always an in-sync copy, balance evens the
load while moving little, and ``step_toward`` reaches its target without a slot ever losing its last in-sync
copy. Random matrices come from a drawn seed (numpy), which keeps the examples fast.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.ps.routing import CATCHING_UP, HANDING_OVER, IN_SYNC, NO_SERVER, ServerEntry, ShardMap
from tigana.ps.scheduler import placement

SETTINGS = settings(max_examples=50, deadline=None)

servers_st = st.integers(1, 7)
slots_st = st.integers(16, 128)
replicas_st = st.integers(0, 3)
seeds_st = st.integers(0, 2**32 - 1)


# --- helpers ------------------------------------------------------------------------------------------------
def present(row: np.ndarray) -> list[int]:
    return [int(x) for x in row if x >= 0]


def assert_distinct(copies: np.ndarray) -> None:
    for slot, row in enumerate(copies):
        got = present(row)
        assert len(got) == len(set(got)), f"slot {slot}: duplicate copies {row.tolist()}"


def assert_valid_target(t: np.ndarray, alive: np.ndarray, replicas: int) -> None:
    """One primary per slot, 1 + min(r, alive - 1) copies on distinct alive servers."""
    want = 1 + min(replicas, int(alive.sum()) - 1)
    assert (t[:, 0] >= 0).all(), "a slot without a primary"
    assert_distinct(t)
    for slot, row in enumerate(t):
        got = present(row)
        assert len(got) == want, f"slot {slot}: {row.tolist()} has {len(got)} copies, want {want}"
        assert alive[got].all(), f"slot {slot}: {row.tolist()} has a copy on a dead server"


def spread(counts: np.ndarray, alive: np.ndarray) -> int:
    a = counts[alive]
    return int(a.max() - a.min())


def random_copies(rng: np.random.Generator, n: int, num_slots: int, width: int, p_orphan: float = 0.1
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Valid (copies, states): distinct servers per row, holes anywhere after column 0, a primary in sync,
    other copies in sync or catching up; some rows without a primary (only catching-up copies, if any)."""
    copies = np.full((num_slots, width), NO_SERVER, np.int32)
    states = np.zeros((num_slots, width), np.uint8)
    for slot in range(num_slots):
        if rng.random() >= p_orphan:  # a primary, in sync, and k - 1 others in sync or catching up
            k = int(rng.integers(1, min(width, n) + 1))
            chosen = rng.permutation(n)[:k]
            copies[slot, 0] = chosen[0]
            cols = rng.permutation(np.arange(1, width))[:k - 1]
            copies[slot, cols] = chosen[1:]
            states[slot, cols] = rng.integers(0, 2, size=cols.size)  # IN_SYNC or CATCHING_UP
        else:  # no primary: whatever copies are left are catching up
            k = int(rng.integers(0, min(width - 1, n) + 1))
            cols = rng.permutation(np.arange(1, width))[:k]
            copies[slot, cols] = rng.permutation(n)[:k]
            states[slot, cols] = CATCHING_UP
    return copies, states


def random_alive(rng: np.random.Generator, n: int, p_dead: float = 0.35) -> np.ndarray:
    alive = rng.random(n) >= p_dead
    if not alive.any():
        alive[int(rng.integers(n))] = True
    return alive


def as_map(copies: np.ndarray, states: np.ndarray, n: int, epoch_map: ShardMap | None = None) -> ShardMap:
    """Compact (copies, states) the way the scheduler does: through ``ShardMap.evolve``."""
    m = epoch_map or ShardMap.empty(copies.shape[0]).evolve(
        servers=tuple(ServerEntry(f"s{i}", f"h:{i}") for i in range(n)))
    return m.evolve(copies=copies, states=states)


def data_moves(current: np.ndarray, target: np.ndarray) -> tuple[int, int]:
    """(copies added, copies removed) between two placements."""
    mv = placement.moves(current, target)
    return sum(len(a) for _, a, _ in mv), sum(len(r) for _, _, r in mv)


# --- initial ------------------------------------------------------------------------------------------------
@SETTINGS
@given(n=servers_st, num_slots=slots_st, replicas=replicas_st)
def test_initial_properties(n, num_slots, replicas):
    c = placement.initial(n, num_slots, replicas)
    r = min(replicas, n - 1)
    assert c.shape == (num_slots, 1 + r)
    assert c.dtype == np.int32
    assert ((c >= 0) & (c < n)).all(), "every slot has 1 + r copies on real servers"
    assert_distinct(c)
    prim, total = placement.copy_counts(c, n)
    assert prim.sum() == num_slots and total.sum() == num_slots * (1 + r)
    assert prim.max() - prim.min() <= 1
    # total copies: within 2, not always 1 (e.g. 4 servers, 1 replica, 18 slots: [10, 8, 10, 8]); balance() evens
    # them to within 1
    assert total.max() - total.min() <= 2
    # primaries in contiguous ranges, as a static shard list
    assert (np.diff(c[:, 0]) >= 0).all()


@SETTINGS
@given(n=st.integers(4, 7), num_slots=slots_st, replicas=st.integers(1, 3))
def test_initial_dead_server_load_spreads(n, num_slots, replicas):
    """The slots a server leads have their replicas (and so their failovers) on many servers, evenly."""
    c = placement.initial(n, num_slots, replicas)
    r = min(replicas, n - 1)
    for dead in range(n):
        rows = c[c[:, 0] == dead]
        size = rows.shape[0]
        holders = set(rows[:, 1:].ravel().tolist())
        assert dead not in holders
        assert len(holders) == min(n - 1, size + r - 1), (dead, rows.tolist())
        # failover: repair promotes the first in-sync replica (column 1): spread within one slot
        alive = np.ones(n, bool)
        alive[dead] = False
        fixed, _ = placement.repair(c, np.zeros(c.shape, np.uint8), alive, 0)
        new_primaries = np.bincount(fixed[c[:, 0] == dead, 0], minlength=n)
        others = np.delete(new_primaries, dead)
        assert (others > 0).sum() == min(n - 1, size)
        assert others.max() - others.min() <= 1, others.tolist()


def test_initial_examples():
    np.testing.assert_array_equal(placement.initial(1, 4, 2), [[0], [0], [0], [0]])
    c = placement.initial(2, 4, 1)
    np.testing.assert_array_equal(c, [[0, 1], [0, 1], [1, 0], [1, 0]])
    with pytest.raises(ValueError):
        placement.initial(0, 4, 1)


# --- repair -------------------------------------------------------------------------------------------------
@SETTINGS
@given(n=servers_st, num_slots=slots_st, replicas=replicas_st, width=st.integers(1, 4), seed=seeds_st)
def test_repair_properties(n, num_slots, replicas, width, seed):
    rng = np.random.default_rng(seed)
    c0, s0 = random_copies(rng, n, num_slots, width)
    alive = random_alive(rng, n)
    c, s = placement.repair(c0, s0, alive, replicas)
    assert_distinct(c)
    assert c.shape[1] >= 1 + replicas
    want = min(1 + replicas, int(alive.sum()))
    for slot in range(num_slots):
        before = {int(x): int(s0[slot, j]) for j, x in enumerate(c0[slot]) if x >= 0}
        after = {int(x): int(s[slot, j]) for j, x in enumerate(c[slot]) if x >= 0}
        survivors = {x: st_ for x, st_ in before.items() if alive[x]}
        assert all(alive[x] for x in after), f"slot {slot}: a copy on a dead server: {c[slot].tolist()}"
        # copies on alive servers are never moved or dropped, nor their states changed
        for x, st_ in survivors.items():
            assert after.get(x) == st_, f"slot {slot}: survivor {x} changed: {c0[slot]} -> {c[slot]}"
        p0, p = int(c0[slot, 0]), int(c[slot, 0])
        if p0 >= 0 and alive[p0]:
            assert p == p0, "a live primary stays"
        else:
            in_sync = [int(x) for j, x in enumerate(c0[slot]) if j > 0 and x >= 0 and alive[x]
                       and s0[slot, j] == IN_SYNC]
            if in_sync:
                assert p == in_sync[0], f"slot {slot}: promoted {p}, first in-sync survivor {in_sync[0]}"
            else:
                assert p == NO_SERVER, f"slot {slot}: promoted a catching-up copy: {c0[slot]} {s0[slot]}"
        if p >= 0:
            assert s[slot, 0] == IN_SYNC
        added = set(after) - set(survivors)
        assert all(after[x] == CATCHING_UP for x in added)
        if p >= 0:
            assert len(after) == max(len(survivors), want), (slot, c0[slot], c[slot], alive)
        else:
            assert not added, "a slot without a primary gets no copy (nothing to copy from)"


@SETTINGS
@given(n=st.integers(2, 7), num_slots=slots_st, replicas=st.integers(1, 3), seed=seeds_st)
def test_repair_never_promotes_catching_up(n, num_slots, replicas, seed):
    """From a full placement with some replicas catching up: kill servers; every new primary was in sync."""
    rng = np.random.default_rng(seed)
    c0 = placement.initial(n, num_slots, replicas)
    s0 = np.zeros(c0.shape, np.uint8)
    s0[:, 1:] = rng.random((num_slots, c0.shape[1] - 1)) < 0.5
    alive = random_alive(rng, n, 0.5)
    c, s = placement.repair(c0, s0, alive, replicas)
    for slot in range(num_slots):
        p = int(c[slot, 0])
        if p >= 0 and p != c0[slot, 0]:
            j = int(np.flatnonzero(c0[slot] == p)[0])
            assert j > 0 and s0[slot, j] == IN_SYNC
        if p < 0:
            assert not any(alive[x] and s0[slot, j] == IN_SYNC for j, x in enumerate(c0[slot]) if x >= 0)


def test_repair_example():
    copies = np.array([[0, 1, 2], [0, 1, 2], [1, 0, 2], [2, 1, NO_SERVER]], np.int32)
    states = np.array([[0, 1, 0], [0, 1, 1], [0, 0, 0], [0, 1, 0]], np.uint8)
    alive = np.array([False, True, True, True])
    c, s = placement.repair(copies, states, alive, 2)
    assert c[0, 0] == 2  # 1 is catching up: skipped for 2
    assert c[1, 0] == NO_SERVER and present(c[1]) == [1, 2]  # nothing in sync survived: no primary, no copy
    assert c[2, 0] == 1 and sorted(present(c[2])) == [1, 2, 3]
    assert c[3, 0] == 2 and sorted(present(c[3])) == [1, 2, 3]
    assert s[2, list(c[2]).index(3)] == CATCHING_UP


# --- balance ------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(n=servers_st, num_slots=slots_st, replicas=replicas_st, width=st.integers(1, 4), seed=seeds_st)
def test_balance_valid_and_even(n, num_slots, replicas, width, seed):
    rng = np.random.default_rng(seed)
    c0, _ = random_copies(rng, n, num_slots, width)
    alive = random_alive(rng, n)
    t = placement.balance(c0, alive, replicas)
    assert_valid_target(t, alive, replicas)
    prim, total = placement.copy_counts(t, n)
    assert (prim[~alive] == 0).all() and (total[~alive] == 0).all()
    assert spread(prim, alive) <= 1, prim[alive].tolist()
    assert spread(total, alive) <= 1, total[alive].tolist()
    # a balanced placement is a fixed point: balancing it again moves nothing
    assert placement.moves(t, placement.balance(t, alive, replicas)) == []


def test_balance_keeps_every_copy_of_an_uncompacted_row():
    """Regression: a repaired row may have its replica after a hole ([p, -1, x]); balance must not cut it."""
    copies = np.array([[2, 3, 0]] * 4 + [[0, 2, NO_SERVER]] * 4, np.int32)
    alive = np.array([True, False, True, False])
    t = placement.balance(copies, alive, 1)
    assert_valid_target(t, alive, 1)


@SETTINGS
@given(n=servers_st, num_slots=slots_st, replicas=replicas_st)
def test_balance_join_moves_little(n, num_slots, replicas):
    """A server joins a balanced cluster: it gets its share, and little else moves.

    Bound: copies added <= ceil(S (1 + r') / (n + 1)) + n, where r' = min(r, n) is the replica count with the
    new server and the first term is exactly the new server's share; as many copies leave the old servers
    (plus the extra copy per slot when r' grew)."""
    base = placement.balance(placement.initial(n, num_slots, replicas), np.ones(n, bool), replicas)
    alive = np.ones(n + 1, bool)
    t = placement.balance(base, alive, replicas)
    assert_valid_target(t, alive, replicas)
    r_new, r_old = min(replicas, n), min(replicas, n - 1)
    share = -(-num_slots * (1 + r_new) // (n + 1))
    added, removed = data_moves(base, t)
    assert added <= share + n, (added, share)
    assert added - removed == num_slots * (r_new - r_old)
    prim, total = placement.copy_counts(t, n + 1)
    assert total[n] >= num_slots * (1 + r_new) // (n + 1)
    assert spread(prim, alive) <= 1 and spread(total, alive) <= 1
    # primary roles: about the new server's share moves
    assert (t[:, 0] != base[:, 0]).sum() <= -(-num_slots // (n + 1)) + n


@SETTINGS
@given(n=st.integers(2, 7), num_slots=slots_st, replicas=replicas_st, seed=seeds_st)
def test_balance_leave_moves_only_what_was_lost(n, num_slots, replicas, seed):
    """A server leaves a balanced cluster: its copies are replaced; copies on the survivors stay, except for a
    few moved to even the load back to max - min <= 1 (observed: at most 2; bound used: n)."""
    rng = np.random.default_rng(seed)
    alive0 = np.ones(n, bool)
    base = placement.balance(placement.initial(n, num_slots, replicas), alive0, replicas)
    dead = int(rng.integers(n))
    alive = alive0.copy()
    alive[dead] = False
    fixed, _ = placement.repair(base, np.zeros(base.shape, np.uint8), alive, replicas)
    for via in (base, fixed):  # straight from the old placement, or after the scheduler's repair
        t = placement.balance(via, alive, replicas)
        assert_valid_target(t, alive, replicas)
        prim, total = placement.copy_counts(t, n)
        assert spread(prim, alive) <= 1 and spread(total, alive) <= 1
        survivors_moved = 0
        for slot in range(num_slots):
            old = set(present(base[slot])) - {dead}
            survivors_moved += len(old - set(present(t[slot])))
        assert survivors_moved <= n, survivors_moved
        added, _ = data_moves(base, t)
        on_dead = int((base == dead).sum())
        assert added <= on_dead + n


@pytest.mark.parametrize("n,replicas,hot", [(4, 0, [0, 1, 2, 3]), (4, 1, [0, 1, 2, 3]), (4, 1, [0, 5, 9]),
                                           (5, 2, [0, 1, 2, 3, 4]), (3, 1, [0, 1, 2])])
def test_balance_spreads_hot_slots(n, replicas, hot):
    """Hot slots (weight 50), all led by server 0 at first, end up led by different servers."""
    num_slots = 64
    c = placement.initial(n, num_slots, replicas)
    assert (c[hot, 0] == 0).all()
    w = np.ones(num_slots)
    w[hot] = 50
    t = placement.balance(c, np.ones(n, bool), replicas, w)
    assert_valid_target(t, np.ones(n, bool), replicas)
    assert len(set(t[hot, 0].tolist())) == len(hot), t[hot].tolist()
    weighted_primaries = np.array([w[t[:, 0] == i].sum() for i in range(n)])
    assert weighted_primaries.max() - weighted_primaries.min() < 50


def test_balance_no_alive_server():
    with pytest.raises(ValueError):
        placement.balance(placement.initial(2, 16, 1), np.zeros(2, bool), 1)


# --- step_toward --------------------------------------------------------------------------------------------
def assert_safe(c: np.ndarray, s: np.ndarray, had_primary: np.ndarray) -> None:
    assert_distinct(c)
    for slot in np.flatnonzero(had_primary):
        row = c[slot]
        assert row[0] >= 0 and s[slot, 0] in (IN_SYNC, HANDING_OVER), \
            f"slot {slot}: primary {row.tolist()} {s[slot].tolist()}"
        assert ((row >= 0) & (s[slot] != CATCHING_UP)).sum() >= 1
        assert (s[slot, 1:] != HANDING_OVER).all()  # only a primary hands over


@settings(max_examples=40, deadline=None)
@given(n=servers_st, add=st.integers(0, 2), num_slots=slots_st, replicas=replicas_st, seed=seeds_st,
       max_new=st.one_of(st.none(), st.integers(1, 8)), partial=st.booleans())
def test_step_toward_reaches_target_safely(n, add, num_slots, replicas, seed, max_new, partial):
    """From a repaired placement (some copies catching up) toward a balance over more/fewer servers: every
    intermediate map is safe, and the target is reached in a bounded number of steps."""
    rng = np.random.default_rng(seed)
    total = n + add
    alive = np.ones(total, bool)
    c0 = placement.initial(n, num_slots, replicas)
    if c0.shape[1] > 1 and rng.random() < 0.5:  # one server dies: every slot still has a copy to promote
        alive[int(rng.integers(n))] = False
    s0 = np.zeros(c0.shape, np.uint8)
    c, s = placement.repair(c0, s0, alive, replicas)
    m = as_map(c, s, total)
    c = np.array(m.copies)
    had_primary = c[:, 0] >= 0
    assert had_primary.all()
    target = placement.balance(c, alive, replicas)
    per_slot = 5  # add, (catch up), start handing over the primary, (it reports), drop
    bound = per_slot * (1 if max_new is None else -(-num_slots // max_new) + 1) + 4
    if partial:
        bound *= 8  # catching up happens to about half the copies per step
    for _ in range(bound + 1):
        cur = np.array(m.copies)
        nc, ns = placement.step_toward(cur, np.array(m.states), target, max_new_copies=max_new)
        assert_safe(nc, ns, had_primary)
        if max_new is not None:  # the copies a step starts are limited
            started = [slot for slot in range(num_slots) if set(present(nc[slot])) - set(present(cur[slot]))]
            assert len(started) <= max_new
        m = m.evolve(copies=nc, states=ns)
        # copies catch up (all of them, or about half)
        ns = np.array(m.states)
        catching = (np.array(m.copies) >= 0) & (ns == CATCHING_UP)
        if partial:
            catching &= rng.random(catching.shape) < 0.5
        ns[catching] = IN_SYNC
        m = m.evolve(states=ns)
        # primaries handing over report (all of them, or about half): the roles swap
        handing = np.flatnonzero(np.array(m.states)[:, 0] == HANDING_OVER)
        if partial:
            handing = handing[rng.random(handing.shape) < 0.5]
        hc, hs, done = placement.hand_over(np.array(m.copies), np.array(m.states), handing, target)
        assert done.size == handing.size  # the target's primary is an in-sync copy of each
        m = m.evolve(copies=hc, states=hs)
        c, s = np.array(m.copies), np.array(m.states)
        assert_safe(c, s, had_primary)
        if not placement.moves(c, target) and (s[c >= 0] == IN_SYNC).all():
            break
    else:
        pytest.fail(f"target not reached in {bound} steps: {placement.moves(c, target)[:4]}")
    np.testing.assert_array_equal(c[:, 0], target[:, 0])


def test_step_toward_example():
    copies = np.array([[0, 1]], np.int32)
    states = np.array([[IN_SYNC, IN_SYNC]], np.uint8)
    target = np.array([[2, 1]], np.int32)
    c, s = placement.step_toward(copies, states, target)
    assert present(c[0]) == [0, 1, 2] and s[0, 2] == CATCHING_UP
    again, _ = placement.step_toward(c, s, target)  # nothing moves before the new copy caught up
    np.testing.assert_array_equal(again[:, :3], c[:, :3])
    s[0, 2] = IN_SYNC
    c, s = placement.step_toward(c, s, target)
    assert c[0, 0] == 0 and s[0, 0] == HANDING_OVER  # the primary is told to refuse writes and drain first
    again, s2 = placement.step_toward(c, s, target)  # nothing more until it reports
    np.testing.assert_array_equal(again[:, :3], c[:, :3])
    np.testing.assert_array_equal(s2[:, :3], s[:, :3])
    c, s, done = placement.hand_over(c, s, np.array([0]), target)
    assert done.tolist() == [0] and c[0, 0] == 2 and (s[0, :3] == IN_SYNC).all()
    assert sorted(present(c[0])) == [0, 1, 2]  # role handed over, nothing dropped yet
    c, s = placement.step_toward(c, s, target)
    assert c[0, 0] == 2 and sorted(present(c[0])) == [1, 2]
    assert placement.moves(c, target) == []


def test_step_toward_hands_over_once_every_copy_is_made():
    """A hand-over fences its slot (writes refused until the next map): none starts while another slot of the
    move still copies, so the fences of a move come together, over streams no longer busy with copied rows."""
    copies = np.array([[0, 1], [0, 1]], np.int32)
    states = np.array([[IN_SYNC, IN_SYNC]] * 2, np.uint8)
    target = np.array([[1, 0], [2, 1]], np.int32)  # slot 0: a role swap only; slot 1: a copy to make first
    c, s = placement.step_toward(copies, states, target)
    assert s[0, 0] == IN_SYNC and s[1, present(c[1]).index(2)] == CATCHING_UP  # slot 0 waits for slot 1's copy
    c2, s2 = placement.step_toward(c, s, target)
    np.testing.assert_array_equal(s2[:, :s.shape[1]], s)  # still copying: nothing is fenced
    s[1, present(c[1]).index(2)] = IN_SYNC
    c, s = placement.step_toward(c, s, target)
    assert s[0, 0] == HANDING_OVER and s[1, 0] == HANDING_OVER  # both fenced in one map


def test_step_toward_drops_copies_after_the_hand_overs():
    """Copies leave once no primary role of the move is still to hand over: deleting their rows does not
    compete with the servers in the fence."""
    copies = np.array([[0, 1], [0, 1]], np.int32)
    states = np.array([[IN_SYNC, IN_SYNC]] * 2, np.uint8)
    target = np.array([[1, 0], [0, 2]], np.int32)  # slot 0: a role swap; slot 1: copy on 1 moves to 2
    c, s = placement.step_toward(copies, states, target)
    s[c == 2] = IN_SYNC  # slot 1's new copy caught up
    c, s = placement.step_toward(c, s, target)
    assert s[0, 0] == HANDING_OVER and sorted(present(c[1])) == [0, 1, 2]  # slot 1 keeps its old copy
    c, s, done = placement.hand_over(c, s, np.array([0]), target)
    assert done.tolist() == [0]
    c, s = placement.step_toward(c, s, target)
    assert sorted(present(c[1])) == [0, 2] and placement.moves(c, target) == []


def test_step_toward_leaves_slots_without_primary():
    copies = np.array([[NO_SERVER, 1]], np.int32)
    states = np.array([[0, CATCHING_UP]], np.uint8)
    c, s = placement.step_toward(copies, states, np.array([[1, 2]], np.int32))
    assert present(c[0]) == [1] and c[0, 0] == NO_SERVER


def test_moves_and_copy_counts():
    cur = np.array([[0, 1], [1, 0], [2, NO_SERVER]], np.int32)
    tgt = np.array([[1, 0], [1, 2], [2, NO_SERVER]], np.int32)
    # slot 0: role swap only (no data); slot 1: 2 added, 0 removed
    assert placement.moves(cur, tgt) == [(0, [], []), (1, [2], [0])]
    prim, total = placement.copy_counts(cur, 4)
    assert prim.tolist() == [1, 1, 1, 0] and total.tolist() == [2, 2, 1, 0]


def test_hand_overs_that_cannot_complete_are_cancelled():
    copies = np.array([[0, 1], [0, 1], [0, 1], [0, 1]], np.int32)
    states = np.array([[HANDING_OVER, IN_SYNC], [HANDING_OVER, CATCHING_UP], [HANDING_OVER, IN_SYNC],
                       [HANDING_OVER, IN_SYNC]], np.uint8)
    target = np.array([[1, 0], [1, 0], [0, 1], [1, 0]], np.int32)
    expired = np.array([False, False, False, True])
    s = placement.cancel_hand_overs(copies, states, target, expired)
    # slot 0 goes on; 1: the new primary is not in sync; 2: the target keeps the primary; 3: expired
    assert s[:, 0].tolist() == [HANDING_OVER, IN_SYNC, IN_SYNC, IN_SYNC]
    assert (placement.cancel_hand_overs(copies, states, None)[:, 0] == IN_SYNC).all()
    # a report only completes where the new primary is an in-sync copy
    c, s2, done = placement.hand_over(copies, states, np.arange(4), target)
    assert done.tolist() == [0, 3] and c[0].tolist() == [1, 0] and c[1].tolist() == [0, 1]
