"""Compiled (numba) kernels of the client's hot path: batch deduplication and fp16 conversion.

``dedup`` and ``dedup_sum`` use an open-addressing hash over the batch (O(n), no sort) and keep ids in
first-seen order; ``dedup_sum`` adds duplicate rows in batch order in float32, the order the storage engine
uses, so a pre-summed push lands bit for bit as the engine would apply the raw batch. The fp16 kernels convert
with round-to-nearest-even and saturate finite values at ±65504 (numpy's converter is a scalar loop, ~10x
slower). All release the GIL and compile once per machine (``cache=True``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


@njit(nogil=True, cache=True, inline="always")
def _bucket(key, mask):
    z = np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    z = z ^ (z >> np.uint64(31))
    return np.int64(z & np.uint64(mask))


@njit(nogil=True, cache=True, inline="always")
def _capacity(n):
    cap = 16
    while cap < 2 * n:
        cap *= 2
    return cap


@njit(nogil=True, cache=True)
def dedup(ids):
    """(n,) int64 -> (unique ids in first-seen order, (n,) int64 inverse: ids == uniq[inverse])."""
    n = ids.shape[0]
    cap = _capacity(n)
    mask = cap - 1
    index = np.full(cap, -1, np.int64)
    uniq = np.empty(n, np.int64)
    inverse = np.empty(n, np.int64)
    k = 0
    for i in range(n):
        key = ids[i]
        p = _bucket(key, mask)
        while True:
            j = index[p]
            if j == -1:
                index[p] = k
                uniq[k] = key
                inverse[i] = k
                k += 1
                break
            if uniq[j] == key:
                inverse[i] = j
                break
            p = (p + 1) & mask
    return uniq[:k].copy(), inverse


@njit(nogil=True, cache=True)
def dedup_sum(ids, grads):
    """(n,) int64 ids, (n, dim) float32 grads -> (unique ids in first-seen order, their summed grads)."""
    n = ids.shape[0]
    dim = grads.shape[1]
    cap = _capacity(n)
    mask = cap - 1
    index = np.full(cap, -1, np.int64)
    uniq = np.empty(n, np.int64)
    sums = np.empty((n, dim), np.float32)
    k = 0
    for i in range(n):
        key = ids[i]
        p = _bucket(key, mask)
        while True:
            j = index[p]
            if j == -1:
                index[p] = k
                uniq[k] = key
                for c in range(dim):
                    sums[k, c] = grads[i, c]
                k += 1
                break
            if uniq[j] == key:
                for c in range(dim):
                    sums[j, c] += grads[i, c]
                break
            p = (p + 1) & mask
    return uniq[:k].copy(), sums[:k].copy()


@njit(nogil=True, cache=True)
def f32_to_f16_bits(x, out):
    """float32 (any shape, flattened) -> IEEE half bits (uint16), round to nearest even; finite values
    saturate at ±65504, Inf stays Inf, NaN stays NaN."""
    bits = x.view(np.uint32)
    for i in range(bits.shape[0]):
        b = bits[i]
        sign = (b >> np.uint32(16)) & np.uint32(0x8000)
        e = np.int64((b >> np.uint32(23)) & np.uint32(0xFF))
        m = b & np.uint32(0x7FFFFF)
        if e == 0xFF:  # Inf or NaN
            h = np.uint32(0x7C00) | (np.uint32(0x200) if m != 0 else np.uint32(0))
        else:
            e16 = e - 127 + 15
            if e16 >= 0x1F:
                h = np.uint32(0x7BFF)
            elif e16 <= 0:
                if e16 < -10:
                    h = np.uint32(0)
                else:
                    m = m | np.uint32(0x800000)
                    shift = np.uint32(14 - e16)
                    h = m >> shift
                    rem = m & ((np.uint32(1) << shift) - np.uint32(1))
                    half = np.uint32(1) << (shift - np.uint32(1))
                    if rem > half or (rem == half and (h & np.uint32(1)) != 0):
                        h += np.uint32(1)
            else:
                h = (np.uint32(e16) << np.uint32(10)) | (m >> np.uint32(13))
                rem = m & np.uint32(0x1FFF)
                if rem > 0x1000 or (rem == 0x1000 and (h & np.uint32(1)) != 0):
                    h += np.uint32(1)
                if h >= 0x7C00:  # rounded past the largest finite half
                    h = np.uint32(0x7BFF)
        out[i] = np.uint16(h | sign)


_F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


@njit(nogil=True, cache=True)
def _lookup(bits, table, out):
    for i in range(bits.shape[0]):
        out[i] = table[bits[i]]


def f16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Half bits (uint16 or float16, flattened) -> float32, exact, through a 64Ki-entry table."""
    out = np.empty(bits.shape[0], np.float32)
    _lookup(bits.view(np.uint16), _F16_TABLE, out)
    return out
