"""Where the synthetic click model's AUC comes from: oracles that know some of the generator's terms.

    python research/click_oracle.py [--scale small] [--seed 0] [--raw DIR]

The generator (``nestpipe.datasets.synth``) clicks with ``σ(-1 + 1.4 m + 1.0 s + 0.4 h + b_u + w t_uv)``: ``m`` the
item is of the user's community, ``h`` a head item, ``s`` a successor transition (the item is the fixed successor of
the user's previous item), ``b_u`` a per-user bias, ``t_uv`` the latent taste match of the user and the video's
author (weight ``w = click_taste_boost``). In the standard logs ``m`` and ``h`` depend on the video alone (users draw
from their own community or the head), so a model can learn them per video; ``b_u`` per user; ``s`` only from the
pair (previous video, video); ``t_uv`` only from the pair (user, author). This script recomputes every term from the written logs and the config, and prints the
AUC of the click probability with all terms (the Bayes ceiling), without ``s``, without ``b_u``, with ``s`` known only
for pairs that occur as a successor transition in the training dates (what memorising pairs could reach), with
``s`` learnt per pair from its training clicks alone (every other term known; what a model learning from click
labels could reach at best), and with the video terms alone, on the ``eval`` split (the last 3 dates, the CTR ingest's default) and the ``valid``
split (the date before them, ``ingest --validation``).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os

import numpy as np
import polars as pl
from sklearn.metrics import roc_auc_score

from nestpipe.datasets import synth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", default="small", choices=["tiny", "small", "medium"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--raw", default=None, help="the synth output (generated here when absent)")
    ap.add_argument("--eval-days", type=int, default=3)
    ap.add_argument("--synth", nargs="*", default=[], metavar="KEY=VALUE",
                    help="generator settings the data was made with (click_taste_boost, click_taste_of)")
    a = ap.parse_args()
    raw = a.raw or f"/tmp/nestpipe-click-oracle/{a.scale}-seed{a.seed}"
    cfg = synth.SynthConfig.for_scale(a.scale, seed=a.seed, **dict(kv.split("=", 1) for kv in a.synth))
    cfg = dataclasses.replace(cfg, click_taste_boost=float(cfg.click_taste_boost))
    if not os.path.exists(os.path.join(raw, "user_features_27k.csv")):
        synth.generate(raw, config=cfg, progress=False)
    df = pl.concat([pl.read_csv(f).select("user_id", "video_id", "time_ms", "date", "is_click", "is_rand")
                    for f in sorted(glob.glob(os.path.join(raw, "log_*.csv")))])
    df = df.sort(["user_id", "time_ms", "video_id"])  # the CTR ingest's order
    u, v = df["user_id"].to_numpy(), df["video_id"].to_numpy()
    y, d, std = df["is_click"].to_numpy(), df["date"].to_numpy(), df["is_rand"].to_numpy() == 0
    slot = synth.video_slots(cfg, v)
    vc = synth.video_communities(cfg, v)
    m = (vc == synth.user_communities(cfg)[u]).astype(float)
    h = (vc == -1).astype(float)
    bu = synth._user_bias(cfg, u)
    taste = cfg.click_taste_boost * synth.taste_match(cfg, u, v) if cfg.click_taste_boost else np.zeros(len(u))
    # s: the previous standard-log row of the same user holds the video this one succeeds
    idx = np.flatnonzero(std)
    prev = np.full(len(v), -1)
    same_user = u[idx][1:] == u[idx][:-1]
    prev[idx[1:]] = np.where(same_user, slot[idx][:-1], -1)
    s = std & (prev >= 0) & (synth._successor(cfg, np.maximum(prev, 0)) == slot)
    pair = prev.astype(np.int64) * (1 << 32) + slot

    def sig(x):
        return 1.0 / (1.0 + np.exp(-x))

    dates = sorted(set(d.tolist()))
    splits = {"eval": (d >= dates[-a.eval_days], d < dates[-a.eval_days]),
              "valid": (d == dates[-a.eval_days - 1], d < dates[-a.eval_days - 1])}
    print(f"{a.scale} seed {a.seed}: {len(y)} rows, successor transitions {s.mean():.3f} of them")
    z = -1 + 1.4 * m + 0.4 * h + bu + taste  # every term but s
    z_no_taste = -1 + 1.4 * m + 1.0 * s + 0.4 * h + bu  # every term but t_uv
    for name, (sel, train) in splits.items():
        seen = s & np.isin(pair, np.unique(pair[train & s]))
        rows = {
            "s learnt from training clicks alone": _pair_posterior(z, y, s, prev, pair, sel, train, sig),
            "all terms (Bayes ceiling)": sig(-1 + 1.4 * m + 1.0 * s + 0.4 * h + bu + taste),
            "without the successor term s": sig(-1 + 1.4 * m + 0.4 * h + bu + taste),
            "s only for pairs seen in training": sig(-1 + 1.4 * m + 1.0 * seen + 0.4 * h + bu + taste),
            "t_u learnt from training clicks": sig(z_no_taste + _taste_posterior(cfg, u, v, y, train, z_no_taste, sig)),
            "without the taste match t_uv": sig(z_no_taste),
            "without the user bias b_u": sig(-1 + 1.4 * m + 1.0 * s + 0.4 * h + taste),
            "video terms alone (m, h)": sig(-1 + 1.4 * m + 0.4 * h),
        }
        print(f"{name}: {int(sel.sum())} rows, successor pairs seen in training "
              f"{seen[sel].sum() / max(1, s[sel].sum()):.3f} of the split's transitions")
        for what, p in rows.items():
            print(f"  {what:36s} AUC {roc_auc_score(y[sel], p[sel]):.4f}")


def _taste_posterior(cfg, u, v, y, train, z, sig, iterations=8):
    """What learning each user's taste vector from its clicks can reach, at best: every other term and every
    author's vector known exactly, ``t_u`` the MAP estimate (its standard-normal prior) from the user's training
    rows, by Newton steps on the logistic likelihood; returns ``w <t_u_hat, w_v> / sqrt(rank)`` per row."""
    if not cfg.click_taste_boost:
        return np.zeros(len(u))
    r = synth.TASTE_RANK
    x = synth.video_tastes(cfg, v) * (cfg.click_taste_boost / np.sqrt(r))
    users = int(u.max()) + 1
    t = np.zeros((users, r))
    tr = np.flatnonzero(train)
    for _ in range(iterations):
        p = sig(z[tr] + (t[u[tr]] * x[tr]).sum(1))
        g = np.zeros((users, r))
        np.add.at(g, u[tr], (y[tr] - p)[:, None] * x[tr])
        hess = np.zeros((users, r, r))
        np.add.at(hess, u[tr], (p * (1 - p))[:, None, None] * x[tr][:, :, None] * x[tr][:, None, :])
        t += np.linalg.solve(hess + np.eye(r), (g - t)[:, :, None])[:, :, 0]
    return (t[u] * x).sum(1)


def _pair_posterior(z, y, s, prev, pair, sel, train, sig):
    """What learning each pair from its click labels can reach, at best: every term but ``s`` known exactly, and
    each pair's chance of being a successor pair updated by Bayes from the clicks of its occurrences in the training
    dates (the likelihood ratio of clicking with and without the +1.0 successor term), from the training share of
    successor transitions as the prior. A model that learns from clicks sees nothing more of a pair than its
    occurrences' labels; it also has to learn the other terms, so it stays below this."""
    has_prev = prev >= 0
    prior = float(s[train & has_prev].mean())
    p1, p0 = sig(z + 1.0), sig(z)
    llr = np.where(y == 1, np.log(p1 / p0), np.log((1 - p1) / (1 - p0)))
    tr = train & has_prev
    keys, inv = np.unique(pair[tr], return_inverse=True)
    total = np.bincount(inv, weights=llr[tr], minlength=len(keys))
    pos = np.searchsorted(keys, pair)
    pos_c = np.minimum(pos, max(len(keys) - 1, 0))
    known = has_prev & (len(keys) > 0) & (keys[pos_c] == pair)
    logit = np.log(prior / (1 - prior)) + np.where(known, total[pos_c], 0.0)
    post = np.where(has_prev, sig(logit), 0.0)
    return post * p1 + (1 - post) * p0


if __name__ == "__main__":
    main()
