"""CPU fast paths: Numba-compiled loops over numpy views of the (contiguous) torch tensors.

Why Numba: fbgemm's CPU build has no standalone row-wise AdaGrad, gather-into-buffer or sorted-intersection op
(its fused AdaGrad lives inside the table-batched embedding backward and cannot update a store we own), and
Inductor lowers ``index_put_`` to separate kernels with extra passes behind a long cold compile. A Numba loop reads
each store row once and writes it once, touches no temporaries, and compiles quickly (cached on disk).
``benchmarks/kernels_bench.py`` times the kernels the trainer runs against the unfused torch composition
(docs/kernels.md). Where a torch op does the same memory-bound work (the row gather, the sequence backward's serial
``index_add_``), it is used instead: a loop of ours has nothing to save there.

Determinism: every parallel loop gives one output row to one iteration, and that iteration sums in a fixed order
(ascending source position), so results are bitwise identical run to run and for any thread count. ``fastmath``
is off, so float32 arithmetic is IEEE and matches the torch reference to rounding.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_JIT = dict(nopython=True, nogil=True, cache=True)

# Rows ahead of the current one whose cache lines are prefetched by the store-row loops. A store row of a random
# id misses every cache and (with 4 KiB pages) the TLB; a loop body of a few hundred instructions leaves the
# out-of-order window room for one or two such misses, so without prefetching the loop waits on each row in turn.
# 16 rows ahead is a tuning choice: `python benchmarks/kernels_bench.py --prefetch-grid` times the AdaGrad loop at
# other distances, cache levels and lines per row.
# The plain gather loop gains nothing (its short body already keeps many rows in flight), so ``gather_rows`` stays
# on ``index_select``.
PREFETCH_DISTANCE = 16


def prefetch_intrinsic(locality: int = 3):
    """A Numba intrinsic ``prefetch(arr, index)``: ``llvm.prefetch`` (read, at cache ``locality``: 3 all levels ...
    0 non-temporal) of the cache line holding ``arr.flat[index]`` (a C-contiguous array); a hint only, so an index
    past the end is harmless (it is never dereferenced)."""

    @intrinsic
    def prefetch(typingctx, arr, index):
        if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            array = context.make_array(signature.args[0])(context, builder, args[0])
            offset = context.cast(builder, args[1], signature.args[1], types.intp)
            i8p = ir.IntType(8).as_pointer()
            address = builder.bitcast(builder.gep(array.data, [offset]), i8p)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [i8p] + [ir.IntType(32)] * 3), "llvm.prefetch.p0"
            )
            i32 = ir.IntType(32)
            builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, int(locality)), ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return types.void(arr, index), codegen

    return prefetch


_prefetch = prefetch_intrinsic(3)


@numba.jit(**_JIT)
def _prefetch_row(flat, row, dim):
    """Prefetch every 64-byte line of row ``row`` of a [R, dim] float32 store viewed flat."""
    base = row * dim
    for k in range(0, dim, 16):
        _prefetch(flat, base + k)
    _prefetch(flat, base + dim - 1)


def _np(t: torch.Tensor) -> np.ndarray:
    if t.device.type != "cpu":
        raise ValueError(f"CPU kernel got a tensor on {t.device}")
    return t.detach().contiguous().numpy() if not t.is_contiguous() else t.detach().numpy()


@numba.jit(**_JIT)
def _sum_squares(g, dim):
    """``sum(g[:dim] ** 2)`` in a fixed order: 8 interleaved partial sums (lane ``k`` adds ``d = k, k + 8, ...``),
    the tail into lane 0, then a fixed pairwise tree. One serial chain of ``dim`` dependent float adds (no
    ``fastmath``, so no reassociation) makes the update latency-bound (every add waits for the one before); 8
    independent chains keep the adder busy. Every CPU AdaGrad kernel uses this one order."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    d = 0
    while d + 8 <= dim:
        a0 += g[d] * g[d]
        a1 += g[d + 1] * g[d + 1]
        a2 += g[d + 2] * g[d + 2]
        a3 += g[d + 3] * g[d + 3]
        a4 += g[d + 4] * g[d + 4]
        a5 += g[d + 5] * g[d + 5]
        a6 += g[d + 6] * g[d + 6]
        a7 += g[d + 7] * g[d + 7]
        d += 8
    while d < dim:
        a0 += g[d] * g[d]
        d += 1
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


# Shared row bodies of the kernels below. ``inline="always"`` inlines them at Numba's IR level into every caller, so
# the serial and parallel twins share one body without a call per row (a plain, non-inlined helper keeps the loops
# from vectorising).
@numba.jit(inline="always", **_JIT)
def _apply_row(weights, state, r, g, dim, inv_dim, lr, eps, momentum_scale, scale_state):
    """Row-wise AdaGrad of row ``r`` with its summed gradient ``g``: ``v += mean(g^2)``, ``w -= lr g / (sqrt(v') +
    eps)`` with ``v' = v / momentum_scale`` when ``scale_state`` (2D-SP), else ``v``."""
    acc = _sum_squares(g, dim)
    s = state[r] + acc / inv_dim
    state[r] = s
    if scale_state:
        s = s / momentum_scale
    multiplier = lr / (np.sqrt(s) + eps)
    w = weights[r]
    for d in range(dim):
        w[d] -= multiplier * g[d]


@numba.jit(inline="always", **_JIT)
def _prefetch_ahead(state, flat, rows, i, n, distance, dim):
    """Prefetch the store row and AdaGrad state of the row ``distance`` positions after ``i`` (none past ``n``)."""
    if distance > 0 and i + distance < n:
        ahead = rows[i + distance]
        _prefetch(state, ahead)
        _prefetch_row(flat, ahead, dim)


@numba.jit(inline="always", **_JIT)
def _add_entries(g, grads, order, j0, j1, dim):
    """``g += grads[order[j]]`` for ``j0 <= j < j1``, in ascending ``j``."""
    for j in range(j0, j1):
        e = order[j]
        for d in range(dim):
            g[d] += grads[e, d]


@numba.jit(inline="always", **_JIT)
def _add_pairs(g, e_acc, src, order, j0, j1, entry_offsets, pair_src, dim):
    """``g += `` the entries ``order[j0:j1]`` in that order, each the sum of its pairs' source rows (ascending pair,
    from zero); an entry with one pair adds its row directly (bitwise the same, see :func:`_adagrad_pairs_serial`)."""
    for j in range(j0, j1):
        e = order[j]
        p0 = entry_offsets[e]
        p1 = entry_offsets[e + 1]
        # row slices, not ``src[b + d]``: a flat signed index is wrap-around checked per element, which keeps these
        # loops from vectorising
        if p1 - p0 == 1:
            row = src[pair_src[p0]:pair_src[p0] + dim]
            for d in range(dim):
                g[d] += row[d]
        else:
            e_acc[:] = 0.0
            for p in range(p0, p1):
                row = src[pair_src[p]:pair_src[p] + dim]
                for d in range(dim):
                    e_acc[d] += row[d]
            for d in range(dim):
                g[d] += e_acc[d]


@numba.jit(parallel=True, **_JIT)
def _adagrad(weights, state, rows, grads, lr, eps, momentum_scale, scale_state, distance):
    n, dim = grads.shape
    inv_dim = np.float32(dim)
    flat = weights.reshape(-1)
    for i in numba.prange(n):
        _prefetch_ahead(state, flat, rows, i, n, distance, dim)
        _apply_row(weights, state, rows[i], grads[i], dim, inv_dim, lr, eps, momentum_scale, scale_state)


@numba.jit(parallel=True, **_JIT)
def _adagrad_segments(weights, state, rows, grads, order, offsets, lr, eps, momentum_scale, scale_state, distance):
    """:func:`_adagrad` whose gradient of row ``i`` is the sum of ``grads[order[j]]`` for
    ``offsets[i] <= j < offsets[i + 1]``, added in ascending ``j`` from zero (the arithmetic of a serial
    ``index_add_`` into zeros), so the per-row gradient is never materialised."""
    n = rows.shape[0]
    dim = grads.shape[1]
    inv_dim = np.float32(dim)
    flat = weights.reshape(-1)
    for i in numba.prange(n):
        _prefetch_ahead(state, flat, rows, i, n, distance, dim)
        g = np.zeros(dim, dtype=np.float32)
        _add_entries(g, grads, order, offsets[i], offsets[i + 1], dim)
        _apply_row(weights, state, rows[i], g, dim, inv_dim, lr, eps, momentum_scale, scale_state)


@numba.jit(**_JIT)
def _adagrad_segments_serial(weights, state, rows, grads, order, offsets, lr, eps, momentum_scale, scale_state, distance):
    """Serial twin of :func:`_adagrad_segments` (same arithmetic, bitwise equal results) for one intra-op thread:
    a parallel Numba region entered from several Python threads at once (the pipeline's stage threads) is not
    safe. It is a separate Python function, not a second ``numba.jit`` of the same one, because Numba's on-disk
    cache keys do not include the ``parallel`` flag: two dispatchers of one function could load each other's
    compiled code."""
    n = rows.shape[0]
    dim = grads.shape[1]
    inv_dim = np.float32(dim)
    flat = weights.reshape(-1)
    for i in range(n):
        _prefetch_ahead(state, flat, rows, i, n, distance, dim)
        g = np.zeros(dim, dtype=np.float32)
        _add_entries(g, grads, order, offsets[i], offsets[i + 1], dim)
        _apply_row(weights, state, rows[i], g, dim, inv_dim, lr, eps, momentum_scale, scale_state)


@numba.jit(**_JIT)
def _adagrad_pairs_serial(weights, state, rows, src, order, offsets, entry_offsets, pair_src, lr, eps,
                          momentum_scale, scale_state, distance):
    """Row-wise AdaGrad whose row gradients are two-level ordered sums over a flat source: row ``i``'s gradient
    ``g`` adds its entries (``order[offsets[i]:offsets[i + 1]]``) in that order from zero, each entry being its
    pairs' source rows (``src[pair_src[p]:pair_src[p] + dim]``, ascending ``p``) added from zero; neither the
    per-entry nor the per-row gradients are materialised. An entry with one pair adds its source row directly:
    ``g + (0 + x) == g + x`` bitwise because ``g`` starts at +0 and a round-to-nearest sum is -0 only when both
    operands are -0. Serial (one intra-op thread); the parallel twin shares its row body (:func:`_add_pairs`,
    :func:`_apply_row`)."""
    n = rows.shape[0]
    dim = weights.shape[1]
    inv_dim = np.float32(dim)
    flat = weights.reshape(-1)
    g = np.empty(dim, dtype=np.float32)
    e_acc = np.empty(dim, dtype=np.float32)
    for i in range(n):
        _prefetch_ahead(state, flat, rows, i, n, distance, dim)
        g[:] = 0.0
        _add_pairs(g, e_acc, src, order, offsets[i], offsets[i + 1], entry_offsets, pair_src, dim)
        _apply_row(weights, state, rows[i], g, dim, inv_dim, lr, eps, momentum_scale, scale_state)


@numba.jit(parallel=True, **_JIT)
def _adagrad_pairs(weights, state, rows, src, order, offsets, entry_offsets, pair_src, lr, eps,
                   momentum_scale, scale_state, distance):
    """Parallel twin of :func:`_adagrad_pairs_serial` (one row per iteration: bitwise the same results)."""
    n = rows.shape[0]
    dim = weights.shape[1]
    inv_dim = np.float32(dim)
    flat = weights.reshape(-1)
    for i in numba.prange(n):
        _prefetch_ahead(state, flat, rows, i, n, distance, dim)
        g = np.empty(dim, dtype=np.float32)
        e_acc = np.empty(dim, dtype=np.float32)
        g[:] = 0.0
        _add_pairs(g, e_acc, src, order, offsets[i], offsets[i + 1], entry_offsets, pair_src, dim)
        _apply_row(weights, state, rows[i], g, dim, inv_dim, lr, eps, momentum_scale, scale_state)


@numba.jit(**_JIT)
def _place_keys(ids, a, b, vocab, rows_per_shard, owners, dest, local):
    # unsigned arithmetic (every operand is >= 0 and a * id + b < 2**62): no sign fix-ups around the divisions,
    # and one division gives the shard and the row (about half the time of the signed ``%`` and ``//``)
    ua, ub, uv, ur = np.uint64(a), np.uint64(b), np.uint64(vocab), np.uint64(rows_per_shard)
    n_owners = owners.shape[0]
    for i in range(ids.shape[0]):
        p = (np.uint64(ids[i]) * ua + ub) % uv
        s = p // ur
        dest[i] = owners[s] if n_owners else np.int64(s)
        local[i] = np.int64(p - s * ur)


def place_keys(ids: np.ndarray, a: int, b: int, vocab: int, rows_per_shard: int, owners: np.ndarray):
    """One pass of the placement arithmetic (see :func:`nestpipe.kernels.place_keys`)."""
    dest = np.empty(len(ids), dtype=np.int64)
    local = np.empty(len(ids), dtype=np.int64)
    _place_keys(np.ascontiguousarray(ids, dtype=np.int64), np.int64(a), np.int64(b), np.int64(vocab),
                np.int64(rows_per_shard), owners, dest, local)
    return dest, local


@numba.jit(**_JIT)
def _micro_batch_values(offsets, samples, inverse, keys, num_keys):
    m = samples.shape[0]
    lengths = np.empty(m, dtype=np.int64)
    total = 0
    for j in range(m):
        n = offsets[samples[j] + 1] - offsets[samples[j]]
        lengths[j] = n
        total += n
    value_index = np.empty(total, dtype=np.int64)
    value_key = np.empty(total, dtype=np.int64)
    value_sample = np.empty(total, dtype=np.int64)
    value_pos = np.full(total, -1, dtype=np.int64)
    at = 0
    for j in range(m):
        for v in range(offsets[samples[j]], offsets[samples[j] + 1]):
            value_index[at] = v
            value_key[at] = inverse[v]
            value_sample[at] = j
            at += 1
    for k in range(keys.shape[0]):
        if keys[k] < 0 or keys[k] >= num_keys or (k > 0 and keys[k] <= keys[k - 1]):
            return lengths, value_key, value_sample, value_pos, value_index, 1
    for v in range(total):
        if value_key[v] < 0 or value_key[v] >= num_keys:
            return lengths, value_key, value_sample, value_pos, value_index, 2
    posmap = np.full(num_keys, -1, dtype=np.int64)
    for k in range(keys.shape[0]):
        posmap[keys[k]] = k
    status = 0
    for v in range(total):
        p = posmap[value_key[v]]
        value_pos[v] = p
        if p < 0:
            status = 3
    return lengths, value_key, value_sample, value_pos, value_index, status


def micro_batch_values(offsets, samples, inverse, keys, num_keys: int):
    """One pass over the micro-batch's values (see :func:`nestpipe.kernels.micro_batch_values`)."""
    return _micro_batch_values(np.ascontiguousarray(offsets, dtype=np.int64),
                               np.ascontiguousarray(samples, dtype=np.int64), np.ascontiguousarray(inverse),
                               np.ascontiguousarray(keys, dtype=np.int64), np.int64(num_keys))


def pooled_owner_plan(got, at, size, b, b0, out_at, grad_off, dim: int, rows_all):
    """One pass over a pooled store's blocks of the received routing payload (see
    :func:`nestpipe.kernels.pooled_owner_plan`)."""
    i64 = [np.ascontiguousarray(x, dtype=np.int64) for x in (at, size, b, b0, out_at, grad_off)]
    return _pooled_owner_plan(np.ascontiguousarray(got), *i64, np.int64(dim),
                              np.ascontiguousarray(rows_all, dtype=np.int64))


@numba.jit(**_JIT)
def _pooled_owner_plan(got, at, size, b, b0, out_at, grad_off, dim, rows_all):
    n_seg = 0
    n_pair = 0
    for k in range(at.shape[0]):
        n_seg += b[k]
        n_pair += size[k] - b[k]
    offsets = np.empty(n_seg + 1, dtype=np.int64)
    out = np.empty(n_seg, dtype=np.int64)
    grad = np.empty(n_seg, dtype=np.int64)
    entries = np.empty(n_pair, dtype=np.int64)
    rows = np.zeros(n_pair, dtype=np.int64)
    offsets[0] = 0
    s = 0
    p = 0
    bad_count = False
    bad_entry = False
    n_rows = rows_all.shape[0]
    for k in range(at.shape[0]):
        a = at[k]
        for j in range(b[k]):  # the block's per-sample counts
            c = np.int64(got[a + j])
            bad_count |= c < 0
            offsets[s + 1] = offsets[s] + c
            out[s] = out_at[k] + dim * j
            grad[s] = out[s] + grad_off[k]
            s += 1
        for j in range(size[k] - b[k]):  # then its entries, sample after sample
            e = np.int64(got[a + b[k] + j]) + b0[k]
            entries[p] = e
            if e < 0 or e >= n_rows:
                bad_entry = True
            else:
                rows[p] = rows_all[e]
            p += 1
    if bad_entry:
        return offsets, entries, out, grad, np.zeros(n_pair, dtype=np.int64), 2
    status = 1 if bad_count or offsets[n_seg] != n_pair else 0
    return offsets, entries, out, grad, rows, status


@numba.jit(**_JIT)
def _bag_rows_sorted(indices, offsets, num_rows):
    """The occurrences of ``indices`` grouped by row, stably (a row's occurrences in ascending position): ``uniq``
    (distinct rows ascending), ``starts`` [len(uniq) + 1] and ``src`` (the bag of each occurrence in that order).
    Both ways give the same three arrays. A counting sort when ``num_rows`` is within a small multiple of the
    occurrences (three passes: count, one scan that turns the counts into each row's first slot while listing the
    rows, and the scatter), else a stable merge sort (a 32M-row store must not cost a 32M-entry count per call)."""
    n = indices.shape[0]
    n_bags = offsets.shape[0] - 1
    if num_rows <= 8 * n + 65536 and n < 2**31:  # int32 slots: half the scanned bytes
        slot = np.zeros(num_rows, dtype=np.int32)
        for j in range(n):
            slot[indices[j]] += 1
        uniq = np.empty(n, dtype=np.int64)
        starts = np.empty(n + 1, dtype=np.int64)
        u = 0
        taken = 0
        for r in range(num_rows):
            c = slot[r]
            if c > 0:
                uniq[u] = r
                starts[u] = taken
                slot[r] = taken
                taken += c
                u += 1
        starts[u] = n
        src = np.empty(n, dtype=np.int64)
        for b in range(n_bags):
            for j in range(offsets[b], offsets[b + 1]):
                r = indices[j]
                src[slot[r]] = b
                slot[r] += 1
        return uniq[:u], starts[:u + 1], src
    bag_of = np.empty(n, dtype=np.int64)
    for b in range(n_bags):
        for j in range(offsets[b], offsets[b + 1]):
            bag_of[j] = b
    order = np.argsort(indices, kind="mergesort")
    u = 0
    for i in range(n):
        if i == 0 or indices[order[i]] != indices[order[i - 1]]:
            u += 1
    uniq = np.empty(u, dtype=np.int64)
    starts = np.empty(u + 1, dtype=np.int64)
    src = np.empty(n, dtype=np.int64)
    k = 0
    for i in range(n):
        j = order[i]
        if i == 0 or indices[j] != indices[order[i - 1]]:
            uniq[k] = indices[j]
            starts[k] = i
            k += 1
        src[i] = bag_of[j]
    starts[u] = n
    return uniq, starts, src


@numba.jit(**_JIT)
def _adagrad_bags_serial(weights, state, indices, offsets, grad_output, lr, eps, distance):
    """Row-wise AdaGrad from bag gradients (see :func:`adagrad_bags`), one intra-op thread."""
    uniq, starts, src = _bag_rows_sorted(indices, offsets, weights.shape[0])
    n = uniq.shape[0]
    dim = weights.shape[1]
    inv_dim = np.float32(dim)
    one = np.float32(1.0)
    flat = weights.reshape(-1)
    g = np.empty(dim, dtype=np.float32)
    for i in range(n):
        _prefetch_ahead(state, flat, uniq, i, n, distance, dim)
        g[:] = 0.0
        _add_entries(g, grad_output, src, starts[i], starts[i + 1], dim)
        _apply_row(weights, state, uniq[i], g, dim, inv_dim, lr, eps, one, False)
    return n


@numba.jit(parallel=True, **_JIT)
def _adagrad_bags(weights, state, indices, offsets, grad_output, lr, eps, distance):
    """Parallel twin of :func:`_adagrad_bags_serial` (one row per iteration: bitwise the same results)."""
    uniq, starts, src = _bag_rows_sorted(indices, offsets, weights.shape[0])
    n = uniq.shape[0]
    dim = weights.shape[1]
    inv_dim = np.float32(dim)
    one = np.float32(1.0)
    flat = weights.reshape(-1)
    for i in numba.prange(n):
        _prefetch_ahead(state, flat, uniq, i, n, distance, dim)
        g = np.zeros(dim, dtype=np.float32)
        _add_entries(g, grad_output, src, starts[i], starts[i + 1], dim)
        _apply_row(weights, state, uniq[i], g, dim, inv_dim, lr, eps, one, False)
    return n


def adagrad_bags(weights, state, indices, offsets, grad_output, lr: float, eps: float) -> None:
    """Row-wise AdaGrad from bag gradients, in place: the arithmetic of fbgemm's TBE CPU backward
    (``EXACT_ROWWISE_ADAGRAD``) step for step, so the two agree bitwise (tested): each touched row's occurrences are
    taken in ascending position (fbgemm's stable radix sort), their bags' gradients added from zero in that order,
    then :func:`_apply_row` (the 8-lane sum of squares of fbgemm's JIT kernel, ``v += sum / D``,
    ``w -= lr / (sqrt(v) + eps) * g``)."""
    fn = _adagrad_bags_serial if torch.get_num_threads() == 1 else _adagrad_bags
    fn(_np(weights), _np(state), _rows64(indices), _rows64(offsets), _np(grad_output.contiguous()),
       np.float32(lr), np.float32(eps), PREFETCH_DISTANCE)


@numba.jit(**_JIT)
def _pool_segments_serial(src, index, offsets, out, out_offsets, distance):
    """``out[out_offsets[s]:out_offsets[s] + D] = sum of src[index[j]]`` for ``offsets[s] <= j < offsets[s + 1]``,
    ascending ``j`` from zero (``out`` flat). Source rows ``distance`` pairs ahead are prefetched (store rows of
    random ids miss every cache)."""
    dim = src.shape[1]
    flat = src.reshape(-1)
    m = index.shape[0]
    for s in range(offsets.shape[0] - 1):
        o = out[out_offsets[s]:out_offsets[s] + dim]
        for d in range(dim):
            o[d] = 0.0
        for j in range(offsets[s], offsets[s + 1]):
            if distance > 0 and j + distance < m:
                _prefetch_row(flat, index[j + distance], dim)
            row = src[index[j]]
            for d in range(dim):
                o[d] += row[d]


@numba.jit(parallel=True, **_JIT)
def _pool_segments(src, index, offsets, out, out_offsets, distance):
    dim = src.shape[1]
    for s in numba.prange(offsets.shape[0] - 1):
        o = out[out_offsets[s]:out_offsets[s] + dim]
        for d in range(dim):
            o[d] = 0.0
        for j in range(offsets[s], offsets[s + 1]):
            row = src[index[j]]
            for d in range(dim):
                o[d] += row[d]


@numba.jit(**_JIT)
def _copy_segments(src, index, out, out_offsets, distance):
    """``out[out_offsets[j]:out_offsets[j] + D] = src[index[j]]`` (a bitwise copy)."""
    dim = src.shape[1]
    flat = src.reshape(-1)
    m = index.shape[0]
    for j in range(m):
        if distance > 0 and j + distance < m:
            _prefetch_row(flat, index[j + distance], dim)
        o = out[out_offsets[j]:out_offsets[j] + dim]
        row = src[index[j]]
        for d in range(dim):
            o[d] = row[d]


def pool_segments(src: torch.Tensor, index: torch.Tensor, offsets, out: torch.Tensor, out_offsets) -> None:
    """Ordered segment sums (``offsets`` given) or row copies (``offsets`` None) of ``src`` rows into the flat
    ``out`` at element offsets ``out_offsets``. Index arrays are int64 numpy arrays or tensors."""
    idx = index.numpy() if isinstance(index, torch.Tensor) else index
    oo = out_offsets.numpy() if isinstance(out_offsets, torch.Tensor) else out_offsets
    if offsets is None:
        _copy_segments(_np(src), idx, _np(out), oo, PREFETCH_DISTANCE)
        return
    off = offsets.numpy() if isinstance(offsets, torch.Tensor) else offsets
    fn = _pool_segments_serial if torch.get_num_threads() == 1 else _pool_segments
    fn(_np(src), idx, off, _np(out), oo, PREFETCH_DISTANCE)


def adagrad_update_pairs(weights, state, rows, src, order, offsets, entry_offsets, pair_src, lr: float, eps: float,
                         momentum_scale: float = 1.0) -> None:
    if not (weights.is_contiguous() and state.is_contiguous()):
        raise ValueError("the store's weights and state must be contiguous (they are updated in place)")
    fn = _adagrad_pairs_serial if torch.get_num_threads() == 1 else _adagrad_pairs
    fn(_np(weights), _np(state), _rows64(rows), _np(src), _rows64(order), _rows64(offsets), _rows64(entry_offsets),
       _rows64(pair_src), np.float32(lr), np.float32(eps), np.float32(momentum_scale), momentum_scale != 1.0,
       PREFETCH_DISTANCE)


@numba.jit(**_JIT)
def _sync_rows(active_keys, prefetch_keys, src_w, src_s, from_store, copy_state, dst_w, dst_s):
    """Serial sorted merge of the two key lists (O(n + m)); a common key's source row (active buffer row ``i``, or
    store row ``active_keys[i]`` when ``from_store``) and its state go to prefetch row ``j``. Serial: it runs in
    the pipeline's compute thread while other stage threads may be inside Numba code."""
    n_a = active_keys.shape[0]
    n_p = prefetch_keys.shape[0]
    dim = dst_w.shape[1]
    i = 0
    j = 0
    copied = 0
    while i < n_a and j < n_p:
        a = active_keys[i]
        p = prefetch_keys[j]
        if a < p:
            i += 1
        elif a > p:
            j += 1
        else:
            r = a if from_store else i
            for d in range(dim):
                dst_w[j, d] = src_w[r, d]
            if copy_state:
                dst_s[j] = src_s[r]
            copied += 1
            i += 1
            j += 1
    return copied


def dual_buffer_sync_rows(active_keys, prefetch_keys, src_weight, src_state, dst_weight, dst_state,
                          from_store: bool) -> int:
    copy_state = dst_state is not None
    if not (dst_weight.is_contiguous() and (not copy_state or dst_state.is_contiguous())):
        raise ValueError("the prefetch buffer must be contiguous (it is updated in place)")
    none = np.zeros(0, dtype=_np(dst_weight).dtype)  # stands in for the state arrays when only weights are synced
    return int(_sync_rows(_rows64(active_keys), _rows64(prefetch_keys), _np(src_weight),
                          _np(src_state) if copy_state else none, bool(from_store), copy_state, _np(dst_weight),
                          _np(dst_state) if copy_state else none))


_SYNC_CHUNK = 4096


@numba.jit(parallel=True, **_JIT)
def _sync(active_keys, active_rows, prefetch_keys, prefetch_rows):
    """Sorted-merge intersection + row copy. Prefetch keys are cut into chunks (one per parallel iteration); a
    chunk finds its start in the active keys by one binary search, then merges linearly (O(n + m) overall)."""
    n_active = active_keys.shape[0]
    n_prefetch = prefetch_keys.shape[0]
    copied = 0
    for c in numba.prange((n_prefetch + _SYNC_CHUNK - 1) // _SYNC_CHUNK):
        j = c * _SYNC_CHUNK
        end = min(n_prefetch, j + _SYNC_CHUNK)
        i = np.searchsorted(active_keys, prefetch_keys[j])
        found = 0
        while j < end and i < n_active:
            a = active_keys[i]
            p = prefetch_keys[j]
            if a < p:
                i += 1
            elif a > p:
                j += 1
            else:
                prefetch_rows[j, :] = active_rows[i, :]
                found += 1
                i += 1
                j += 1
        copied += found
    return copied


@numba.jit(**_JIT)
def _counting_sort(segment_of, num_segments):
    """Stable counting sort: positions grouped by segment, ascending within a segment (O(n), serial)."""
    offsets = np.zeros(num_segments + 1, dtype=np.int64)
    for i in range(segment_of.shape[0]):
        offsets[segment_of[i] + 1] += 1
    for s in range(num_segments):
        offsets[s + 1] += offsets[s]
    cursor = offsets[:-1].copy()
    order = np.empty(segment_of.shape[0], dtype=np.int64)
    for i in range(segment_of.shape[0]):
        s = segment_of[i]
        order[cursor[s]] = i
        cursor[s] += 1
    return order, offsets


@numba.jit(parallel=True, **_JIT)
def _segment_sum(src, src_index, offsets, out):
    dim = src.shape[1]
    for s in numba.prange(offsets.shape[0] - 1):
        for d in range(dim):
            out[s, d] = 0.0
        for i in range(offsets[s], offsets[s + 1]):
            k = src_index[i]
            for d in range(dim):
                out[s, d] += src[k, d]


@numba.jit(parallel=True, **_JIT)
def _gather(weights, rows, out, distance):
    """``out[i] = weights[rows[i]]``, prefetching the row ``distance`` positions ahead. Not selected: the gather is
    a memory-bound copy that ``index_select`` already does; kept so ``benchmarks/kernels_bench.py`` can compare it."""
    n = rows.shape[0]
    dim = weights.shape[1]
    flat = weights.reshape(-1)
    for i in numba.prange(n):
        if distance > 0 and i + distance < n:
            _prefetch_row(flat, rows[i + distance], dim)
        out[i, :] = weights[rows[i], :]


@numba.jit(parallel=True, **_JIT)
def _take(values, index, out):
    for i in numba.prange(index.shape[0]):
        out[i] = values[index[i]]


def _rows64(rows: torch.Tensor) -> np.ndarray:
    return _np(rows.to(torch.int64))


def adagrad_update(weights, state, rows, grads, lr: float, eps: float, momentum_scale: float = 1.0,
                   order=None, offsets=None) -> None:
    if not (weights.is_contiguous() and state.is_contiguous()):
        raise ValueError("the store's weights and state must be contiguous (they are updated in place)")
    if order is not None:
        fn = _adagrad_segments_serial if torch.get_num_threads() == 1 else _adagrad_segments
        fn(
            _np(weights), _np(state), _rows64(rows), _np(grads.to(torch.float32)), _rows64(order), _rows64(offsets),
            np.float32(lr), np.float32(eps), np.float32(momentum_scale), momentum_scale != 1.0, PREFETCH_DISTANCE,
        )
        return
    _adagrad(
        _np(weights), _np(state), _rows64(rows), _np(grads.to(torch.float32)),
        np.float32(lr), np.float32(eps), np.float32(momentum_scale), momentum_scale != 1.0, PREFETCH_DISTANCE,
    )


def dual_buffer_sync(active_keys, active_rows, prefetch_keys, prefetch_rows) -> int:
    if not prefetch_rows.is_contiguous():
        raise ValueError("the prefetch buffer must be contiguous (it is updated in place)")
    return int(_sync(_rows64(active_keys), _np(active_rows), _rows64(prefetch_keys), _np(prefetch_rows)))


@numba.jit(**_JIT)
def _dedup_rows(rows, num_rows):
    """Stable dedup of ``rows`` (values in ``[0, num_rows)``) by one counting sort; see :func:`dedup_rows`."""
    n = rows.shape[0]
    counts = np.zeros(num_rows, dtype=np.int64)
    for i in range(n):
        counts[rows[i]] += 1
    u = 0
    for r in range(num_rows):
        if counts[r] > 0:
            u += 1
    uniq = np.empty(u, dtype=np.int64)
    starts = np.empty(u, dtype=np.int64)
    pos = 0
    k = 0
    for r in range(num_rows):
        c = counts[r]
        if c > 0:
            uniq[k] = r
            starts[k] = pos
            counts[r] = k  # reused: the row's position in ``uniq``
            k += 1
            pos += c
    cursor = starts.copy()
    order = np.empty(n, dtype=np.int64)
    inv_sorted = np.empty(n, dtype=np.int64)
    inv = np.empty(n, dtype=np.int64)
    for i in range(n):
        j = counts[rows[i]]
        p = cursor[j]
        order[p] = i
        inv_sorted[p] = j
        cursor[j] = p + 1
        inv[i] = j
    return order, uniq, starts, inv_sorted, inv


def dedup_rows(rows: np.ndarray, num_rows: int):
    """``(order, uniq, starts, inv_sorted, inv)`` of int64 ``rows`` in ``[0, num_rows)``: ``order`` the stable
    sort permutation (a row's positions ascending), ``uniq`` the distinct rows ascending, ``starts[k]`` where
    ``uniq[k]``'s run starts in sorted order, ``inv_sorted``/``inv`` the position in ``uniq`` of every element in
    sorted order / in input order. One counting sort (O(n + num_rows)); equal to the ``np.argsort(kind="stable")``
    formulation element for element (tested)."""
    return _dedup_rows(np.ascontiguousarray(rows, dtype=np.int64), int(num_rows))


def csr_by_segment(segment_of: torch.Tensor, num_segments: int):
    """``(order, offsets)``: positions of ``segment_of`` grouped by value (stable), as int64 tensors."""
    order, offsets = _counting_sort(_rows64(segment_of), num_segments)
    return torch.from_numpy(order), torch.from_numpy(offsets)


def segment_sum_rows(src: torch.Tensor, src_index: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[s] = sum(src[src_index[i]] for i in range(offsets[s], offsets[s+1]))`` in ascending ``i``."""
    out = torch.empty(offsets.numel() - 1, src.shape[1], dtype=src.dtype)
    _segment_sum(_np(src.contiguous()), _rows64(src_index), _rows64(offsets), _np(out))
    return out


def take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    out = torch.empty(index.numel(), dtype=values.dtype)
    _take(_np(values), _rows64(index), _np(out))
    return out
