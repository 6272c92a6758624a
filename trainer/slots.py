"""A bounded map from int64 ids to slots of fixed-size arrays, vectorized over whole batches of ids.

The trainer's row cache (``cache``) and the error-feedback store of adaptive compression (``compression``)
keep one row per id in preallocated arrays indexed by slot; this index says which slot holds which id.

Layout: ``keys`` (n,) ascending ids held and ``slot_of_key`` (n,) their slots; ``id_of_slot`` (capacity,) and
``used`` (capacity,) the reverse; a stack of free slots. Invariants: ``keys`` is strictly ascending, the slots
of ``keys`` are distinct and ``used``, every unused slot is on the free stack exactly once, so
n + free == capacity. Lookups are one ``searchsorted`` (O(m log n)); adds and removals rebuild the two sorted
arrays in O(n + m) (``np.insert`` / a mask), never row by row. Payload rows never move.

Not thread-safe: its owner calls it from one thread.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SlotIndex"]


class SlotIndex:
    """Up to ``capacity`` distinct int64 ids, each bound to a slot in [0, capacity)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        self.keys = np.empty(0, np.int64)
        self.slot_of_key = np.empty(0, np.int64)
        self.id_of_slot = np.zeros(self.capacity, np.int64)
        self.used = np.zeros(self.capacity, bool)
        self._free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)  # a stack: top at _free[_nfree - 1]
        self._nfree = self.capacity

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @property
    def free(self) -> int:
        return self._nfree

    def find(self, ids: np.ndarray) -> np.ndarray:
        """(m,) slots of ``ids``, -1 where an id is not held."""
        ids = np.asarray(ids, np.int64)
        if self.keys.shape[0] == 0 or ids.shape[0] == 0:
            return np.full(ids.shape[0], -1, np.int64)
        pos = np.searchsorted(self.keys, ids)
        pos_c = np.minimum(pos, self.keys.shape[0] - 1)
        hit = self.keys[pos_c] == ids
        return np.where(hit, self.slot_of_key[pos_c], -1)

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Bind distinct ids that are not held to free slots; returns their slots (in the order of ``ids``).
        Raises ValueError when there are fewer free slots than ids (the caller evicts first)."""
        ids = np.asarray(ids, np.int64)
        m = ids.shape[0]
        if m == 0:
            return np.empty(0, np.int64)
        if m > self._nfree:
            raise ValueError(f"{m} ids to add but only {self._nfree} free slots")
        slots = self._free[self._nfree - m:self._nfree][::-1].copy()
        self._nfree -= m
        self.id_of_slot[slots] = ids
        self.used[slots] = True
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        pos = np.searchsorted(self.keys, sorted_ids)
        self.keys = np.insert(self.keys, pos, sorted_ids)
        self.slot_of_key = np.insert(self.slot_of_key, pos, slots[order])
        return slots

    def remove(self, slots: np.ndarray) -> None:
        """Unbind distinct used ``slots`` (their ids are no longer held) and put them back on the free stack."""
        slots = np.asarray(slots, np.int64)
        if slots.shape[0] == 0:
            return
        pos = np.searchsorted(self.keys, self.id_of_slot[slots])
        keep = np.ones(self.keys.shape[0], bool)
        keep[pos] = False
        self.keys = self.keys[keep]
        self.slot_of_key = self.slot_of_key[keep]
        self.used[slots] = False
        self._free[self._nfree:self._nfree + slots.shape[0]] = slots
        self._nfree += slots.shape[0]

    def used_slots(self) -> np.ndarray:
        """The slots in use, in the order of their ids."""
        return self.slot_of_key

    def clear(self) -> None:
        self.__init__(self.capacity)
