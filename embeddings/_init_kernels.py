"""The compiled (numba) twin of ``initializers.py``: deterministic initial rows, bit for bit the numpy code.

One kernel, ``initial_rows``, called once per batch of new ids; it releases the GIL. Normal rows use the
ziggurat whose tables ``initializers.py`` computes and passes in, so both forms read the same numbers.
``AVAILABLE`` is False when numba cannot be imported (the numpy code is used then).
"""

from __future__ import annotations

import math

import numpy as np

from tigana.embeddings.mixing import mix64_scalar

try:  # pragma: no cover - exercised by whichever path the machine has
    from numba import njit

    AVAILABLE = True
except ImportError:  # pragma: no cover
    AVAILABLE = False

if AVAILABLE:
    _GOLDEN = np.uint64(0x9E3779B97F4A7C15)
    _S11 = np.uint64(11)
    _LAYER_MASK = np.uint64(127)
    _TWO_POW_M53 = 1.0 / (1 << 53)

    @njit(nogil=True, cache=True, inline="always")
    def _unit(x):
        return np.float64(x >> _S11) * _TWO_POW_M53

    @njit(nogil=True, cache=True, inline="always")
    def _normal(w, zx, zr, tail_r, salt):
        """One standard normal from the draw chain that starts at ``w`` (see ``initializers._normal``)."""
        while True:
            layer = np.int64(w & _LAYER_MASK)
            u = 2.0 * _unit(w) - 1.0
            if abs(u) < zr[layer]:
                return u * zx[layer]
            v = mix64_scalar(w ^ salt)
            if layer == 0:  # the tail beyond R, by Marsaglia's exponential method, keeping u's sign
                while True:
                    t = mix64_scalar(v ^ salt)
                    x = math.log(1.0 - _unit(v)) / tail_r
                    y = math.log(1.0 - _unit(t))
                    if -2.0 * y >= x * x:
                        return x - tail_r if u < 0.0 else tail_r - x
                    v = mix64_scalar(t ^ salt)
            x = u * zx[layer]
            f0 = math.exp(-0.5 * (zx[layer] * zx[layer] - x * x))
            f1 = math.exp(-0.5 * (zx[layer + 1] * zx[layer + 1] - x * x))
            if f1 + _unit(v) * (f0 - f1) < 1.0:
                return x
            w = mix64_scalar(w + _GOLDEN)

    @njit(nogil=True, cache=True)
    def initial_rows(kind, seed_key, salt, ids, a, b, zx, zr, tail_r, out):
        """kind 1: uniform [a, b); kind 2: normal (mean a, std b) by the ziggurat (tables ``zx``, ``zr``).
        ``ids`` as uint64 bits; ``out`` (n, dim) float32.

        Normal rows take two passes: a branch-free one that writes every rectangle draw (the compiler
        vectorizes it) and marks the others NaN, then the rare marked values by the whole chain."""
        dim = out.shape[1]
        span = b - a
        nan = np.float32(np.nan)
        for i in range(ids.shape[0]):
            base = mix64_scalar(ids[i] ^ seed_key)
            if kind == 1:
                for j in range(dim):
                    out[i, j] = np.float32(a + span * _unit(mix64_scalar(base + np.uint64(j + 1) * _GOLDEN)))
                continue
            for j in range(dim):
                w = mix64_scalar(base + np.uint64(j + 1) * _GOLDEN)
                layer = np.int64(w & _LAYER_MASK)
                u = 2.0 * _unit(w) - 1.0
                out[i, j] = np.float32(a + b * (u * zx[layer])) if abs(u) < zr[layer] else nan
            for j in range(dim):
                if math.isnan(out[i, j]):
                    w = mix64_scalar(base + np.uint64(j + 1) * _GOLDEN)
                    out[i, j] = np.float32(a + b * _normal(w, zx, zr, tail_r, salt))
