"""The scheduler's state machine (``SchedulerCore``) without sockets, driven by register / heartbeat / tick /
reports as the gRPC service would (``scheduler_harness``): the map it keeps: persisted across restarts,
rebalanced, its tables created and dropped, waited on, its changes against a set reference."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_harness import TIMEOUT, Cluster, assert_valid, spec, started

from tigana.ps.errors import TableExists
from tigana.ps.routing import CATCHING_UP, IN_SYNC, ShardMap
from tigana.ps.scheduler import SchedulerConfig, SchedulerDriver, placement
from tigana.ps.scheduler.stores.file import FileMapStore


# --- persistence --------------------------------------------------------------------------------------------
def test_restarted_scheduler_loses_nothing(tmp_path):
    c = started(tmp_path, ("a", "b", "c"))
    c.core.create_table(spec(durability="async"), exist_ok=False)
    c.advance(TIMEOUT + 1, alive=("a", "b"))  # c dies; some copies catching up
    old = c.map
    assert (old.states == CATCHING_UP).any()
    # kill -9: a new core on the same directory, its clock far ahead
    c2 = Cluster(tmp_path, t0=1000.0)
    c2.boots = dict(c.boots)
    new = c2.map
    assert new.epoch == old.epoch and new.cluster_id == old.cluster_id
    assert new.servers == old.servers and new.tables == old.tables and new.replicas == old.replicas
    for name in ("copies", "states", "slot_epochs"):
        np.testing.assert_array_equal(getattr(new, name), getattr(old, name))
    # nobody is declared dead before a full timeout from the new start
    c2.advance(TIMEOUT, alive=("a",))
    assert c2.map.epoch == old.epoch and c2.map.servers[1].up
    c2.advance(1.0, alive=("a",))
    assert not c2.map.servers[1].up and c2.map.servers[0].up
    assert c2.map.epoch > old.epoch
    assert_valid(c2.map, unled_ok=True)  # b and c down: slots whose only other copy was catching up wait


def test_restarted_scheduler_keeps_its_target(tmp_path):
    c = started(tmp_path, ("a", "b"), auto_rebalance=False)
    c.register("c")  # joins empty
    assert not c.map.holds(2).any()
    target = c.core.rebalance().target
    assert c.map.holds(2).any()  # the first step started copies on c
    c2 = Cluster(tmp_path, t0=50.0)
    assert c2.core.target is not None
    np.testing.assert_array_equal(c2.core.target, target)


# --- rebalancing --------------------------------------------------------------------------------------------
def run_to_target(c: Cluster, alive: tuple[str, ...], limit: int = 40) -> int:
    for step in range(limit):
        assert_valid(c.map)
        assert (c.map.in_sync_count() >= 1).all()
        if c.core.target is None:
            return step
        c.catch_up_all()
        c.advance(0.5, alive=alive)
    pytest.fail("the rebalance did not finish")


def test_rebalance_to_a_new_server(tmp_path):
    c = started(tmp_path, ("a", "b", "c"), auto_rebalance=False)
    c.register("d")
    before = c.map.copies.copy()
    c.core.rebalance()
    run_to_target(c, ("a", "b", "c", "d"))
    m = c.map
    prim, total = placement.copy_counts(m.copies, 4)
    assert prim.tolist() == [6, 6, 6, 6] and total.tolist() == [12, 12, 12, 12]
    added = sum(len(a) for _, a, _ in placement.moves(before, m.copies))
    assert added == 12  # exactly d's share
    assert (m.states[m.copies >= 0] == IN_SYNC).all()


def test_auto_rebalance_moves_slots_to_a_joining_server(tmp_path):
    c = started(tmp_path, ("a", "b", "c"), auto_rebalance=True)
    before = c.map.copies.copy()
    c.register("d")
    assert c.core.target is not None and c.map.holds(3).any()
    run_to_target(c, ("a", "b", "c", "d"))
    prim, total = placement.copy_counts(c.map.copies, 4)
    assert prim.tolist() == [6, 6, 6, 6] and total.tolist() == [12, 12, 12, 12]
    assert sum(len(a) for _, a, _ in placement.moves(before, c.map.copies)) == 12


def test_without_auto_rebalance_a_joining_server_stays_empty(tmp_path):
    c = started(tmp_path, ("a", "b", "c"), auto_rebalance=False)
    c.register("d")
    c.advance(2.0, alive=("a", "b", "c", "d"))
    assert c.core.target is None and not c.map.holds(3).any()


def test_server_dies_during_rebalance(tmp_path):
    """The target is re-aimed after the death; the cluster converges to a valid placement of 1 + r copies."""
    c = started(tmp_path, ("a", "b", "c"))
    c.register("d")
    c.core.rebalance()
    c.advance(TIMEOUT + 1, alive=("a", "b", "d"))  # c dies with copies of d still catching up
    assert not c.map.servers[2].up
    run_to_target(c, ("a", "b", "d"))
    m = c.map
    assert ((m.copies >= 0).sum(axis=1) == 2).all(), m.copies
    assert (m.states[m.copies >= 0] == IN_SYNC).all()
    prim, total = placement.copy_counts(m.copies, 4)
    assert prim[2] == total[2] == 0
    up = [0, 1, 3]
    assert prim[up].max() - prim[up].min() <= 1 and total[up].max() - total[up].min() <= 1


# --- tables -------------------------------------------------------------------------------------------------
def test_create_and_drop_tables(tmp_path):
    c = started(tmp_path, ("a",))
    e = c.map.epoch
    held, created = c.core.create_table(spec(), exist_ok=False)
    assert created and held == spec() and c.map.epoch == e + 1 and c.map.tables == {"emb": spec()}
    assert c.core.create_table(spec(), exist_ok=True) == (spec(), False)
    assert c.map.epoch == e + 1
    with pytest.raises(TableExists, match="exist_ok"):
        c.core.create_table(spec(), exist_ok=False)
    with pytest.raises(TableExists, match="dim"):
        c.core.create_table(spec(dim=16), exist_ok=True)
    with pytest.raises(TableExists, match="durability"):
        c.core.create_table(spec(durability="async"), exist_ok=True)
    with pytest.raises(TableExists, match="min_copies"):
        c.core.create_table(spec(min_copies=2), exist_ok=True)
    assert c.map.epoch == e + 1
    assert c.core.create_table(spec("other", 4), exist_ok=False)[1]
    assert c.core.drop_table("emb") is True
    assert c.map.epoch == e + 3 and set(c.map.tables) == {"other"}
    assert c.core.drop_table("emb") is False and c.map.epoch == e + 3
    # slot epochs do not move for table changes
    assert (c.map.slot_epochs < e + 1).all()


# --- wait_map -----------------------------------------------------------------------------------------------
def test_wait_map(tmp_path):
    c = started(tmp_path, ("a",))
    e = c.map.epoch
    assert c.core.wait_map(e - 1, 0.0) is c.map
    assert c.core.wait_map(e, 0.0) is None
    got: list[ShardMap | None] = []
    waiter = threading.Thread(target=lambda: got.append(c.core.wait_map(e, 30.0)))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()
    c.core.create_table(spec(), exist_ok=False)
    waiter.join(5.0)
    assert not waiter.is_alive() and got[0] is not None and got[0].epoch == e + 1


def test_wait_map_times_out(tmp_path):
    core = SchedulerDriver(SchedulerConfig(num_slots=8), FileMapStore(tmp_path / "s"))  # the real clock
    t0 = time.monotonic()
    assert core.wait_map(core.map.epoch, 0.2) is None
    assert 0.2 <= time.monotonic() - t0 < 2.0


@given(st.data())
@settings(max_examples=100, deadline=None)
def test_placement_changes_match_a_set_reference(data) -> None:
    """The vectorized diff of two copies arrays against per-slot sets (copies anywhere in a row, -1 holes)."""
    from tigana.ps.scheduler import _placement_changes

    n = data.draw(st.integers(1, 8))

    def copies(width: int) -> np.ndarray:
        rows = [data.draw(st.lists(st.integers(-1, 4), min_size=width, max_size=width)) for _ in range(n)]
        rows = [[x if x < 0 or x not in row[:k] else -1 for k, x in enumerate(row)] for row in rows]  # distinct
        return np.array(rows, np.int32).reshape(n, width)

    a, b = copies(data.draw(st.integers(1, 3))), copies(data.draw(st.integers(1, 3)))
    out, servers = _placement_changes(a, b)
    want: dict[str, list[int]] = {"added": [], "primary": [], "dropped": []}
    involved: set[int] = set()
    for slot in range(n):
        old, new = {int(x) for x in a[slot] if x >= 0}, {int(x) for x in b[slot] if x >= 0}
        if new - old:
            want["added"].append(slot)
        if old - new:
            want["dropped"].append(slot)
        involved |= old ^ new
        if a[slot, 0] != b[slot, 0]:
            want["primary"].append(slot)
            involved |= {int(x) for x in (a[slot, 0], b[slot, 0]) if x >= 0}
    assert out == want and servers == involved
