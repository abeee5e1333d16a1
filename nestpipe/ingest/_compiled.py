"""Compiled loops of the shard stage, in a module of their own so that the parse and join workers, which import
the ingest pipeline, never load Numba."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def segment_keys(values, seg, mb, n):
    total = values.shape[0]
    nseg = seg.shape[0] - 1
    unique = np.empty(total, np.int64)
    ut = np.zeros(nseg + 1, np.int64)
    inverse = np.empty(total, np.int64)
    pos = np.empty(total, np.int64)
    mb_counts = np.zeros(nseg * n, np.int64)
    width = 0
    for s in range(nseg):
        width = max(width, seg[s + 1] - seg[s])
    mark = np.zeros(n * max(width, 1), np.bool_)
    # a segment whose values span fewer than 4 x the widest segment's length + 64 ids (the small single-id and tag
    # tables) is ranked by a presence map over that span instead of a sort; both give the sorted unique keys and the
    # same inverse
    max_span = 4 * width + 64
    present = np.zeros(max_span, np.bool_)
    rank = np.empty(max_span, np.int64)
    k_total = 0
    p_total = 0
    for s in range(nseg):
        a, b = seg[s], seg[s + 1]
        ut[s] = k_total
        if b == a:
            continue
        lo = values[a]
        hi = values[a]
        for i in range(a, b):
            lo = min(lo, values[i])
            hi = max(hi, values[i])
        d = hi - lo  # wraps negative when the true difference is >= 2**63 (keys at the int64 extremes)
        if 0 <= d < max_span:
            span = d + 1
            for i in range(a, b):
                present[values[i] - lo] = True
            k = 0
            for q in range(span):
                if present[q]:
                    rank[q] = k
                    unique[k_total + k] = lo + q
                    present[q] = False
                    k += 1
            for i in range(a, b):
                inverse[i] = rank[values[i] - lo]
        else:
            order = np.argsort(values[a:b], kind="mergesort")
            k = -1
            prev = 0
            for i in range(b - a):
                v = values[a + order[i]]
                if i == 0 or v != prev:
                    k += 1
                    unique[k_total + k] = v
                    prev = v
                inverse[a + order[i]] = k
            k += 1
        for i in range(a, b):
            mark[mb[i] * k + inverse[i]] = True
        for g in range(n):  # distinct positions of each micro-batch, ascending, micro-batch after micro-batch
            c = 0
            for q in range(k):
                if mark[g * k + q]:
                    pos[p_total] = q
                    p_total += 1
                    c += 1
                    mark[g * k + q] = False
            mb_counts[s * n + g] = c
        k_total += k
    ut[nseg] = k_total
    return unique[:k_total].copy(), ut, inverse, pos[:p_total].copy(), mb_counts
