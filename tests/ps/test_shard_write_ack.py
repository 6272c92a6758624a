"""When a sync write that waited for its copies may be acknowledged (``view.check_unmoved``, invariant S1).

Copies added, demoted or dropped while it waited do not make it start again (they used to: every sync write
in flight during a rebalance, a map every 0.1 s, was answered UNAVAILABLE and retried, and the clients
stalled for seconds). A change of primary, or the slot dropped and held again (its rows deleted and rebuilt),
does. The simulator (``tests/sim``) and ``bench nemesis`` check S1 itself under these rules. A retry that is
a duplicate in some slots waits for those slots' copies too (a real ``ShardService`` with a copy that never
answers)."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from tigana.embeddings import SGD, TableConfig, Zeros
from tigana.proto import shard_pb2 as pb
from tigana.ps.errors import Unavailable
from tigana.ps.routing import CATCHING_UP, IN_SYNC, NO_SERVER, ServerEntry, ShardMap, TableDef, slot_of
from tigana.ps.shard import ShardService
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.view import View, check_unmoved
from tigana.ps.wire import data as wire

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


def _views(*maps: ShardMap) -> list[View]:
    out, old = [], View.waiting(SLOTS)
    for m in maps:
        old = View.of(m, ME, True).held_from(old)
        out.append(old)
    return out


def _check(view: View, now: View) -> None:
    check_unmoved("emb", view, now, np.arange(4))


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


def _silent_copy_service(copied_slot: int):
    """A real ``ShardService`` leading every slot of a sync table "t"; only ``copied_slot`` has a copy, on a
    server where nothing listens: what is queued for it is never acknowledged (a paused copy)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: connections are refused
    svc = ShardService(ServerConfig(num_slots=SLOTS, scheduler="127.0.0.1:1", ack_timeout_s=0.3,
                                    replication_timeout_s=60.0))
    svc.state = "serving"
    spec = TableDef(TableConfig("t", dim=4, optimizer=SGD(lr=1.0), initializer=Zeros()), durability="sync",
                    created_epoch=1)
    servers = (ServerEntry(svc.server_id, "127.0.0.1:2", svc.boot), ServerEntry("paused", f"127.0.0.1:{port}", "b"))
    copies = np.full((SLOTS, 2), NO_SERVER, np.int32)
    copies[:, 0] = 0
    copies[copied_slot, 1] = 1
    states = np.where(copies >= 0, IN_SYNC, 0).astype(np.uint8)
    svc.install(ShardMap(5, SLOTS, 1, servers, copies, states, np.zeros(SLOTS, np.uint64), {"t": spec}))
    return svc


def _push(ids: np.ndarray, seq: int) -> pb.PushRequest:
    return pb.PushRequest(table="t", ids=wire.encode_ids(ids), grads=wire.encode_rows(-np.ones((ids.size, 4),
                                                                                               np.float32)),
                          client_id="c", seq=seq, epoch=5)


def test_a_partly_duplicate_push_waits_for_the_copies_of_its_applied_slots_too() -> None:
    """A push part whose first attempt reached slot a (its copy has not acknowledged it) is retried, split
    differently, with slot b: b is applied now, a is a duplicate. The retry must not be acknowledged while a's
    copy still lacks the first attempt (S1): only b's marks were awaited, and b has no copy, so it was
    acknowledged at once. The fully duplicate retry waits for a's copy already."""
    ids = np.arange(10_000, dtype=np.int64)
    slots = slot_of(ids, SLOTS)
    a_ids, b_ids = ids[slots == 2][:3], ids[slots == 5][:3]
    svc = _silent_copy_service(2)
    try:
        with pytest.raises(Unavailable, match="not yet by the in-sync copies"):
            svc.writes.push(_push(a_ids, 1))  # applied here, never acknowledged by a's copy
        with pytest.raises(Unavailable, match="not yet by the in-sync copies"):
            svc.writes.push(_push(a_ids, 1))  # the whole retry is a duplicate: it waits for a's copy
        with pytest.raises(Unavailable, match="not yet by the in-sync copies"):
            svc.writes.push(_push(np.concatenate([a_ids, b_ids]), 1))  # a duplicate, b new: still a's copy
        rows = svc.tables.get("t").table.pull(np.concatenate([a_ids, b_ids]), insert=False)
        np.testing.assert_array_equal(rows, np.ones((6, 4)))  # each slot applied once
    finally:
        svc.close_tables()
