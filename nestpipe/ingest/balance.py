"""Cost-balanced GR batches: every training batch costs about the same attention time, whatever its samples.

Ranks read their own batches and meet at every step's collectives, so a step lasts as long as its costliest batch.
A sequence of ``n`` tokens costs ``c(n) = a n^2 + b n`` (attention's causal triangle, and everything done per token;
:class:`SequenceCost`, fitted by ``nestpipe measure sequence-cost`` on the HSTU layer stack). The ingest composes the
training batches so that their costs are nearly equal (:func:`balanced_order`) and then the micro-batches of each
batch (:func:`balance_micro_batches`), both deterministic functions of the samples' lengths and the sample order.

Batches: the split's sample order (partitions in order, each shuffled by its keyed generator) is cut into windows of
``window`` batches (``window x B`` consecutive samples, so that a batch still reads one or two partitions); inside a
window the samples are dealt in decreasing cost, ``window`` at a time, the costliest of each round to the batch that
is cheapest so far (longest-processing-time with equal counts), then swaps of one sample between the costliest and
the cheapest batch (as for micro-batches, below) until the costliest is at most ``BATCH_TOLERANCE`` above the mean:
the rounds alone leave the batches that drew the few longest sequences above the rest. Windows differ only by their
mean sample cost (a mean over ``window x B`` samples).
Each batch keeps its samples in their sample order, and the batches of a window keep the order of their first sample.

Micro-batches (``--balance tokens``; ``batches`` leaves them as the clustering made them): the clustering chooses the
partition; then, while the costliest micro-batch is more than ``MICRO_TOLERANCE`` above the mean, one sample of it
and one of the cheapest are swapped (counts stay equal): among the swaps that at least halve their gap, the one that
adds the fewest distinct keys to the two micro-batches. The clustering groups users with similar (so often similarly
long) histories, so its micro-batches can differ twofold in cost; evening them out costs exchanged rows, part of
which single exact-gain swaps that keep every micro-batch under the cap win back afterwards
(``nestpipe.clustering.refine``, called by ``nestpipe.ingest.common.cluster_fields``).

Both tolerances bound the costliest against the mean (``max / mean - 1``, :func:`imbalance`, the trainer's
``token_imbalance``), not the spread max - min: a synchronous step, or a frozen-window exchange of micro-batch i,
waits for the costliest of its parts, and a cheaper part costs nothing. Every micro-batch within ``1 +
MICRO_TOLERANCE`` of its batch's mean bounds the frozen-window step of equal-cost batches at the same factor.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from nestpipe.datasets.sequence_cost import DEFAULT_COST, SequenceCost  # noqa: F401  (the ingest's names)
from nestpipe.ingest.config import BALANCE_MODES, BATCH_TOLERANCE, MICRO_TOLERANCE, WINDOW_BATCHES  # noqa: F401

HALVING = 0.5  # a keyed swap must at least halve the gap (or reach the tolerance)


def balanced_order(lengths: np.ndarray, batch_size: int, cost: SequenceCost,
                   window: int = WINDOW_BATCHES) -> np.ndarray:
    """A permutation of the sample positions ``0 .. len(lengths) - 1``: consecutive runs of ``batch_size`` are the
    balanced batches (see the module docstring); the samples after the last whole batch stay last, in order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    B = int(batch_size)
    n_batches = len(lengths) // B
    out = [np.zeros(0, np.int64)]
    for w0 in range(0, n_batches, window):
        w = min(window, n_batches - w0)
        pos = np.arange(w0 * B, (w0 + w) * B, dtype=np.int64)
        out.append(pos[_deal(cost.units(lengths[pos]), w, B)])
    out.append(np.arange(n_batches * B, len(lengths), dtype=np.int64))
    return np.concatenate(out)


def _deal(c: np.ndarray, w: int, B: int) -> np.ndarray:
    """Positions 0 .. w B - 1 with costs ``c`` -> an order whose consecutive runs of B are the balanced batches."""
    order = np.argsort(-c, kind="stable")  # decreasing cost; equal costs in sample order
    load = np.zeros(w, dtype=c.dtype)
    members = np.empty((w, B), dtype=np.int64)
    for r in range(B):
        take = order[r * w:(r + 1) * w]
        cheapest = np.argsort(load, kind="stable")  # the costliest sample of the round to the cheapest batch
        members[cheapest, r] = take
        load[cheapest] += c[take]
    # the heavy tail (a few very long sequences) leaves some batches above the rest: swaps between the costliest and
    # the cheapest batch close the gap (the micro-batch rule, here over the window's batches)
    assign = np.empty(w * B, dtype=np.int64)
    assign[members.reshape(-1)] = np.repeat(np.arange(w), B)
    assign, _ = balance_micro_batches(assign, c, w, tolerance=BATCH_TOLERANCE, max_swaps=4 * w)
    members = np.argsort(assign, kind="stable").reshape(w, B)  # each batch's samples, in sample order
    return members[np.argsort(members[:, 0], kind="stable")].reshape(-1)


def balance_micro_batches(mb: np.ndarray, costs: np.ndarray, n: int, tolerance: float = MICRO_TOLERANCE,
                          max_swaps: int = 256, keys: Optional[Tuple[np.ndarray, np.ndarray]] = None
                          ) -> Tuple[np.ndarray, int]:
    """``(mb', swaps)``: the micro-batch (or batch) of every sample after the balancing swaps.

    Each swap exchanges one sample of the costliest group with one of the cheapest. Without ``keys`` it is the swap
    that brings their costs closest. With ``keys = (values, offsets)`` (every sample's keys, CSR), the swaps that at
    least halve the gap (or reach the tolerance) compete on the rows they add: the one that adds the fewest distinct
    keys to the two groups (each sample's keys it no longer shares in its old group against those it does not find
    in its new one) is made, so the balancing undoes as little of the clustering as it can. Stops when the costliest
    group is at most ``tolerance`` of the mean above it (:func:`imbalance` <= ``tolerance``), after ``max_swaps``, or
    when no swap narrows the gap."""
    mb = np.asarray(mb).copy()
    costs = np.asarray(costs)  # integer units (exact sums) or floats
    swaps = 0
    mean = costs.sum() / max(n, 1)
    key_of = counts = None
    if keys is not None:
        values, offsets = keys
        _, codes = np.unique(np.asarray(values), return_inverse=True)
        sample_of = np.repeat(np.arange(len(mb)), np.diff(offsets))
        k = int(codes.max()) + 1 if len(codes) else 0
        # (sample, key) once each, in (sample, key) order: one sort of int64 codes (a row-wise unique sorts rows)
        pair_sample, pair_key = np.divmod(np.unique(sample_of * k + codes.reshape(-1)), max(k, 1))
        key_of = (pair_sample, pair_key, np.searchsorted(pair_sample, np.arange(len(mb) + 1)))
        counts = np.zeros((n, k), dtype=np.int64)
        np.add.at(counts, (mb[pair_sample], pair_key), 1)  # samples of group g holding key k
    for _ in range(max_swaps):
        load = np.zeros(n, dtype=costs.dtype)
        np.add.at(load, mb, costs)
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        gap = load[hi] - load[lo]
        if load[hi] - mean <= tolerance * mean:  # the costliest within the tolerance (imbalance <= tolerance)
            break
        i_hi, i_lo = np.flatnonzero(mb == hi), np.flatnonzero(mb == lo)
        d = costs[i_hi][:, None] - costs[i_lo][None, :]  # moving a cost-d difference changes the gap by 2 d
        after = np.where(d > 0, np.abs(gap - 2 * d), gap)  # a swap that moves nothing (or the wrong way) never wins
        if after.min() >= gap:
            break
        if key_of is None:
            k = int(np.argmin(after))  # the first of equal gaps: deterministic
        else:
            good = after <= max(tolerance * mean, gap * HALVING)
            if not good.any():
                good = after == after.min()
            added = (_moved_keys(key_of, counts, mb, i_hi, hi, lo)[:, None]
                     + _moved_keys(key_of, counts, mb, i_lo, lo, hi)[None, :])
            k = int(np.argmin(np.where(good, added, np.iinfo(np.int64).max)))
        a, b = divmod(k, len(i_lo))
        i, j = i_hi[a], i_lo[b]
        if counts is not None:
            for s_, src, dst in ((i, hi, lo), (j, lo, hi)):
                ks = key_of[1][key_of[2][s_]:key_of[2][s_ + 1]]
                counts[src, ks] -= 1
                counts[dst, ks] += 1
        mb[i], mb[j] = lo, hi
        swaps += 1
    return mb, swaps


def _moved_keys(key_of, counts: np.ndarray, mb: np.ndarray, samples: np.ndarray, src: int, dst: int) -> np.ndarray:
    """Per sample of group ``src`` (``samples``: all of them, ascending): distinct rows added by moving it to
    ``dst``: its keys absent from ``dst`` minus its keys no other sample of ``src`` holds (those leave ``src``)."""
    sample, key, _ = key_of
    sel = mb[sample] == src
    s_, k_ = sample[sel], key[sel]
    gain = (counts[dst, k_] == 0).astype(np.int64) - (counts[src, k_] == 1).astype(np.int64)
    per = np.zeros(len(samples), dtype=np.int64)
    np.add.at(per, np.searchsorted(samples, s_), gain)
    return per


def imbalance(batch_costs: np.ndarray) -> float:
    """``max / mean - 1`` of a set of costs (0 when all are equal)."""
    c = np.asarray(batch_costs, dtype=np.float64)
    return float(c.max() / c.mean() - 1.0) if len(c) and c.mean() > 0 else 0.0
