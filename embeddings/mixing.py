"""splitmix64's finalizer: the one 64-bit mix of the project, over whole numpy arrays (``mix64``) and, for the
numba kernels, over one key (``mix64_scalar``, inlined into the kernel that calls it), and the routing slot of one
key (``slot_of_key``: mix64 modulo the slot count, masked for a power of two).

A bijection on 64-bit integers with good avalanche, identical on every machine and run. It keys initial rows
and admission draws, places ids in hash buckets, routes ids to slots (``tigana.ps.routing``), groups a batch's
ids (``tigana.ps._kernels``, ``tigana.trainer._kernels``) and hashes categorical features
(``tigana.trainer.data``). Both forms compute the same three steps; ``tests/embeddings/test_mixing.py`` holds
them against each other and against a scalar reference.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mix64", "mix64_scalar", "slot_of_key", "slots_of_keys"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 (or int64, reinterpreted bit for bit) array; returns a new uint64
    array. The one 64-bit mix of the project: initial rows, admission, hash homes, routing and feature hashing."""
    with np.errstate(over="ignore"):
        x = np.asarray(x)
        z = x.view(np.uint64).copy() if x.dtype == np.int64 else np.array(x, dtype=np.uint64, copy=True)
        z ^= z >> _S30
        z *= _M1
        z ^= z >> _S27
        z *= _M2
        z ^= z >> _S31
        return z


def slots_of_keys(keys: np.ndarray, num_slots: int) -> np.ndarray:
    """The routing slot of every key, ``mix64(key) % num_slots`` as int64 (numpy; ``slot_of_key`` in kernels)."""
    return (mix64(keys) % np.uint64(num_slots)).astype(np.int64)


def _mix64_scalar(key):  # compiled below for any integer type
    """``mix64`` of one key (int64 reinterpreted bit for bit, or uint64) as a uint64, for numba kernels."""
    z = np.uint64(key)
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def _slot_of_key(key, num_slots):  # compiled below
    """The routing slot of one key, ``mix64(key) % num_slots`` (``tigana.ps.routing.slot_of``) as an int64, for
    numba kernels: a power-of-two count (``num_slots`` a uint64) masks instead of dividing."""
    m = mix64_scalar(key)
    return np.int64(m & (num_slots - np.uint64(1)) if num_slots & (num_slots - np.uint64(1)) == np.uint64(0)
                    else m % num_slots)


try:  # pragma: no cover - exercised by whichever path the machine has
    from numba import njit
except ImportError:  # pragma: no cover - the kernels' numpy fallbacks use ``mix64``
    mix64_scalar = _mix64_scalar
    slot_of_key = _slot_of_key
else:
    # Every kernel module imports this one before it compiles anything: key numba's disk cache by all kernel
    # sources at once (a kernel inlines this function; a change here must recompile it).
    from tigana.embeddings._jitcache import install as _install_kernel_cache

    _install_kernel_cache()
    mix64_scalar = njit(nogil=True, cache=True, inline="always")(_mix64_scalar)
    slot_of_key = njit(nogil=True, cache=True, inline="always")(_slot_of_key)
