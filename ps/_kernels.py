"""Compiled (numba) kernels of the data path: batch deduplication and grouping (by primary, then slot), fp16
conversion, the server's check that it leads every id's slot.

``dedup_grouped`` and ``dedup_sum_grouped`` use an open-addressing hash over the batch (O(n), no sort), keep
ids in first-seen order within each group, and add duplicate rows in batch order in float32, the order the
storage engine uses, so a pre-summed push lands bit for bit as the engine would apply the raw batch. The fp16 kernels convert
with round-to-nearest-even and saturate finite values at ±65504 (numpy's converter is a scalar loop, ~10x
slower). All release the GIL and compile once per machine (``cache=True``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tigana.embeddings.mixing import mix64_scalar, slot_of_key


@njit(nogil=True, cache=True, inline="always")
def _bucket(key, mask):
    return np.int64(mix64_scalar(key) & np.uint64(mask))


@njit(nogil=True, cache=True, inline="always")
def _capacity(n):
    cap = 16
    while cap < 2 * n:
        cap *= 2
    return cap


@njit(nogil=True, cache=True)
def f32_to_f16_bits(x, out):
    """float32 (any shape, flattened) -> IEEE half bits (uint16), round to nearest even; finite values
    saturate at ±65504, Inf stays Inf, NaN stays NaN (quiet, payload dropped). Branch-free (both roundings are
    computed and one selected) so the loop vectorizes; checked against a branchy reference on all 2^32 inputs."""
    bits = x.view(np.uint32)
    for i in range(bits.shape[0]):
        b = bits[i]
        sign = (b >> np.uint32(16)) & np.uint32(0x8000)
        a = b & np.uint32(0x7FFFFFFF)
        # a normal half: rebias the exponent, round the 13 dropped bits to nearest even, saturate at 65504
        hn = (a - np.uint32(0x38000000) + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
        hn = min(hn, np.uint32(0x7BFF))
        # a subnormal half or zero (|x| < 2^-14): the mantissa with its implicit bit, shifted and rounded
        e = a >> np.uint32(23)
        shift = min(max(np.uint32(126) - min(e, np.uint32(126)), np.uint32(14)), np.uint32(25))
        m = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
        hs = m >> shift
        rem = m & ((np.uint32(1) << shift) - np.uint32(1))
        half = np.uint32(1) << (shift - np.uint32(1))
        hs += np.uint32((rem > half) | ((rem == half) & ((hs & np.uint32(1)) == np.uint32(1))))
        h = hs if a < np.uint32(0x38800000) else hn
        special = np.uint32(0x7C00) | (np.uint32(0x200) if a > np.uint32(0x7F800000) else np.uint32(0))
        h = special if a >= np.uint32(0x7F800000) else h
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


@njit(nogil=True, cache=True, inline="always")
def _group_of_key(key, group_of_slot, num_slots):
    return group_of_slot[slot_of_key(key, num_slots)]


@njit(nogil=True, cache=True)
def _dedup_grouped(ids, group_of_slot, num_groups, unique=False):
    """Shared first pass: (position of each id's unique in the grouped order, grouped unique ids,
    starts). Groups are in group order; within a group, first-seen order. ``unique``: the caller has
    deduplicated ``ids`` already (a trainer's plan), so the hash pass is skipped and only the counting sort
    by group runs (duplicates would then travel twice, which every server still handles correctly)."""
    n = ids.shape[0]
    num_slots = np.uint64(group_of_slot.shape[0])
    first = np.empty(n, np.int64)  # unique k -> its key
    group = np.empty(n, np.int64)  # unique k -> its group
    inverse = np.empty(n, np.int64)
    starts = np.zeros(num_groups + 1, np.int64)
    k = 0
    if unique:
        for i in range(n):
            key = ids[i]
            first[i] = key
            o = _group_of_key(key, group_of_slot, num_slots)
            group[i] = o
            starts[o + 1] += 1
            inverse[i] = i
        k = n
    cap = _capacity(0 if unique else n)
    mask = cap - 1
    index = np.full(cap, -1, np.int64)
    for i in range(0 if unique else n):
        key = ids[i]
        p = _bucket(key, mask)
        while True:
            j = index[p]
            if j == -1:
                index[p] = k
                first[k] = key
                o = _group_of_key(key, group_of_slot, num_slots)
                group[k] = o
                starts[o + 1] += 1
                inverse[i] = k
                k += 1
                break
            if first[j] == key:
                inverse[i] = j
                break
            p = (p + 1) & mask
    for o in range(num_groups):
        starts[o + 1] += starts[o]
    fill = starts[:-1].copy()
    pos = np.empty(k, np.int64)  # unique k -> its place in the grouped order
    uniq = np.empty(k, np.int64)
    for j in range(k):
        o = group[j]
        pos[j] = fill[o]
        uniq[fill[o]] = first[j]
        fill[o] += 1
    for i in range(n):
        inverse[i] = pos[inverse[i]]
    return inverse, uniq, starts


@njit(nogil=True, cache=True)
def dedup_grouped(ids, group_of_slot, num_groups):
    """(n,) int64 ids -> (uniq, starts, src): the unique ids grouped (group i's at
    ``uniq[starts[i]:starts[i + 1]]``, first-seen order within a group) and (n,) int64 ``src`` with
    ``ids == uniq[src]``. An id's group is ``group_of_slot[routing.slot_of(id)]`` (the client's slot keys:
    by primary, then slot). The pull's one pass over the batch."""
    src, uniq, starts = _dedup_grouped(ids, group_of_slot, num_groups)
    return uniq, starts, src


_GRAD_LIMIT_LOG2 = 64
GRAD_LIMIT = float(2.0**_GRAD_LIMIT_LOG2)  # a summed gradient at or above this magnitude is refused by the client
# float32 bits of GRAD_LIMIT with the sign cleared: |x| >= GRAD_LIMIT exactly when x's exponent field is at least
# this (NaN/Inf have the largest exponent, so they compare above it too). A module constant: numba freezes it.
_GRAD_LIMIT_BITS = (127 + _GRAD_LIMIT_LOG2) << 23


@njit(nogil=True, cache=True)
def dedup_sum_grouped(ids, grads, group_of_slot, num_groups):
    """(n,) int64 ids, (n, dim) float32 grads -> (uniq, sums, starts, in_range) grouped as
    ``dedup_grouped``, duplicate rows added in batch order in float32; ``in_range`` is False when some sum is
    NaN, Inf or of magnitude 2**64 or more (``GRAD_LIMIT``: its square overflows float32, so every optimizer
    with a second moment would write Inf; always False when grads has a NaN or Inf). Each server's rows are
    one contiguous slice, so a push message is built from views without a gather copy."""
    src, uniq, starts = _dedup_grouped(ids, group_of_slot, num_groups)
    sums, in_range = _sum_rows(src, grads, uniq.shape[0])
    return uniq, sums, starts, in_range


@njit(nogil=True, cache=True, inline="always")
def _sum_rows(src, grads, k):
    """(k, dim) sums of ``grads`` rows by ``src`` (batch order, float32) and whether every sum is in range."""
    n = src.shape[0]
    dim = grads.shape[1]
    sums = np.empty((k, dim), np.float32)
    seen = np.zeros(k, np.bool_)
    for i in range(n):
        r = src[i]
        if seen[r]:
            for c in range(dim):
                sums[r, c] += grads[i, c]
        else:
            seen[r] = True
            for c in range(dim):
                sums[r, c] = grads[i, c]
    # A NaN or Inf anywhere in grads leaves a non-finite sum (finite values can also overflow to Inf); the
    # biased exponent of |x| >= GRAD_LIMIT is at least that of GRAD_LIMIT, and NaN/Inf have the largest (255).
    bits = sums.reshape(-1).view(np.uint32)
    exp = np.uint32(0x7F800000)
    limit = np.uint32(_GRAD_LIMIT_BITS)
    bad = np.uint32(0)
    for i in range(bits.shape[0]):  # an integer or-reduction: vectorizes
        bad |= np.uint32((bits[i] & exp) >= limit)
    return sums, bad == 0


@njit(nogil=True, cache=True)
def dedup_grouped_many(ids, bounds, group_of_slot, num_groups, unique):
    """Several tables' pulls grouped in one call: segment t is ``ids[bounds[t]:bounds[t + 1]]``, grouped as
    ``dedup_grouped`` (``unique``: already deduplicated, see ``_dedup_grouped``). Returns (uniq, ubounds,
    starts, src): segment t's grouped unique ids are ``uniq[ubounds[t]:ubounds[t + 1]]`` with group starts
    ``starts[t]`` (relative to that block), and ``src`` maps each id to its row in its own segment's block."""
    t_count = bounds.shape[0] - 1
    uniq = np.empty(ids.shape[0], np.int64)
    src = np.empty(ids.shape[0], np.int64)
    ubounds = np.zeros(t_count + 1, np.int64)
    starts = np.empty((t_count, num_groups + 1), np.int64)
    for t in range(t_count):
        lo, hi = bounds[t], bounds[t + 1]
        s, u, st = _dedup_grouped(ids[lo:hi], group_of_slot, num_groups, unique)
        k = u.shape[0]
        uniq[ubounds[t]:ubounds[t] + k] = u
        ubounds[t + 1] = ubounds[t] + k
        starts[t] = st
        src[lo:hi] = s
    return uniq[:ubounds[t_count]], ubounds, starts, src


@njit(nogil=True, cache=True)
def dedup_sum_grouped_many(ids, grads, bounds, group_of_slot, num_groups, unique):
    """Several tables' pushes grouped in one call, segments as ``dedup_grouped_many``: (uniq, sums, ubounds,
    starts, in_range), segment t's sums at ``sums[ubounds[t]:ubounds[t + 1]]`` and ``in_range[t]`` as
    ``dedup_sum_grouped``'s."""
    t_count = bounds.shape[0] - 1
    uniq = np.empty(ids.shape[0], np.int64)
    sums = np.empty((ids.shape[0], grads.shape[1]), np.float32)
    ubounds = np.zeros(t_count + 1, np.int64)
    starts = np.empty((t_count, num_groups + 1), np.int64)
    in_range = np.empty(t_count, np.bool_)
    for t in range(t_count):
        lo, hi = bounds[t], bounds[t + 1]
        s, u, st = _dedup_grouped(ids[lo:hi], group_of_slot, num_groups, unique)
        k = u.shape[0]
        block, ok = _sum_rows(s, grads[lo:hi], k)
        uniq[ubounds[t]:ubounds[t] + k] = u
        sums[ubounds[t]:ubounds[t] + k] = block
        ubounds[t + 1] = ubounds[t] + k
        starts[t] = st
        in_range[t] = ok
    return uniq[:ubounds[t_count]], sums[:ubounds[t_count]], ubounds, starts, in_range



@njit(nogil=True, cache=True)
def slots_of(ids, num_slots, out):
    """out[i] = the slot of ids[i] (``routing.slot_of``: mix64 modulo ``num_slots``), in one pass without the GIL;
    a power-of-two count masks instead of dividing. Lists and maps of whole tables (a slot copy's listing, a
    replica emptying slots) map millions of ids at once: numpy's five passes and 64-bit modulo took ~27 ns an id."""
    n = np.uint64(num_slots)
    for i in range(ids.shape[0]):
        out[i] = slot_of_key(ids[i], n)


@njit(nogil=True, cache=True)
def first_foreign(ids, leads):
    """(count, first position) of the ids whose slot (``routing.slot_of`` over ``len(leads)`` slots) this
    server does not lead (``leads[slot]`` False); position -1 when it leads them all. One pass, no temporaries
    (the server's check before a write or pull)."""
    num_slots = np.uint64(leads.shape[0])
    count = 0
    first = -1
    for i in range(ids.shape[0]):
        if not leads[slot_of_key(ids[i], num_slots)]:
            if first < 0:
                first = i
            count += 1
    return count, first


@njit(nogil=True, cache=True)
def gather_rows(block, src, out):
    """out[i] = block[src[i]]: the batch's rows from its unique rows. Pass row-compatible integer views
    (``row_words``): a plain word loop runs ~2x faster than ``np.take``'s per-row copies."""
    w = out.shape[1]
    for i in range(src.shape[0]):
        r = src[i]
        for c in range(w):
            out[i, c] = block[r, c]


@njit(nogil=True, cache=True)
def gather_rows2(first, second, src, out):
    """``gather_rows`` from two consecutive blocks (unique rows [0, len(first)) and then ``second``): a pull
    answered by two servers is reassembled straight from the two replies, without joining them first."""
    w = out.shape[1]
    split = first.shape[0]
    for i in range(src.shape[0]):
        r = src[i]
        if r < split:
            for c in range(w):
                out[i, c] = first[r, c]
        else:
            r -= split
            for c in range(w):
                out[i, c] = second[r, c]


def row_words(rows: np.ndarray) -> np.ndarray:
    """(n, dim) float32 (C-contiguous rows) as (n, words) int64 when a row is a whole number of 8-byte words,
    else as int32: the same bytes, in the unit the gather kernels copy."""
    if rows.shape[1] % 2 == 0:
        return rows.view(np.int64)
    return rows.view(np.int32)


@njit(nogil=True, cache=True)
def slots_foreign(ids, leads):
    """(slots, count, first): every id's routing slot (``routing.slot_of`` over ``len(leads)`` slots) and the
    count and first position of ids whose slot this server does not lead (-1: it leads them all). One pass."""
    num_slots = np.uint64(leads.shape[0])
    n = ids.shape[0]
    slots = np.empty(n, np.int64)
    count = 0
    first = -1
    for i in range(n):
        s = slot_of_key(ids[i], num_slots)
        slots[i] = s
        if not leads[s]:
            if first < 0:
                first = i
            count += 1
    return slots, count, first


@njit(nogil=True, cache=True)
def first_nonfinite_row(bits):
    """The first row of float32 values (given as their uint32 ``bits``, (n, dim)) holding NaN or Inf, or -1: a
    float32 is not finite iff its exponent bits are all ones. One pass, no temporary array."""
    exp = np.uint32(0x7F800000)
    for i in range(bits.shape[0]):
        for j in range(bits.shape[1]):
            if bits[i, j] & exp == exp:
                return i
    return -1


@njit(nogil=True, cache=True)
def count_into(slots, counts):
    """``counts[s] += 1`` for every slot in ``slots`` (a table's per-slot request counter): O(ids), where a
    ``np.bincount(slots, minlength=num_slots)`` added to ``counts`` costs a num_slots array per request."""
    for i in range(slots.shape[0]):
        counts[slots[i]] += 1.0
