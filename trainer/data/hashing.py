"""Stable 64-bit hashing of categorical values into int64 ids, salted per feature.

Two features holding the same raw value (say ``C3`` and ``C7`` both ``"68fd1e64"``) must land on different
ids when they share a table, so every raw value is mixed with a salt derived from its feature's name.
The mix is splitmix64's finalizer: a bijection on 64-bit integers with good avalanche, vectorized over
whole numpy arrays, identical on every machine and every run (Python's ``hash()`` is randomized per
process, so it is never used). Ids are masked to 63 bits: always non-negative int64.

All functions are pure and thread-safe.
"""

from __future__ import annotations

import hashlib

import numpy as np

from tigana.ps.routing import mix64  # the one splitmix64 of the project

__all__ = ["ID_MASK", "MISSING_RAW", "feature_salt", "hash_values", "missing_id", "mix64"]

ID_MASK = np.uint64(0x7FFF_FFFF_FFFF_FFFF)
"""Ids keep 63 bits so they are non-negative as int64."""

MISSING_RAW = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
"""The raw value an empty categorical field stands for before salting (outside the 32-bit hex range
Criteo uses, so a missing value never collides with a real one of the same feature)."""


def feature_salt(name: str, seed: int = 0) -> np.uint64:
    """The 64-bit salt of a feature: the first 8 bytes of BLAKE2b(name, seed). Stable across processes."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def hash_values(raw: np.ndarray, salt: np.uint64 | np.ndarray) -> np.ndarray:
    """uint64 raw values -> int64 ids in [0, 2**63), same shape.

    id = mix64(raw XOR salt) & (2**63 - 1); different salts make equal raw values differ across features.
    ``salt`` is one feature's salt, or an (F,) array of salts broadcast over the last axis of an (n, F) ``raw``.
    """
    raw = np.asarray(raw)
    raw = raw.view(np.uint64) if raw.dtype == np.int64 else raw.astype(np.uint64, copy=False)
    return (mix64(raw ^ salt) & ID_MASK).view(np.int64)


def missing_id(salt: np.uint64) -> int:
    """The fixed id an empty value of the feature with this salt maps to."""
    return int(hash_values(np.array([MISSING_RAW], dtype=np.uint64), salt)[0])
