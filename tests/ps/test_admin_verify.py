"""``admin.verify`` compares a copy with its primary only at the same log position: a copy that has not yet
applied the primary's last items (asynchronous replication) is read again, and reported ``behind`` if it stays
so, never as a difference; a copy at the primary's position with another checksum differs."""

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
