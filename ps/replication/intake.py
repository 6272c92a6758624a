"""A target's side of the slot copies it is receiving, per table: which copy each slot is being built by, and the
ids that changes removed since that copy began.

A slot copy's rows travel on a lane of their own (``stream``), beside the changes, so a copied row may reach the
target after a change that wrote or removed the same id later on the primary. The rule that keeps the copy
exact (invariant S11 in docs/replication.md): ``SNAPSHOT_BEGIN`` (change lane) empties the slots and names the
copy (``begin``); from then on a change writes whole rows (weights, optimizer state, counters as written), so a
row present in a copying slot is newer than any copied one; a copied row lands only where the id is absent and
no change removed it since the copy began (``admit``); ``SNAPSHOT_END`` (copy lane) ends it (``end``). Rows of
an older copy of the same slots (a copy started again) are moot: their copy is no longer the slot's.

Sans-IO and unlocked: the caller holds the table's write lock.
"""

from __future__ import annotations

import hashlib

import numpy as np

from tigana.ps.routing import slot_of


def copy_token(source: str, generation: int, copy_id: int) -> int:
    """A slot copy's name on the target: its source, stream generation and first ``SNAPSHOT_BEGIN`` seq, as one
    nonzero int64 (0 means no copy)."""
    h = hashlib.blake2b(f"{source}\0{int(generation)}\0{int(copy_id)}".encode(), digest_size=8).digest()
    return (int.from_bytes(h, "little") & ((1 << 62) - 1)) | 1


class CopyIntake:
    """The slot copies a table is receiving: a token per slot (0: none) and the ids removed since each began."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.token = np.zeros(num_slots, np.int64)
        self._removed = np.empty(0, np.int64)  # ids removed by changes in copying slots since their copy began

    def active(self) -> bool:
        return bool(self.token.any())

    def begin(self, slots: np.ndarray, token: int) -> None:
        """``SNAPSHOT_BEGIN`` applied (the slots emptied): ``slots`` are being built by copy ``token``."""
        self._forget(slots)
        self.token[slots] = token

    def removed(self, ids: np.ndarray) -> None:
        """A change removed ``ids``: those in copying slots must not come back with a copied row read before."""
        if ids.size and self.active():
            keep = ids[self.token[slot_of(ids, self.num_slots)] != 0]
            if keep.size:
                self._removed = np.concatenate([self._removed, keep.astype(np.int64)])

    def admit(self, ids: np.ndarray, token: int, present: np.ndarray) -> np.ndarray:
        """(n,) bool: which copied rows of copy ``token`` land: their slot is still built by it, the table does not
        hold the id (``present``: a change wrote it, newer), and no change removed it since the copy began."""
        ok = (self.token[slot_of(ids, self.num_slots)] == token) & ~present
        if ok.any() and self._removed.size:
            ok &= ~np.isin(ids, self._removed)
        return ok

    def end(self, slots: np.ndarray, token: int) -> None:
        """``SNAPSHOT_END`` of copy ``token``: its slots are whole; a slot another copy took meanwhile stays."""
        mine = slots[self.token[slots] == token]
        if mine.size:
            self._forget(mine)
            self.token[mine] = 0

    def drop(self, slots: np.ndarray) -> None:
        """The slots' rows were dropped here (the copy removed): no copy builds them any more."""
        self._forget(slots)
        self.token[slots] = 0

    def _forget(self, slots: np.ndarray) -> None:
        if not self._removed.size or not slots.size:
            return
        mask = np.zeros(self.num_slots, bool)
        mask[slots] = True
        self._removed = self._removed[~mask[slot_of(self._removed, self.num_slots)]]
