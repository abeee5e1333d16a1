"""Compiled loops of the clustering, in a module of their own so that importing ``nestpipe.clustering`` does not
load Numba (see :func:`nestpipe.clustering.balance.balanced_argmax` for when they run)."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def balanced_argmax_compiled(score, caps):
    b, n = score.shape
    out = np.full(b, -1, np.int64)
    room = caps.copy()
    pending = np.arange(b)
    choice = np.empty(b, np.int64)
    neg = np.empty(b, np.float64)
    while len(pending) > 0:
        m = len(pending)
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
            neg[i] = -best
        # order by (column, -score, row): pending is ascending, and stable sorts keep it within ties
        o1 = np.argsort(neg[:m], kind="mergesort")
        o2 = np.argsort(choice[:m][o1], kind="mergesort")
        order = o1[o2]
        taken = np.zeros(n, np.int64)
        keep = np.empty(m, np.int64)
        nk = 0
        for q in range(m):
            i = order[q]
            j = choice[i]
            if taken[j] < room[j]:
                out[pending[i]] = j
                taken[j] += 1
            else:
                keep[nk] = pending[i]
                nk += 1
        for j in range(n):
            room[j] -= taken[j]
        pending = np.sort(keep[:nk])
    return out
