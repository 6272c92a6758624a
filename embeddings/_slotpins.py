"""``SlotPins``: the spill slots whose records open cuts still have to read, kept from reuse until they have.

A row that spills while a cut is open, or leaves the spill tier before the cut has read it, is read by the cut
from the spill file, not kept in RAM (``Cut``): the cut parks the row's slot, whose record holds the row as of
the cut. The table frees a slot when its row leaves the tier (or never held it: a record written for the cuts
alone); a pinned slot does not go back to the ``SpillFile`` then, so the file cannot write another row over the
record, but when the last cut holding it lets go of it (read it, or closed).

One byte a slot, allocated at the first pin and dropped once no slot is pinned (no cut is open, or none parked a
row): bits 0-6 count the cuts holding the slot (a cut pins a slot at most once, and a table has at most
``MAX_CUTS`` cuts open), bit 7 says the table no longer holds the record. Not thread-safe: the table holds its
lock around every call.
"""

from __future__ import annotations

import numpy as np

MAX_CUTS = 127  # cuts open at once on one table: the pins' count bits
_FREED = np.uint8(0x80)
_COUNT = np.uint8(0x7F)


class SlotPins:
    """Pin counts of spill slots, and the slots the table let go of while pinned; see the module docstring."""

    def __init__(self) -> None:
        self._pins = np.zeros(0, np.uint8)
        self._pinned = 0  # slots with a count > 0

    @property
    def nbytes(self) -> int:
        return int(self._pins.nbytes)

    def pin(self, slots: np.ndarray) -> None:
        """One more cut holds each of the unique ``slots``."""
        if not slots.size:
            return
        need = int(slots.max()) + 1
        if need > self._pins.shape[0]:
            grown = np.zeros(max(need, self._pins.shape[0] + self._pins.shape[0] // 4, 1024), np.uint8)
            grown[:self._pins.shape[0]] = self._pins
            self._pins = grown
        self._pinned += int(((self._pins[slots] & _COUNT) == 0).sum())
        self._pins[slots] += np.uint8(1)

    def free(self, slots: np.ndarray) -> np.ndarray:
        """The table lets go of the records at unique ``slots``: -> those no cut holds (free them now); the
        others are marked, and come back from ``release`` once the last cut lets go."""
        if not self._pinned or not slots.size:
            return slots
        held = np.zeros(slots.shape[0], bool)
        inside = slots < self._pins.shape[0]
        held[inside] = (self._pins[slots[inside]] & _COUNT) > 0
        self._pins[slots[held]] |= _FREED
        return slots[~held]

    def release(self, slots: np.ndarray) -> np.ndarray:
        """A cut lets go of unique ``slots`` it pinned: -> those no longer held by anyone (free them now)."""
        if not slots.size:
            return slots
        pins = self._pins[slots] - np.uint8(1)
        done = (pins & _COUNT) == 0
        self._pinned -= int(done.sum())
        gone = done & ((pins & _FREED) != 0)
        pins[done] = 0
        self._pins[slots] = pins
        if not self._pinned:
            self._pins = np.zeros(0, np.uint8)  # no cut holds a slot: give the bytes back
        return slots[gone]
