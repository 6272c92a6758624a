"""The scheduler's state machine (``SchedulerCore``) without sockets: a ``FileMapStore`` under ``tmp_path``
and a fake clock (``t[0]``), driven by register / heartbeat / tick / reports as the gRPC service would."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from primaries import report_all

from tigana.embeddings import TableConfig
from tigana.ps import placement
from tigana.ps.errors import InvalidArgument, TableExists
from tigana.ps.routing import CATCHING_UP, IN_SYNC, NO_SERVER, ShardMap, TableDef
from tigana.ps.scheduler import SchedulerConfig, SchedulerCore
from tigana.ps.scheduler.stores.file import FileMapStore

TIMEOUT = 3.0
SLOTS = 24


class Cluster:
    """A core, its fake clock, the maps it announced, and the boot of every server we registered."""

    def __init__(self, tmp_path, *, t0: float = 0.0, **config) -> None:
        self.t = [t0]
        self.dir = tmp_path / "scheduler"
        config.setdefault("num_slots", SLOTS)
        config.setdefault("heartbeat_timeout_s", TIMEOUT)
        config.setdefault("replicas", 1)
        self.config = SchedulerConfig(**config)
        self.announced: list[ShardMap] = []
        self.core = SchedulerCore(self.config, FileMapStore(self.dir), announce=self.announced.append,
                                  clock=lambda: self.t[0])
        self.boots: dict[str, str] = {}

    @property
    def map(self) -> ShardMap:
        return self.core.map

    def register(self, server: str, boot: str | None = None, positions=None) -> ShardMap:
        self.boots[server] = boot or self.boots.get(server) or f"{server}-boot1"
        return self.core.register(server, f"host-{server}:1", self.boots[server], positions)

    def advance(self, dt: float, *, alive: tuple[str, ...] = ()) -> None:
        """Time passes in steps of a second; at each, the servers in ``alive`` heartbeat, then a tick."""
        end = self.t[0] + dt
        while self.t[0] < end:
            self.t[0] = min(end, self.t[0] + 1.0)
            for s in alive:
                _, again = self.core.heartbeat(s, self.boots[s], self.map.epoch)
                assert not again, s
            self.core.tick()

    def catch_up_all(self) -> int:
        """Every primary reports every catching-up copy of its slots caught up (a report can change the map:
        each is made from the current one). Returns the reports made."""
        return report_all(self.core)


def assert_valid(m: ShardMap) -> None:
    """Copies on distinct servers that are up; a primary is in sync; slot_epochs never ahead of the map."""
    up = np.array([s.up for s in m.servers], bool)
    for slot in range(m.num_slots):
        row = [int(x) for x in m.copies[slot] if x >= 0]
        assert len(row) == len(set(row)), f"slot {slot}: {m.copies[slot]}"
        assert all(up[x] for x in row), f"slot {slot}: a copy on a server that is down: {m.copies[slot]}"
        if m.copies[slot, 0] >= 0:
            assert m.states[slot, 0] == IN_SYNC
    assert (m.slot_epochs <= m.epoch).all()


def started(tmp_path, servers=("a", "b", "c"), **config) -> Cluster:
    config.setdefault("expect_servers", len(servers))
    c = Cluster(tmp_path, **config)
    for s in servers:
        c.register(s)
    assert (c.map.copies[:, 0] >= 0).all()
    return c


def spec(name: str = "emb", dim: int = 8, **kw) -> TableDef:
    return TableDef(TableConfig(name, dim), **kw)


# --- bootstrap ----------------------------------------------------------------------------------------------
def test_bootstrap_waits_for_expect_servers(tmp_path):
    c = Cluster(tmp_path, expect_servers=3, bootstrap_wait_s=100.0, replicas=1)
    c.register("a")
    c.register("b")
    c.advance(2.0, alive=("a", "b"))
    assert (c.map.copies == NO_SERVER).all() and len(c.map.servers) == 2
    epoch = c.map.epoch
    m = c.register("c")
    assert m.epoch == epoch + 2  # c joins, then the first placement
    assert_valid(m)
    assert m.width == 2 and (m.copies >= 0).all() and (m.states == IN_SYNC).all()
    prim, total = placement.copy_counts(m.copies, 3)
    assert prim.max() - prim.min() <= 1
    assert total.max() - total.min() <= 1, total  # 24 slots, 3 servers: exact
    assert (m.slot_epochs == m.epoch).all()
    assert [x.epoch for x in c.announced] == sorted({x.epoch for x in c.announced})
    assert c.announced[-1] is m


def test_bootstrap_after_wait(tmp_path):
    c = Cluster(tmp_path, expect_servers=3, bootstrap_wait_s=2.0, replicas=2)
    c.register("a")
    c.t[0] = 1.9
    c.core.tick()
    assert (c.map.copies == NO_SERVER).all()
    c.t[0] = 2.0
    c.core.tick()
    m = c.map
    assert (m.copies[:, 0] == 0).all() and m.width == 1  # one server: no replica possible
    c.register("b")  # a later server starts empty: no automatic rebalance ...
    assert (c.map.copies[:, 0] == 0).all()
    # ... but it is used to re-replicate (replicas=2 wanted, 1 more server now)
    assert c.map.holds(1).all() and (c.map.copy_state(1) == CATCHING_UP).all()


def test_config_validation(tmp_path):
    for bad in (dict(replicas=-1), dict(heartbeat_timeout_s=0), dict(expect_servers=0), dict(num_slots=0)):
        with pytest.raises(InvalidArgument):
            SchedulerConfig(**bad)
    Cluster(tmp_path, num_slots=16)
    with pytest.raises(InvalidArgument, match="slots"):
        Cluster(tmp_path, num_slots=32)  # the saved map has 16
    with pytest.raises(InvalidArgument):
        Cluster(tmp_path, num_slots=16).core.register("", "x:1", "b")


# --- failure detection and failover -------------------------------------------------------------------------
def test_silent_server_declared_dead_and_slots_recovered(tmp_path):
    c = started(tmp_path, ("a", "b", "c"))
    before = c.map
    led_by_c = np.flatnonzero(before.leads(2))
    replica_of = {int(s): int(before.copies[s, 1]) for s in led_by_c}
    # a stops hearing from c; just under the timeout nothing happens
    c.advance(TIMEOUT, alive=("a", "b"))
    assert c.map.servers[2].up and c.map.epoch == before.epoch
    epochs = [c.map.epoch]
    c.advance(1.0, alive=("a", "b"))
    m = c.map
    assert not m.servers[2].up and not m.holds(2).any()
    assert m.epoch >= epochs[-1] + 2  # declared dead (failover), then re-replication
    assert_valid(m)
    for s, r in replica_of.items():
        assert m.copies[s, 0] == r, f"slot {s}: failed over to {m.copies[s, 0]}, in-sync replica was {r}"
    # every slot again has 2 copies (only a and b are up), the new ones catching up
    assert ((m.copies >= 0).sum(axis=1) == 2).all()
    assert (m.in_sync_count() >= 1).all()
    catching = (m.copies >= 0) & (m.states == CATCHING_UP)
    assert catching.any()
    assert (m.slot_epochs[catching.any(axis=1)] > before.epoch).all()
    untouched = ~before.holds(2)
    np.testing.assert_array_equal(m.slot_epochs[untouched], before.slot_epochs[untouched])
    # the primaries report their copies caught up
    epoch = m.epoch
    assert c.catch_up_all() > 0
    m = c.map
    assert m.epoch > epoch and (m.in_sync_count() == 2).all() and (m.states[m.copies >= 0] == IN_SYNC).all()
    assert m.summary()["degraded_slots"] == 0
    assert [x.epoch for x in c.announced] == sorted({x.epoch for x in c.announced})


def test_failover_never_promotes_a_catching_up_copy(tmp_path):
    c = started(tmp_path, ("a", "b", "c"))
    m = c.map
    led_by_c = np.flatnonzero(m.leads(2))
    demoted = led_by_c[: len(led_by_c) // 2]
    on_a = demoted[m.copies[demoted, 1] == 0]
    on_b = demoted[m.copies[demoted, 1] == 1]
    for target, slots in (("a", on_a), ("b", on_b)):
        if slots.size:
            assert c.core.copy_failed("c", target, slots, "stream broke") == (True, "")
    assert (c.map.in_sync_count()[demoted] == 1).all()
    c.advance(TIMEOUT + 1, alive=("a", "b"))
    m = c.map
    assert not m.servers[2].up
    assert (m.copies[demoted, 0] == NO_SERVER).all(), "a catching-up copy must not lead"
    kept = np.setdiff1d(led_by_c, demoted)
    assert (m.copies[kept, 0] >= 0).all()
    assert m.summary()["unavailable_slots"] == demoted.size
    assert_valid(m)


def test_copy_caught_up_is_checked(tmp_path):
    c = started(tmp_path, ("a", "b", "c"))
    c.advance(TIMEOUT + 1, alive=("a", "b"))
    m = c.map
    catching = np.flatnonzero(m.copy_state(1) == CATCHING_UP)  # copies on b catching up
    assert catching.size
    primary = int(m.copies[catching[0], 0])
    assert (m.copies[catching, 0] == 0).all()  # only a and b are up: a leads the slots b is building
    epoch = m.epoch
    # from a non-primary: b about its own copies, c (dead) about them
    ok, _ = c.core.copy_caught_up("b", "b", catching)
    assert not ok
    in_sync = np.flatnonzero((m.copy_state(1) == IN_SYNC) & m.leads(0))  # b's in-sync copies of a's slots
    ok, _ = c.core.copy_caught_up("a", "b", in_sync)
    assert not ok
    ok, _ = c.core.copy_caught_up("zz", "b", catching)
    assert not ok
    ok, _ = c.core.copy_caught_up("a", "c", catching)  # c is dead
    assert not ok
    assert c.map.epoch == epoch
    # a stale report: of a slot copy started before these copies became catching up (a retried report
    # of an earlier copy, arriving after a demotion) must not mark a half-built copy in sync
    since = c.core.catching_since[(int(catching[0]), 1)]
    ok, msg = c.core.copy_caught_up(m.servers[primary].id, "b", catching[:1], since - 1)
    assert not ok and msg.startswith("stale")
    # the right report
    ok, msg = c.core.copy_caught_up(m.servers[primary].id, "b", catching[:1], m.epoch)
    assert ok, msg
    assert c.map.copy_state(1)[catching[0]] == IN_SYNC and c.map.epoch > epoch


def test_copy_failed_demotes_only_the_reporters_slots(tmp_path):
    c = started(tmp_path, ("a", "b", "c"), replicas=2)
    m = c.map
    assert (m.states == IN_SYNC).all() and m.width == 3
    every = np.arange(SLOTS)
    # from a non-primary (c reports about b for slots c does not lead): nothing changes
    not_c = np.flatnonzero(~m.leads(2))
    assert c.core.copy_failed("c", "b", not_c, "x")[0]
    assert c.map.epoch == m.epoch
    assert not c.core.copy_failed("zz", "b", every, "x")[0]
    # from the primary a, about b, for every slot: only the slots a leads are demoted, only b's copies
    ok, msg = c.core.copy_failed("a", "b", every, "stream broke")
    assert ok and msg == ""
    m2 = c.map
    assert m2.epoch == m.epoch + 1
    led = m.leads(0)
    assert (m2.copy_state(1)[led] == CATCHING_UP).all()
    assert (m2.copy_state(1)[~led] == IN_SYNC).all()
    for other in (0, 2):
        assert (m2.copy_state(other) == IN_SYNC).all()
    np.testing.assert_array_equal(m2.copies, m.copies)
    assert (m2.slot_epochs[led] == m2.epoch).all() and (m2.slot_epochs[~led] == m.slot_epochs[~led]).all()
    # again: nothing left to demote
    assert c.core.copy_failed("a", "b", every, "x") == (True, "nothing to demote")
    assert c.map.epoch == m2.epoch


def test_copy_failed_about_itself_keeps_the_primary_in_sync(tmp_path):
    """A primary is in sync by definition, even in a map of width 1 (one copy per slot)."""
    c = started(tmp_path, ("a",), replicas=0)
    c.core.copy_failed("a", "a", np.arange(SLOTS), "odd report")
    assert (c.map.states == IN_SYNC).all() and (c.map.in_sync_count() == 1).all()


# --- restarts -----------------------------------------------------------------------------------------------
def test_restarted_server_is_demoted(tmp_path):
    c = started(tmp_path, ("a", "b", "c"))
    m = c.map
    epoch = m.epoch
    c.register("b", boot="b-boot2")
    m2 = c.map
    assert m2.epoch > epoch and m2.servers[1].boot == "b-boot2" and m2.servers[1].up
    assert_valid(m2)
    assert not m2.leads(1).any(), "a restarted server never leads while an in-sync copy exists"
    for s in np.flatnonzero(m.leads(1)):
        assert m2.copies[s, 0] == m.copies[s, 1]  # its in-sync replica took over
    assert (m2.copy_state(1)[m.holds(1)] == CATCHING_UP).all()
    np.testing.assert_array_equal(m2.holds(1), m.holds(1))  # it keeps its copies, to rebuild them
    assert (m2.in_sync_count() >= 1).all()
    assert c.catch_up_all() > 0
    assert (c.map.states[c.map.copies >= 0] == IN_SYNC).all()


def positions(slots, epoch, index, table="emb"):
    return {table: {int(s): (epoch, index) for s in slots}}


def test_all_servers_restarted_unclean_election_newest_wins(tmp_path):
    c = started(tmp_path, ("a", "b"))
    c.core.create_table(spec(), exist_ok=False)
    every = np.arange(SLOTS)
    a_newer = every[every % 2 == 0]
    # a comes back first: its slots fail over to b, still in sync
    pos_a = {"emb": {**{int(s): (3, 9) for s in a_newer}, **{int(s): (3, 2) for s in every if s % 2}}}
    c.register("a", boot="a2", positions=pos_a)
    assert (c.map.copies[:, 0] == 1).all()
    # b comes back too: no in-sync copy anywhere; every server is back, so the election runs at once
    pos_b = {"emb": {int(s): (3, 5) for s in every}}
    c.register("b", boot="b2", positions=pos_b)
    m = c.map
    assert_valid(m)
    np.testing.assert_array_equal(m.copies[a_newer, 0], 0)
    np.testing.assert_array_equal(m.copies[every % 2 == 1, 0], 1)
    assert ((m.copies >= 0).sum(axis=1) == 2).all()  # the loser keeps a copy, catching up
    assert (m.in_sync_count() == 1).all()
    assert m.summary()["unavailable_slots"] == 0


def test_unclean_election_waits_for_every_server_or_the_timeout(tmp_path):
    c = started(tmp_path, ("a", "b", "c"))
    c.core.create_table(spec(), exist_ok=False)
    # c dies; the others catch up so every slot has 2 in-sync copies on a and b
    c.advance(TIMEOUT + 1, alive=("a", "b"))
    c.catch_up_all()
    assert (c.map.in_sync_count() == 2).all()
    every = np.arange(SLOTS)
    c.register("a", boot="a2", positions=positions(every, 4, 1))
    c.register("b", boot="b2", positions=positions(every[:SLOTS // 2], 4, 7))
    m = c.map
    assert (m.copies[:, 0] == NO_SERVER).all(), "no in-sync copy left: no primary"
    assert ((m.copies >= 0).sum(axis=1) == 2).all()
    t_orphan = c.t[0]
    c.advance(2 * TIMEOUT - 1.0, alive=("a", "b"))  # c (dead) is not back: wait
    assert (c.map.copies[:, 0] == NO_SERVER).all()
    c.advance(1.5, alive=("a", "b"))
    assert c.t[0] - t_orphan >= 2 * TIMEOUT
    m = c.map
    assert_valid(m)
    np.testing.assert_array_equal(m.copies[: SLOTS // 2, 0], 1)  # b's rows are newer there
    np.testing.assert_array_equal(m.copies[SLOTS // 2:, 0], 0)  # only a has rows
    assert m.summary()["unavailable_slots"] == 0


def test_unclean_election_without_rows_starts_empty(tmp_path):
    c = started(tmp_path, ("a", "b"))
    c.advance(TIMEOUT + 1, alive=("a",))  # b dies: a leads everything, alone
    assert (c.map.copies[:, 0] == 0).all()
    c.register("a", boot="a2")  # no positions: it lost everything
    assert (c.map.copies[:, 0] == NO_SERVER).all()
    c.advance(2 * TIMEOUT + 1, alive=("a",))
    assert (c.map.copies[:, 0] == 0).all()
    assert_valid(c.map)


def test_unclean_election_keeps_at_most_one_plus_replicas_copies(tmp_path):
    c = started(tmp_path, ("a", "b"), replicas=0)
    c.core.create_table(spec(), exist_ok=False)
    c.register("b", boot="b2")  # no rows of its slots (no positions): every copy of them is gone
    c.catch_up_all()
    c.advance(2 * TIMEOUT + 1, alive=("a", "b"))
    assert_valid(c.map)
    assert ((c.map.copies >= 0).sum(axis=1) <= 1).all(), c.map.copies.tolist()


# --- heartbeats ---------------------------------------------------------------------------------------------
def test_heartbeat_answers(tmp_path):
    c = started(tmp_path, ("a", "b"))
    m = c.map
    assert c.core.heartbeat("zz", "x", 0) == (None, True)
    assert c.core.heartbeat("a", "stale-boot", 0) == (None, True)
    assert c.core.heartbeat("a", c.boots["a"], m.epoch) == (None, False)
    assert c.core.heartbeat("a", c.boots["a"], m.epoch + 5) == (None, False)
    got, again = c.core.heartbeat("a", c.boots["a"], m.epoch - 1)
    assert got is m and not again
    assert c.core.heartbeat("b", c.boots["b"], m.epoch, {"rows": 5.0})[1] is False
    assert c.core.stats["b"] == {"rows": 5.0}
    assert c.map.epoch == m.epoch


def test_paused_server_comes_back_empty_and_is_used(tmp_path):
    c = started(tmp_path, ("a", "b"))
    c.advance(TIMEOUT + 1, alive=("a",))
    m = c.map
    assert not m.servers[1].up and (m.copies[:, 0] == 0).all() and m.width == 1
    epoch = m.epoch
    got, again = c.core.heartbeat("b", c.boots["b"], 0)  # same boot: it was paused
    assert not again and got is c.map
    m = c.map
    assert m.servers[1].up and m.epoch >= epoch + 2
    assert_valid(m)
    assert not m.leads(1).any() and m.holds(1).all()
    assert (m.copy_state(1) == CATCHING_UP).all()  # back empty: every copy is rebuilt
    c.catch_up_all()
    assert (c.map.in_sync_count() == 2).all()


def test_dead_server_registering_with_same_boot_is_back(tmp_path):
    c = started(tmp_path, ("a", "b"))
    c.advance(TIMEOUT + 1, alive=("a",))
    c.register("b")
    assert c.map.servers[1].up and (c.map.copy_state(1) == CATCHING_UP).all()


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
    assert_valid(c2.map)


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
    core = SchedulerCore(SchedulerConfig(num_slots=8), FileMapStore(tmp_path / "s"))  # the real clock
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
