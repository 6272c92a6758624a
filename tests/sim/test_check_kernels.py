"""The checks' kernels (``tigana.tools.testing.sim.kernels``) find what the numpy checks they replaced found: the
same violation kind, in the same precedence, at the same first id. Each kernel is held against a numpy
reference written here as the checkers wrote it before (masks, then ``argmax`` of the first mask that has
any), on random small arrays whose values collide often."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.ps.routing import IN_SYNC, slot_of
from tigana.tools.testing.sim import kernels

SETTINGS = settings(max_examples=200, deadline=None)


def _ints(data: st.DataObject, shape: int | tuple, lo: int = 0, hi: int = 3) -> np.ndarray:
    size = int(np.prod(shape))
    return np.array(data.draw(st.lists(st.integers(lo, hi), min_size=size, max_size=size)), np.int64).reshape(shape)


def _bools(data: st.DataObject, n: int) -> np.ndarray:
    return np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)


def _first(mask: np.ndarray) -> int:
    return int(mask.argmax()) if mask.any() else -1


# --- references: the numpy checks as they were ---
def _copy_reference(v, sent, sent_w, acked, held, primary, leads, leads_valid, slots, losing, lost, sync):
    over = (v[:, 0] > sent) | (v[:, 1] > sent_w)
    if over.any():
        return int(over.argmax()), None, -1
    must = held if sync else primary & (leads[slots] if leads_valid else np.zeros_like(primary)) & ~losing
    return -1, must & ~lost, _first(held & lost & (v[:, 0] < acked))


def _exact_reference(v, must, e0, e1, unknown, acked, acked_w, allow, lost_ever, sync):
    if not must.any():
        return 0, -1
    allow = np.zeros_like(acked) if sync else allow
    exact = must & ~unknown & (sync | ~lost_ever)
    r0, r1 = v[:, 0] - acked, v[:, 1] - acked_w
    for code, mask in ((kernels.LOW, exact & (r0 < e0)), (kernels.HIGH, exact & (r0 > e0)),
                       (kernels.SWAP, exact & (r1 != e1)), (kernels.LOOSE, must & ~exact & (v[:, 0] < acked - allow))):
        if mask.any():
            return code, int(mask.argmax())
    return 0, -1


def _in_doubt_reference(owner, at, slot, pending, weight, must, applied, blind, untold, n):
    untold = untold.copy()
    keep = pending & must[at]
    byte, bit = slot >> 3, (slot & 7).astype(np.uint8)
    done = ((applied[owner, byte] >> bit) & 1).astype(bool)
    unsure = keep & ~done & ((blind[owner, byte] >> bit) & 1).astype(bool)
    untold[owner[unsure]] = True
    out = keep & untold[owner]
    unknown = np.zeros(n, bool)
    unknown[at[out]] = True
    hit = keep & done & ~out
    e0 = np.bincount(at[hit], minlength=n)
    e1 = np.rint(np.bincount(at[hit], weights=weight[owner[hit]], minlength=n)).astype(np.int64)
    return e0, e1, unknown, untold


def _order_reference(copies, states, valid, positions, values, slots):
    every, ids = np.arange(copies.shape[0]), np.arange(slots.size)
    p = copies[:, 0]
    pi = np.maximum(p, 0)
    for col in range(1, copies.shape[1]):
        c = copies[:, col]
        ci = np.maximum(c, 0)
        same = ((p >= 0) & (c >= 0) & valid[pi] & valid[ci] & (states[:, col] == IN_SYNC)
                & (positions[pi, every] == positions[ci, every]).all(axis=1)
                & (positions[pi, every, 0] != np.iinfo(np.uint64).max))
        differ = same[slots] & (values[pi[slots], ids] != values[ci[slots], ids]).any(axis=1)
        if differ.any():
            return col, int(differ.argmax())
    return -1, -1


# --- the properties ---
@SETTINGS
@given(st.data(), st.integers(1, 12), st.booleans(), st.booleans())
def test_copy_verdict_is_the_numpy_bounds(data: st.DataObject, n: int, sync: bool, leads_valid: bool) -> None:
    num_slots = 4
    v, acked = _ints(data, (n, 2)), _ints(data, n)
    # what was sent: at least ``v`` but, in half the examples, below it at a few ids (an id above it ends the pass)
    sent, sent_w = (v[:, col] + _ints(data, n, 0, 2) - data.draw(st.booleans()) * (_ints(data, n, 0, 5) == 0)
                    for col in (0, 1))
    held, primary, losing, lost = (_bools(data, n) for _ in range(4))
    leads, slots = _bools(data, num_slots), _ints(data, n, 0, num_slots - 1)
    must = np.empty(n, bool)
    over, any_must, short = kernels.copy_verdict(v, sent, sent_w, acked, held, primary, leads, leads_valid, slots,
                                                 losing, lost, sync, must)
    want_over, want_must, want_short = _copy_reference(v, sent, sent_w, acked, held, primary, leads, leads_valid,
                                                       slots, losing, lost, sync)
    assert over == want_over
    if over < 0:
        assert (must == want_must).all() and any_must == want_must.any() and short == want_short


@SETTINGS
@given(st.data(), st.integers(1, 12), st.booleans())
def test_exact_verdict_is_the_numpy_precedence(data: st.DataObject, n: int, sync: bool) -> None:
    v, acked, acked_w = _ints(data, (n, 2), 0, 4), _ints(data, n), _ints(data, n)
    e0, e1, allow = _ints(data, n, 0, 2), _ints(data, n, 0, 2), _ints(data, n, 0, 2)
    must, unknown, lost_ever = _bools(data, n), _bools(data, n), _bools(data, n)
    got = kernels.exact_verdict(v, must, e0, e1, unknown, acked, acked_w, allow, lost_ever, sync)
    assert got == _exact_reference(v, must, e0, e1, unknown, acked, acked_w, allow, lost_ever, sync)


@SETTINGS
@given(st.data(), st.integers(1, 10), st.integers(1, 4), st.integers(1, 20))
def test_applied_in_doubt_is_the_numpy_bit_tests(data: st.DataObject, n: int, pushes: int, entries: int) -> None:
    num_slots = 12
    nbytes = (num_slots + 7) // 8
    owner, at = _ints(data, entries, 0, pushes - 1), _ints(data, entries, 0, n - 1)
    slot, pending = _ints(data, entries, 0, num_slots - 1), _bools(data, entries)
    weight = _ints(data, pushes, 1, 1000).astype(np.float64)
    must, untold = _bools(data, n), _bools(data, pushes)
    applied = _ints(data, (pushes, nbytes), 0, 255).astype(np.uint8)
    blind = _ints(data, (pushes, nbytes), 0, 255).astype(np.uint8)
    want = _in_doubt_reference(owner, at, slot, pending, weight, must, applied, blind, untold, n)
    assert kernels.kept_in_doubt(pending, at, must) == (pending & must[at]).any()
    e0, e1, unknown, told = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, bool), untold.copy()
    kernels.applied_in_doubt(owner, at, slot, pending, weight, must, applied, blind, told, e0, e1, unknown)
    for got, expected in zip((e0, e1, unknown, told), want, strict=True):
        assert (got == expected).all()


@SETTINGS
@given(st.data(), st.integers(1, 3), st.integers(1, 3), st.integers(1, 12))
def test_order_verdict_is_the_numpy_s5(data: st.DataObject, servers: int, width: int, n: int) -> None:
    num_slots = 4
    copies = _ints(data, (num_slots, width), -1, servers - 1).astype(np.int32)
    states = _ints(data, (num_slots, width), 0, 2).astype(np.uint8)
    valid = _bools(data, servers)
    positions = _ints(data, (servers, num_slots, 2), 0, 1).astype(np.uint64)
    positions[_bools(data, servers * num_slots).reshape(servers, num_slots)] = np.iinfo(np.uint64).max
    values, slots = _ints(data, (servers, n, 2), 0, 1), _ints(data, n, 0, num_slots - 1)
    got = kernels.order_verdict(copies, states, IN_SYNC, valid, positions, values, slots)
    assert got == _order_reference(copies, states, valid, positions, values, slots)


@SETTINGS
@given(st.data(), st.integers(1, 12), st.integers(0, 12))
def test_first_unchanged_and_rounded_are_the_numpy_reads(data: st.DataObject, n: int, size: int) -> None:
    num_slots = 4
    ids = _ints(data, size, -n, n + 3)
    leads, now, before = _bools(data, num_slots), _ints(data, (n, 2)), _ints(data, (n, 2))
    kept = ids[ids < n]
    missed = kept[leads[slot_of(kept, num_slots)] & (now[kept, 0] <= before[kept, 0])]
    assert kernels.first_unchanged(ids, n, leads, num_slots, now, before) == (int(missed[0]) if missed.size else -1)
    rows = (np.array(data.draw(st.lists(st.integers(-8, 8), min_size=2 * n, max_size=2 * n)), np.float32) / 4).reshape(n, 2)
    cached = np.rint(rows).astype(np.int64) + _ints(data, (n, 2), 0, 1) * data.draw(st.booleans())
    out = np.empty((n, 2), np.int64)
    same = kernels.rounded(rows, cached, out)
    assert (out == np.rint(rows).astype(np.int64)).all() and same == np.array_equal(cached, out)
    assert not kernels.rounded(rows, np.zeros((0, 2), np.int64), out)
