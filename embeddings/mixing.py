"""splitmix64's finalizer over whole numpy arrays: the one 64-bit mix of the project.

A bijection on 64-bit integers with good avalanche, identical on every machine and run. It keys initial rows
and admission draws, places ids in hash buckets, routes ids to slots (``tigana.ps.routing``) and hashes
categorical features (``tigana.trainer.data``). The numba kernels inline the same three steps per key.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mix64"]


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 (or int64, reinterpreted bit for bit) array; returns a new uint64
    array. The one 64-bit mix of the project: initial rows, admission, hash homes, routing and feature hashing."""
    with np.errstate(over="ignore"):
        x = np.asarray(x)
        z = x.view(np.uint64).copy() if x.dtype == np.int64 else np.array(x, dtype=np.uint64, copy=True)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        return z
