"""Placement over failure domains (``tigana.ps.domains`` with ``tigana.ps.scheduler.placement``): pure, no sockets.

Property tests draw clusters whose servers sit in zones, racks and hosts, and check: every slot's copies are
in distinct domains at the widest level that has enough of them; a slot is domain-degraded exactly when no
level has enough; on a regular topology (every host the same size, every rack the same hosts...) balance still
evens the primaries and copies to max - min <= 1, as without domains (relaying a copy through a third server
where the domains forbid every direct move).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tigana.ps import domains
from tigana.ps.domains import FailureDomain
from tigana.ps.routing import NO_SERVER
from tigana.ps.scheduler import placement

SETTINGS = settings(max_examples=60, deadline=None)


def present(row: np.ndarray) -> list[int]:
    return [int(x) for x in row if x >= 0]


def random_domains(rng: np.random.Generator, n: int) -> list[FailureDomain]:
    """Each server in one of 1-3 zones, 1-2 racks a zone, 1-3 hosts a rack; some hosts unknown."""
    zones, racks, hosts = (int(rng.integers(1, k + 1)) for k in (3, 2, 3))
    out = []
    for _ in range(n):
        host = f"h{rng.integers(hosts)}" if rng.random() > 0.1 else ""
        out.append(FailureDomain(f"z{rng.integers(zones)}", f"r{rng.integers(racks)}", host))
    return out


def regular_domains(zones: int, racks: int, hosts: int, per_host: int) -> list[FailureDomain]:
    return [FailureDomain(f"z{z}", f"r{r}", f"h{h}") for z in range(zones) for r in range(racks)
            for h in range(hosts) for _ in range(per_host)]


def check_target(t: np.ndarray, alive: np.ndarray, replicas: int, doms: list[FailureDomain]) -> str:
    """The domain properties of a balanced target; returns the level used."""
    want = 1 + min(replicas, int(alive.sum()) - 1)
    groups, level = domains.groups_for(doms, alive, want)
    for slot, row in enumerate(t):
        got = present(row)
        assert len(got) == want and len(set(got)) == want and alive[got].all(), (slot, row.tolist())
    # the level is the widest with enough domains among the alive servers
    for wider in domains.LEVELS[:domains.LEVELS.index(level) if level in domains.LEVELS else 3]:
        assert np.unique(domains.group_ids(doms, wider)[alive]).size < want, (wider, level)
    if level != "server":
        assert np.unique(groups[alive]).size >= want
        bad = np.flatnonzero(domains.collapsed(t, groups))
        assert bad.size == 0, f"level {level}: slots {bad[:5].tolist()} share a domain: {t[bad[:5]].tolist()}"
    degraded, judged_level = domains.degraded_slots(t, t >= 0, doms, alive, want)
    assert judged_level == level
    if level == "server" and want > 1:
        assert degraded.all(), "no level has enough domains: every slot is domain-degraded"
    else:
        assert not degraded.any(), f"level {level}: slots {np.flatnonzero(degraded)[:5].tolist()} degraded"
    return level


@SETTINGS
@given(n=st.integers(1, 8), num_slots=st.integers(16, 96), replicas=st.integers(0, 3),
       seed=st.integers(0, 2**32 - 1))
# Evening the copies put a replica where a primary role could then move for free: balance evens the roles again.
@example(n=8, num_slots=21, replicas=1, seed=14910)
def test_balance_puts_copies_in_distinct_domains(n, num_slots, replicas, seed):
    rng = np.random.default_rng(seed)
    doms = random_domains(rng, n)
    alive = rng.random(n) > 0.25
    if not alive.any():
        alive[int(rng.integers(n))] = True
    want = 1 + min(replicas, int(alive.sum()) - 1)
    groups, _ = domains.groups_for(doms, alive, want)
    start = placement.initial(n, num_slots, replicas)
    t = placement.balance(start, alive, replicas, groups=groups)
    check_target(t, alive, replicas, doms)
    # balancing a balanced placement again moves nothing
    assert placement.moves(t, placement.balance(t, alive, replicas, groups=groups)) == []


@SETTINGS
@given(zones=st.integers(1, 3), racks=st.integers(1, 2), hosts=st.integers(1, 3), per_host=st.integers(1, 3),
       num_slots=st.integers(16, 96), replicas=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
# Four hosts of three servers, three copies: every slot on the busiest server already has a copy on the idlest
# one's host, so evening out needs a copy relayed through a third server.
@example(zones=1, racks=2, hosts=2, per_host=3, num_slots=16, replicas=2, seed=1)
def test_balance_stays_even_on_a_regular_topology(zones, racks, hosts, per_host, num_slots, replicas, seed):
    """Every domain of a level the same size: the domain rule costs no balance (max - min <= 1, as before)."""
    doms = regular_domains(zones, racks, hosts, per_host)
    n = len(doms)
    alive = np.ones(n, bool)
    rng = np.random.default_rng(seed)
    start = rng.permutation(n)[placement.initial(n, num_slots, replicas)].astype(np.int32)
    want = 1 + min(replicas, n - 1)
    groups, _ = domains.groups_for(doms, alive, want)
    t = placement.balance(start, alive, replicas, groups=groups)
    check_target(t, alive, replicas, doms)
    prim, total = placement.copy_counts(t, n)
    assert prim.max() - prim.min() <= 1, prim.tolist()
    assert total.max() - total.min() <= 1, total.tolist()


@SETTINGS
@given(n=st.integers(2, 8), num_slots=st.integers(16, 64), replicas=st.integers(1, 2),
       seed=st.integers(0, 2**32 - 1))
def test_repair_adds_copies_in_a_domain_the_slot_lacks(n, num_slots, replicas, seed):
    """A lost copy is replaced in a domain the slot has no copy in wherever an alive server offers one."""
    rng = np.random.default_rng(seed)
    doms = random_domains(rng, n)
    alive = np.ones(n, bool)
    want = 1 + min(replicas, n - 1)
    groups, level = domains.groups_for(doms, alive, want)
    t = placement.balance(placement.initial(n, num_slots, replicas), alive, replicas, groups=groups)
    dead = int(rng.integers(n))
    alive[dead] = False
    if not alive.any():
        return
    c, _ = placement.repair(t, np.zeros(t.shape, np.uint8), alive, replicas, groups=groups)
    for slot in range(num_slots):
        row = present(c[slot])
        if dead not in present(t[slot]) or not row:
            continue
        have = set(groups[row].tolist())
        spare = {int(groups[s]) for s in np.flatnonzero(alive) if s not in row}
        assert len(have) == len(row) or not (spare - have), (slot, c[slot].tolist())


def test_two_hosts_of_two_servers_split_every_slot():
    """The real-daemon layout: four servers on two hosts, one replica: each slot has a copy on each host."""
    doms = [FailureDomain(host="a"), FailureDomain(host="a"), FailureDomain(host="b"), FailureDomain(host="b")]
    alive = np.ones(4, bool)
    groups, level = domains.groups_for(doms, alive, 2)
    assert level == "host" and groups.tolist() == [0, 0, 1, 1]
    start = placement.initial(4, 64, 1)  # servers 0 and 1 hold copies of each other's slots
    assert domains.collapsed(start, groups).any()
    t = placement.balance(start, alive, 1, groups=groups)
    assert not domains.collapsed(t, groups).any()
    assert sorted(placement.copy_counts(t, 4)[1].tolist()) == [32, 32, 32, 32]


def test_one_host_is_domain_degraded_and_placed_as_before():
    doms = [FailureDomain(host="laptop")] * 3
    alive = np.ones(3, bool)
    groups, level = domains.groups_for(doms, alive, 2)
    assert level == "server"
    start = placement.initial(3, 32, 1)
    assert np.array_equal(placement.balance(start, alive, 1, groups=groups), placement.balance(start, alive, 1))
    degraded, _ = domains.degraded_slots(start, start >= 0, doms, alive, 2)
    assert degraded.all()
    single = start.copy()
    single[:, 1] = NO_SERVER  # one copy each: nothing shares a host
    assert not domains.degraded_slots(single, single >= 0, doms, alive, 2)[0].any()


def test_unknown_hosts_are_their_own():
    doms = [FailureDomain(), FailureDomain(zone="z"), FailureDomain(zone="z")]
    assert domains.group_ids(doms, "host").tolist() == [0, 1, 2]
    assert domains.choose_level(doms, np.ones(3, bool), 2) == "zone"  # "" and "z" are two zones
    assert domains.choose_level(doms, np.ones(3, bool), 3) == "host"


@pytest.mark.parametrize("text,want", [
    ("zone=a,rack=r1,host=h1", FailureDomain("a", "r1", "h1")),
    (" host=h1 , zone=a ", FailureDomain("a", "", "h1")),
    ("", FailureDomain()),
    ("zone=,host=node-1", FailureDomain(host="node-1")),  # a node without a zone label
])
def test_parse(text, want):
    assert FailureDomain.parse(text) == want
    assert FailureDomain.parse(str(want)) == want


@pytest.mark.parametrize("text,says", [("zone", "expected zone=Z"), ("region=x", "expected zone=Z"),
                                       ("host=a,host=b", "'host' given twice"), ("host=a b", "without")])
def test_parse_refuses_naming_the_field(text, says):
    with pytest.raises(ValueError, match=says) as err:
        FailureDomain.parse(text, field="flag --domain")
    assert "flag --domain" in str(err.value)


def test_primaries_pass_through_a_server_at_its_share_in_batches(monkeypatch):
    """The real-daemon layout once host B's second server joins: every slot on {a1 or a2, b1}. a1 and a2 lead
    everything, and their roles reach b2 only through b1 (which holds every replica): balance moves them two hops
    at once, in batches, not one role per round (4096 slots took 2,051 rounds, seconds under the scheduler's
    lock)."""
    rounds = []
    real = placement._weighted

    def counted(*args, **kwargs):
        rounds.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(placement, "_weighted", counted)
    doms = [FailureDomain(host="a"), FailureDomain(host="a"), FailureDomain(host="b"), FailureDomain(host="b")]
    alive = np.ones(4, bool)
    groups, _ = domains.groups_for(doms, alive, 2)
    start = placement.initial(2, 4096, 1).astype(np.int32)
    start[:, 1] = 2
    t = placement.balance(start, alive, 1, groups=groups)
    prim, total = placement.copy_counts(t, 4)
    assert prim.tolist() == [1024] * 4 and total.tolist() == [2048] * 4
    assert not domains.collapsed(t, groups).any()
    assert len(rounds) < 50, len(rounds)


def test_a_slot_moving_within_a_host_is_not_domain_degraded():
    """Two hosts, two copies wanted: a slot whose copy moves from a1 to a2 holds three in-sync copies on two hosts
    for a moment; losing either host still leaves a copy, so it is not reported. Two copies on one host are."""
    doms = [FailureDomain(host="a"), FailureDomain(host="a"), FailureDomain(host="b")]
    alive = np.ones(3, bool)
    copies = np.array([[0, 2, NO_SERVER],   # one copy per host
                       [0, 2, 1],           # mid-move within host a: three copies, two hosts
                       [0, 1, NO_SERVER],   # both copies on host a
                       [0, 1, 2]], np.int32)  # three copies, two of them counted (the third catching up)
    counted = copies >= 0
    counted[3, 2] = False
    degraded, level = domains.degraded_slots(copies, counted, doms, alive, 2)
    assert level == "host"
    assert degraded.tolist() == [False, False, True, True]
