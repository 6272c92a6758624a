"""Test helper: damage one spilled row's record in its table's spill file (its CRC check then fails)."""

from __future__ import annotations

import numpy as np


def corrupt_spilled(table, victim: int | None = None, offset: int = 30) -> int:
    """Flip the bits of one byte inside the spill-file record of ``victim`` (default: the smallest spilled
    id); returns the id."""
    if victim is None:
        victim = int(np.sort(table._spilled.items()[0])[0])
    slot = int(table._spilled.lookup(np.array([victim], np.int64))[0])  # the spilled index holds its slot
    assert slot >= 0, f"id {victim} is not spilled"
    store = table._spill
    with open(store.file, "r+b") as f:
        f.seek(slot * store.record_bytes + offset)
        byte = f.read(1)
        f.seek(slot * store.record_bytes + offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    return victim
