"""What a partition costs: redundancy (All2All row volume relative to ideal) and per-micro-batch unique keys.

Both are sort-based and loop-free over micro-batches: the distinct (micro-batch, key) pairs are the distinct
values of ``mb * K + key_index`` (no overflow: K <= nnz < 2**31 and mb < N <= B < 2**31).
"""

from __future__ import annotations

import threading
from typing import List, Optional, Tuple

import numpy as np

from nestpipe.clustering.incidence import (
    check_assignment,
    check_batch,
    distinct_codes,
    sample_of_occurrence,
    unique_inverse,
)


def _mb_key_codes(values, offsets, assignment, num_micro_batches=None):
    values, offsets = check_batch(values, offsets)
    a, n = check_assignment(assignment, len(offsets) - 1, num_micro_batches)
    keys, inverse = unique_inverse(values)
    codes = distinct_codes(a[sample_of_occurrence(offsets)] * max(len(keys), 1) + inverse)
    return values, keys, inverse, codes, n


def redundancy(values, offsets, assignment, *, weights=None) -> float:
    """Sum over micro-batches of their unique-key count, divided by the batch's unique-key count.

    1.0 is the lower bound (every key in one micro-batch); N is the upper bound. With ``weights`` (one
    non-negative cost per key occurrence, equal for equal keys, e.g. the row's bytes) both counts are weighted.
    A batch without keys (or of zero total weight) has redundancy 1.0.
    """
    values, keys, inverse, codes, _ = _mb_key_codes(values, offsets, assignment)
    if len(keys) == 0:
        return 1.0
    if weights is None:
        return len(codes) / len(keys)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != values.shape:
        raise ValueError(f"weights must give one cost per key occurrence: shape {values.shape}, got {w.shape}")
    if not np.all(np.isfinite(w)) or (w.size and w.min() < 0):
        raise ValueError("weights must be finite and >= 0")
    key_weight = np.zeros(len(keys))
    key_weight[inverse] = w
    if not np.array_equal(key_weight[inverse], w):
        raise ValueError("weights must be equal for every occurrence of the same key")
    total = key_weight.sum()
    if total == 0:
        return 1.0
    return float(key_weight[codes % len(keys)].sum() / total)


def unique_keys(
    values, offsets, assignment, *, num_micro_batches: Optional[int] = None
) -> Tuple[np.ndarray, np.ndarray, List[np.ndarray]]:
    """(sorted unique int64 keys U, int32 inverse with ``U[inverse] == values``, per-micro-batch positions).

    The third item has one sorted int32 array per micro-batch i in 0..N-1 (N = ``num_micro_batches`` or max id
    + 1): the positions in U of the keys that micro-batch i holds, each once. So the trainer routes U once per
    batch and never dedups again.
    """
    _, keys, inverse, codes, n = _mb_key_codes(values, offsets, assignment, num_micro_batches)
    k = max(len(keys), 1)
    mb, position = np.divmod(codes, k)
    bounds = np.searchsorted(mb, np.arange(1, n))
    per_mb = np.split(position.astype(np.int32), bounds) if n else []
    return keys, inverse.astype(np.int32), per_mb


def unique_keys_multi(
    tables: List[Tuple[np.ndarray, np.ndarray]], assignment, *, num_micro_batches: Optional[int] = None
) -> List[Tuple[np.ndarray, np.ndarray, List[np.ndarray]]]:
    """:func:`unique_keys` for several tables of one batch at once (one sort instead of one per table).

    ``tables`` holds (values, offsets) per table, all over the same B samples. Returns, per table, exactly what
    :func:`unique_keys` returns for it. Worth it when a batch has many small tables (e.g. CTR single-id features).
    """
    packed = unique_keys_packed(tables, assignment, num_micro_batches=num_micro_batches)
    return [(keys, inverse, np.split(mb_unique, mb_offsets[1:-1])) for keys, inverse, mb_unique, mb_offsets in packed]


_SCRATCH = threading.local()
_SCRATCH_MAX = 1 << 23  # elements kept per thread between calls (32 MiB of int32 ranks)


def _scratch(name: str, size: int, dtype) -> np.ndarray:
    """A per-thread buffer of ``size`` elements reused across calls: a fresh multi-megabyte array costs a page fault
    per 4 KiB touched, about a third of a GR batch's unique-key time. ``present`` buffers are all False between
    calls (the caller clears what it set); ``rank`` buffers hold garbage."""
    if size > _SCRATCH_MAX:
        return np.zeros(size, dtype)
    buf = getattr(_SCRATCH, name, None)
    if buf is None or len(buf) < size or buf.dtype != dtype:
        buf = np.zeros(max(size, 1 << 16), dtype)
        setattr(_SCRATCH, name, buf)
    return buf[:size]


def _dense_or_sorted_unique(g: np.ndarray, span: int) -> Tuple[np.ndarray, np.ndarray]:
    """(sorted distinct values, int64 rank of every element) of non-negative int64 ``g`` < ``span``.

    A presence map over ``0..span-1`` when that range is small next to ``len(g)`` (no sort at all), one argsort
    otherwise. Both give the same result."""
    n = len(g)
    if n == 0:
        return g[:0].copy(), np.zeros(0, np.int64)
    if span <= 16 * n + (1 << 16):
        present = _scratch("present", span, np.bool_)
        distinct = None
        try:
            present[g] = True
            distinct = np.flatnonzero(present)
        finally:  # the buffer must be all False for the next call, whatever happened
            if distinct is None:
                present[:] = False
            else:
                present[distinct] = False
        rank = _scratch("rank", span, np.int32 if len(distinct) < (1 << 31) else np.int64)  # half the pages of int64
        rank[distinct] = np.arange(len(distinct))
        return distinct, rank[g].astype(np.int64)
    return unique_inverse(g)


def unique_keys_packed(
    tables: List[Tuple[np.ndarray, np.ndarray]], assignment, *, num_micro_batches: Optional[int] = None
) -> List[Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Like :func:`unique_keys_multi`, with the per-micro-batch positions of each table concatenated in
    micro-batch order (int32) plus their int64 offsets [N+1]: the layout the shard format stores.

    Each table's keys are shifted into a disjoint range (``key - min + base``) of one id space, so one argsort (or,
    for a small id range, a presence map) finds every table's unique keys at once; when the ranges would overflow
    int64 a (table, key) lexsort is used instead. The distinct (table, micro-batch, key) triples come from a
    presence map over table-major (micro-batch, key) codes."""
    if not tables:
        return []
    b = len(np.asarray(tables[0][1])) - 1
    a, n = check_assignment(assignment, b, num_micro_batches)
    n = max(n, 1)
    vals, mbs, los, spans = [], [], [], []
    prev = None
    for t, (values, offsets) in enumerate(tables):
        values, offsets = check_batch(values, offsets)
        if len(offsets) - 1 != b:
            raise ValueError(f"table {t} has {len(offsets) - 1} samples, expected {b}")
        vals.append(values)
        if prev is not None and np.array_equal(offsets, prev[0]):
            mbs.append(prev[1])  # tables of equal lengths (the GR tables) share one expansion
        else:
            mbs.append(a[np.repeat(np.arange(b), np.diff(offsets))] if len(values) != b or not np.array_equal(
                offsets, np.arange(b + 1)) else a)
        prev = (offsets, mbs[-1])
        lo = int(values.min()) if len(values) else 0
        los.append(lo)
        spans.append(int(values.max()) - lo + 1 if len(values) else 0)
    nnz = np.array([len(v) for v in vals], np.int64)
    v_off = np.concatenate([[0], np.cumsum(nnz)])
    base = np.concatenate([[0], np.cumsum(spans, dtype=object)]).tolist()  # Python ints: no overflow
    if base[-1] < (1 << 62):
        g = np.concatenate([v - np.int64(lo) + np.int64(bs) for v, lo, bs in zip(vals, los, base[:-1])])
        distinct, global_key = _dense_or_sorted_unique(g, int(base[-1]))
        keys_all = np.empty(len(distinct), np.int64)
        table_start = np.searchsorted(distinct, np.array(base, np.int64))
        for t in range(len(tables)):
            lo_k, hi_k = table_start[t], table_start[t + 1]
            keys_all[lo_k:hi_k] = distinct[lo_k:hi_k] - np.int64(base[t]) + np.int64(los[t])
    else:
        values = np.concatenate(vals)
        tid = np.repeat(np.arange(len(tables), dtype=np.int64), nnz)
        order = np.lexsort((values, tid))
        sv, st = values[order], tid[order]
        new = np.ones(len(sv), bool)
        if len(sv):
            new[1:] = (sv[1:] != sv[:-1]) | (st[1:] != st[:-1])
        global_key = np.empty(len(values), np.int64)
        global_key[order] = new.astype(np.int64).cumsum() - 1
        keys_all = sv[new]
        table_start = np.searchsorted(st[new], np.arange(len(tables) + 1))
    k_of = np.diff(table_start).astype(np.int64)
    # table-major codes: table t owns [N * table_start[t], N * table_start[t + 1]), ordered by (micro-batch, key)
    ts = table_start[:-1].astype(np.int64)
    codes = np.empty(len(global_key), np.int64)
    for t in range(len(tables)):  # per table with scalars: no [nnz] gathers of per-table constants
        sl = slice(v_off[t], v_off[t + 1])
        np.multiply(mbs[t], k_of[t], out=codes[sl], casting="unsafe")
        codes[sl] += global_key[sl]
        codes[sl] += ts[t] * (n - 1)
    distinct_codes_, _ = _dense_or_sorted_unique(codes, int(table_start[-1]) * n) if len(codes) else (codes, None)
    out = []
    for t in range(len(tables)):
        lo_k, hi_k = int(table_start[t]), int(table_start[t + 1])
        k = max(hi_k - lo_k, 1)
        sl = distinct_codes_[np.searchsorted(distinct_codes_, lo_k * n):np.searchsorted(distinct_codes_, hi_k * n)]
        mb_t, pos_t = np.divmod(sl - lo_k * n, k)
        mb_offsets = np.searchsorted(mb_t, np.arange(n + 1)).astype(np.int64)
        inverse = (global_key[v_off[t]:v_off[t + 1]] - lo_k).astype(np.int32)
        out.append((keys_all[lo_k:hi_k].copy(), inverse, pos_t.astype(np.int32), mb_offsets))
    return out
