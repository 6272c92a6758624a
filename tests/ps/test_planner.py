"""The cost-model planner (``placement.plan``, ``server_loads``, ``CostModel``): pure functions, no sockets.

Property tests draw clusters of 2-6 servers, 32-256 slots and 0-2 replicas with per-slot rows, bytes and
request rates (a few hot slots among them) from a drawn seed, and check what ``tigana admin rebalance``
relies on: the target is a valid placement, the predicted figures (bytes, seconds, load) match the moves,
the load never gets worse, hot slots are spread, and a balanced placement is left alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.ps.scheduler import placement
from tigana.ps.scheduler.placement import CostModel

SETTINGS = settings(max_examples=40, deadline=None)

servers_st = st.integers(2, 6)
slots_st = st.integers(32, 256)
replicas_st = st.integers(0, 2)
seeds_st = st.integers(0, 2**32 - 1)


# --- helpers ------------------------------------------------------------------------------------------------
def present(row: np.ndarray) -> set[int]:
    return {int(x) for x in row if x >= 0}


def random_copies(rng: np.random.Generator, n: int, num_slots: int, replicas: int) -> np.ndarray:
    """A valid but arbitrary placement over all ``n`` servers: 1 + min(r, n - 1) distinct servers per slot."""
    width = 1 + min(replicas, n - 1)
    return np.stack([rng.choice(n, width, replace=False) for _ in range(num_slots)]).astype(np.int32)


def random_load(rng: np.random.Generator, num_slots: int, hot: int = 3
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rows, bytes, rates, hot slots): rows 0-1000 (some empty), 64..128 bytes a row, rates 0-50 rows/s,
    and ``hot`` slots with 20x the rows and 1000x the rate."""
    rows = rng.integers(0, 1000, num_slots).astype(np.int64)
    rows[rng.random(num_slots) < 0.1] = 0
    bytes_ = rows * rng.integers(64, 129)
    rates = rng.uniform(0, 50, num_slots)
    hot_slots = rng.choice(num_slots, min(hot, num_slots), replace=False)
    rows[hot_slots] *= 20
    bytes_[hot_slots] *= 20
    rates[hot_slots] *= 1000
    return rows, bytes_, rates, hot_slots


def assert_valid_target(t: np.ndarray, alive: np.ndarray, replicas: int) -> None:
    """One primary per slot on an alive server; 1 + min(r, alive - 1) copies on distinct alive servers."""
    want = 1 + min(replicas, int(alive.sum()) - 1)
    assert t.shape[1] >= want
    assert (t[:, 0] >= 0).all(), "a slot without a primary"
    for slot, row in enumerate(t):
        got = [int(x) for x in row if x >= 0]
        assert len(got) == len(set(got)), f"slot {slot}: duplicate copies {row.tolist()}"
        assert len(got) == want, f"slot {slot}: {row.tolist()} has {len(got)} copies, want {want}"
        assert alive[got].all(), f"slot {slot}: {row.tolist()} has a copy on a dead server"


# --- validity and the predicted cost --------------------------------------------------------------------------
@SETTINGS
@given(n=servers_st, num_slots=slots_st, replicas=replicas_st, seed=seeds_st, dead=st.integers(0, 2),
       link=st.sampled_from([1e6, 100e6, 12.5e9]))
def test_plan_target_valid_and_cost_matches_moves(n, num_slots, replicas, seed, dead, link):
    rng = np.random.default_rng(seed)
    copies = random_copies(rng, n, num_slots, replicas)
    alive = np.ones(n, bool)
    alive[rng.choice(n, min(dead, n - 1), replace=False)] = False
    rows, bytes_, rates, _ = random_load(rng, num_slots)
    cost = CostModel(link_bytes_per_s=link)
    p = placement.plan(copies, alive, replicas, rows, bytes_, rates, cost)

    assert_valid_target(p.target, alive, replicas)
    # bytes: every copy the target adds is a full copy of its slot; nothing else is copied
    added = {s: present(p.target[s]) - present(copies[s]) for s in range(num_slots)}
    assert p.bytes_moved == sum(int(bytes_[s]) * len(a) for s, a in added.items())
    assert p.seconds == pytest.approx(p.bytes_moved / link)
    # the moves: one entry per slot that changes (its copies or its primary), consistent with the target
    changed = {s for s in range(num_slots)
               if present(p.target[s]) != present(copies[s]) or p.target[s, 0] != copies[s, 0]}
    assert sorted(m[0] for m in p.moves) == sorted(changed)
    for slot, add, remove, p_from, p_to, nbytes in p.moves:
        assert add == sorted(added[slot])
        assert remove == sorted(present(copies[slot]) - present(p.target[slot]))
        assert (p_from, p_to) == (int(copies[slot, 0]), int(p.target[slot, 0]))
        assert nbytes == int(bytes_[slot]) * len(add)
    assert sum(m[5] for m in p.moves) == p.bytes_moved
    # the load figures are server_loads of the two placements
    np.testing.assert_allclose(p.load_before, placement.server_loads(copies, n, rows, rates, cost))
    np.testing.assert_allclose(p.load_after, placement.server_loads(p.target, n, rows, rates, cost))
    assert (p.load_after[~alive] == 0).all()


@SETTINGS
@given(n=servers_st, num_slots=slots_st, replicas=replicas_st, seed=seeds_st, dead=st.integers(0, 2),
       explicit=st.booleans())
def test_plan_again_moves_nothing(n, num_slots, replicas, seed, dead, explicit):
    rng = np.random.default_rng(seed)
    copies = random_copies(rng, n, num_slots, replicas)
    alive = np.ones(n, bool)
    alive[rng.choice(n, min(dead, n - 1), replace=False)] = False
    rows, bytes_, rates, _ = random_load(rng, num_slots)
    cost = CostModel(rate_weight=0.5) if explicit else CostModel()
    first = placement.plan(copies, alive, replicas, rows, bytes_, rates, cost)
    again = placement.plan(first.target, alive, replicas, rows, bytes_, rates, cost)
    assert again.moves == [] and again.bytes_moved == 0 and again.seconds == 0
    for slot in range(num_slots):
        assert present(again.target[slot]) == present(first.target[slot])
        assert again.target[slot, 0] == first.target[slot, 0]
    np.testing.assert_allclose(again.load_after, again.load_before)


# --- load: never worse, even, hot slots spread ----------------------------------------------------------------
@SETTINGS
@given(n=servers_st, num_slots=slots_st, replicas=replicas_st, seed=seeds_st, rows_per_slot=st.integers(1, 100),
       rate_per_slot=st.sampled_from([0.0, 1.0, 250.0]), balanced_start=st.booleans())
def test_plan_uniform_load_is_even_and_never_worse(n, num_slots, replicas, seed, rows_per_slot, rate_per_slot,
                                                    balanced_start):
    rng = np.random.default_rng(seed)
    copies = (placement.initial(n, num_slots, replicas) if balanced_start
              else random_copies(rng, n, num_slots, replicas))
    alive = np.ones(n, bool)
    rows = np.full(num_slots, rows_per_slot)
    rates = np.full(num_slots, rate_per_slot)
    p = placement.plan(copies, alive, replicas, rows, rows * 100, rates)
    assert_valid_target(p.target, alive, replicas)
    assert p.load_after.max() <= p.load_before.max() + 1e-9
    # every slot weighs the same: a server is at most one slot's primary (its rows and its rate) above the mean
    unit = rows_per_slot * (2.0 if rate_per_slot > 0 else 1.0)
    mean = p.load_after.mean()
    assert p.load_after.max() <= mean + unit + 1e-9, (p.load_after, unit)
    assert p.load_after.max() / mean <= 1.2, p.load_after
    prim, total = placement.copy_counts(p.target, n)
    assert prim.max() - prim.min() <= 1 and total.max() - total.min() <= 1


@SETTINGS
@given(n=servers_st, num_slots=slots_st, seed=seeds_st, hot=st.integers(0, 4))
def test_plan_never_worse_without_replicas(n, num_slots, seed, hot):
    """With one copy per slot the primary carries all of its slot's load, rows and rate: the plan never
    raises the busiest server's load, whatever the (skewed) per-slot loads."""
    rng = np.random.default_rng(seed)
    copies = random_copies(rng, n, num_slots, 0)
    rows, bytes_, rates, _ = random_load(rng, num_slots, hot)
    alive = np.ones(n, bool)
    for cost in (CostModel(), CostModel(rate_weight=2.0), CostModel(row_weight=0.5, rate_weight=0.0)):
        p = placement.plan(copies, alive, 0, rows, bytes_, rates, cost)
        assert p.load_after.max() <= p.load_before.max() + 1e-6 * p.load_before.max(), cost


@SETTINGS
@given(n=servers_st, num_slots=slots_st, replicas=replicas_st, seed=seeds_st, data=st.data())
def test_plan_spreads_very_hot_slots_over_primaries(n, num_slots, replicas, seed, data):
    """A few slots that take nearly all the requests end led by different servers (as many servers as hot
    slots at least). Each is hotter than everything else together, so no mix of other slots evens one out."""
    hot = data.draw(st.integers(1, n), label="hot")
    rng = np.random.default_rng(seed)
    copies = random_copies(rng, n, num_slots, replicas)
    rows, bytes_, rates, _ = random_load(rng, num_slots, hot=0)
    hot_slots = rng.choice(num_slots, hot, replace=False)
    cost = CostModel(row_weight=1.0, rate_weight=1.0)
    rates[hot_slots] = 10 * (rows.sum() * (1 + replicas) + rates.sum())
    if hot > 1:  # the worst start: every hot slot on one server
        copies[hot_slots] = copies[hot_slots[0]]
    p = placement.plan(copies, np.ones(n, bool), replicas, rows, bytes_, rates, cost)
    assert_valid_target(p.target, np.ones(n, bool), replicas)
    leaders = p.target[hot_slots, 0].tolist()
    assert len(set(leaders)) == hot, (hot_slots.tolist(), p.target[hot_slots].tolist())


def test_plan_can_make_the_load_worse_with_replicas_and_rates():
    """Regression: ``balance`` weighed a primary by its slot's rows + rate, but ``server_loads`` charges a
    primary only its rate (the rows load every copy alike), so the primary pass swapped roles that raised the
    busiest server's load. Now primaries are evened by rate, copies by rows, and a plan never raises the max. Two servers, every slot on both: the rows load is 70 on each whatever happens, and
    the rates are split 30/30 already, yet the plan moves slot 0's primary and predicts 110 instead of 100."""
    copies = np.array([[1, 0], [0, 1], [1, 0]], np.int32)
    rows, rates = np.array([20.0, 10.0, 40.0]), np.array([10.0, 30.0, 20.0])
    cost = CostModel(row_weight=1.0, rate_weight=1.0)
    before = placement.server_loads(copies, 2, rows, rates, cost)
    assert before.tolist() == [100.0, 100.0]
    p = placement.plan(copies, np.ones(2, bool), 1, rows, rows, rates, cost)
    assert p.load_after.max() <= p.load_before.max()


def test_plan_can_copy_onto_the_busiest_server_when_rates_are_zero():
    """Regression (same root): with no request rate a primary role carries no load, yet the primary pass
    evened the rows *led* and, where the idlest leader held no copy, moved the slot there: here slot 3 is
    copied onto server 2, already the busiest (80 -> 90 rows), for nothing."""
    copies = np.array([[1, 2], [0, 2], [2, 0], [1, 0]], np.int32)
    rows = np.array([50.0, 20.0, 10.0, 10.0])
    p = placement.plan(copies, np.ones(3, bool), 1, rows, rows, np.zeros(4))
    assert p.load_before.tolist() == [40.0, 60.0, 80.0]
    assert p.load_after.max() <= p.load_before.max()


# --- server_loads and the rate weight -------------------------------------------------------------------------
def test_server_loads_rows_on_every_copy_rate_on_the_primary():
    copies = np.array([[0, 1, 2], [1, 2, -1], [2, -1, -1]], np.int32)
    rows = np.array([10.0, 20.0, 30.0])
    rates = np.array([1.0, 2.0, 4.0])
    cost = CostModel(row_weight=2.0, rate_weight=100.0)
    load = placement.server_loads(copies, 4, rows, rates, cost)
    # server 0: slot 0's copy (10 rows) + its rate 1; server 1: copies of 0 and 1 + slot 1's rate 2;
    # server 2: copies of 0, 1 and 2 + slot 2's rate 4; server 3: nothing
    assert load.tolist() == [2 * 10 + 100 * 1, 2 * (10 + 20) + 100 * 2, 2 * (10 + 20 + 30) + 100 * 4, 0.0]
    # rows only (rate weight 0): every copy weighs its rows, the primary no more than a replica
    rows_only = placement.server_loads(copies, 4, rows, rates, CostModel(rate_weight=0.0))
    assert rows_only.tolist() == [10.0, 30.0, 60.0, 0.0]


def test_rate_weight_none_weighs_the_mean_slots_rows_and_rate_alike():
    rows = np.array([100.0, 300.0, 200.0, 200.0])  # mean 200
    rates = np.array([1.0, 3.0, 0.0, 4.0])          # mean 2
    copies = np.array([[0, 1], [1, 0], [0, 1], [1, 0]], np.int32)
    # None: rate_weight = row_weight * mean(rows) / mean(rate) = 3 * 200 / 2 = 300
    auto = placement.server_loads(copies, 2, rows, rates, CostModel(row_weight=3.0))
    explicit = placement.server_loads(copies, 2, rows, rates, CostModel(row_weight=3.0, rate_weight=300.0))
    np.testing.assert_allclose(auto, explicit)
    assert auto.tolist() == [3 * 800 + 300 * (1 + 0), 3 * 800 + 300 * (3 + 4)]
    # the mean slot: 200 rows weigh 3 * 200 = 600, its 2 rows/s weigh 300 * 2 = 600 as well
    assert 3.0 * rows.mean() == 300.0 * rates.mean()
    # no requests at all: the rate weighs nothing (no division by zero)
    idle = placement.server_loads(copies, 2, rows, np.zeros(4), CostModel(row_weight=3.0))
    assert idle.tolist() == [3 * 800.0, 3 * 800.0]
    # plan uses the same weight for its load figures
    p = placement.plan(copies, np.ones(2, bool), 1, rows, rows, rates, CostModel(row_weight=3.0))
    np.testing.assert_allclose(p.load_before, auto)
