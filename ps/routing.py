"""Ids → virtual slots → servers. Pure functions, no I/O.

An id's slot is a stable 64-bit mix (splitmix64's finalizer) of the id modulo ``num_slots``; slots, not ids,
are what servers own, so moving a slot moves a well-defined set of rows. Which server owns a slot is data
(a routing table), not a constant: a static shard list assigns contiguous slot ranges in order.
"""

from __future__ import annotations

import numpy as np

from tigana.embeddings.mixing import mix64

__all__ = ["DEFAULT_NUM_SLOTS", "mix64", "parse_slots", "slot_of", "slot_range", "split_by_owner",
           "static_assignment"]

DEFAULT_NUM_SLOTS = 4096



def slot_of(ids: np.ndarray, num_slots: int = DEFAULT_NUM_SLOTS) -> np.ndarray:
    """Slot of each id, int64 in [0, num_slots)."""
    return (mix64(ids) % np.uint64(num_slots)).astype(np.int64)


def static_assignment(num_servers: int, num_slots: int = DEFAULT_NUM_SLOTS) -> np.ndarray:
    """Owner index of each slot for a static list of ``num_servers``: contiguous, near-equal ranges."""
    if num_servers < 1:
        raise ValueError("num_servers must be >= 1")
    return (np.arange(num_slots, dtype=np.int64) * num_servers) // num_slots


def slot_range(index: int, num_servers: int, num_slots: int = DEFAULT_NUM_SLOTS) -> tuple[int, int]:
    """[start, stop) of the slots server ``index`` of ``num_servers`` owns under ``static_assignment``."""
    owners = static_assignment(num_servers, num_slots)
    hits = np.flatnonzero(owners == index)
    return int(hits[0]), int(hits[-1]) + 1


def parse_slots(text: str, num_slots: int = DEFAULT_NUM_SLOTS) -> np.ndarray:
    """Parse ``"0-2047,4000"`` (inclusive ranges) into a bool mask of owned slots; ``"all"`` or ``""`` owns all."""
    mask = np.zeros(num_slots, dtype=bool)
    if text.strip() in ("", "all"):
        mask[:] = True
        return mask
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        start, stop = int(lo), int(hi or lo)
        if not 0 <= start <= stop < num_slots:
            raise ValueError(f"slots: range {part!r} outside [0, {num_slots})")
        mask[start:stop + 1] = True
    return mask


def split_by_owner(owners_of_ids: np.ndarray, num_owners: int) -> list[np.ndarray]:
    """Positions of the ids each owner gets (a list of int64 index arrays, one per owner), order kept."""
    order = np.argsort(owners_of_ids, kind="stable")
    bounds = np.searchsorted(owners_of_ids[order], np.arange(num_owners + 1))
    return [order[bounds[i]:bounds[i + 1]] for i in range(num_owners)]
