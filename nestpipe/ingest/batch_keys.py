"""Unique keys, inverse indices and per-micro-batch key lists of every batch of a shard at once.

The shard stage needs, per batch and per table, what :func:`nestpipe.clustering.unique_keys_packed` gives. Doing
that batch by batch costs a few dozen NumPy calls per table per batch; here every batch and every table of a
packed group is handled by one sort (or presence map) over composite (batch, table, key) codes, so the cost per
batch is a few array slices.

Invariant (tested against ``unique_keys_packed`` batch by batch): for batch j and table t, the keys are the
sorted distinct values of that table in that batch, ``inverse`` gives each occurrence's position among them, and
the micro-batch lists are the sorted distinct positions held by each micro-batch, in micro-batch order.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

import numpy as np


def _distinct_rank(codes: np.ndarray, bound: int, need_rank: bool = True) -> Tuple[np.ndarray, np.ndarray]:
    """(sorted distinct codes, rank of each element among them or None) for int64 ``codes`` in ``0..bound-1``.

    A presence map when ``bound`` is small next to the element count; otherwise one ``np.sort`` of the codes with
    the element index packed into the low bits (a plain sort is several times faster than an argsort); an argsort
    when the packed words would overflow."""
    n = len(codes)
    if n == 0:
        return codes[:0].copy(), np.zeros(0, np.int64)
    if bound <= (16 if not need_rank else 2) * n + (1 << 16):
        present = np.zeros(bound, bool)
        present[codes] = True
        distinct = np.flatnonzero(present)
        if not need_rank:
            return distinct, None
        rank = np.empty(bound, np.int64)
        rank[distinct] = np.arange(len(distinct))
        return distinct, rank[codes]
    bits = max(1, int(n - 1).bit_length())
    if (bound - 1).bit_length() + bits <= 62:
        packed = np.sort((codes << np.int64(bits)) | np.arange(n, dtype=np.int64))
        order = packed & np.int64((1 << bits) - 1)
        sorted_codes = packed >> np.int64(bits)
    else:
        order = np.argsort(codes, kind="stable")
        sorted_codes = codes[order]
    new = np.empty(n, bool)
    new[0] = True
    np.not_equal(sorted_codes[1:], sorted_codes[:-1], out=new[1:])
    if not need_rank:
        return sorted_codes[new], None
    rank = np.empty(n, np.int64)
    rank[order] = new.astype(np.int64).cumsum() - 1  # a bool cumsum is several times slower
    return sorted_codes[new], rank


@dataclasses.dataclass
class GroupKeys:
    """Keys of one packed group for ``nb`` batches of ``T`` tables and ``N`` micro-batches.

    ``unique[ut[j*T + t]:ut[j*T + t + 1]]`` are batch j's sorted unique keys of table t (so batch j's group member
    is the contiguous run ``ut[j*T]:ut[(j+1)*T]``); ``inverse`` is aligned with the input occurrences;
    ``mb_unique[mt[j]:mt[j+1]]`` is batch j's group ``mb_unique`` member and ``mb_counts[j]`` [T, N] the sizes of
    its per-table, per-micro-batch runs."""

    unique: np.ndarray
    ut: np.ndarray
    inverse: np.ndarray
    mb_unique: np.ndarray
    mt: np.ndarray
    mb_counts: np.ndarray

    def batch(self, j: int, num_tables: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(unique, unique_counts [T], mb_unique, mb_offsets [T, N+1]) of batch j, in the packed-group layout."""
        lo, hi = self.ut[j * num_tables], self.ut[(j + 1) * num_tables]
        counts = np.diff(self.ut[j * num_tables:(j + 1) * num_tables + 1])
        c = self.mb_counts[j]
        offs = np.zeros((c.shape[0], c.shape[1] + 1), np.int64)
        np.cumsum(c, axis=1, out=offs[:, 1:])
        return self.unique[lo:hi], counts, self.mb_unique[self.mt[j]:self.mt[j + 1]], offs


def group_keys(values: np.ndarray, batch: np.ndarray, table: np.ndarray, mb: np.ndarray, nb: int, num_tables: int,
               n: int) -> GroupKeys:
    """Per-batch unique keys of a packed group. ``values`` int64 occurrences; ``batch``, ``table``, ``mb`` their
    batch (0..nb-1), table (0..T-1) and micro-batch (0..n-1), all int64 of the same length.

    Occurrences grouped by (batch, table), as the shard stage lays them out, take the compiled path
    (:func:`nestpipe.ingest._compiled.segment_keys`: each (batch, table) segment, a few hundred values, sorted on its
    own instead of one sort of the whole shard's composite codes); any other order takes :func:`group_keys_numpy`.
    Both give the same arrays (tests/test_ingest.py)."""
    bt = batch.astype(np.int64, copy=False) * num_tables + table
    if len(bt) and not np.all(bt[1:] >= bt[:-1]):
        return group_keys_numpy(values, batch, table, mb, nb, num_tables, n)
    seg = np.searchsorted(bt, np.arange(nb * num_tables + 1)).astype(np.int64)
    kernel = load_kernel()
    unique, ut, inverse, pos, mb_counts = kernel(values.astype(np.int64, copy=False), seg,
                                                 mb.astype(np.int64, copy=False), n)
    mt = np.concatenate([[0], np.cumsum(mb_counts.reshape(nb, -1).sum(axis=1))]).astype(np.int64)
    return GroupKeys(unique, ut, inverse, pos, mt, mb_counts.reshape(nb, num_tables, n))


def load_kernel():
    """The compiled per-segment keys (:mod:`nestpipe.ingest._compiled`; importing it loads Numba, which the parse
    and join workers never do)."""
    from nestpipe.ingest._compiled import segment_keys  # loads Numba: only in the shard units

    return segment_keys


def group_keys_numpy(values: np.ndarray, batch: np.ndarray, table: np.ndarray, mb: np.ndarray, nb: int,
                     num_tables: int, n: int) -> GroupKeys:
    """:func:`group_keys` for occurrences in any order: one sort (or presence map) over composite (batch, table,
    key) codes for all batches and tables at once."""
    T = num_tables
    values = values.astype(np.int64, copy=False)
    lo = np.zeros(T, np.int64)
    span = np.zeros(T, np.int64)
    if len(values):
        big = np.iinfo(np.int64)
        mins = np.full(T, big.max, np.int64)
        maxs = np.full(T, big.min, np.int64)
        np.minimum.at(mins, table, values)
        np.maximum.at(maxs, table, values)
        held = mins <= maxs
        lo[held] = mins[held]
        span_py = [int(maxs[t]) - int(mins[t]) + 1 if held[t] else 0 for t in range(T)]
    else:
        span_py = [0] * T
    total = sum(span_py)
    bt = batch * T + table
    if total * max(nb, 1) < (1 << 62):
        span[:] = span_py
        base = np.concatenate([[0], np.cumsum(span)[:-1]])
        codes = batch * np.int64(total) + (values - lo[table] + base[table])
        distinct, rank = _distinct_rank(codes, total * max(nb, 1))
        d_batch = distinct // np.int64(max(total, 1))
        d_gid = distinct - d_batch * np.int64(total)
        d_table = np.searchsorted(base, d_gid, side="right") - 1
        # a table of zero span never holds a key, so the right-most base <= gid is the key's table
        unique = d_gid - base[d_table] + lo[d_table]
        d_bt = d_batch * T + d_table
    else:  # ids too far apart for one code space: sort by (batch, table, value)
        order = np.lexsort((values, bt))
        sv, sb = values[order], bt[order]
        new = np.ones(len(sv), bool)
        if len(sv):
            new[1:] = (sv[1:] != sv[:-1]) | (sb[1:] != sb[:-1])
        rank = np.empty(len(values), np.int64)
        rank[order] = new.astype(np.int64).cumsum() - 1  # a bool cumsum is several times slower
        unique, d_bt = sv[new], sb[new]
    ut = np.searchsorted(d_bt, np.arange(nb * T + 1)).astype(np.int64)
    inverse = rank - ut[bt]
    counts = np.diff(ut)
    kmax = int(counts.max()) if len(counts) and len(values) else 1
    kmax = max(kmax, 1)
    mcodes = (bt * n + mb) * kmax + inverse
    mdistinct, _ = _distinct_rank(mcodes, nb * T * n * kmax, need_rank=False)
    group, pos = np.divmod(mdistinct, kmax)
    mb_counts = np.bincount(group, minlength=nb * T * n).reshape(nb, T, n)
    mt = np.searchsorted(group, np.arange(nb + 1) * (T * n)).astype(np.int64)
    return GroupKeys(unique, ut, inverse, pos, mt, mb_counts)
