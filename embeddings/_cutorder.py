"""The ordered read of a cut (``Cut.batches(in_order=True)``) in ranges of ids: a pass over the held arrays
collects one range's ids still the cut's, sorted, and the cut reads their rows by id, so the read holds 8 bytes
an id of one range, not of the whole table (at 125 M rows a daemon, 1 GB beside a 4 GiB budget). The ranges
split the rows at the cut's opening into about equal parts of at least ``ORDERED_IDS`` ids, at most
``ORDERED_RANGES`` of them (each range is one more pass over the held arrays). Called on the reader's thread;
the table's lock is taken per chunk of buckets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tigana.embeddings.cut import Cut

__all__ = ["ORDERED_IDS", "ORDERED_RANGES", "collect_ids", "id_ranges"]

ORDERED_IDS = 1 << 19  # a range holds at least this many ids (8 bytes each; twice that while collected) ...
ORDERED_RANGES = 32  # ... and there are at most this many ranges (passes over the held arrays)


def id_ranges(cut: Cut, chunk: int) -> list[tuple[int | None, int | None]]:
    """[lo, hi) ranges of ids (None: unbounded) that split the rows at the cut's opening into about equal parts
    (module docstring). The bounds are quantiles of a sample of the held keys (the buckets in a stride: a hash
    index's bucket order is random to the ids)."""
    per = max(ORDERED_IDS, -(-cut._rows // ORDERED_RANGES))
    ranges = -(-cut._rows // per)
    if ranges <= 1:
        return [(None, None)]
    stride = max(1, (cut._res.size + cut._sp.size) // (ranges * 1024))
    sample = []
    for first, end, spilled in cut._segments():
        view = cut._sp if spilled else cut._res
        for lo in range(first, end, chunk * stride):
            with cut._table._lock:
                cut._check()
                keys, vals = view.slice(lo, min(lo + chunk * stride, end))
                sample.append(keys[::stride][vals[::stride] >= 0].view(np.int64))
    keys = np.sort(np.concatenate(sample))
    if keys.size < ranges:
        return [(None, None)]
    bounds = np.unique(keys[(np.arange(1, ranges) * keys.size) // ranges]).tolist()
    return list(zip([None, *bounds], [*bounds, None], strict=True))


def collect_ids(cut: Cut, chunk: int, dirty_only: bool, lo_id: int | None, hi_id: int | None) -> np.ndarray:
    """The sorted ids in [lo_id, hi_id) of the held arrays still the cut's (``dirty_only``: those whose marks
    as of the open are among the cut's marks)."""
    table = cut._table
    parts = []
    for first, end, spilled in cut._segments():
        for lo in range(first, end, chunk):
            hi = min(lo + chunk, end)
            with table._lock:
                cut._check()
                if spilled:
                    keys, v = cut._sp.slice(lo, hi)
                    live = (v >= 0) & ~cut._sp_done[lo:hi]
                else:
                    keys, v = cut._res.slice(lo, hi)
                    live = v >= 0
                ids = keys.view(np.int64)
                if lo_id is not None:
                    live &= ids >= lo_id
                if hi_id is not None:
                    live &= ids < hi_id
                if spilled:
                    if dirty_only:
                        live[live] = np.isin(table._spill_marks_of(v[live]), cut.marks)
                else:
                    live[live] = v[live] < cut._high_water
                    pos = v[live].astype(np.int64)
                    state = cut._where[pos]
                    keep = state != -1
                    if dirty_only:  # a row changed since the open has its mark as of then in the saved copy
                        marks = table._slab.dirty[pos]
                        saved = state > 0
                        marks[saved] = cut._saved.dirty[state[saved].astype(np.int64) - 1]
                        keep &= np.isin(marks, cut.marks)
                    live[live] = keep
                parts.append(ids[live])
    ids = np.concatenate(parts) if parts else np.empty(0, np.int64)
    del parts
    ids.sort()
    if ids.size < 2:
        return ids
    first = np.empty(ids.shape[0], bool)  # an id is listed once (one live bucket, in one index); checked anyway
    first[0] = True
    np.not_equal(ids[1:], ids[:-1], out=first[1:])
    return ids if first.all() else ids[first]  # (np.unique hashes: far slower here)
