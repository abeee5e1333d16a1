"""What a partition costs: redundancy (All2All row volume relative to ideal) and per-micro-batch unique keys.

Both are sort-based and loop-free over micro-batches: the distinct (micro-batch, key) pairs are the distinct
values of ``mb * K + key_index`` (no overflow: K <= nnz < 2**31 and mb < N <= B < 2**31).
"""

from __future__ import annotations

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


def unique_keys_packed(
    tables: List[Tuple[np.ndarray, np.ndarray]], assignment, *, num_micro_batches: Optional[int] = None
) -> List[Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Like :func:`unique_keys_multi`, with the per-micro-batch positions of each table concatenated in
    micro-batch order (int32) plus their int64 offsets [N+1]: the layout the shard format stores."""
    if not tables:
        return []
    b = len(np.asarray(tables[0][1])) - 1
    a, n = check_assignment(assignment, b, num_micro_batches)
    vals, tids, mbs = [], [], []
    for t, (values, offsets) in enumerate(tables):
        values, offsets = check_batch(values, offsets)
        if len(offsets) - 1 != b:
            raise ValueError(f"table {t} has {len(offsets) - 1} samples, expected {b}")
        vals.append(values)
        tids.append(np.full(len(values), t, np.int64))
        mbs.append(a[sample_of_occurrence(offsets)].astype(np.int64))
    values = np.concatenate(vals)
    tid = np.concatenate(tids)
    mb = np.concatenate(mbs)
    order = np.lexsort((values, tid))
    sv, st = values[order], tid[order]
    new = np.ones(len(sv), bool)
    if len(sv):
        new[1:] = (sv[1:] != sv[:-1]) | (st[1:] != st[:-1])
    global_key = np.empty(len(values), np.int64)
    global_key[order] = np.cumsum(new) - 1
    keys_all = sv[new]
    table_start = np.searchsorted(st[new], np.arange(len(tables) + 1))
    k = max(len(keys_all), 1)
    # distinct (table, micro-batch, key) triples, sorted by table, then micro-batch, then key
    codes = np.sort((tid * n + mb) * k + global_key)
    if len(codes):
        codes = codes[np.concatenate([[True], codes[1:] != codes[:-1]])]
    group, gkey = np.divmod(codes, k)
    bounds = np.searchsorted(group, np.arange(len(tables) * n + 1))
    out = []
    cursor = 0
    for t in range(len(tables)):
        lo, hi = table_start[t], table_start[t + 1]
        nnz = len(vals[t])
        inverse = (global_key[cursor:cursor + nnz] - lo).astype(np.int32)
        cursor += nnz
        gb = bounds[t * n:(t + 1) * n + 1]
        mb_unique = (gkey[gb[0]:gb[-1]] - lo).astype(np.int32)
        out.append((keys_all[lo:hi].copy(), inverse, mb_unique, (gb - gb[0]).astype(np.int64)))
    return out
