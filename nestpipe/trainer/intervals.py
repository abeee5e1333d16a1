"""Bootstrap intervals of evaluation metrics, and paired intervals of differences between two scorers.

What is resampled: the evaluated samples (one row per scored eval sample: a held-out next-item target, or a CTR
impression), drawn with replacement, ``n`` out of ``n``, ``resamples`` times. The fitted models are not refitted and
the samples' scores and ranks are not recomputed: a resample only reweights the per-sample outcomes already
computed, so an interval states the uncertainty from which samples happened to land in the eval split, not from
training. A resample is a vector of counts ``w`` (``w[i]`` = how often sample ``i`` was drawn, ``sum(w) == n``), and
a metric on it is the metric of the sample multiset: a weighted mean for per-sample metrics (logloss, HR@k,
NDCG@k: :func:`mean_metric`), the weighted Mann-Whitney statistic for AUC (:func:`auc_metric`; tied scores count
one half, so it equals ``roc_auc_score`` on the drawn multiset).

Invariants:

- deterministic: the resamples depend only on ``(n, resamples, seed)``; one :class:`Bootstrap` draws them once per
  :meth:`Bootstrap.replicates` call, and every metric of that call sees the same resamples (in the same order);
- paired: a difference ``a - b`` is taken resample by resample over those shared resamples
  (:meth:`Bootstrap.compare`), so what the two scorers have in common (hard and easy samples) cancels;
  ``paired=False`` draws ``b``'s resamples independently (the negative control: wider for correlated scorers);
- intervals are percentile intervals (the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the replicates);
- a comparison's verdict is ``"tie"`` when its interval covers 0, else ``"better"`` / ``"worse"`` for the first
  scorer, in the metric's direction (lower is better for logloss).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

# a metric of a block of resamples: counts [r, n] -> one value per resample [r]
Metric = Callable[[np.ndarray], np.ndarray]

LOWER_IS_BETTER = frozenset({"logloss"})


def mean_metric(values: np.ndarray) -> Metric:
    """The mean of per-sample ``values`` over a resample (the counts as weights)."""
    v = np.asarray(values, dtype=np.float64)

    def metric(w: np.ndarray) -> np.ndarray:
        return (w @ v) / w.sum(1)

    return metric


def auc_metric(labels: np.ndarray, scores: np.ndarray) -> Metric:
    """AUC of ``scores`` against binary ``labels`` on a resample: the probability that a drawn positive scores above
    a drawn negative, ties counting one half, each sample weighted by its count. NaN on a resample without both
    classes. Up front: the negatives sorted by score, and for every positive the range ``[lo, hi)`` of negatives
    scoring below / level with it; per resample, with ``C`` the cumulative counts of the sorted negatives,
    ``AUC = sum_pos w (C[lo] + C[hi]) / (2 W_pos W_neg)`` in integers."""
    y = np.asarray(labels) > 0.5
    s = np.asarray(scores, dtype=np.float64)
    neg = np.flatnonzero(~y)
    neg = neg[np.argsort(s[neg], kind="stable")]
    pos = np.flatnonzero(y)
    neg_scores = s[neg]
    lo = np.searchsorted(neg_scores, s[pos], side="left")
    hi = np.searchsorted(neg_scores, s[pos], side="right")

    def metric(w: np.ndarray) -> np.ndarray:
        # int32 counts and partial sums (at most 2 n, n < 2**30 samples), int64 totals
        w = np.asarray(w, dtype=np.int32)
        cum = np.zeros((len(w), len(neg) + 1), dtype=np.int32)
        np.cumsum(w[:, neg], axis=1, out=cum[:, 1:])
        wp = w[:, pos]
        if len(neg) and s.min() == s.max():  # every pair tied (a constant scorer): the same arithmetic, shortcut
            num = wp.sum(1, dtype=np.int64) * cum[:, -1]
        else:
            num = (wp * (cum[:, lo] + cum[:, hi])).sum(1, dtype=np.int64)
        den = 2 * wp.sum(1, dtype=np.int64) * cum[:, -1]
        return np.where(den > 0, num / np.maximum(den, 1), np.nan)

    return metric


def logloss_metric(labels: np.ndarray, probs: np.ndarray) -> Metric:
    """Mean binary cross-entropy on a resample (probabilities clipped as :func:`baselines.logloss` does)."""
    p = np.clip(np.asarray(probs, dtype=np.float64), 1e-7, 1 - 1e-7)
    y = np.asarray(labels, dtype=np.float64)
    return mean_metric(-(y * np.log(p) + (1 - y) * np.log(1 - p)))


def verdict(interval: Sequence[float], metric_name: str) -> str:
    """``"tie"`` when the interval of ``a - b`` covers 0, else ``"better"`` / ``"worse"`` for ``a``."""
    lo, hi = interval
    if not (np.isfinite(lo) and np.isfinite(hi)) or lo <= 0.0 <= hi:
        return "tie"
    higher = lo > 0.0
    return "better" if higher != (metric_name in LOWER_IS_BETTER) else "worse"


@dataclasses.dataclass
class Bootstrap:
    """``resamples`` draws of ``n`` sample indices with replacement from a generator seeded by ``seed``; drawn in
    blocks of ``block`` resamples (memory ``block * n`` counts)."""

    n: int
    resamples: int = 1000
    seed: int = 0
    level: float = 0.95
    block: int = 50

    def counts(self, seed: Optional[int] = None) -> Iterator[np.ndarray]:
        """The resamples as count blocks ``[<= block, n]`` (int32), every time the same for the same seed."""
        rng = np.random.default_rng(self.seed if seed is None else seed)
        done = 0
        while done < self.resamples:
            r = min(self.block, self.resamples - done)
            idx = rng.integers(0, self.n, size=(r, self.n), dtype=np.int64)
            w = np.empty((r, self.n), dtype=np.int32)
            for i in range(r):  # row by row: each count vector stays in cache
                w[i] = np.bincount(idx[i], minlength=self.n)
            yield w
            done += r

    def replicates(self, metrics: Dict[str, Metric], seed: Optional[int] = None) -> Dict[str, np.ndarray]:
        """Every metric on every resample, ``{name: [resamples]}``; all metrics on the same resamples."""
        out: Dict[str, List[np.ndarray]] = {k: [] for k in metrics}
        for w in self.counts(seed):
            for k, m in metrics.items():
                out[k].append(m(w))
        return {k: np.concatenate(v) if v else np.zeros(0) for k, v in out.items()}

    def interval(self, replicates: np.ndarray) -> Tuple[float, float]:
        """The percentile interval of ``replicates`` (NaN resamples left out; NaNs when none is left)."""
        r = np.asarray(replicates, dtype=np.float64)
        r = r[np.isfinite(r)]
        if not len(r):
            return float("nan"), float("nan")
        a = (1.0 - self.level) / 2.0
        lo, hi = np.quantile(r, [a, 1.0 - a])
        return float(lo), float(hi)

    def compare(self, a: Metric, b: Metric, paired: bool = True) -> Tuple[float, float]:
        """The interval of ``a - b``: on the same resamples (paired), or, as a control, ``b`` on resamples drawn
        independently of ``a``'s (seed + 1)."""
        if paired:
            rep = self.replicates({"a": a, "b": b})
            return self.interval(rep["a"] - rep["b"])
        ra = self.replicates({"a": a})["a"]
        rb = self.replicates({"b": b}, seed=self.seed + 1)["b"]
        return self.interval(ra - rb)

    def describe(self) -> Dict[str, object]:
        return {"method": "percentile bootstrap over the scored samples (drawn with replacement, n of n); "
                          "comparisons (difference = model - the other) paired: both on the same resamples; "
                          "verdict 'tie' when the difference's interval covers 0",
                "resamples": self.resamples, "seed": self.seed, "level": self.level, "samples": self.n}


def report(boot: Bootstrap, scorers: Dict[str, Dict[str, Metric]], points: Dict[str, Dict[str, float]],
           reference: str = "model") -> Tuple[Dict, Dict]:
    """``(intervals, comparisons)`` for eval.json from one set of resamples.

    ``scorers[name][metric]``: the metric of scorer ``name`` on a resample; ``points[name][metric]``: its value on
    the full eval set. ``intervals[name][metric] = [lo, hi]``; ``comparisons[other][metric]`` for every scorer but
    ``reference``: ``{"difference": point(reference) - point(other), "interval": paired [lo, hi], "verdict"}``.
    """
    flat = {(name, m): f for name, ms in scorers.items() for m, f in ms.items()}
    reps = boot.replicates({f"{name}\t{m}": f for (name, m), f in flat.items()})
    intervals: Dict[str, Dict[str, List[float]]] = {}
    for (name, m) in flat:
        intervals.setdefault(name, {})[m] = list(boot.interval(reps[f"{name}\t{m}"]))
    comparisons: Dict[str, Dict[str, Dict]] = {}
    for name, ms in scorers.items():
        if name == reference:
            continue
        for m in ms:
            if m not in scorers[reference]:
                continue
            iv = list(boot.interval(reps[f"{reference}\t{m}"] - reps[f"{name}\t{m}"]))
            comparisons.setdefault(name, {})[m] = {"difference": float(points[reference][m] - points[name][m]),
                                                   "interval": iv, "verdict": verdict(iv, m)}
    return intervals, comparisons
