"""``admin.verify`` compares a copy with its primary only at the same log position: a copy that has not yet
applied the primary's last items (asynchronous replication) is read again, and reported ``behind`` if it stays
so, never as a difference; a copy at the primary's position with another checksum differs. A side with no
position for a slot is behind while its server answers under another map than the scheduler's (not installed
yet, or a newer one the slot left), and differs only when its server is under that very map at the last read."""

from __future__ import annotations

import numpy as np

from tigana.ps.ops.admin import _compare_copies
from tigana.ps.routing import IN_SYNC, NO_SERVER, ServerEntry, ShardMap

SLOTS = 4


def _map() -> ShardMap:
    copies = np.full((SLOTS, 2), NO_SERVER, np.int32)
    copies[:, 0], copies[:, 1] = 0, 1
    servers = (ServerEntry("a", "a:1"), ServerEntry("b", "b:1"))
    return ShardMap(3, SLOTS, 1, servers, copies, np.full((SLOTS, 2), IN_SYNC, np.uint8), np.zeros(SLOTS, np.uint64))


def _info(checksums: list[int], lsn_indexes: list[int], rows: int = 8) -> dict[str, dict[str, np.ndarray]]:
    return {"t": {"slots": np.arange(SLOTS, dtype=np.int32), "checksums": np.array(checksums, np.uint64),
                  "lsn_epochs": np.full(SLOTS, 3, np.uint64), "lsn_indexes": np.array(lsn_indexes, np.uint64),
                  "rows": np.full(SLOTS, rows, np.int64)}}


def test_a_copy_is_compared_only_at_its_primarys_log_position() -> None:
    primary = _info([10, 11, 12, 13], [5, 5, 7, 2])
    copy = _info([10, 99, 50, 13], [5, 5, 6, 2], rows=7)  # slot 1 differs at the same position; slot 2 is behind
    checked, differing, behind = _compare_copies(_map(), {0: primary, 1: copy}, ["t"])
    assert checked == 3
    assert [d["slot"] for d in differing] == [1] and differing[0]["copy"] == "b"
    # what differs is said: the position both are at, and each side's rows
    assert differing[0]["primary_lsn"] == differing[0]["copy_lsn"] == [3, 5]
    assert (differing[0]["primary_rows"], differing[0]["copy_rows"]) == (8, 7)
    assert [(b["slot"], b["primary_lsn"], b["copy_lsn"]) for b in behind] == [(2, [3, 7], [3, 6])]


def test_a_copy_that_caught_up_is_equal() -> None:
    same = _info([10, 11, 12, 13], [5, 5, 7, 2])
    assert _compare_copies(_map(), {0: same, 1: same}, ["t"]) == (4, [], [])


def _without(info: dict[str, dict[str, np.ndarray]], slot: int) -> dict[str, dict[str, np.ndarray]]:
    keep = info["t"]["slots"] != slot
    return {"t": {k: v[keep] for k, v in info["t"].items()}}


def test_a_server_under_another_map_without_the_slot_is_behind_not_differing() -> None:
    """The scheduler's map (epoch 3) gives both servers slot 2; a server that answers under epoch 2 has not
    installed it yet, one under epoch 4 installed a newer map the slot left (a move, a drain): neither is a
    difference, both are read again."""
    full = _info([10, 11, 12, 13], [5, 5, 7, 2])
    for copy_epoch in (2, 4):
        checked, differing, behind = _compare_copies(_map(), {0: full, 1: _without(full, 2)}, ["t"],
                                                     {0: 3, 1: copy_epoch})
        assert (checked, differing) == (3, []), differing
        assert [(b["slot"], b["primary_lsn"], b["copy_lsn"], b["copy_map_epoch"]) for b in behind] == \
            [(2, [3, 7], None, copy_epoch)]
    # the primary's side alike
    checked, differing, behind = _compare_copies(_map(), {0: _without(full, 1), 1: full}, ["t"], {0: 4, 1: 3})
    assert (checked, differing, [(b["slot"], b["primary_lsn"]) for b in behind]) == (3, [], [(1, None)])


def test_a_server_under_the_map_without_a_slot_it_gives_differs_at_the_last_read() -> None:
    """Under the map's own epoch a missing slot is read again (a restarted process answers for a map naming
    its predecessor until the scheduler hears it), and is a difference once the reads are over."""
    full = _info([10, 11, 12, 13], [5, 5, 7, 2])
    infos = {0: full, 1: _without(full, 2)}
    checked, differing, behind = _compare_copies(_map(), infos, ["t"], {0: 3, 1: 3}, final=False)
    assert (checked, differing, [b["slot"] for b in behind]) == (3, [], [2])
    checked, differing, behind = _compare_copies(_map(), infos, ["t"], {0: 3, 1: 3}, final=True)
    assert (checked, behind) == (4, [])
    assert [(d["slot"], d["copy"], d["copy_lsn"], d["copy_rows"]) for d in differing] == [(2, "b", None, None)]


def test_a_copy_without_the_table_is_not_skipped() -> None:
    """A server that holds none of a table it is a copy of (not created there, or dropped) was counted neither
    compared nor behind: under the map's epoch it differs on every slot, under another it is behind."""
    full = _info([10, 11, 12, 13], [5, 5, 7, 2])
    checked, differing, behind = _compare_copies(_map(), {0: full, 1: {}}, ["t"])
    assert (checked, len(differing), behind) == (4, 4, [])
    checked, differing, behind = _compare_copies(_map(), {0: full, 1: {}}, ["t"], {0: 3, 1: 2})
    assert (checked, differing, len(behind)) == (0, [], 4)
