"""Log positions: per table and slot, the position (epoch, index) of the last write a server holds.

A primary stamps each write with (its map epoch, next index) and sends, per slot, the position the target
must be at (``prev``). A target applies an item only when its positions equal ``prev`` for every slot, so a
gap or a divergence (a write the new primary never had) is detected, never silently applied or lost.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NO_POSITION", "SlotLog"]

NO_POSITION = np.iinfo(np.uint64).max  # a slot this server holds no copy of: matches no prev


class SlotLog:
    """Log positions of one table on one server: (num_slots, 2) uint64 (epoch, index) and the index counter.
    Not thread-safe: used under the table's write lock."""

    def __init__(self, num_slots: int) -> None:
        self.positions = np.zeros((num_slots, 2), np.uint64)
        self.counter = 0

    def stamp(self, slots: np.ndarray, epoch: int) -> tuple[tuple[int, int], np.ndarray]:
        """A primary's write touching ``slots``: its position and the slots' previous positions."""
        self.counter += 1
        prev = self.positions[slots].copy()
        self.positions[slots, 0] = epoch
        self.positions[slots, 1] = self.counter
        return (epoch, self.counter), prev

    def advance(self, slots: np.ndarray, lsn: tuple[int, int]) -> None:
        """A target applied a write at ``lsn`` touching ``slots``."""
        self.positions[slots, 0] = lsn[0]
        self.positions[slots, 1] = lsn[1]
        self.counter = max(self.counter, int(lsn[1]))

    def matches(self, slots: np.ndarray, prev: np.ndarray) -> np.ndarray:
        """(k,) bool: the slots whose position equals ``prev`` ((k, 2))."""
        return (self.positions[slots] == prev).all(axis=1)

    def reset(self, slots: np.ndarray, positions: np.ndarray | None = None) -> None:
        """Slots dropped (no position) or starting a copy at ``positions``."""
        if positions is None:
            self.positions[slots] = NO_POSITION
        else:
            self.positions[slots] = positions
            if positions.size:
                self.counter = max(self.counter, int(positions[:, 1][positions[:, 1] != NO_POSITION].max(
                    initial=0)))

    def to_bytes(self, keep: np.ndarray | None = None) -> bytes:
        """The positions (those outside the bool mask ``keep`` as 0: unknown) and the counter."""
        positions = self.positions if keep is None else np.where(keep[:, None], self.positions, 0)
        return np.concatenate([positions.reshape(-1), np.array([self.counter], np.uint64)]).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, num_slots: int) -> SlotLog:
        a = np.frombuffer(data, np.uint64)
        if a.shape[0] != num_slots * 2 + 1:
            raise ValueError(f"slot log of {(a.shape[0] - 1) // 2} slots, the server has {num_slots}")
        out = cls(num_slots)
        out.positions = a[:-1].reshape(num_slots, 2).copy()
        out.counter = int(a[-1])
        return out
