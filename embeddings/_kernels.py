"""Compiled (numba) kernels of the storage engine: hash probing, dedup+segment-sum, optimizers, row gathers.

Every kernel is ``@njit(nogil=True, cache=True)``: it releases the GIL (a server's request threads overlap) and
compiles once per machine. Each is called with one signature only (C-contiguous arrays of fixed dtypes), so a
process pays each compile at most once. ``AVAILABLE`` is False when numba cannot be imported; the callers then
use their numpy fallbacks, which compute the same results.

Hash layout shared with ``hashtable.py``: ``keys`` uint64[cap] (the int64 ids' bits), ``vals`` int32[cap] with
``EMPTY`` (-1) / ``TOMBSTONE`` (-2) / a value >= 0 (for a table's index: the row's position in its Slab). A
bucket's state lives in ``vals``, so every 64-bit id is a valid key. Home bucket = fastrange(hash) =
((hash >> 32) * cap) >> 32 with hash = mix64(key ^ salt), the index's own random salt (``hashtable``), linear
probing with wrap-around.
"""

from __future__ import annotations

import math

import numpy as np

from tigana.embeddings.mixing import mix64_scalar, slot_of_key

EMPTY = -1
TOMBSTONE = -2

try:  # pragma: no cover - exercised by whichever path the machine has
    import llvmlite.binding
    from llvmlite import ir
    from numba import njit, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    AVAILABLE = True
except ImportError:  # pragma: no cover
    AVAILABLE = False

_PREFETCH_DISTANCE = 32  # queries ahead whose hash bucket is prefetched
_ROW_PREFETCH_DISTANCE = 16  # rows ahead whose cache lines are prefetched

if AVAILABLE:
    # Software prefetch (llvm.prefetch): random buckets and rows are cache misses; issuing them a few
    # dozen iterations ahead overlaps their latency (measured: lookup+gather about 2x faster).
    _PREFETCH_NAME = "llvm.prefetch.p0" if llvmlite.binding.llvm_version_info >= (15,) else "llvm.prefetch.p0i8"

    def _emit_prefetch(context, builder, ary_t, ary_v, indices):
        ary = context.make_array(ary_t)(context, builder, ary_v)
        ptr = cgutils.get_item_pointer(context, builder, ary_t, ary, indices, wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH_NAME)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])  # read, keep, data cache

    @intrinsic
    def _prefetch1(typingctx, arr, i):
        """Prefetch the cache line of ``arr[i]`` (1-D); never faults."""
        def codegen(context, builder, signature, args):
            idx = context.cast(builder, args[1], signature.args[1], types.intp)
            _emit_prefetch(context, builder, signature.args[0], args[0], [idx])
            return context.get_dummy_value()
        return types.void(arr, i), codegen

    @intrinsic
    def _prefetch2(typingctx, arr, i, j):
        """Prefetch the cache line of ``arr[i, j]`` (2-D); never faults."""
        def codegen(context, builder, signature, args):
            ii = context.cast(builder, args[1], signature.args[1], types.intp)
            jj = context.cast(builder, args[2], signature.args[2], types.intp)
            _emit_prefetch(context, builder, signature.args[0], args[0], [ii, jj])
            return context.get_dummy_value()
        return types.void(arr, i, j), codegen

    @njit(nogil=True, cache=True, inline="always")
    def _prefetch_row(arr, r):
        """Prefetch every cache line of row ``r`` of a 2-D float32 array."""
        for c in range(0, arr.shape[1], 16):
            _prefetch2(arr, r, c)

    _S32 = np.uint64(32)

    @njit(nogil=True, cache=True, inline="always")
    def _home(key, cap, salt):
        """The home bucket of ``key`` in an index of ``cap`` buckets salted with ``salt`` (both uint64)."""
        return np.int64(((mix64_scalar(key ^ salt) >> _S32) * cap) >> _S32)

    @njit(nogil=True, cache=True, inline="always")
    def _prefetch_ahead(keys, vals, queries, i, n, ucap, salt):
        """Prefetch the home bucket of the query a fixed distance ahead of ``i`` (a random bucket is a miss)."""
        if i + _PREFETCH_DISTANCE < n:
            h = _home(queries[i + _PREFETCH_DISTANCE], ucap, salt)
            _prefetch1(keys, h)
            _prefetch1(vals, h)

    @njit(nogil=True, cache=True)
    def probe(keys, vals, queries, out_pos, out_val, salt):
        """For each query: bucket position and value (a row's slab position) if present, else -1 and -1."""
        cap = keys.shape[0]
        ucap = np.uint64(cap)
        n = queries.shape[0]
        for i in range(n):
            _prefetch_ahead(keys, vals, queries, i, n, ucap, salt)
            q = queries[i]
            p = _home(q, ucap, salt)
            while True:
                v = vals[p]
                if v == EMPTY:
                    out_pos[i] = -1
                    out_val[i] = -1
                    break
                if v >= 0 and keys[p] == q:
                    out_pos[i] = p
                    out_val[i] = v
                    break
                p += 1
                if p == cap:
                    p = 0

    @njit(nogil=True, cache=True)
    def insert(keys, vals, new_keys, new_vals, salt):
        """Insert unique keys known to be absent; returns how many EMPTY buckets were consumed. Each home bucket
        is prefetched a fixed distance ahead (a random insert is a cache miss: about 2x faster)."""
        cap = keys.shape[0]
        ucap = np.uint64(cap)
        consumed = 0
        n = new_keys.shape[0]
        for i in range(n):
            _prefetch_ahead(keys, vals, new_keys, i, n, ucap, salt)
            p = _home(new_keys[i], ucap, salt)
            while vals[p] >= 0:
                p += 1
                if p == cap:
                    p = 0
            if vals[p] == EMPTY:
                consumed += 1
            keys[p] = new_keys[i]
            vals[p] = new_vals[i]
        return consumed

    @njit(nogil=True, cache=True)
    def rehash(keys, vals, new_keys, new_vals, salt):
        """Insert every live bucket of (keys, vals) into the empty (new_keys, new_vals); returns live keys.
        One pass over the old buckets, no intermediate arrays, homes prefetched ahead."""
        cap = new_keys.shape[0]
        ucap = np.uint64(cap)
        n = keys.shape[0]
        live = 0
        for i in range(n):
            ahead = i + _PREFETCH_DISTANCE
            if ahead < n and vals[ahead] >= 0:
                h = _home(keys[ahead], ucap, salt)
                _prefetch1(new_keys, h)
                _prefetch1(new_vals, h)
            if vals[i] < 0:
                continue
            p = _home(keys[i], ucap, salt)
            while new_vals[p] >= 0:
                p += 1
                if p == cap:
                    p = 0
            new_keys[p] = keys[i]
            new_vals[p] = vals[i]
            live += 1
        return live

    @njit(nogil=True, cache=True)
    def dedup_sum(positions, grads):
        """Sum rows of ``grads`` that share a key (a slab position, or any int64 but -1). Returns (unique keys in
        first-seen order, (k, dim) float32 sums added in batch order). A local open-addressing map keyed by
        key assigns each row its group."""
        n = positions.shape[0]
        dim = grads.shape[1]
        cap = 16
        while cap < 2 * n:
            cap *= 2
        mask = cap - 1
        table_key = np.full(cap, -1, np.int64)
        table_group = np.empty(cap, np.int32)
        group = np.empty(n, np.int32)
        uniq = np.empty(n, np.int64)
        k = 0
        for i in range(n):
            s = positions[i]
            p = np.int64((np.uint64(s) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)) & mask
            while True:
                t = table_key[p]
                if t == -1:
                    table_key[p] = s
                    table_group[p] = k
                    group[i] = k
                    uniq[k] = s
                    k += 1
                    break
                if t == s:
                    group[i] = table_group[p]
                    break
                p = (p + 1) & mask
        sums = np.zeros((k, dim), np.float32)
        for i in range(n):
            r = group[i]
            for j in range(dim):
                sums[r, j] += grads[i, j]
        return uniq[:k].copy(), sums

    @njit(nogil=True, cache=True)
    def first_nonfinite_row(bits):
        """(index of the first row holding NaN or Inf in float32 values given as uint32 ``bits`` or -1, the
        largest exponent field seen up to there): the exponent bounds every value, so the caller can tell
        whether a sum of the rows could overflow.

        A float32 is not finite iff its exponent bits are all ones; the integer max vectorizes."""
        exp = np.uint32(0x7F800000)
        top = np.uint32(0)
        for i in range(bits.shape[0]):
            m = np.uint32(0)
            for j in range(bits.shape[1]):
                m = max(m, bits[i, j] & exp)
            if m == exp:
                return i, exp
            top = max(top, m)
        return -1, top

    @njit(nogil=True, cache=True)
    def touch(rows, update_count, last_step, last_time, last_access, dirty, step, now, clock, mark):
        """Stamp an update on unique ``rows``: count +1, step and time (their uint32 codes, ``Slab.step_codes``),
        access clock (when kept: ``last_access`` is empty otherwise), snapshot mark."""
        track = last_access.shape[0] > 0
        for i in range(rows.shape[0]):
            r = rows[i]
            update_count[r] += np.uint32(1)
            last_step[r] = step
            last_time[r] = now
            if track:
                last_access[r] = clock
            dirty[r] = mark

    @njit(nogil=True, cache=True)
    def write_meta(rows, counts, steps, times, update_count, last_step, last_time, last_access, dirty, step_base,
                   time_base, access, mark):
        """``Slab.write``'s columns of whole rows at unique ``rows``: update counts (clamped to uint32), step and
        time codes (``Slab.step_codes``/``time_codes`` of finite times, the same float64 operations), access
        clock (when kept), snapshot mark."""
        track = last_access.shape[0] > 0
        for i in range(rows.shape[0]):
            r = rows[i]
            update_count[r] = min(counts[i], 4294967295)
            last_step[r] = min(max(steps[i] - step_base, 0), 4294967295)
            last_time[r] = np.uint32(min(max(np.ceil((times[i] - time_base) * 128.0), 0.0), 4294967295.0))
            if track:
                last_access[r] = access
            dirty[r] = mark

    # Reassociation lets the row reductions (row-wise Adagrad's mean of g²) vectorize: about 5x faster.
    # No finite-math assumptions: NaN/Inf stay well defined. error_model="numpy" drops numba's per-divide
    # zero check (which blocks vectorization): the adagrad kernel ran about 4x faster with it.
    _FAST = {"reassoc", "nsz", "contract"}
    _F32_MAX = np.float32(np.finfo(np.float32).max)

    # --- optimizers: rows ``rows`` of weights (N, dim) f32 and state (N, width) f32 updated by ``grads`` (k,
    # dim); row i's result goes to row ``out[i]`` of ``w_out``/``s_out``, and ``bad[out[i]]`` says whether it
    # holds a NaN/Inf (not |x| <= max float32: no finite-math flag lets LLVM fold that comparison, where
    # reassociation folds x - x to 0). Nothing is written in place: the table checks ``bad`` before it stores
    # the results, so a push that would poison a row changes nothing.
    @njit(nogil=True, cache=True, fastmath=_FAST, error_model="numpy")
    def sgd(weights, rows, grads, lr, w_out, out, bad):
        dim = weights.shape[1]
        k = rows.shape[0]
        for i in range(k):
            if i + _ROW_PREFETCH_DISTANCE < k:
                _prefetch_row(weights, rows[i + _ROW_PREFETCH_DISTANCE])
            r, o = rows[i], out[i]
            nf = False
            for j in range(dim):
                w = weights[r, j] - np.float32(lr) * grads[i, j]
                w_out[o, j] = w
                nf |= not (abs(w) <= _F32_MAX)
            bad[o] = nf

    @njit(nogil=True, cache=True, fastmath=_FAST, error_model="numpy")
    def adagrad(weights, state, rows, grads, lr, eps, w_out, s_out, out, bad):
        dim = weights.shape[1]
        lr32 = np.float32(lr)
        eps32 = np.float32(eps)
        k = rows.shape[0]
        for i in range(k):
            if i + _ROW_PREFETCH_DISTANCE < k:
                _prefetch_row(weights, rows[i + _ROW_PREFETCH_DISTANCE])
                _prefetch_row(state, rows[i + _ROW_PREFETCH_DISTANCE])
            r, o = rows[i], out[i]
            nf = False
            for j in range(dim):
                g = grads[i, j]
                acc = state[r, j] + g * g
                w = weights[r, j] - lr32 * g / (np.sqrt(acc) + eps32)
                s_out[o, j] = acc
                w_out[o, j] = w
                nf |= not ((abs(acc) <= _F32_MAX) & (abs(w) <= _F32_MAX))
            bad[o] = nf

    @njit(nogil=True, cache=True, fastmath=_FAST, error_model="numpy")
    def rowwise_adagrad(weights, state, rows, grads, lr, eps, w_out, s_out, out, bad):
        dim = weights.shape[1]
        lr32 = np.float32(lr)
        eps32 = np.float32(eps)
        k = rows.shape[0]
        for i in range(k):
            if i + _ROW_PREFETCH_DISTANCE < k:
                _prefetch_row(weights, rows[i + _ROW_PREFETCH_DISTANCE])
                _prefetch_row(state, rows[i + _ROW_PREFETCH_DISTANCE])
            r, o = rows[i], out[i]
            sq = np.float32(0.0)
            for j in range(dim):
                g = grads[i, j]
                sq += g * g
            acc = state[r, 0] + sq / np.float32(dim)
            s_out[o, 0] = acc
            scale = lr32 / (np.sqrt(acc) + eps32)
            nf = not (abs(acc) <= _F32_MAX)
            for j in range(dim):
                w = weights[r, j] - scale * grads[i, j]
                w_out[o, j] = w
                nf |= not (abs(w) <= _F32_MAX)
            bad[o] = nf

    # Adam without reassociation: it moved (1 - beta2) * g * g to (1 - beta2) * (g * g), which overflows for
    # |g| > 1.8e19 where numpy's order does not, so the backends disagreed (NaN weights on numba only).
    @njit(nogil=True, cache=True, fastmath=_FAST - {"reassoc"}, error_model="numpy")
    def adam(weights, state, rows, grads, steps, lr, beta1, beta2, eps, weight_decay, w_out, s_out, out, bad):
        dim = weights.shape[1]
        b1 = np.float32(beta1)
        b2 = np.float32(beta2)
        wd = np.float32(weight_decay)
        eps32 = np.float32(eps)
        k = rows.shape[0]
        for i in range(k):
            if i + _ROW_PREFETCH_DISTANCE < k:
                _prefetch_row(weights, rows[i + _ROW_PREFETCH_DISTANCE])
                _prefetch_row(state, rows[i + _ROW_PREFETCH_DISTANCE])
            r, o = rows[i], out[i]
            t = steps[i]
            bc1 = 1.0 - beta1**t
            bc2 = 1.0 - beta2**t
            step_size = np.float32(lr / bc1)
            bc2_sqrt = np.float32(math.sqrt(bc2))
            nf = False
            for j in range(dim):
                w = weights[r, j]
                g = grads[i, j] + wd * w
                m = b1 * state[r, j] + (np.float32(1.0) - b1) * g
                v = b2 * state[r, dim + j] + (np.float32(1.0) - b2) * g * g
                w = w - step_size * m / (np.sqrt(v) / bc2_sqrt + eps32)
                s_out[o, j] = m
                s_out[o, dim + j] = v
                w_out[o, j] = w
                nf |= not ((abs(m) <= _F32_MAX) & (abs(v) <= _F32_MAX) & (abs(w) <= _F32_MAX))
            bad[o] = nf

    @njit(nogil=True, cache=True, fastmath=_FAST, error_model="numpy")
    def ftrl(weights, state, rows, grads, alpha, beta, l1, l2, w_out, s_out, out, bad):
        dim = weights.shape[1]
        k = rows.shape[0]
        for i in range(k):
            if i + _ROW_PREFETCH_DISTANCE < k:
                _prefetch_row(weights, rows[i + _ROW_PREFETCH_DISTANCE])
                _prefetch_row(state, rows[i + _ROW_PREFETCH_DISTANCE])
            r, o = rows[i], out[i]
            nf = False
            for j in range(dim):
                g = np.float64(grads[i, j])
                w = np.float64(weights[r, j])
                z = np.float64(state[r, j])
                n = np.float64(state[r, dim + j])
                n_new = n + g * g
                sigma = (math.sqrt(n_new) - math.sqrt(n)) / alpha
                z += g - sigma * w
                z32 = np.float32(z)
                n32 = np.float32(n_new)
                if abs(z) <= l1:
                    w32 = np.float32(0.0)
                else:
                    sgn = 1.0 if z > 0 else -1.0
                    w32 = np.float32(-(z - sgn * l1) / ((beta + math.sqrt(n_new)) / alpha + l2))
                s_out[o, j] = z32
                s_out[o, dim + j] = n32
                w_out[o, j] = w32
                nf |= not ((abs(z32) <= _F32_MAX) & (abs(n32) <= _F32_MAX) & (abs(w32) <= _F32_MAX))
            bad[o] = nf

    @njit(nogil=True, cache=True)
    def unique_first_seen(ids):
        """(k,) the distinct int64 ``ids`` in first-seen order (an O(n) hash pass; no sort)."""
        n = ids.shape[0]
        cap = 16
        while cap < 2 * n:
            cap *= 2
        mask = cap - 1
        keys = np.empty(cap, np.int64)
        used = np.zeros(cap, np.bool_)
        out = np.empty(n, np.int64)
        k = 0
        for i in range(n):
            s = ids[i]
            p = np.int64((np.uint64(s) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)) & mask
            while True:
                if not used[p]:
                    used[p] = True
                    keys[p] = s
                    out[k] = s
                    k += 1
                    break
                if keys[p] == s:
                    break
                p = (p + 1) & mask
        return out[:k].copy()

    @njit(nogil=True, cache=True)
    def gather_rows(src, index, out):
        """out[i] = src[index[i]] for 2-D arrays of one dtype (a row loop: ~2x numpy's fancy indexing)."""
        w = src.shape[1]
        for i in range(index.shape[0]):
            r = index[i]
            if i + _ROW_PREFETCH_DISTANCE < index.shape[0]:
                _prefetch_row(src, index[i + _ROW_PREFETCH_DISTANCE])
            for c in range(w):
                out[i, c] = src[r, c]

    @njit(nogil=True, cache=True)
    def keys_in_slots(keys, vals, num_slots, wanted, out, start, stop):
        """Live keys of buckets [start, stop) whose slot (``HashIndex.keys_in_slots``) is marked in ``wanted``,
        into ``out``; how many."""
        n, k = np.uint64(num_slots), 0
        for b in range(start, stop):
            if vals[b] >= 0 and wanted[slot_of_key(keys[b], n)]:
                out[k] = keys[b]
                k += 1
        return k

    @njit(nogil=True, cache=True)
    def count_slots(keys, vals, num_slots, counts, start, stop):
        """counts[s] += live keys of buckets [start, stop) in slot s."""
        n = np.uint64(num_slots)
        for b in range(start, stop):
            if vals[b] >= 0:
                counts[slot_of_key(keys[b], n)] += 1

    @njit(nogil=True, cache=True)
    def scatter_rows(dst, index, src):
        """dst[index[i]] = src[i] for 2-D arrays of one dtype."""
        w = dst.shape[1]
        for i in range(index.shape[0]):
            r = index[i]
            for c in range(w):
                dst[r, c] = src[i, c]
