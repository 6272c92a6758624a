"""Server-side sparse optimizers: update the rows named by a deduplicated batch of gradients.

State layout per row (float32, ``state_width(opt, dim)`` columns):

    SGD             -                       (width 0)
    Adagrad         G[dim]                  G += g²;  w -= lr·g / (√G + eps)            (torch.optim.Adagrad)
    RowWiseAdagrad  G[1]                    G += mean(g²); w -= lr·g / (√G + eps)        (FBGEMM row-wise)
    Adam            m[dim], v[dim]          lazy: bias correction uses the row's own step count t
    FTRL            z[dim], n[dim]          FTRL-Proximal (McMahan et al. 2013), per coordinate

``updated`` returns the rows ``rows`` after the update as new compact arrays, with a flag per row for a NaN/Inf
in its result (the table checks the flags before it stores anything); ``grads`` (k, dim) float32 are already
summed per row. ``steps`` (k,) are the rows' 1-based update counts including this update (Adam only). Pure
arrays in, arrays out: no locks, no I/O. The numba kernels and the numpy fallback implement the same equations,
in the same order of operations (Adam's ``(1 - beta2) * g * g`` overflows for the same gradients on both).
"""

from __future__ import annotations

import numpy as np

from tigana.embeddings import _kernels
from tigana.embeddings.config import FTRL, SGD, Adagrad, Adam, Optimizer, RowWiseAdagrad


def state_width(opt: Optimizer, dim: int) -> int:
    if isinstance(opt, SGD):
        return 0
    if isinstance(opt, Adagrad):
        return dim
    if isinstance(opt, RowWiseAdagrad):
        return 1
    if isinstance(opt, (Adam, FTRL)):
        return 2 * dim
    raise TypeError(f"unknown optimizer {opt!r}")


def initial_state(opt: Optimizer, n: int, dim: int) -> np.ndarray:
    """(n, state_width) float32 state of fresh rows."""
    width = state_width(opt, dim)
    fill = opt.initial_accumulator_value if isinstance(opt, (Adagrad, RowWiseAdagrad)) else 0.0
    return np.full((n, width), fill, np.float32)


def updated(opt: Optimizer, weights: np.ndarray, state: np.ndarray, rows: np.ndarray, grads: np.ndarray,
            steps: np.ndarray | None, *, backend: str, out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
            at: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows ``rows`` (unique) of ``weights`` (float32 (N, dim)) and ``state`` ((N, width)) after the update by
    ``grads``, and which of them would hold a NaN/Inf: (weights (k, dim), state (k, width), bad (k,) bool), new
    arrays; the inputs are not changed. With ``out`` (weights, state, bad arrays) and ``at`` (k,) the results go
    to those rows of ``out`` instead (to assemble one batch from rows read in several places)."""
    k = rows.shape[0]
    if out is None:
        out = (np.empty((k, weights.shape[1]), np.float32), np.empty((k, state.shape[1]), np.float32),
               np.zeros(k, bool))
        at = np.arange(k)
    w_out, s_out, bad = out
    if not k:
        return out
    if backend == "numba":
        _numba(opt, weights, state, np.ascontiguousarray(rows, np.int64), grads, steps, w_out, s_out,
               np.ascontiguousarray(at, np.int64), bad)
        return out
    w, s = weights[rows], state[rows]
    with np.errstate(over="ignore", invalid="ignore"):
        _apply_numpy(opt, w, s, grads, steps)
    w_out[at], s_out[at] = w, s
    bad[at] = ~(np.isfinite(w).all(axis=1) & np.isfinite(s).all(axis=1))
    return out


def _numba(opt, weights, state, rows, grads, steps, w_out, s_out, at, bad) -> None:
    if isinstance(opt, SGD):
        _kernels.sgd(weights, rows, grads, opt.lr, w_out, at, bad)
    elif isinstance(opt, Adagrad):
        _kernels.adagrad(weights, state, rows, grads, opt.lr, opt.eps, w_out, s_out, at, bad)
    elif isinstance(opt, RowWiseAdagrad):
        _kernels.rowwise_adagrad(weights, state, rows, grads, opt.lr, opt.eps, w_out, s_out, at, bad)
    elif isinstance(opt, Adam):
        _kernels.adam(weights, state, rows, grads, np.ascontiguousarray(steps, np.float64), opt.lr, opt.beta1,
                      opt.beta2, opt.eps, opt.weight_decay, w_out, s_out, at, bad)
    elif isinstance(opt, FTRL):
        _kernels.ftrl(weights, state, rows, grads, opt.alpha, opt.beta, opt.l1, opt.l2, w_out, s_out, at, bad)
    else:
        raise TypeError(f"unknown optimizer {opt!r}")


def _apply_numpy(opt, w: np.ndarray, s: np.ndarray, g: np.ndarray, steps) -> None:
    """The same equations on compact (k, dim) copies, updated in place."""
    f32 = np.float32
    if isinstance(opt, SGD):
        w -= f32(opt.lr) * g
    elif isinstance(opt, Adagrad):
        s += g * g
        w -= f32(opt.lr) * g / (np.sqrt(s) + f32(opt.eps))
    elif isinstance(opt, RowWiseAdagrad):
        s[:, 0] += (g * g).sum(axis=1, dtype=f32) / f32(g.shape[1])
        w -= (f32(opt.lr) / (np.sqrt(s[:, :1]) + f32(opt.eps))) * g
    elif isinstance(opt, Adam):
        dim = w.shape[1]
        t = np.asarray(steps, np.float64)[:, None]
        gg = g + f32(opt.weight_decay) * w
        m = f32(opt.beta1) * s[:, :dim] + (f32(1.0) - f32(opt.beta1)) * gg
        v = f32(opt.beta2) * s[:, dim:] + (f32(1.0) - f32(opt.beta2)) * gg * gg
        s[:, :dim], s[:, dim:] = m, v
        step_size = (opt.lr / (1.0 - opt.beta1**t)).astype(f32)
        bc2_sqrt = np.sqrt(1.0 - opt.beta2**t).astype(f32)
        w -= step_size * m / (np.sqrt(v) / bc2_sqrt + f32(opt.eps))
    elif isinstance(opt, FTRL):
        dim = w.shape[1]
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        z, n = s[:, :dim].astype(np.float64), s[:, dim:].astype(np.float64)
        n_new = n + g64 * g64
        sigma = (np.sqrt(n_new) - np.sqrt(n)) / opt.alpha
        z += g64 - sigma * w64
        shrunk = -(z - np.sign(z) * opt.l1) / ((opt.beta + np.sqrt(n_new)) / opt.alpha + opt.l2)
        w[:] = np.where(np.abs(z) <= opt.l1, 0.0, shrunk)
        s[:, :dim], s[:, dim:] = z, n_new
    else:
        raise TypeError(f"unknown optimizer {opt!r}")
