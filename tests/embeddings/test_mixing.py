"""``tigana.embeddings.mixing``: the numpy ``mix64`` and the compiled ``mix64_scalar`` (what the numba kernels
inline) are splitmix64's finalizer, bit for bit, for int64 and uint64 keys alike."""

from __future__ import annotations

import numpy as np
from numba import njit

from tigana.embeddings.mixing import mix64, mix64_scalar

_MASK = (1 << 64) - 1


def _reference(x: int) -> int:
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@njit(cache=False)
def _each(keys):
    out = np.empty(keys.shape[0], np.uint64)
    for i in range(keys.shape[0]):
        out[i] = mix64_scalar(keys[i])
    return out


def _keys() -> np.ndarray:
    rng = np.random.default_rng(16)
    edges = np.array([0, 1, -1, 2**63 - 1, -(2**63), 0x9E3779B97F4A7C15 - 2**64], np.int64)
    return np.concatenate([edges, rng.integers(-(2**63), 2**63 - 1, 10_000, dtype=np.int64, endpoint=True)])


def test_mix64_is_splitmix64s_finalizer() -> None:
    keys = _keys()
    assert mix64(keys).tolist() == [_reference(int(k)) for k in keys]
    assert np.array_equal(mix64(keys), mix64(keys.view(np.uint64)))


def test_the_compiled_mix_equals_the_numpy_mix_for_int64_and_uint64_keys() -> None:
    keys = _keys()
    assert np.array_equal(_each(keys), mix64(keys))
    assert np.array_equal(_each(keys.view(np.uint64)), mix64(keys))


def test_mix64_leaves_its_input_alone() -> None:
    keys = _keys()
    before = keys.copy()
    mix64(keys)
    assert np.array_equal(keys, before)
