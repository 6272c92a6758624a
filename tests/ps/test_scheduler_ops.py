"""Placement operations of the scheduler (``SchedulerCore.move_slot``, ``drain``, ``rebalance``, auto-rebalance)
without sockets: a ``FileMapStore`` under ``tmp_path`` that also records every state it saves, and a fake
clock. Every saved map is checked: a slot always keeps an in-sync primary, and a move is never left half
done, whether a server dies in the middle or the scheduler is killed and restarted on the same directory."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_harness import SLOTS, Cluster, assert_valid, started

from tigana.ps.errors import InvalidArgument
from tigana.ps.routing import CATCHING_UP, HANDING_OVER, IN_SYNC, ShardMap
from tigana.ps.scheduler import placement

SLOT = 5


def row_of(m: ShardMap, slot: int) -> list[tuple[int, int]]:
    """A slot's copies as (server, state), primary first."""
    return [(int(x), int(s)) for x, s in zip(m.copies[slot], m.states[slot], strict=True) if x >= 0]


def history(c: Cluster, slot: int, since: int = 0) -> list[list[tuple[int, int]]]:
    """The distinct rows of ``slot`` in the maps saved from ``c.store.saved[since]`` on, in order."""
    out: list[list[tuple[int, int]]] = []
    for state in c.store.saved[since:]:
        row = row_of(state.map, slot)
        if not out or out[-1] != row:
            out.append(row)
    return out


def not_holding(m: ShardMap, slot: int) -> int:
    return next(i for i in range(len(m.servers)) if not m.holds(i)[slot] and m.servers[i].up)


# --- move_slot ----------------------------------------------------------------------------------------------
def test_move_primary_in_safe_steps(tmp_path):
    c = started(tmp_path)
    m0 = c.map
    (p, r), = [(int(m0.copies[SLOT, 0]), int(m0.copies[SLOT, 1]))]
    x = not_holding(m0, SLOT)
    others = np.setdiff1d(np.arange(SLOTS), [SLOT])
    mark = len(c.store.saved)

    plan = c.core.move_slot(SLOT, m0.servers[x].id)
    assert plan.moves == [(SLOT, [x], [p], p, x, 0)]
    assert c.core.target_kind == "moves"
    assert row_of(c.map, SLOT) == [(p, IN_SYNC), (r, IN_SYNC), (x, CATCHING_UP)]  # step 1 at once
    # nothing more happens until the copy is built, however long it takes
    c.advance(10.0)
    assert row_of(c.map, SLOT) == [(p, IN_SYNC), (r, IN_SYNC), (x, CATCHING_UP)]
    # only the slot's primary may say the copy caught up
    ok, _ = c.core.copy_caught_up(m0.servers[r].id, m0.servers[x].id, np.array([SLOT]), c.map.epoch)
    assert not ok and row_of(c.map, SLOT)[2] == (x, CATCHING_UP)
    ok, msg = c.core.copy_caught_up(m0.servers[p].id, m0.servers[x].id, np.array([SLOT]), c.map.epoch)
    assert ok, msg
    c.advance(1.0)
    # the primary is told to refuse writes and drain; nothing more happens until it reports that it did
    assert row_of(c.map, SLOT)[0] == (p, HANDING_OVER)
    c.advance(1.0)
    assert row_of(c.map, SLOT)[0] == (p, HANDING_OVER)
    ok, _ = c.core.handover_ready(m0.servers[r].id, np.array([SLOT]), c.map.epoch)  # only its primary
    assert not ok
    ok, msg = c.core.handover_ready(m0.servers[p].id, np.array([SLOT]), c.map.epoch)
    assert ok, msg
    c.advance(1.0)
    assert c.core.target is None
    assert history(c, SLOT, mark) == [
        [(p, IN_SYNC), (r, IN_SYNC)],
        [(p, IN_SYNC), (r, IN_SYNC), (x, CATCHING_UP)],  # 1. a catching-up copy on the new server
        [(p, IN_SYNC), (r, IN_SYNC), (x, IN_SYNC)],      # 2. in sync once its primary says so
        [(p, HANDING_OVER), (r, IN_SYNC), (x, IN_SYNC)],  # 3a. the primary refuses writes and drains
        [(x, IN_SYNC), (r, IN_SYNC), (p, IN_SYNC)],      # 3b. the primary role moves (the old one stays)
        [(x, IN_SYNC), (r, IN_SYNC)],                    # 4. the old copy is dropped
    ]
    for state in c.store.saved[mark:]:
        assert_valid(state.map)
        assert state.map.in_sync_count()[SLOT] >= 2  # never fewer in-sync copies than before the move
        np.testing.assert_array_equal(state.map.copies[others, :2], m0.copies[others])  # no other slot moves


def test_move_a_replica_keeps_the_primary(tmp_path):
    c = started(tmp_path)
    m0 = c.map
    p, r = int(m0.copies[SLOT, 0]), int(m0.copies[SLOT, 1])
    x = not_holding(m0, SLOT)
    mark = len(c.store.saved)
    plan = c.core.move_slot(SLOT, m0.servers[x].id, from_=m0.servers[r].id)
    assert plan.moves == [(SLOT, [x], [r], p, p, 0)]
    c.run_to_target()
    assert row_of(c.map, SLOT) == [(p, IN_SYNC), (x, IN_SYNC)]
    rows = history(c, SLOT, mark)
    assert all(row[0] == (p, IN_SYNC) for row in rows), rows  # the primary never changes
    assert rows[-2] == [(p, IN_SYNC), (r, IN_SYNC), (x, IN_SYNC)]  # r dropped only once x is in sync


def test_move_a_replica_to_lead(tmp_path):
    c = started(tmp_path)
    m0 = c.map
    p, r = int(m0.copies[SLOT, 0]), int(m0.copies[SLOT, 1])
    x = not_holding(m0, SLOT)
    c.core.move_slot(SLOT, m0.servers[x].id, from_=m0.servers[r].id, primary=True)
    c.run_to_target()
    assert row_of(c.map, SLOT) == [(x, IN_SYNC), (p, IN_SYNC)]


def test_move_primary_to_an_existing_replica_swaps_roles(tmp_path):
    c = started(tmp_path)
    m0 = c.map
    p, r = int(m0.copies[SLOT, 0]), int(m0.copies[SLOT, 1])
    plan = c.core.move_slot(SLOT, m0.servers[r].id, primary=True)
    assert plan.moves == [(SLOT, [], [], p, r, 0)]  # no data moves
    assert row_of(c.map, SLOT) == [(p, HANDING_OVER), (r, IN_SYNC)]  # drains first
    c.catch_up_all()  # the primary reports the hand-over
    assert row_of(c.map, SLOT) == [(r, IN_SYNC), (p, IN_SYNC)]
    c.advance(1.0)
    assert c.core.target is None and row_of(c.map, SLOT) == [(r, IN_SYNC), (p, IN_SYNC)]
    c.check_saved()


def test_move_slot_errors_name_the_field_or_server(tmp_path):
    c = started(tmp_path, ("a", "b", "c", "d"))
    m0 = c.map
    p, r = (m0.servers[int(i)].id for i in m0.copies[SLOT, :2])
    x = m0.servers[not_holding(m0, SLOT)].id
    y = next(s.id for i, s in enumerate(m0.servers) if not m0.holds(i)[SLOT] and s.id != x)
    epoch = m0.epoch
    with pytest.raises(InvalidArgument, match="'zz'.*no such server"):
        c.core.move_slot(SLOT, "zz")
    with pytest.raises(InvalidArgument, match="'zz'.*no such server"):
        c.core.move_slot(SLOT, x, from_="zz")
    for bad in (-1, SLOTS, 10**6):
        with pytest.raises(InvalidArgument, match=rf"field 'slot'.*{bad}"):
            c.core.move_slot(bad, x)
    # a refusal names what holds the slot
    with pytest.raises(InvalidArgument, match=rf"'{r}' already holds a copy of slot {SLOT} \({p} leads it, {r} "
                                              r"holds an in-sync copy\).*--primary makes it lead"):
        c.core.move_slot(SLOT, r)
    with pytest.raises(InvalidArgument, match=rf"'{y}' holds no copy of slot {SLOT} \({p} leads it"):
        c.core.move_slot(SLOT, x, from_=y)
    assert c.map.epoch == epoch and c.core.target is None
    # a draining target
    c.core.drain(y)
    with pytest.raises(InvalidArgument, match=f"'{y}' is draining"):
        c.core.move_slot(SLOT, y)
    c.run_to_target()
    # a dead target (by id or by address)
    c.kill(x)
    with pytest.raises(InvalidArgument, match=f"'{x}' is down"):
        c.core.move_slot(SLOT, x)
    with pytest.raises(InvalidArgument, match=f"'host-{x}:1' is down"):
        c.core.move_slot(SLOT, f"host-{x}:1")
    assert c.core.target is None


def test_a_move_whose_end_state_holds_is_a_no_op_that_says_so(tmp_path):
    """Re-running a move is safe: when what it asks for already holds (or is already planned), nothing
    changes and the plan's note says what holds."""
    c = started(tmp_path, ("a", "b", "c", "d"))
    m0 = c.map
    p, r = (m0.servers[int(i)].id for i in m0.copies[SLOT, :2])
    x = m0.servers[not_holding(m0, SLOT)].id
    epoch = m0.epoch
    for kwargs in ({"primary": True}, {}):  # the primary's copy to where it is, or its lead to its leader
        plan = c.core.move_slot(SLOT, p, **kwargs)
        assert plan.moves == [] and plan.note == f"server {p} already leads slot {SLOT}: nothing to move"
    plan = c.core.move_slot(SLOT, r, from_=r)
    assert plan.moves == [] and plan.note == f"server {r} already holds a copy of slot {SLOT}: nothing to move"
    assert c.map.epoch == epoch and c.core.target is None
    # a move planned, asked again while it runs: nothing more is planned; once done, the same again
    first = c.core.move_slot(SLOT, x, primary=True)
    assert first.moves and not first.note
    target = c.core.target.copy()
    again = c.core.move_slot(SLOT, x, primary=True)
    assert again.moves == [] and again.note.startswith(f"slot {SLOT} is already moving to server {x} as primary")
    np.testing.assert_array_equal(c.core.target, target)
    c.run_to_target()
    assert c.map.servers[int(c.map.copies[SLOT, 0])].id == x
    epoch = c.map.epoch
    for _ in range(2):
        plan = c.core.move_slot(SLOT, x, primary=True)
        assert plan.moves == [] and plan.note == f"server {x} already leads slot {SLOT}: nothing to move"
    # a replica moved away from its old server, asked again: the copy is on the target, none on the source
    holder = c.map.servers[int(c.map.copies[SLOT, 1])].id
    free = c.map.servers[not_holding(c.map, SLOT)].id
    c.core.move_slot(SLOT, free, from_=holder)
    c.run_to_target()
    epoch = c.map.epoch
    plan = c.core.move_slot(SLOT, free, from_=holder)
    assert plan.moves == [] and plan.note == f"server {free} already holds a copy of slot {SLOT}: nothing to move"
    assert c.map.epoch == epoch and c.core.target is None


# --- drain --------------------------------------------------------------------------------------------------
def test_drain_moves_every_copy_off_then_undrain(tmp_path):
    c = started(tmp_path, ("a", "b", "c", "d"))
    d = c.idx("d")
    held = set(np.flatnonzero(c.map.holds(d)).tolist())
    assert len(held) == 12
    plan = c.core.drain("host-d:1")  # by address
    moved = {slot: removed for slot, _, removed, *_ in plan.moves}
    assert held <= set(moved) and all(d in moved[slot] for slot in held)
    assert c.core.draining == {"d"} and c.core.target_kind == "balance"
    c.run_to_target()
    m = c.map
    assert not m.holds(d).any()
    assert ((m.copies >= 0).sum(axis=1) == 2).all() and (m.states[m.copies >= 0] == IN_SYNC).all()
    prim, total = placement.copy_counts(m.copies, 4)
    assert prim.tolist()[:3] == [8, 8, 8] and total.tolist() == [16, 16, 16, 0]
    # it stays empty and draining: failures elsewhere never put copies back on it
    c.advance(5.0)
    assert not c.map.holds(d).any() and c.core.draining == {"d"}
    c.kill("a")
    c.run_to_target()
    c.advance(2.0)
    c.catch_up_all()
    assert not c.map.holds(d).any() and (c.map.in_sync_count() == 2).all()
    assert c.core.status().draining == ["d"]
    # undrain: placeable again (a rebalance then gives it slots)
    c.core.drain("d", undrain=True)
    assert c.core.draining == set() and c.core.status().draining == []
    c.core.rebalance()
    c.run_to_target()
    assert c.map.holds(d).sum() == 16 and c.map.leads(d).sum() == 8
    c.check_saved()


def test_drain_undrain_and_rebalance_again_are_no_ops_that_say_so(tmp_path):
    c = started(tmp_path, ("a", "b", "c", "d"))
    d = c.idx("d")
    epoch = c.map.epoch
    plan = c.core.rebalance()  # balanced from the first placement
    assert plan.moves == [] and plan.note == "the placement is balanced already: nothing to move"
    plan = c.core.drain("d", undrain=True)
    assert plan.moves == [] and plan.note == "server d is not draining: nothing to undo"
    assert c.map.epoch == epoch and c.core.target is None and c.core.draining == set()
    first = c.core.drain("d")
    target = c.core.target.copy()
    again = c.core.drain("d")  # while its moves run: the same moves, no new plan
    assert again.note.startswith("server d is already draining: 12 slot cop(ies) still on it")
    assert sorted(mv[0] for mv in again.moves) == sorted(mv[0] for mv in first.moves)
    np.testing.assert_array_equal(c.core.target, target)
    c.run_to_target()
    assert not c.map.holds(d).any()
    epoch = c.map.epoch
    plan = c.core.drain("host-d:1")
    assert plan.moves == [] and plan.note == "server d is already drained: it holds nothing"
    assert c.map.epoch == epoch and c.core.target is None and c.core.draining == {"d"}
    c.check_saved()


def test_drain_the_last_server_is_refused(tmp_path):
    c = started(tmp_path, ("a", "b", "c"))
    c.core.drain("a")
    c.run_to_target()
    assert not c.map.holds(0).any() and (c.map.in_sync_count() == 2).all()
    epoch = c.map.epoch
    # a drain never makes the cluster under-replicated: two copies of every slot need two servers
    with pytest.raises(InvalidArgument, match="'b': 1 server.* would be left to hold 2 copies"):
        c.core.drain("b")
    assert c.core.draining == {"a"} and c.core.target is None and c.map.epoch == epoch
    with pytest.raises(InvalidArgument, match="'zz'"):
        c.core.drain("zz")
    # one server
    solo = started(tmp_path / "solo", ("a",))
    with pytest.raises(InvalidArgument, match="last server"):
        solo.core.drain("a")
    assert solo.core.draining == set()


# --- failures in the middle of a move -------------------------------------------------------------------------
@pytest.mark.parametrize("primary", [True, False])
def test_target_of_a_move_dies_while_catching_up(tmp_path, primary):
    c = started(tmp_path, ("a", "b", "c", "d"))
    m0 = c.map
    before = row_of(m0, SLOT)
    x = not_holding(m0, SLOT)
    src = "" if primary else m0.servers[before[1][0]].id
    c.core.move_slot(SLOT, m0.servers[x].id, from_=src, primary=primary)
    assert row_of(c.map, SLOT)[-1] == (x, CATCHING_UP)
    c.kill(m0.servers[x].id)
    # rolled back: the slot's target is its copies again (x's other slots are being re-replicated)
    assert row_of(c.map, SLOT) == before
    assert c.core.target is not None and c.core.target_kind == "moves"
    assert [int(s) for s in c.core.target[SLOT] if s >= 0] == [s for s, _ in before]
    assert not (c.core.target == x).any()
    c.run_to_target()
    assert row_of(c.map, SLOT) == before and not c.map.holds(x).any()
    assert ((c.map.copies >= 0).sum(axis=1) == 2).all() and (c.map.in_sync_count() == 2).all()


def test_new_primary_dies_after_the_role_moved(tmp_path):
    """The move got as far as the primary transfer (the old primary still holds its copy): the new primary
    dies, the slot fails over to an in-sync copy and keeps its original servers."""
    c = started(tmp_path, ("a", "b", "c", "d"))
    m0 = c.map
    before = {x for x, _ in row_of(m0, SLOT)}
    x = not_holding(m0, SLOT)
    c.core.move_slot(SLOT, m0.servers[x].id)
    c.catch_up_all()
    row = row_of(c.map, SLOT)
    assert row[0] == (x, IN_SYNC) and {s for s, _ in row} == before | {x}  # transferred, not yet dropped
    c.kill(m0.servers[x].id)
    row = row_of(c.map, SLOT)
    assert {s for s, _ in row} == before and all(st == IN_SYNC for _, st in row)
    assert not (c.core.target == x).any()
    c.run_to_target()
    assert row_of(c.map, SLOT) == row  # nothing half done is resumed
    assert (c.map.in_sync_count() == 2).all()


def test_source_of_a_move_dies_and_the_move_completes(tmp_path):
    c = started(tmp_path, ("a", "b", "c", "d"))
    m0 = c.map
    p, r = int(m0.copies[SLOT, 0]), int(m0.copies[SLOT, 1])
    x = not_holding(m0, SLOT)
    c.core.move_slot(SLOT, m0.servers[x].id)
    c.kill(m0.servers[p].id)
    assert row_of(c.map, SLOT)[0] == (r, IN_SYNC)  # the in-sync replica took over, x still catching up
    c.run_to_target()
    row = row_of(c.map, SLOT)
    assert row == [(x, IN_SYNC), (r, IN_SYNC)], row


def test_server_dies_during_a_rebalance_is_planned_again(tmp_path):
    c = started(tmp_path, ("a", "b", "c"))
    c.register("d")
    d = c.idx("d")
    c.core.rebalance()
    assert c.core.target_kind == "balance" and (c.core.target == d).any()
    assert c.map.holds(d).any()
    c.kill("d")  # the server being filled
    target = c.core.target
    assert target is None or not (target == d).any()
    assert c.core.target_kind == "balance"
    c.run_to_target()
    m = c.map
    assert not m.holds(d).any() and ((m.copies >= 0).sum(axis=1) == 2).all()
    prim, total = placement.copy_counts(m.copies, 4)
    assert prim.tolist() == [8, 8, 8, 0] and total.tolist() == [16, 16, 16, 0]
    # a server that was not being moved to dies while d (back) is filled: planned again over the rest
    c.register("d")
    c.core.rebalance()
    c.kill("c")
    assert c.core.target is not None and not (c.core.target == c.idx("c")).any()
    c.run_to_target()
    prim, total = placement.copy_counts(c.map.copies, 4)
    assert prim.tolist() == [8, 8, 0, 8] and total.tolist() == [16, 16, 0, 16]


# --- persistence --------------------------------------------------------------------------------------------
def test_scheduler_restart_mid_move_keeps_target_kind_and_draining(tmp_path):
    c = started(tmp_path, ("a", "b", "c", "d"))
    c.core.drain("d")
    c.run_to_target()
    m0 = c.map
    x = not_holding(m0, SLOT)
    plan = c.core.move_slot(SLOT, m0.servers[x].id)
    assert row_of(c.map, SLOT)[-1] == (x, CATCHING_UP)
    # kill -9 of the scheduler: a new core on the same directory, its clock elsewhere
    c2 = Cluster(tmp_path, t0=500.0, boots=c.boots)
    assert c2.core.target is not None
    np.testing.assert_array_equal(c2.core.target, plan.target)
    assert c2.core.target_kind == "moves" and c2.core.draining == {"d"}
    assert c2.map.epoch == c.map.epoch and row_of(c2.map, SLOT) == row_of(c.map, SLOT)
    assert c2.core.status().moving_slots == 1 and c2.core.status().draining == ["d"]
    # the move then completes
    c2.run_to_target()
    assert row_of(c2.map, SLOT)[0] == (x, IN_SYNC) and len(row_of(c2.map, SLOT)) == 2
    assert not c2.map.holds(c2.idx("d")).any() and c2.core.draining == {"d"}
    # and the next restart finds nothing to do
    c3 = Cluster(tmp_path, t0=900.0, boots=c.boots)
    assert c3.core.target is None and c3.core.draining == {"d"} and c3.map.epoch == c2.map.epoch


def test_scheduler_restart_mid_drain(tmp_path):
    c = started(tmp_path, ("a", "b", "c"))
    c.core.drain("c")
    assert c.core.target is not None and c.core.target_kind == "balance"
    c.catch_up_all()  # part way: copies built, not yet dropped
    c2 = Cluster(tmp_path, t0=100.0, boots=c.boots)
    assert c2.core.draining == {"c"} and c2.core.target_kind == "balance"
    np.testing.assert_array_equal(c2.core.target, c.core.target)
    c2.run_to_target()
    assert not c2.map.holds(2).any() and ((c2.map.copies >= 0).sum(axis=1) == 2).all()


# --- auto-rebalance -----------------------------------------------------------------------------------------
def test_auto_rebalance_fills_joining_servers(tmp_path):
    c = started(tmp_path, ("a", "b"), auto_rebalance=True)
    before = c.map.copies.copy()
    c.register("c")
    assert c.core.target is not None and c.core.target_kind == "balance"
    assert c.map.holds(2).any() and (c.map.copy_state(2)[c.map.holds(2)] == CATCHING_UP).all()
    c.catch_up_all()
    c.advance(0.5)
    c.register("d")  # joins while c's moves are in flight: planned again over four
    assert c.core.target is not None and (c.core.target == 3).any()
    c.run_to_target()
    m = c.map
    prim, total = placement.copy_counts(m.copies, 4)
    assert prim.tolist() == [6, 6, 6, 6] and total.tolist() == [12, 12, 12, 12]
    assert (m.states[m.copies >= 0] == IN_SYNC).all()
    assert sum(len(a) for _, a, _ in placement.moves(before, m.copies)) == 24  # exactly c's and d's shares
