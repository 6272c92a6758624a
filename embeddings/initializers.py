"""Deterministic row initialization: the initial row of an id is a pure function of (seed, id, column).

Every shard, replica and restarted process computes the same row for the same (seed, id) without storing it:
a counter-based generator (splitmix64 of the seed, the id and the column) yields uniform bits. Normal uses the
ziggurat (Marsaglia and Tsang 2000, in Doornik's ZIGNOR form, 128 layers): 98.8 % of draws cost one multiply and
one compare, so a first-sight row costs about what copying it does (Box-Muller's log, sqrt and cos per value
made initialization 40 % of an insert). A rejected draw continues a deterministic chain of further draws, so a
value stays a pure function of (seed, id, column). The numpy code below and its compiled twin
(``_init_kernels``) run the same operations in the same order on the same tables.
"""

from __future__ import annotations

import math

import numpy as np

from tigana.embeddings import _init_kernels
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
    if backend == "numba" and _init_kernels.AVAILABLE:
        out = np.empty((n, dim), np.float32)
        _init_kernels.initial_rows(kind, seed_key(seed), _SALT_SECOND, np.ascontiguousarray(ids, np.int64).view(
            np.uint64), a, b, ZIG_X, ZIG_RATIO, ZIG_R, out)
        return out
    bits = uniform_bits(seed, ids, dim)
    if kind == 1:
        return (a + (b - a) * unit_interval(bits)).astype(np.float32)
    return (a + b * _normal(bits)).astype(np.float32)


# --- the ziggurat ---------------------------------------------------------------------------------------------
ZIG_R = 3.442619855899  # where the tail starts
_ZIG_V = 9.91256303526217e-3  # the area of each of the 128 layers


def _zig_tables() -> tuple[np.ndarray, np.ndarray]:
    """Layer edges ``x`` (129: x[0] = V / f(R), x[1] = R, ..., x[128] = 0) and ``ratio[i] = x[i+1] / x[i]``,
    the share of layer i that lies wholly under the density (Doornik's zigNorInit)."""
    x = np.zeros(129, np.float64)
    f = math.exp(-0.5 * ZIG_R * ZIG_R)
    x[0], x[1] = _ZIG_V / f, ZIG_R
    for i in range(2, 128):
        x[i] = math.sqrt(-2.0 * math.log(_ZIG_V / x[i - 1] + f))
        f = math.exp(-0.5 * x[i] * x[i])
    return x, x[1:] / x[:-1]


ZIG_X, ZIG_RATIO = _zig_tables()


def _normal(bits: np.ndarray) -> np.ndarray:
    """Standard normals, one per uint64 draw (any shape). A draw's low 7 bits pick a layer and its top 53 bits a
    signed offset u; inside the layer's rectangle (98.8 %) the value is u * x[layer]. Otherwise one more draw
    decides the wedge (accept, or go on with the next draw of the chain, ``mix64(w + golden)``) or, in the bottom
    layer, starts the tail's own chain of pairs. Vectorized over the draws still open."""
    w = bits.ravel().copy()
    z = np.empty(w.shape, np.float64)
    todo = np.arange(w.shape[0])
    with np.errstate(over="ignore"):
        while todo.size:
            wt = w[todo]
            layer = (wt & np.uint64(127)).astype(np.intp)
            u = 2.0 * unit_interval(wt) - 1.0
            fast = np.abs(u) < ZIG_RATIO[layer]
            z[todo[fast]] = u[fast] * ZIG_X[layer[fast]]
            slow = ~fast
            todo, wt, layer, u = todo[slow], wt[slow], layer[slow], u[slow]
            v = mix64(wt ^ _SALT_SECOND)
            tail = layer == 0
            if tail.any():
                z[todo[tail]] = _tail(v[tail], u[tail] < 0.0)
            wedge = ~tail
            todo, wt, layer, u, v = todo[wedge], wt[wedge], layer[wedge], u[wedge], v[wedge]
            x = u * ZIG_X[layer]
            f0 = np.exp(-0.5 * (ZIG_X[layer] * ZIG_X[layer] - x * x))
            f1 = np.exp(-0.5 * (ZIG_X[layer + 1] * ZIG_X[layer + 1] - x * x))
            accept = f1 + unit_interval(v) * (f0 - f1) < 1.0
            z[todo[accept]] = x[accept]
            todo, wt = todo[~accept], wt[~accept]
            w[todo] = mix64(wt + _GOLDEN)
    return z.reshape(bits.shape)


def _tail(v: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Values beyond R (Marsaglia's exponential method), one chain of draw pairs per value, signs kept."""
    out = np.empty(v.shape[0], np.float64)
    todo = np.arange(v.shape[0])
    with np.errstate(over="ignore"):
        while todo.size:
            vt = v[todo]
            t = mix64(vt ^ _SALT_SECOND)
            x = np.log(1.0 - unit_interval(vt)) / ZIG_R
            y = np.log(1.0 - unit_interval(t))
            ok = -2.0 * y >= x * x
            done = todo[ok]
            out[done] = np.where(negative[done], x[ok] - ZIG_R, ZIG_R - x[ok])
            todo = todo[~ok]
            v[todo] = mix64(t[~ok] ^ _SALT_SECOND)
    return out
