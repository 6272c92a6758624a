"""Failure domains in the scheduler's core (``SchedulerCore`` through ``scheduler_harness``, no sockets): servers
register with their domain, placement keeps a slot's copies on distinct hosts, the domain-degraded slots are
counted (status, figures), a drain that would put a slot's copies into one domain is refused, and the domain
survives in the persisted state (a state saved before domains loads as unknown)."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_harness import SLOTS, Cluster, assert_valid

from tigana.proto import scheduler_pb2 as spb
from tigana.ps import domains
from tigana.ps.domains import FailureDomain
from tigana.ps.errors import InvalidArgument
from tigana.ps.scheduler.stores.file import decode_state, encode_state

X, Y = FailureDomain(zone="z1", host="x"), FailureDomain(zone="z1", host="y")
LAYOUT = {"a": X, "b": X, "c": Y, "d": Y}


def host_groups(c: Cluster) -> np.ndarray:
    return domains.group_ids([s.domain for s in c.map.servers], "host")


def apart(c: Cluster) -> bool:
    """Every slot's copies on distinct hosts."""
    return not domains.collapsed(c.map.copies, host_groups(c)).any()


def two_hosts(tmp_path, first=("a", "b", "c", "d"), **config) -> Cluster:
    config.setdefault("expect_servers", len(first))
    c = Cluster(tmp_path, **config)
    for s in first:
        c.register(s, domain=LAYOUT[s])
    c.core.tick()  # a running scheduler has ticked (its first tick forgives the time since its start)
    return c


def test_first_placement_puts_the_copies_of_a_slot_on_two_hosts(tmp_path):
    c = two_hosts(tmp_path)
    assert_valid(c.map)
    assert (c.map.copies >= 0).all() and c.map.width == 2
    assert [s.domain for s in c.map.servers] == [X, X, Y, Y]
    assert apart(c), c.map.copies.tolist()
    st = c.core.status()
    assert st.domain_level == "host" and st.domain_degraded_slots == 0
    assert c.core.figures()["slots_domain_degraded"] == 0
    assert [s.info.domain.host for s in st.servers] == ["x", "x", "y", "y"]


def test_servers_of_a_second_host_joining_later_get_one_copy_of_every_slot(tmp_path):
    """The first placement came when only host x had registered (both copies there: domain-degraded); once
    host y's servers join, the map moves until every slot has a copy on each host."""
    c = two_hosts(tmp_path, first=("a", "b"), expect_servers=2)
    assert not apart(c)
    assert c.core.status().domain_degraded_slots == SLOTS  # two copies, one host: loud
    c.register("c", domain=Y)
    c.register("d", domain=Y)
    c.run_to_target()
    assert_valid(c.map)
    assert apart(c), c.map.copies.tolist()
    assert c.core.figures()["slots_domain_degraded"] == 0
    _, total = np.unique(c.map.copies, return_counts=True)
    assert total.max() - total.min() <= 1  # still balanced


def test_copies_are_spread_over_hosts_without_auto_rebalance_too(tmp_path):
    """Spreading copies over domains restores protection, as re-replication does: not left to the operator."""
    c = two_hosts(tmp_path, first=("a", "b"), expect_servers=2, auto_rebalance=False)
    c.register("c", domain=Y)
    c.register("d", domain=Y)
    c.run_to_target()
    assert apart(c), c.map.copies.tolist()


def test_losing_a_host_makes_every_slot_domain_degraded(tmp_path):
    c = two_hosts(tmp_path)
    c.kill("c")
    c.kill("d")
    c.run_to_target()
    c.catch_up_all()
    c.advance(1.0)
    assert_valid(c.map)
    assert (c.map.in_sync_count() == 2).all()  # re-replicated, on host x alone
    st = c.core.status()
    assert st.domain_level == "server" and st.domain_degraded_slots == SLOTS
    assert c.core.figures()["slots_domain_degraded"] == SLOTS


def test_drain_that_would_put_copies_on_one_host_is_refused_naming_slot_and_domain(tmp_path):
    c = two_hosts(tmp_path)
    c.core.drain("a")  # b is left on host x: every slot can keep a copy on each host
    c.run_to_target()
    assert apart(c) and not c.map.holds(0).any()
    epoch, draining = c.map.epoch, set(c.core.draining)
    with pytest.raises(InvalidArgument, match=r"drain: 'b': slot \d+'s copies would share host zone=z1,host=y") as err:
        c.core.drain("b")
    assert "another domain" in str(err.value)
    assert c.map.epoch == epoch and set(c.core.draining) == draining and c.core.target is None  # nothing changed
    c.register("e", domain=FailureDomain(zone="z1", host="w"))  # a third host: now b may go
    c.run_to_target()
    c.core.drain("b")
    c.run_to_target()
    assert apart(c) and not c.map.holds(1).any()


def test_drain_on_one_host_is_not_refused(tmp_path):
    """Every server on one machine (a laptop): the copies share the host already; a drain takes nothing away."""
    c = Cluster(tmp_path, expect_servers=3)
    for s in "abc":
        c.register(s, domain=FailureDomain(host="laptop"))
    assert c.core.status().domain_degraded_slots == SLOTS
    c.core.drain("a")
    c.run_to_target()
    assert not c.map.holds(0).any()


def test_a_server_back_with_another_domain_is_placed_by_it(tmp_path):
    c = two_hosts(tmp_path)
    c.register("b", domain=FailureDomain(zone="z1", host="w"))  # same boot: the label changed
    assert c.map.servers[1].domain.host == "w"
    c.register("c", boot="c-boot2", domain=FailureDomain(zone="z1", host="v"))  # restarted elsewhere
    assert c.map.servers[2].domain.host == "v"


def test_the_domain_is_persisted_and_an_old_state_loads_as_unknown(tmp_path):
    c = two_hosts(tmp_path)
    state = c.store.load()
    assert [s.domain for s in state.map.servers] == [X, X, Y, Y]
    old = spb.SchedulerState.FromString(encode_state(state))
    for s in old.map.servers:
        s.ClearField("domain")  # as a scheduler before failure domains wrote it
    loaded = decode_state(old.SerializeToString(), "old")
    assert [s.domain for s in loaded.map.servers] == [FailureDomain()] * 4
    # unknown hosts are each their own: nothing reads as domain-degraded, placement is as before
    assert domains.group_ids([s.domain for s in loaded.map.servers], "host").tolist() == [0, 1, 2, 3]


def test_a_move_that_would_put_both_copies_on_one_host_is_refused(tmp_path):
    c = two_hosts(tmp_path)
    slot = int(np.flatnonzero(c.map.copies[:, 0] == 0)[0])  # led by a (host x); its replica is on host y
    replica = c.map.servers[int(c.map.copies[slot, 1])].id
    other_y = next(s for s in ("c", "d") if s != replica)
    epoch = c.map.epoch
    with pytest.raises(InvalidArgument, match=rf"move-slot: slot {slot}'s copies would share host zone=z1,host=y"):
        c.core.move_slot(slot, other_y)  # the primary's copy to host y, where the replica is
    assert c.core.target is None and c.map.epoch == epoch
    c.core.move_slot(slot, "b")  # within host x: the copies stay apart
    c.run_to_target()
    assert apart(c) and c.map.copies[slot, 0] == 1
