"""Optimizer math: table pushes against torch.optim on a dense copy of the touched rows, a hand-written
row-wise Adagrad, and the FTRL-Proximal equations written out per coordinate."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tigana import embeddings as emb
from tigana.embeddings import _kernels

BACKENDS = ["numpy"] + (["numba"] if _kernels.AVAILABLE else [])
DIM, ROWS, STEPS = 6, 12, 8


def _batches(seed: int, *, every_row: bool):
    """Per step: ids with duplicates (all ROWS ids when every_row) and float32 grads."""
    rng = np.random.default_rng(seed)
    for _ in range(STEPS):
        ids = rng.integers(0, ROWS, 30)
        if every_row:
            ids = np.concatenate([np.arange(ROWS), ids])
        yield ids, rng.normal(size=(ids.size, DIM)).astype(np.float32)


def _dense_grad(ids: np.ndarray, grads: np.ndarray) -> torch.Tensor:
    dense = np.zeros((ROWS, DIM), np.float64)
    np.add.at(dense, ids, grads)
    return torch.from_numpy(dense.astype(np.float32))


def _run_table(opt, backend: str, every_row: bool, seed: int = 0) -> tuple[emb.EmbeddingTable, np.ndarray]:
    table = emb.EmbeddingTable(emb.TableConfig("t", dim=DIM, optimizer=opt, initializer=emb.Normal(0, 0.5),
                                               backend=backend))
    init = table.pull(np.arange(ROWS))
    for ids, grads in _batches(seed, every_row=every_row):
        table.push(ids, grads)
    return table, init


def _run_torch(make_opt, init: np.ndarray, every_row: bool, seed: int = 0) -> np.ndarray:
    param = torch.nn.Parameter(torch.from_numpy(init.copy()))
    opt = make_opt([param])
    for ids, grads in _batches(seed, every_row=every_row):
        param.grad = _dense_grad(ids, grads)
        opt.step()
    return param.detach().numpy()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam", "adam_wd"])
def test_against_torch_optim(backend: str, name: str) -> None:
    ours, make = {
        "sgd": (emb.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
        "adagrad": (emb.Adagrad(lr=0.1, initial_accumulator_value=0.1, eps=1e-10),
                    lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1, eps=1e-10)),
        "adam": (emb.Adam(lr=0.05), lambda p: torch.optim.Adam(p, lr=0.05)),
        "adam_wd": (emb.Adam(lr=0.05, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
                    lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    }[name]
    # Adam is lazy: it equals dense torch Adam when every row is touched every step.
    every_row = name.startswith("adam")
    table, init = _run_table(ours, backend, every_row)
    expect = _run_torch(make, init, every_row)
    # Adam normalizes by sqrt(v): float32 rounding of tiny sums shows up as ~1e-6 absolute
    atol = 2e-5 if every_row else 2e-6
    np.testing.assert_allclose(table.pull(np.arange(ROWS)), expect, rtol=2e-5, atol=atol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lazy_adam_uses_per_row_step_counts(backend: str) -> None:
    """A row touched in k of the steps equals torch Adam run on just those k gradients."""
    opt = emb.Adam(lr=0.05)
    table, init = _run_table(opt, backend, every_row=False)
    got = table.pull(np.arange(ROWS))
    for row in range(ROWS):
        param = torch.nn.Parameter(torch.from_numpy(init[row].copy()))
        adam = torch.optim.Adam([param], lr=0.05)
        touched = 0
        for ids, grads in _batches(0, every_row=False):
            if row in ids:
                param.grad = torch.from_numpy(grads[ids == row].sum(0, dtype=np.float32))
                adam.step()
                touched += 1
        np.testing.assert_allclose(got[row], param.detach().numpy(), rtol=2e-5, atol=2e-5)
        assert table.export_rows(ids=np.array([row])).update_count[0] == touched


@pytest.mark.parametrize("backend", BACKENDS)
def test_rowwise_adagrad_against_torch_reference(backend: str) -> None:
    lr, eps, acc0 = 0.1, 1e-8, 0.05
    table, init = _run_table(emb.RowWiseAdagrad(lr=lr, eps=eps, initial_accumulator_value=acc0), backend,
                             every_row=False)
    w = torch.from_numpy(init.copy())
    acc = torch.full((ROWS,), acc0)
    for ids, grads in _batches(0, every_row=False):
        touched = torch.from_numpy(np.unique(ids))
        g = _dense_grad(ids, grads)[touched]
        acc[touched] += g.pow(2).mean(dim=1)
        w[touched] -= lr * g / (acc[touched].sqrt() + eps).unsqueeze(1)
    np.testing.assert_allclose(table.pull(np.arange(ROWS)), w.numpy(), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(table.export_rows().state[:, 0], acc.numpy(), rtol=2e-5)


def _ftrl_reference(w0: float, grads: list[float], alpha: float, beta: float, l1: float, l2: float) -> float:
    """McMahan et al. (2013), Algorithm 1, one coordinate, starting from weight w0 with z = n = 0."""
    z = n = 0.0
    w = w0
    for g in grads:
        sigma = (math.sqrt(n + g * g) - math.sqrt(n)) / alpha
        z = z + g - sigma * w
        n = n + g * g
        w = 0.0 if abs(z) <= l1 else -(z - math.copysign(l1, z)) / ((beta + math.sqrt(n)) / alpha + l2)
    return w


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("l1, l2", [(0.0, 0.0), (0.3, 0.1), (5.0, 1.0)])
def test_ftrl_proximal_equations(backend: str, l1: float, l2: float) -> None:
    alpha, beta = 0.1, 1.0
    table, init = _run_table(emb.FTRL(alpha=alpha, beta=beta, l1=l1, l2=l2), backend, every_row=False)
    got = table.pull(np.arange(ROWS))
    for row in range(ROWS):
        for col in range(DIM):
            grads = [float(g[ids == row, col].astype(np.float64).sum(dtype=np.float32))
                     for ids, g in _batches(0, every_row=False) if row in ids]
            expect = _ftrl_reference(float(init[row, col]), grads, alpha, beta, l1, l2)
            assert got[row, col] == pytest.approx(expect, rel=1e-4, abs=1e-6)
            if l1 and abs(expect) == 0.0:  # the L1 proximal step yields exact zeros
                assert got[row, col] == 0.0


def test_state_widths() -> None:
    widths = {emb.SGD(): 0, emb.Adagrad(): DIM, emb.RowWiseAdagrad(): 1, emb.Adam(): 2 * DIM, emb.FTRL(): 2 * DIM}
    for opt, width in widths.items():
        assert emb.EmbeddingTable(emb.TableConfig("t", dim=DIM, optimizer=opt)).state_width == width
