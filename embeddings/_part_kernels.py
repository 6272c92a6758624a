"""Compiled (numba) kernels of a ``PartitionedIndex``: a probe over every partition in one pass, the split of a
batch by partition (for inserts and deletes, which reserve room partition by partition), and the row gather of
a table's pull after its lookup.

A key's partition is bits 27-30 of its salted mix (``hashtable.parts_of``), which neither its home bucket inside the
partition (the top 32 bits, scaled onto its capacity as ``_kernels._home``) nor a power-of-two routing slot (the
low bits) reads: one mix per key picks both. ``probe`` reads the partitions' bucket arrays through their
addresses (``addresses``: int64 arrays the caller builds from arrays it keeps alive for the call), since numba
indexes a tuple of arrays by a runtime number through a copy of each array's struct: a probe given the arrays
as a tuple ran at 2 M keys/s, a split and one probe per partition at ~17 M, and this one as fast as one
``HashIndex`` (~30 M, 2 M keys). Same conventions as ``_kernels``: ``nogil``, cached, one signature each;
``AVAILABLE`` as there.
"""

from __future__ import annotations

import numpy as np

from tigana.embeddings._kernels import _ROW_PREFETCH_DISTANCE, AVAILABLE, EMPTY
from tigana.embeddings.mixing import mix64_scalar

PARTS = 16  # partitions of a PartitionedIndex; a power of two (a mask picks one)
_PART_SHIFT = np.uint64(27)  # below the 32 bits a partition's home bucket takes, away from routing's low bits
_PART_MASK = np.uint64(PARTS - 1)

_AHEAD = 32  # queries ahead whose home bucket is prefetched (as ``_kernels._PREFETCH_DISTANCE``)


def addresses(arrays: list[np.ndarray]) -> np.ndarray:
    """The data addresses of C-contiguous arrays (int64), for ``probe``: valid while the arrays live."""
    return np.array([a.__array_interface__["data"][0] for a in arrays], np.int64)


if AVAILABLE:
    from llvmlite import ir
    from numba import njit, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from tigana.embeddings._kernels import _PREFETCH_NAME, _prefetch_row

    def _load(bits: int):
        def codegen(context, builder, signature, args):
            ptr = builder.inttoptr(args[0], ir.IntType(bits).as_pointer())
            return builder.load(builder.gep(ptr, [args[1]]))
        return codegen

    @intrinsic
    def _u64_at(typingctx, addr, i):
        """The uint64 at ``addr`` (a data address) + 8 * ``i``."""
        return types.uint64(types.int64, types.int64), _load(64)

    @intrinsic
    def _i32_at(typingctx, addr, i):
        """The int32 at ``addr`` + 4 * ``i``."""
        return types.int32(types.int64, types.int64), _load(32)

    @intrinsic
    def _prefetch_addr(typingctx, addr):
        """Prefetch the cache line of byte address ``addr``; never faults."""
        def codegen(context, builder, signature, args):
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                _PREFETCH_NAME)
            builder.call(fn, [builder.inttoptr(args[0], i8p), i32(0), i32(3), i32(1)])  # read, keep, data cache
            return context.get_dummy_value()
        return types.void(types.int64), codegen

    _S32 = np.uint64(32)

    @njit(nogil=True, cache=True, inline="always")
    def _where(q, caps, salt):
        """(partition, home bucket in it) of key ``q`` in an index salted with ``salt``."""
        m = mix64_scalar(q ^ salt)
        part = np.int64((m >> _PART_SHIFT) & _PART_MASK)
        return part, np.int64(((m >> _S32) * np.uint64(caps[part])) >> _S32)

    @njit(nogil=True, cache=True)
    def probe(keys_at, vals_at, caps, offsets, queries, out_pos, out_val, salt):
        """For each uint64 query: its global bucket (``offsets[partition]`` + its bucket in the partition) and its
        value, else -1 and -1. ``keys_at``/``vals_at``: the addresses of each partition's keys (uint64) and
        values (int32) arrays (``addresses``), ``caps`` their lengths."""
        n = queries.shape[0]
        for i in range(n):
            if i + _AHEAD < n:
                ahead, h = _where(queries[i + _AHEAD], caps, salt)
                _prefetch_addr(keys_at[ahead] + 8 * h)
                _prefetch_addr(vals_at[ahead] + 4 * h)
            q = queries[i]
            part, p = _where(q, caps, salt)
            ka, va, cap = keys_at[part], vals_at[part], caps[part]
            while True:
                v = _i32_at(va, p)
                if v == EMPTY:
                    out_pos[i] = -1
                    out_val[i] = -1
                    break
                if v >= 0 and _u64_at(ka, p) == q:
                    out_pos[i] = offsets[part] + p
                    out_val[i] = v
                    break
                p += 1
                if p == cap:
                    p = 0

    @njit(nogil=True, cache=True)
    def split(keys, order, sorted_keys, bounds, salt):
        """Counting sort of uint64 ``keys`` by partition: ``sorted_keys[bounds[p]:bounds[p + 1]]`` are the keys of
        partition ``p`` (in batch order), ``order`` their places in ``keys``."""
        n = keys.shape[0]
        parts = np.empty(n, np.uint8)
        fill = np.zeros(PARTS, np.int64)
        for i in range(n):
            p = np.int64((mix64_scalar(keys[i] ^ salt) >> _PART_SHIFT) & _PART_MASK)
            parts[i] = p
            fill[p] += 1
        bounds[0] = 0
        for p in range(PARTS):
            bounds[p + 1] = bounds[p] + fill[p]
            fill[p] = bounds[p]
        for i in range(n):
            p = parts[i]
            at = fill[p]
            order[at] = i
            sorted_keys[at] = keys[i]
            fill[p] = at + 1

    @njit(nogil=True, cache=True)
    def gather_hits(weights, last_access, clock, positions, out_rows):
        """The rows of a pull's hits, for float32 storage: ``out_rows[i] = weights[positions[i]]`` and
        ``last_access = clock`` (when the table keeps the clock: ``last_access`` is empty otherwise) where
        ``positions[i] >= 0``; a miss's output row is left as it is. Rows are prefetched a fixed distance ahead."""
        n = positions.shape[0]
        dim = weights.shape[1]
        track = last_access.shape[0] > 0
        for i in range(n):
            if i + _ROW_PREFETCH_DISTANCE < n:
                t = positions[i + _ROW_PREFETCH_DISTANCE]
                if t >= 0:
                    _prefetch_row(weights, t)
            s = positions[i]
            if s >= 0:
                if track:
                    last_access[s] = clock
                for j in range(dim):
                    out_rows[i, j] = weights[s, j]
