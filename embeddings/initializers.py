"""Deterministic row initialization: the initial row of an id is a pure function of (seed, id, column).

Every shard, replica and restarted process computes the same row for the same (seed, id) without storing it:
a counter-based generator (splitmix64 of the seed, the id and the column) yields uniform bits; Normal uses
Box-Muller on two such draws. Pure numpy, one implementation, so results agree bit for bit everywhere.
"""

from __future__ import annotations

import numpy as np

from tigana.embeddings import _kernels
from tigana.embeddings.config import Initializer, Normal, Uniform, Zeros
from tigana.embeddings.mixing import mix64

_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SALT_SEED = 0xD1B54A32D192ED03
_SALT_SECOND = np.uint64(0x8CB92BA72F3D8DD7)
_TWO_POW_M53 = 1.0 / (1 << 53)


def seed_key(seed: int, salt: int = 0) -> np.uint64:
    """A well-mixed 64-bit key from a Python int seed (any sign or size) and a salt."""
    return mix64(np.array([(int(seed) ^ _SALT_SEED ^ int(salt)) & _MASK64], np.uint64))[0]


def uniform_bits(seed: int, ids: np.ndarray, columns: int, *, salt: int = 0) -> np.ndarray:
    """(n,) int64 ids -> (n, columns) uint64 pseudo-random bits, a pure function of (seed, salt, id, column)."""
    base = mix64(np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64) ^ seed_key(seed, salt))
    with np.errstate(over="ignore"):
        col = (np.arange(1, columns + 1, dtype=np.uint64) * _GOLDEN)[None, :]
        return mix64(base[:, None] + col)


def unit_interval(bits: np.ndarray) -> np.ndarray:
    """uint64 bits -> float64 in [0, 1) with 53 random bits."""
    return (bits >> np.uint64(11)).astype(np.float64) * _TWO_POW_M53


def initial_rows(initializer: Initializer, seed: int, ids: np.ndarray, dim: int, *,
                 backend: str = "numpy") -> np.ndarray:
    """(n,) int64 ids -> (n, dim) float32 initial rows. ``backend="numba"`` runs the compiled twin of the
    numpy code below (same operations in the same order)."""
    n = int(np.shape(ids)[0])
    if isinstance(initializer, Zeros) or n == 0:
        return np.zeros((n, dim), np.float32)
    if isinstance(initializer, Uniform):
        kind, a, b = 1, float(initializer.low), float(initializer.high)
    elif isinstance(initializer, Normal):
        kind, a, b = 2, float(initializer.mean), float(initializer.std)
    else:
        raise TypeError(f"unknown initializer {initializer!r}")
    if backend == "numba" and _kernels.AVAILABLE:
        out = np.empty((n, dim), np.float32)
        _kernels.initial_rows(kind, seed_key(seed), _SALT_SECOND, np.ascontiguousarray(ids, np.int64).view(
            np.uint64), a, b, out)
        return out
    bits = uniform_bits(seed, ids, dim)
    u = unit_interval(bits)
    if kind == 1:
        return (a + (b - a) * u).astype(np.float32)
    u1 = 1.0 - u  # (0, 1]: log is finite
    u2 = unit_interval(mix64(bits ^ _SALT_SECOND))
    z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
    return (a + b * z).astype(np.float32)
