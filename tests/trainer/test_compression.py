"""Adaptive compression (``tigana.trainer.compression``): error feedback delivers every gradient exactly (what
was pushed plus what is held equals what was given, per id), a held gradient waits at most ``max_delay``
steps, the codec is the cheapest whose measured error is within bound, and the guard backs off to full
precision on a quantization error or a loss regression."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tigana import ps
from tigana.trainer.compression import AdaptiveCompressor, AdaptiveConfig, int8_error_estimate, round_trip

DIM = 4


def _sums(plans, dim: int) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for p in plans:
        assert len(set(p.ids.tolist())) == p.ids.size  # a push never names an id twice
        for i, g in zip(p.ids.tolist(), p.grads.astype(np.float64), strict=True):
            out[i] = out.get(i, np.zeros(dim)) + g
    return out


_batches = st.lists(st.tuples(st.lists(st.integers(0, 30), min_size=1, max_size=12, unique=True),
                              st.integers(0, 2 ** 31 - 1), st.floats(1e-4, 1e3)), min_size=1, max_size=25)


@settings(max_examples=120, deadline=None)
@given(batches=_batches, density=st.floats(0.05, 1.0), max_delay=st.integers(1, 6),
       capacity=st.integers(1, 40), max_error=st.sampled_from([1e-6, 0.02, 0.5]))
# found by CI: large pushes of one id that nearly cancel, with its remainders dropped (capacity 1)
@example(batches=[([0], 0, 1.0), ([0], 0, 1.0), ([0, 2, 3, 1], 17355, 51.0), ([0, 2, 3, 4, 1, 5, 6], 6574, 28.0)],
         density=1.0, max_delay=1, capacity=1, max_error=0.02)
def test_error_feedback_delivers_every_gradient(batches, density, max_delay, capacity, max_error) -> None:
    comp = AdaptiveCompressor(DIM, AdaptiveConfig(density=density, max_delay=max_delay, capacity=capacity,
                                                  max_error=max_error), table="t")
    given_sum: dict[int, np.ndarray] = {}
    given_mag: dict[int, float] = {}  # sum over batches of the row's largest element: bounds what one push carries
    plans = []
    for ids, seed, scale in batches:
        rng = np.random.default_rng(seed)
        grads = (rng.standard_normal((len(ids), DIM)) * scale * rng.random((len(ids), 1))).astype(np.float32)
        for i, g in zip(ids, grads.astype(np.float64), strict=True):
            given_sum[i] = given_sum.get(i, np.zeros(DIM)) + g
            given_mag[i] = given_mag.get(i, 0.0) + float(np.abs(g).max())
        plans.append(comp.plan_push(np.array(ids, np.int64), grads))
        assert plans[-1].codec in ("int8", "fp16", "fp32")
        used = comp.index.used_slots()
        waiting = comp.since[used][comp.since[used] >= 0]
        assert (comp.step - waiting < max_delay).all()  # nothing held max_delay steps or more
        assert len(comp.index) <= capacity
    last = comp.drain()
    if last is not None:
        assert last.codec == "fp32"
        plans.append(last)
    assert len(comp.index) == 0 and comp.drain() is None
    pushed = _sums(plans, DIM)
    dropped = comp.counts["remainders_dropped"]
    assert set(pushed) <= set(given_sum)
    for i, g in given_sum.items():
        got = pushed.get(i, np.zeros(DIM))
        tol = 1e-4 * (np.abs(g).max() + 1)
        if dropped:
            # only quantization remainders may have been dropped: at most half an int8 step (1/254 of the
            # pushed row's largest element) a push; the rows pushed can be far larger than their sum here
            tol += given_mag[i] * 0.01 + 1e-3 * len(batches)
        np.testing.assert_allclose(got, g, atol=tol, rtol=1e-4)
    if max_error == 1e-6:  # nothing but fp32 fits that bound: no remainders, nothing dropped, exact
        assert dropped == 0


def test_top_k_holds_the_smallest_rows_and_pushes_them_within_max_delay() -> None:
    comp = AdaptiveCompressor(DIM, AdaptiveConfig(density=0.25, max_delay=3, max_error=0.5), table="t")
    ids = np.arange(8, dtype=np.int64)
    grads = np.outer(np.arange(1, 9), np.ones(DIM)).astype(np.float32)  # row i has norm ~ i + 1
    first = comp.plan_push(ids, grads)
    assert sorted(first.ids.tolist()) == [6, 7]  # the 2 largest of 8
    assert comp.held_rows == 6
    other = np.array([100], np.int64)
    second = comp.plan_push(other, np.ones((1, DIM), np.float32))
    assert second.ids.tolist() == [100]
    third = comp.plan_push(other, np.ones((1, DIM), np.float32))
    # the rows held since step 1 have waited max_delay=3 steps at step 4; not yet at step 3
    assert set(third.ids.tolist()) == {100}
    fourth = comp.plan_push(other, np.ones((1, DIM), np.float32))
    assert set(fourth.ids.tolist()) >= set(range(6))
    assert comp.held_rows == 0


def test_codec_is_the_cheapest_within_the_measured_error_and_backs_off() -> None:
    # int8's error is at most sqrt(dim)/254 of a row's norm (half a step per element): a tight bound shows it
    cfg = AdaptiveConfig(density=1.0, max_error=0.005, hold_steps=3)
    comp = AdaptiveCompressor(DIM, cfg, table="t")
    rng = np.random.default_rng(0)
    smooth = (np.ones((64, DIM)) * rng.standard_normal((64, 1))).astype(np.float32)  # int8 holds them exactly
    plan = comp.plan_push(np.arange(64), smooth)
    assert plan.codec == "int8" and comp.last_push_error <= 0.005
    np.testing.assert_array_equal(plan.grads, round_trip(smooth, "int8"))  # what the server will decode
    # one large element per row: the small ones round to a whole step (error 0.7% of the row), fp16 keeps them
    spiky = np.full((64, DIM), 0.004, np.float32)
    spiky[:, 0] = 1.0
    plan = comp.plan_push(np.arange(64, 128), spiky)
    assert plan.codec == "fp16" and comp.push_dir.trips == 1
    np.testing.assert_array_equal(plan.grads, round_trip(spiky, "fp16"))
    plan = comp.plan_push(np.arange(128, 192), smooth)
    assert plan.codec == "fp16"  # held for hold_steps
    for _ in range(3):
        plan = comp.plan_push(np.arange(200, 264), smooth)
    assert plan.codec == "int8"  # measured again after the hold, and fine
    assert comp.codec_steps["fp16"] >= 2
    # nothing cheaper fits a bound below fp16's error: fp32
    exact = AdaptiveCompressor(DIM, AdaptiveConfig(density=1.0, max_error=1e-7), table="t")
    plan = exact.plan_push(np.arange(4), rng.standard_normal((4, DIM)).astype(np.float32))
    assert plan.codec == "fp32" and exact.push_dir.trips == 2 and len(exact.index) == 0


def test_loss_regression_trips_the_guard_to_dense_fp32() -> None:
    cfg = AdaptiveConfig(density=0.1, max_delay=50, loss_window=4, loss_tolerance=0.05, hold_steps=5)
    comp = AdaptiveCompressor(DIM, cfg, table="t")
    rng = np.random.default_rng(1)
    for loss in np.linspace(1.0, 0.5, 10):  # improving: no trip
        comp.plan_push(np.arange(20), rng.standard_normal((20, DIM)).astype(np.float32))
        comp.observe_loss(float(loss))
    assert comp.loss_trips == 0 and not comp.full_precision and comp.held_rows > 0
    for loss in (0.6, 0.7, 0.8):
        comp.observe_loss(loss)
    assert comp.loss_trips == 1 and comp.full_precision and comp.pull_codec == "fp32"
    plan = comp.plan_push(np.arange(5), rng.standard_normal((5, DIM)).astype(np.float32))
    assert plan.codec == "fp32" and set(plan.ids.tolist()) == set(range(20))  # dense, every held row delivered
    assert len(comp.index) == 0
    for _ in range(5):
        comp.plan_push(np.arange(20), rng.standard_normal((20, DIM)).astype(np.float32))
    assert not comp.full_precision and comp.plan_push(np.arange(20), np.ones((20, DIM), np.float32)).codec == "int8"
    comp.observe_loss(float("nan"))
    assert comp.loss_trips == 2 and comp.full_precision


def test_pull_codec_from_the_error_of_the_rows_received() -> None:
    gauss = np.random.default_rng(2).standard_normal((1000, 16)).astype(np.float32)
    measured = float(np.linalg.norm(gauss - round_trip(gauss, "int8")) / np.linalg.norm(gauss))
    assert abs(int8_error_estimate(gauss) - measured) < 0.1 * measured  # the estimate tracks the real error
    comp = AdaptiveCompressor(DIM, AdaptiveConfig(max_error=0.003, hold_steps=2), table="t")
    rows = (np.ones((100, DIM)) * np.random.default_rng(3).standard_normal((100, 1))).astype(np.float32)
    comp.observe_pull(rows)
    assert comp.pull_codec == "int8"
    spiky = np.full((10, DIM), 1e-3, np.float32)
    spiky[:, 0] = 1.0
    comp.observe_pull(spiky)
    assert comp.pull_codec == "fp16" and comp.pull_dir.trips == 1
    comp.observe_pull(rows)
    assert comp.pull_codec == "fp16"  # within the hold
    comp.step += 2
    comp.observe_pull(rows)
    assert comp.pull_codec == "int8"
    huge = spiky * 1e6  # beyond fp16's range: fp32
    comp.observe_pull(huge)
    assert comp.pull_codec == "fp32"


def test_bad_knobs_and_shapes_name_the_field() -> None:
    with pytest.raises(ps.InvalidArgument, match="'density'"):
        AdaptiveConfig(density=0)
    with pytest.raises(ps.InvalidArgument, match="'max_delay'"):
        AdaptiveConfig(max_delay=0)
    with pytest.raises(ps.InvalidArgument, match="'max_error'"):
        AdaptiveConfig(max_error=1.5)
    comp = AdaptiveCompressor(DIM, table="user")
    with pytest.raises(ps.InvalidArgument, match="table 'user'.*'grads'"):
        comp.plan_push(np.arange(3), np.zeros((3, DIM + 1), np.float32))
