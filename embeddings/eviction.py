"""Eviction policy as pure logic: which rows to drop, given their metadata. No table, no I/O.

TTL: rows not updated for more than ``ttl_steps`` table steps or ``ttl_seconds`` seconds (rows never updated
count from their insertion). Capacity: past ``max_rows``, the least recently accessed (LRU) or the least
updated (LFU, ties to the least recently accessed) rows go first.
"""

from __future__ import annotations

import numpy as np

from tigana.embeddings.config import Eviction


def expired(eviction: Eviction, step: int, now: float, last_step: np.ndarray,
            last_time: np.ndarray) -> np.ndarray:
    """(n,) bool: rows past their TTL."""
    out = np.zeros(last_step.shape[0], bool)
    if eviction.ttl_steps:
        out |= (step - last_step) > eviction.ttl_steps
    if eviction.ttl_seconds:
        out |= (now - last_time) > eviction.ttl_seconds
    return out


def over_capacity(eviction: Eviction, k: int, last_access: np.ndarray,
                  update_count: np.ndarray) -> np.ndarray:
    """Indices of the ``k`` rows to evict first under the capacity policy."""
    n = last_access.shape[0]
    k = min(max(k, 0), n)
    if k == 0:
        return np.empty(0, np.int64)
    if eviction.policy == "lfu":
        return np.lexsort((last_access, update_count))[:k]
    if k == n:
        return np.arange(n)
    return np.argpartition(last_access, k - 1)[:k]


def capacity_target(max_rows: int) -> int:
    """Rows to keep after a capacity eviction: a little under the cap, so evictions are amortized."""
    return max_rows - max_rows // 64
