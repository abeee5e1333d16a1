"""Measure the per-sequence cost model ``c(n) = a n^2 + b n`` of the HSTU layer stack (cost-balanced batches).

:func:`sequence_seconds` times the forward + backward of the default HSTU layer stack (jagged attention) on
micro-batches of equal-length sequences, per sequence; :func:`fit` takes the non-negative least-squares ``(a, b)``
of those times, weighting every length by ``1 / c(n)`` so that the short lengths count as much as the long ones.
``nestpipe measure sequence-cost`` runs both and prints the ingest's ``--sequence-cost A,B`` argument; the ingest's
default (:data:`nestpipe.ingest.balance.DEFAULT_COST`) is their result on a reference machine, so that shards do not
depend on the machine that wrote them.
"""

from __future__ import annotations

import time
from typing import Dict, Sequence

import numpy as np
import torch

from nestpipe.datasets.sequence_cost import SequenceCost
from nestpipe.trainer.config import TrainConfig
from nestpipe.trainer.models.hstu import HSTU


def sequence_seconds(lengths: Sequence[int], dim: int = 64, tokens_per_call: int = 4096,
                     repeats: int = 3, max_length: int | None = None) -> Dict[int, float]:
    """Seconds per sequence of each length: the best of ``repeats`` timings of micro-batches holding about
    ``tokens_per_call`` tokens of sequences of that length (one thread), on a layer stack built for sequences of up
    to ``max_length`` tokens (default: the longest length; give the same value to time some lengths again)."""
    cfg = TrainConfig().hstu
    top = max(lengths) if max_length is None else max_length
    model = HSTU(cfg, dim, ["action", "author", "item"], int(top), 1000)
    g = torch.Generator().manual_seed(0)
    out = {}
    for n in lengths:
        count = max(1, tokens_per_call // n)
        lens = torch.full((count,), int(n), dtype=torch.int64)
        emb = {t: torch.randn(count * n, dim, generator=g) for t in ("action", "author", "item")}
        grad = torch.randn(count * n, dim, generator=g)
        best = float("inf")
        for _ in range(repeats + 1):  # the first call warms up (compilation, allocation)
            leaves = {t: e.clone().requires_grad_(True) for t, e in emb.items()}
            t0 = time.perf_counter()
            (model.encode(leaves, lens) * grad).sum().backward()
            best = min(best, time.perf_counter() - t0)
        out[int(n)] = best / count
    return out


def fit(seconds: Dict[int, float]) -> SequenceCost:
    """Non-negative weighted least squares of ``seconds[n] ~ a n^2 + b n`` (relative errors)."""
    n = np.array(sorted(seconds), dtype=np.float64)
    y = np.array([seconds[int(k)] for k in n])
    X = np.stack([n * n, n], 1) / y[:, None]  # relative residuals: (X w - y) / y
    w, *_ = np.linalg.lstsq(X, np.ones_like(y), rcond=None)
    if (w < 0).any():  # clamp: one term alone
        cands = [np.array([max(float(np.linalg.lstsq(X[:, :1], np.ones_like(y), rcond=None)[0][0]), 0.0), 0.0]),
                 np.array([0.0, max(float(np.linalg.lstsq(X[:, 1:], np.ones_like(y), rcond=None)[0][0]), 0.0)])]
        w = min(cands, key=lambda c: float(np.square(X @ c - 1).sum()))
    return SequenceCost(float(w[0]), float(w[1]))


def relative_errors(cost: SequenceCost, seconds: Dict[int, float]) -> Dict[int, float]:
    return {n: float(cost(n) / s - 1.0) for n, s in sorted(seconds.items())}
