"""The trainer's planning kernels against a sort-based reference (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.trainer._kernels import group_ids, group_segments


def _check_grouping(ids: np.ndarray, uniq: np.ndarray, inverse: np.ndarray, order: np.ndarray,
                    starts: np.ndarray) -> None:
    assert sorted(uniq.tolist()) == sorted(set(ids.tolist()))  # each distinct id once
    np.testing.assert_array_equal(uniq[inverse], ids)
    assert sorted(order.tolist()) == list(range(ids.size))
    bounds = np.append(starts, ids.size)
    for r in range(uniq.size):  # row r's values, in batch order
        group = order[bounds[r]:bounds[r + 1]]
        np.testing.assert_array_equal(group, np.flatnonzero(ids == uniq[r]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-2**63, 2**63 - 1) | st.integers(0, 20), max_size=200))
def test_group_ids_groups_like_a_sort(values) -> None:
    ids = np.array(values, np.int64)
    _check_grouping(ids, *group_ids(ids))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 30), max_size=40), min_size=1, max_size=6))
def test_group_segments_equals_group_ids_per_segment(segments) -> None:
    values = np.array([v for seg in segments for v in seg], np.int64)
    bounds = np.cumsum([0] + [len(seg) for seg in segments])
    uniq, index, order, row_starts, counts = group_segments(values, bounds)
    rows_before = 0
    for t, seg in enumerate(segments):
        lo, hi = bounds[t], bounds[t + 1]
        u, inv, o, s = group_ids(np.array(seg, np.int64))
        assert counts[t] == u.size
        np.testing.assert_array_equal(uniq[rows_before:rows_before + u.size], u)
        np.testing.assert_array_equal(index[lo:hi], inv + rows_before)
        np.testing.assert_array_equal(order[lo:hi], o + lo)
        np.testing.assert_array_equal(row_starts[rows_before:rows_before + u.size], s + lo)
        rows_before += u.size
    assert uniq.size == rows_before
