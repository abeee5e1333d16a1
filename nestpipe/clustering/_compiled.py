"""Compiled loops of the clustering, in a module of their own so that importing ``nestpipe.clustering`` does not
load Numba (see :func:`nestpipe.clustering.balance.balanced_argmax` for when they run)."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def balanced_argmax_compiled(score, caps):
    """:func:`nestpipe.clustering.balance.balanced_argmax_numpy`'s rounds, with the same proposals and acceptances.

    A round buckets the proposers by column (in row order); a column with room for all its proposers takes them
    without sorting, an over-full one takes its best by (score descending, row ascending): a stable sort of its
    own proposers only, where the reference sorts every proposer by (column, -score, row)."""
    b, n = score.shape
    out = np.full(b, -1, np.int64)
    room = caps.copy()
    pending = np.arange(b)
    choice = np.empty(b, np.int64)
    best_of = np.empty(b, np.float64)
    count = np.zeros(n, np.int64)
    start = np.zeros(n + 1, np.int64)
    fill = np.zeros(n, np.int64)
    bucket = np.empty(b, np.int64)
    keep = np.empty(b, np.int64)
    while len(pending) > 0:
        m = len(pending)
        count[:] = 0
        for i in range(m):  # best column with room; the first of equal scores, as np.argmax
            r = pending[i]
            best, bj = -np.inf, -1
            for j in range(n):
                if room[j] <= 0:
                    continue
                v = score[r, j]
                if bj < 0 or v > best:
                    best, bj = v, j
            choice[i] = bj
            best_of[i] = best
            count[bj] += 1
        for j in range(n):
            start[j + 1] = start[j] + count[j]
            fill[j] = start[j]
        for i in range(m):  # proposers of each column, in row order (pending is ascending)
            j = choice[i]
            bucket[fill[j]] = i
            fill[j] += 1
        nk = 0
        for j in range(n):
            lo, hi = start[j], start[j + 1]
            if hi - lo <= room[j]:
                for q in range(lo, hi):
                    out[pending[bucket[q]]] = j
                room[j] -= hi - lo
                continue
            neg = np.empty(hi - lo, np.float64)
            for q in range(lo, hi):
                neg[q - lo] = -best_of[bucket[q]]
            order = np.argsort(neg, kind="mergesort")  # stable: equal scores stay in row order
            take = room[j]
            for q in range(hi - lo):
                r = pending[bucket[lo + order[q]]]
                if q < take:
                    out[r] = j
                else:
                    keep[nk] = r
                    nk += 1
            room[j] = 0
        pending = np.sort(keep[:nk])
    return out
