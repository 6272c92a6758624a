"""When a sync write that waited for its copies may be acknowledged (``Writes._check_unmoved``, invariant S1).

Copies added, demoted or dropped while it waited do not make it start again (they used to: every sync write
in flight during a rebalance, a map every 0.1 s, was answered UNAVAILABLE and retried, and the clients
stalled for seconds). A change of primary, or the slot dropped and held again (its rows deleted and rebuilt),
does. The simulator (``tests/sim``) and ``bench nemesis`` check S1 itself under these rules."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tigana.ps.errors import Unavailable
from tigana.ps.routing import CATCHING_UP, IN_SYNC, NO_SERVER, ServerEntry, ShardMap
from tigana.ps.shard.ownership import _View
from tigana.ps.shard.writes import Writes

SLOTS = 8
ME = 0


def _map(base: ShardMap, copies: list[list[int]], states: list[list[int]]) -> ShardMap:
    width = max(len(r) for r in copies)
    c = np.full((SLOTS, width), NO_SERVER, np.int32)
    s = np.zeros((SLOTS, width), np.uint8)
    for slot in range(SLOTS):  # slots 0-3 are the write's; the others keep their first row
        row, st = (copies[slot], states[slot]) if slot < len(copies) else (copies[0], states[0])
        c[slot, :len(row)], s[slot, :len(st)] = row, st
    return base.evolve(copies=c, states=s)


def _views(*maps: ShardMap) -> list[_View]:
    out, old = [], _View.waiting(SLOTS)
    for m in maps:
        old = _View.of(m, ME, True).held_from(old)
        out.append(old)
    return out


def _check(view: _View, now: _View) -> None:
    Writes._check_unmoved(SimpleNamespace(_view=now), "emb", view, np.arange(4))


@pytest.fixture
def base() -> ShardMap:
    servers = tuple(ServerEntry(s, f"h{s}:1", f"{s}1", True) for s in "abc")
    return ShardMap.empty(SLOTS, 1, "c1").evolve(servers=servers)


def test_copies_added_demoted_or_dropped_while_it_waited_need_no_retry(base: ShardMap) -> None:
    at_write = _map(base, [[ME, 1]], [[IN_SYNC, IN_SYNC]])
    added = _map(at_write, [[ME, 1, 2]], [[IN_SYNC, IN_SYNC, CATCHING_UP]])  # a move starts a copy on c
    joined = _map(added, [[ME, 1, 2]], [[IN_SYNC, IN_SYNC, IN_SYNC]])  # it joins the in-sync set
    dropped = _map(joined, [[ME, 2]], [[IN_SYNC, IN_SYNC]])  # the old copy leaves
    demoted = _map(dropped, [[ME, 2]], [[IN_SYNC, CATCHING_UP]])  # a copy failed
    views = _views(at_write, added, joined, dropped, demoted)
    for now in views:
        _check(views[0], now)


def test_a_change_of_primary_or_a_slot_dropped_and_held_again_means_retry(base: ShardMap) -> None:
    at_write = _map(base, [[ME, 1]], [[IN_SYNC, IN_SYNC]])
    handed = _map(at_write, [[1, ME]], [[IN_SYNC, IN_SYNC]])  # the primary role moved to b
    view, now = _views(at_write, handed)
    with pytest.raises(Unavailable, match=r"'emb'.*no longer leads"):
        _check(view, now)
    lost = _map(at_write, [[1, 2]], [[IN_SYNC, CATCHING_UP]])  # declared dead: its copies left the map
    back = _map(lost, [[1, 2, ME]], [[IN_SYNC, CATCHING_UP, CATCHING_UP]])  # rebuilt from b
    leads_again = _map(back, [[ME, 1, 2]], [[IN_SYNC, IN_SYNC, CATCHING_UP]])  # and led again
    views = _views(at_write, lost, back, leads_again)
    assert views[-1].leads[:4].all() and (views[-1].held_since[:4] > at_write.epoch).all()
    with pytest.raises(Unavailable, match="no longer leads"):
        _check(views[0], views[-1])
    _check(views[-1], views[-1])  # the same map: nothing to check
