"""How much of the successor term a model learns from click labels: a factorisation-machine probe.

    python research/click_fm_probe.py [--raw DIR] [--dim 32] [--epochs 2] [--lr 0.05]

On the synthetic logs (``research/click_oracle.py`` explains the click model), fits by row-wise AdaGrad on the
training dates ``logit = b_user + b_video + b_last + f(log1p gap) + <e_video, e_last>`` (``last`` the user's previous
video, the CTR ingest's ``last_video``; ``f`` a small MLP) and prints the ``valid`` AUC (the date before the 3 eval
dates) after every epoch, with and without the dot product. The dot product is the only term that can express the
pair (previous video, video) that the successor term depends on; what it adds is what labels teach about pairs.
"""

from __future__ import annotations

import argparse
import glob
import os

import numpy as np
import polars as pl
import torch
from sklearn.metrics import roc_auc_score

from nestpipe.datasets import synth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--raw", default="/tmp/nestpipe-click-oracle/small-seed0", help="synth small output")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.05)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if not os.path.exists(os.path.join(a.raw, "user_features_27k.csv")):
        synth.generate(a.raw, scale="small", seed=0, progress=False)
    df = pl.concat([pl.read_csv(f).select("user_id", "video_id", "time_ms", "date", "is_click")
                    for f in sorted(glob.glob(os.path.join(a.raw, "log_*.csv")))]).sort(["user_id", "time_ms", "video_id"])
    u, v, t = df["user_id"].to_numpy(), df["video_id"].to_numpy(), df["time_ms"].to_numpy()
    y, d = df["is_click"].to_numpy().astype(np.float32), df["date"].to_numpy()
    first = np.r_[True, u[1:] != u[:-1]]
    last = np.where(first, 0, np.r_[0, v[:-1] + 1])
    gap = np.log1p(np.where(first, 30 * 86400.0, np.maximum(np.r_[0, np.diff(t)], 0) / 1000.0)).astype(np.float32)
    dates = sorted(set(d.tolist()))
    train, valid = np.flatnonzero(d < dates[-4]), np.flatnonzero(d == dates[-4])
    g = torch.Generator().manual_seed(0)
    V, U = int(v.max()) + 2, int(u.max()) + 1
    bias = [torch.nn.Embedding(n, 1) for n in (U, V, V)]
    ev, el = torch.nn.Embedding(V, a.dim), torch.nn.Embedding(V, a.dim)
    for e in bias:
        torch.nn.init.zeros_(e.weight)
    for e in (ev, el):
        torch.nn.init.normal_(e.weight, std=0.01, generator=g)
    gapnet = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    sparse = torch.optim.Adagrad([p for m in (*bias, ev, el) for p in m.parameters()], lr=a.lr)
    dense = torch.optim.Adam(gapnet.parameters(), lr=0.003)

    def T(x):
        return torch.from_numpy(np.ascontiguousarray(x))

    def logits(ix):
        U_, V_, L_ = T(u[ix]), T(v[ix]), T(last[ix])
        base = bias[0](U_)[:, 0] + bias[1](V_)[:, 0] + bias[2](L_)[:, 0] + gapnet(T(gap[ix])[:, None])[:, 0]
        return base + (ev(V_) * el(L_)).sum(1), base

    rng = np.random.default_rng(0)
    for epoch in range(a.epochs):
        order = rng.permutation(train)
        for s in range(0, len(order), 1024):
            ix = order[s:s + 1024]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(ix)[0], T(y[ix]))
            sparse.zero_grad()
            dense.zero_grad()
            loss.backward()
            sparse.step()
            dense.step()
        with torch.no_grad():
            full, base = (x.numpy() for x in logits(valid))
        print(f"dim {a.dim} lr {a.lr} epoch {epoch + 1}: valid AUC {roc_auc_score(y[valid], full):.4f} "
              f"(without the dot product {roc_auc_score(y[valid], base):.4f})", flush=True)


if __name__ == "__main__":
    main()
