"""The bootstrap intervals of ``nestpipe eval`` (:mod:`nestpipe.trainer.intervals`).

- A resample's AUC equals scikit-learn's ``roc_auc_score`` on the drawn multiset (ties and a constant scorer too),
  its mean metrics the plain mean of the drawn values.
- On synthetic data of known truth the 95% interval covers the true value in about 95% of data sets (a mean and an
  AUC), and its width shrinks as the samples grow (about as 1 / sqrt(n)).
- Paired comparisons: two identical scorers are a "tie" (interval exactly [0, 0]); a clearly better scorer is
  "better" (AUC higher, logloss lower), the reverse "worse". Negative control: for two correlated scorers, pairing
  disabled (independent resamples) gives a much wider interval, which covers 0 where the paired one does not.
- The resamples are deterministic for a seed, and :func:`report` compares the model with every other scorer.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import norm
from sklearn.metrics import roc_auc_score

from nestpipe.trainer import baselines
from nestpipe.trainer import intervals as iv

# score = label + N(0, 1): the true AUC is P(N(0, 2) < 1) = Phi(1 / sqrt 2)
TRUE_AUC = float(norm.cdf(1 / np.sqrt(2)))


def _scored(rng, n, rate=0.3):
    y = (rng.random(n) < rate).astype(np.float64)
    return y, y + rng.normal(size=n)


def test_resample_metrics_are_the_metrics_of_the_drawn_multiset():
    rng = np.random.default_rng(0)
    n = 500
    y, s = _scored(rng, n)
    tied = np.round(s, 1)
    p = 1 / (1 + np.exp(-s))
    boot = iv.Bootstrap(n, resamples=12, seed=5, block=5)
    metrics = {"auc": iv.auc_metric(y, s), "tied": iv.auc_metric(y, tied), "const": iv.auc_metric(y, np.full(n, 0.3)),
               "logloss": iv.logloss_metric(y, p), "mean": iv.mean_metric(s)}
    blocks = list(boot.counts())
    assert [len(w) for w in blocks] == [5, 5, 2] and all((w.sum(1) == n).all() for w in blocks)
    reps = boot.replicates(metrics)
    for r, w in enumerate(np.concatenate(blocks)):
        idx = np.repeat(np.arange(n), w)
        assert reps["auc"][r] == pytest.approx(roc_auc_score(y[idx], s[idx]), abs=1e-12)
        assert reps["tied"][r] == pytest.approx(roc_auc_score(y[idx], tied[idx]), abs=1e-12)
        assert reps["const"][r] == 0.5
        assert reps["logloss"][r] == pytest.approx(baselines.logloss(y[idx], p[idx]), abs=1e-12)
        assert reps["mean"][r] == pytest.approx(s[idx].mean(), abs=1e-12)
    # one class only: no AUC
    assert np.isnan(iv.auc_metric(np.ones(n), s)(blocks[0])).all()


def test_intervals_are_deterministic_for_a_seed():
    rng = np.random.default_rng(1)
    y, s = _scored(rng, 300)
    m = {"auc": iv.auc_metric(y, s)}
    a = iv.Bootstrap(300, resamples=200, seed=7).replicates(m)["auc"]
    b = iv.Bootstrap(300, resamples=200, seed=7).replicates(m)["auc"]
    c = iv.Bootstrap(300, resamples=200, seed=8).replicates(m)["auc"]
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def _coverage_and_width(n, data_sets=40, resamples=300):
    rng = np.random.default_rng(n)
    cover = {"mean": 0, "auc": 0}
    width = {"mean": [], "auc": []}
    for d in range(data_sets):
        y, s = _scored(rng, n)
        boot = iv.Bootstrap(n, resamples=resamples, seed=d)
        reps = boot.replicates({"mean": iv.mean_metric(y), "auc": iv.auc_metric(y, s)})
        for k, truth in (("mean", 0.3), ("auc", TRUE_AUC)):
            lo, hi = boot.interval(reps[k])
            cover[k] += lo <= truth <= hi
            width[k].append(hi - lo)
    return {k: c / data_sets for k, c in cover.items()}, {k: float(np.mean(w)) for k, w in width.items()}


def test_interval_covers_the_true_value_and_shrinks_with_more_samples():
    cov_small, w_small = _coverage_and_width(400)
    cov_large, w_large = _coverage_and_width(6400)
    for k in ("mean", "auc"):
        # 95% nominal over 40 data sets: 38 expected; 34 or fewer has probability < 3%
        assert cov_small[k] >= 0.85 and cov_large[k] >= 0.85, (k, cov_small, cov_large)
        # 16x the samples: a quarter of the width (1 / sqrt(n))
        assert 3.0 < w_small[k] / w_large[k] < 5.3, (k, w_small, w_large)
    # the interval has the width of the sampling distribution: the mean's standard error is sqrt(p (1 - p) / n)
    assert w_small["mean"] == pytest.approx(2 * 1.96 * np.sqrt(0.3 * 0.7 / 400), rel=0.15), w_small


def test_paired_comparison_tie_better_worse():
    rng = np.random.default_rng(2)
    n = 3000
    y, s = _scored(rng, n)
    weak = 0.3 * y + rng.normal(size=n)
    boot = iv.Bootstrap(n, resamples=500, seed=0)
    same = boot.compare(iv.auc_metric(y, s), iv.auc_metric(y, s.copy()))
    assert same == (0.0, 0.0) and iv.verdict(same, "AUC") == "tie"
    better = boot.compare(iv.auc_metric(y, s), iv.auc_metric(y, weak))
    assert better[0] > 0.1 and iv.verdict(better, "AUC") == "better", better
    worse = boot.compare(iv.auc_metric(y, weak), iv.auc_metric(y, s))
    assert iv.verdict(worse, "AUC") == "worse"
    # logloss: lower is better, so a negative difference is "better"
    # the calibrated probabilities of each score (prior log-odds log(3/7), likelihood ratio of N(m, 1) vs N(0, 1))
    p_good, p_weak = 1 / (1 + np.exp(-(s - 1.35))), 1 / (1 + np.exp(-(0.3 * weak - 0.89)))
    ll = boot.compare(iv.logloss_metric(y, p_good), iv.logloss_metric(y, p_weak))
    assert ll[1] < 0 and iv.verdict(ll, "logloss") == "better", ll
    assert iv.verdict((-0.01, 0.02), "logloss") == "tie" and iv.verdict((0.01, 0.02), "logloss") == "worse"


def test_negative_control_unpaired_interval_is_wider_for_correlated_scorers():
    rng = np.random.default_rng(3)
    n = 3000
    y = (rng.random(n) < 0.3).astype(np.float64)
    common = rng.normal(size=n)  # what both scorers get wrong alike
    a = y + common + 0.2 * rng.normal(size=n)
    b = 0.92 * y + common + 0.2 * rng.normal(size=n)  # slightly less signal, otherwise the same scorer
    boot = iv.Bootstrap(n, resamples=500, seed=0)
    ma, mb = iv.auc_metric(y, a), iv.auc_metric(y, b)
    paired = boot.compare(ma, mb)
    unpaired = boot.compare(ma, mb, paired=False)
    w_p, w_u = paired[1] - paired[0], unpaired[1] - unpaired[0]
    assert w_u > 3 * w_p, (paired, unpaired)
    # the small but consistent lead: found by the paired interval, lost in the unpaired one
    assert iv.verdict(paired, "AUC") == "better" and iv.verdict(unpaired, "AUC") == "tie", (paired, unpaired)


def test_report_compares_the_model_with_every_other_scorer():
    rng = np.random.default_rng(4)
    n = 2000
    y, s = _scored(rng, n)
    probs = {"model": 1 / (1 + np.exp(-(s - 1.35))), "baseline_constant": np.full(n, y.mean()),
             "baseline_copy": None}
    probs["baseline_copy"] = probs["model"].copy()
    scorers = {k: {"AUC": iv.auc_metric(y, p), "logloss": iv.logloss_metric(y, p)} for k, p in probs.items()}
    points = {k: {"AUC": roc_auc_score(y, p), "logloss": baselines.logloss(y, p)} for k, p in probs.items()}
    boot = iv.Bootstrap(n, resamples=300, seed=0)
    intervals, comparisons = iv.report(boot, scorers, points)
    assert set(intervals) == set(probs) and set(comparisons) == {"baseline_constant", "baseline_copy"}
    for k in probs:
        for m in ("AUC", "logloss"):
            lo, hi = intervals[k][m]
            assert lo <= points[k][m] <= hi, (k, m, intervals[k][m], points[k][m])
    assert intervals["baseline_constant"]["AUC"] == [0.5, 0.5]
    c = comparisons["baseline_constant"]
    assert c["AUC"]["verdict"] == "better" and c["logloss"]["verdict"] == "better", c
    assert c["AUC"]["difference"] == pytest.approx(points["model"]["AUC"] - 0.5)
    assert comparisons["baseline_copy"]["AUC"] == {"difference": 0.0, "interval": [0.0, 0.0], "verdict": "tie"}
