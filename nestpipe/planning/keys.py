"""Unique-key arithmetic of a key stream with Zipf popularity.

Model: the keys of a batch are ``n`` independent draws from ``P(rank r) ~ r^-s`` over ``V`` ranks. Then the
expected number of distinct keys is ``U(n) = sum_r 1 - (1 - p_r)^n``, and

- a random balanced partition into N micro-batches has redundancy ``R(N) = N U(n/N) / U(n)`` (each micro-batch
  deduplicates on its own; see docs/clustering.md);
- an owner that deduplicates the requests of W workers retrieves ``U(W n) / W`` rows instead of ``U(n)``
  (``owner_dedup_factor``);
- two consecutive batches share a fraction ``sum q_r^2 / sum q_r`` of their keys, ``q_r = 1 - (1 - p_r)^n``.

Draws are independent: correlation inside a sample (a user's history) is ignored, which overstates the
redundancy of data with planted communities and understates nothing else. Sums run over geometric rank bins
(exact for the first 2,048 ranks, then 0.5% wide), which keeps them below a millisecond at V = 1e9.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=64)
def _bins(vocab: int, exponent: float):
    head = min(vocab, 2048)
    ranks = [np.arange(1, head + 1, dtype=np.float64)]
    counts = [np.ones(head)]
    if vocab > head:
        edges = np.unique(np.round(np.geomspace(head + 1, vocab + 1, num=max(2, int(np.log(vocab / head) / 0.005)))))
        edges[0], edges[-1] = head + 1, vocab + 1
        lo, hi = edges[:-1], edges[1:]
        ranks.append(np.sqrt(lo * (hi - 1)))
        counts.append(hi - lo)
    r = np.concatenate(ranks)
    c = np.concatenate(counts)
    w = r ** -exponent
    # normalise with the bin counts so the probabilities sum to one exactly
    p = w / float((w * c).sum())
    return p, c


def _q(vocab: int, exponent: float, n: float) -> np.ndarray:
    p, _ = _bins(vocab, exponent)
    return -np.expm1(n * np.log1p(-p))


def expected_unique(vocab: int, exponent: float, n: float) -> float:
    """Expected distinct keys among ``n`` draws."""
    if n <= 0:
        return 0.0
    _, c = _bins(vocab, exponent)
    return float((_q(vocab, exponent, n) * c).sum())


def redundancy_random(vocab: int, exponent: float, n: float, micro_batches: int) -> float:
    """R of a random balanced partition of ``n`` draws into ``micro_batches``."""
    if micro_batches <= 1:
        return 1.0
    return micro_batches * expected_unique(vocab, exponent, n / micro_batches) / expected_unique(vocab, exponent, n)


def owner_dedup_factor(vocab: int, exponent: float, n: float, workers: int) -> float:
    """Rows an owner retrieves when it deduplicates across ``workers`` requesters, relative to not doing so."""
    if workers <= 1:
        return 1.0
    return expected_unique(vocab, exponent, n * workers) / (workers * expected_unique(vocab, exponent, n))


def consecutive_overlap(vocab: int, exponent: float, n: float) -> float:
    """Expected share of a batch's distinct keys also present in the next, independent batch."""
    _, c = _bins(vocab, exponent)
    q = _q(vocab, exponent, n)
    return float((q * q * c).sum() / max((q * c).sum(), 1e-300))
