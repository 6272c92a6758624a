"""The slab's 32-bit step and time columns (``embeddings/slab.py``) against a reference model of what they promise:

- a step reads back exactly while it is within 2**31 steps of the newest one written;
- a time reads back rounded up to the next 1/128 s (never earlier than written, at most one tick later), and a
  time already in whole ticks reads back bit for bit, also through a second slab with another base (a replica);
- a value older than that range reads back as the range's start: never older than written (a TTL expires such a
  row late, never early), never younger than the range.
"""

from __future__ import annotations

import time
from unittest.mock import patch

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.embeddings import slab as slab_module
from tigana.embeddings.rows import RowBatch
from tigana.embeddings.slab import TIME_TICKS, Slab

RANGE = 1 << 31  # codes a base keeps below the newest value
NOW = float(int(time.time()))


def _batch(steps: list[int], times: list[float]) -> RowBatch:
    n = len(steps)
    return RowBatch(np.arange(n, dtype=np.int64), np.zeros((n, 2), np.float32), np.zeros((n, 1), np.float32),
                    np.zeros(n, np.int64), np.asarray(steps, np.int64), np.asarray(times, np.float64))


def _write_in_turns(slab: Slab, steps: list[int], times: list[float]) -> np.ndarray:
    """Write row i with (steps[i], times[i]), one row at a time, as pushes do; returns the positions."""
    positions = slab.allocate(len(steps))
    for k in range(len(steps)):
        slab.write(positions[k:k + 1], _batch(steps[k:k + 1], times[k:k + 1]), access=0)
    return positions


step_st = st.integers(0, 1 << 40)
time_st = st.floats(NOW - 3 * 10**8, NOW + 3 * 10**8, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(step_st, time_st), min_size=1, max_size=30))
def test_steps_and_times_read_back_as_the_model_says(rows: list[tuple[int, float]]) -> None:
    steps, times = [s for s, _ in rows], [t for _, t in rows]
    slab = Slab(2, 1)
    positions = _write_in_turns(slab, steps, times)
    got_steps, got_times = slab.steps_of(positions), slab.times_of(positions)
    newest_step = max(steps)
    for k, (s, t) in enumerate(rows):
        if s >= newest_step - RANGE:  # within the range of the newest: exact
            assert got_steps[k] == s
        else:  # older: exact, or read back as the range's past edge; never older than written
            assert s <= got_steps[k] <= newest_step - RANGE
        tick = np.ceil(t * TIME_TICKS) / TIME_TICKS
        if t >= max(times) - RANGE / TIME_TICKS + 1:
            assert got_times[k] == tick, (t, got_times[k])
        else:
            assert got_times[k] >= t


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(NOW - 8 * 10**6, NOW + 8 * 10**6, allow_nan=False), min_size=1, max_size=20))
def test_times_in_whole_ticks_cross_slabs_bit_for_bit(times: list[float]) -> None:
    """A replica (or a snapshot, or a cut) gets the rows a primary's slab reads: their times must land the same,
    whatever base the second slab chose."""
    first = Slab(2, 1)
    positions = first.allocate(len(times))
    first.write(positions, _batch([0] * len(times), times), access=0)
    read = first.read(np.arange(len(times)), positions)
    second = Slab(2, 1)
    second.write(second.allocate(1), _batch([0], [NOW + 5e6]), access=0)  # another base than the first's
    again = second.allocate(len(times))
    second.write(again, read, access=0)
    np.testing.assert_array_equal(second.times_of(again), read.last_time)
    assert (read.last_time >= np.asarray(times)).all()
    assert (read.last_time - np.asarray(times) <= 1 / TIME_TICKS).all()


def test_a_base_move_keeps_recent_rows_and_clamps_old_ones() -> None:
    slab = Slab(2, 1)
    # the recent time is past the old one's range: the time base moves; the later step moves the step base
    old, recent = _write_in_turns(slab, [5, 3_000_000_000], [NOW - 300 * 86400, NOW - 3600.25])
    later = _write_in_turns(slab, [5_000_000_000], [NOW + 100 * 86400])
    assert slab.steps_of(later).tolist() == [5_000_000_000]
    assert slab.steps_of(np.array([recent])).tolist() == [3_000_000_000]
    assert slab.steps_of(np.array([old])).tolist() == [5_000_000_000 - RANGE]  # the range's past edge
    assert slab.times_of(np.array([recent])).tolist() == [NOW - 3600.25]
    assert slab.times_of(np.array([old]))[0] > NOW - 300 * 86400  # younger than written: expires late, not early
    assert slab.times_of(later).tolist() == [NOW + 100 * 86400]


def test_slab_rows_hold_eight_bytes_less_metadata() -> None:
    """update count, step, time and the mark: 4 + 4 + 4 + 1 bytes (the access clock, when kept, 4 more)."""
    assert Slab(16, 1).row_nbytes == 64 + 4 + 13
    assert Slab(16, 1, track_access=True).row_nbytes == 64 + 4 + 17


@settings(max_examples=200)
@given(st.lists(st.tuples(step_st, st.one_of(time_st, st.sampled_from([float("nan"), float("inf"), -float("inf")]))),
                min_size=1, max_size=30))
def test_one_write_codes_match_the_array_path(writes: list[tuple[int, float]]) -> None:
    # a push codes its one step and time with the scalar path: same codes and the same base moves as the
    # array path, write after write (bases move with steps and times 2**31 codes apart)
    scalar, arrays = Slab(2, 1), Slab(2, 1)
    for step, t in writes:
        assert scalar.step_code(step) == int(arrays.step_codes(np.array([step], np.int64))[0])
        assert scalar.time_code(t) == int(arrays.time_codes(np.array([t], np.float64))[0])
        assert (scalar.step_base, scalar.time_base) == (arrays.step_base, arrays.time_base)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.tuples(step_st, st.one_of(time_st, st.sampled_from([float("nan"), -float("inf")])),
                                   st.integers(-3, 2**33)), min_size=1, max_size=12), min_size=1, max_size=8),
       st.booleans())
def test_a_whole_row_write_codes_its_columns_as_the_array_path(batches: list[list[tuple[int, float, int]]],
                                                                track: bool) -> None:
    # a replicated item's rows are written in one compiled pass when the kernels are there: the same columns
    # (counts clamped, step and time codes, bases moved, access clock, mark) as the numpy path, batch after batch
    fused, arrays = Slab(2, 1, track_access=track), Slab(2, 1, track_access=track)
    for k, rows in enumerate(batches):
        positions = np.arange(len(rows), dtype=np.int64)[::-1].copy()
        batch = _batch([r[0] for r in rows], [r[1] for r in rows])
        batch = RowBatch(batch.ids, batch.weights, batch.state, np.asarray([r[2] for r in rows], np.int64),
                         batch.last_step, batch.last_time)
        for slab in (fused, arrays):
            slab.allocate(max(0, len(rows) - slab.high_water))
        fused.write(positions, batch, access=k + 1)
        with patch.object(slab_module._kernels, "AVAILABLE", False):
            arrays.write(positions, batch, access=k + 1)
        for column in ("update_count", "last_step", "last_time", "last_access", "dirty"):
            np.testing.assert_array_equal(getattr(fused, column), getattr(arrays, column), err_msg=column)
        assert (fused.step_base, fused.time_base) == (arrays.step_base, arrays.time_base)
