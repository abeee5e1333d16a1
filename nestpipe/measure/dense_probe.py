"""Per-call cost of the dense model: a short probe of the run's own model at several micro-batch counts.

Why a probe: a calibration run splits every batch into micro-batches of one size, so its dense time is one number
per step, ``N x (per-call cost) + (FLOP-proportional cost)``, and cannot tell the two apart. They matter apart: a
forward + backward pays a fixed dispatch cost per call (tens of autograd nodes at some microseconds each on a CPU)
on top of its arithmetic, so doubling the micro-batches of a batch adds about that cost per extra call while the
FLOPs stay the same. The probe times the dense model alone (built from the run's config, the shards' sample
lengths, random embeddings) for one batch at ``N / 2``, ``N`` and ``2 N`` micro-batches in the thread setting the
trainer uses. The model uses only the ratios of those batch times (:func:`nestpipe.measure.measured.dense_scale`):
the level (how fast the machine ran the dense model during the run) stays the calibration run's. The slope of a
least-squares line through (calls, seconds), the per-call cost, is reported beside them.

It measures the machine running the dense model, as simulators profile an operator at the shapes they need; no
step time of any other configuration enters.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List, Sequence

import numpy as np
import torch

from nestpipe.clustering.balance import capacities
from nestpipe.trainer.config import TrainConfig
from nestpipe.trainer.data import ShardStream
from nestpipe.trainer.models import model_spec
from nestpipe.trainer.models import build_model, model_table_dims
from nestpipe.trainer.models.hstu import NEG


def _micro_batch_inputs(cfg, manifest, record: Dict, model, dims: Dict[str, int], n: int, rng: torch.Generator):
    """(emb, feats) of each of ``n`` micro-batches of one batch: balanced sample counts, the record's lengths."""
    b = manifest.batch_size
    caps = capacities(b, n)
    starts = np.concatenate([[0], np.cumsum(caps)]).astype(np.int64)
    out = []
    if model_spec(cfg.model).task == "gr":
        lengths = np.asarray(record["item.lengths"], dtype=np.int64)
        k = sum(model_spec(cfg.model).negatives(cfg))
        neg_ids = torch.randint(0, 1 << 30, (k,), generator=rng)
        for g in range(n):
            ln = torch.from_numpy(lengths[starts[g]:starts[g + 1]].copy())
            nnz = int(ln.sum())
            sizes = {t: nnz for t in model.tables}
            sizes[NEG] = k
            widths = {t: dims[t] for t in model.tables}
            widths[NEG] = dims["item"]  # negatives are rows of the item table
            feats = {"lengths": ln, "item_ids": torch.randint(0, 1 << 30, (nnz,), generator=rng), "neg_ids": neg_ids}
            if model.needs_times:  # event times in ms, one second apart within every sample (a model with a time bias)
                feats["times"] = torch.arange(nnz, dtype=torch.int64) * 1000
            out.append((_unpack_like(sizes, widths, rng), feats))  # received buffers, rows picked by index
    else:
        nd = len(manifest.dense_features)
        for g in range(n):
            m = int(caps[g])
            emb = {"leaves": {t: torch.randn(m, dims[t], generator=rng) for t in model.tables}}  # pooled: one each
            feats = {"dense": torch.rand(m, nd, generator=rng),
                     "labels": torch.randint(0, 2, (m,), generator=rng).float()}
            out.append((emb, feats))
    return out


def _unpack_like(sizes: Dict[str, int], widths: Dict[str, int], rng: torch.Generator):
    """Per-table inputs built like the trainer's: one received buffer per row width (the autograd leaves; untied item
    rows are wider than the other tables'), each table's rows picked out of its buffer by index (the backward
    scatters into the leaf), so the probe's call has the trainer's ops."""
    totals: Dict[int, int] = {}
    for t, m in sizes.items():
        totals[widths[t]] = totals.get(widths[t], 0) + m
    return {"leaf": {w: torch.randn(n, w, generator=rng) for w, n in totals.items()},
            "index": {t: (widths[t], torch.randint(0, max(totals[widths[t]], 1), (m,), generator=rng))
                      for t, m in sizes.items()}}


def _batch_seconds(model, inputs, norm: float) -> float:
    t0 = time.perf_counter()
    for emb, feats in inputs:
        if "leaf" in emb:
            leaves = {w: x.requires_grad_(True) for w, x in emb["leaf"].items()}
            views = {t: leaves[w].index_select(0, ix) for t, (w, ix) in emb["index"].items()}
        else:
            views = {t: x.requires_grad_(True) for t, x in emb["leaves"].items()}
        loss = model(views, feats).sum() / norm
        loss.backward()
        loss.detach().double()
    return time.perf_counter() - t0


def probe_call_seconds(cfg_dict: Dict, manifest, record: Dict, micro_batches: int, reps: int = 5,
                       threads: int = 1) -> Dict[str, object]:
    """Seconds per dense forward + backward call beyond its arithmetic (slope of batch time over calls), with the
    medians it was fitted to. ``cfg_dict``: the run's config.json; ``record``: one batch record of its shards."""
    cfg = TrainConfig.from_dict(cfg_dict, where="config.json")
    b = manifest.batch_size
    counts: List[int] = sorted({max(1, micro_batches // 2), micro_batches, min(b, 2 * micro_batches)})
    if len(counts) < 2:
        return {"call_s": 0.0, "counts": counts, "batch_s": {}}
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))
    try:
        dims = model_table_dims(cfg, manifest)
        model = build_model(cfg, manifest, dims)
        rng = torch.Generator().manual_seed(0)
        inputs = {n: _micro_batch_inputs(cfg, manifest, record, model, dims, n, rng) for n in counts}
        norm = float(b * 2)
        for n in counts:  # warm-up: allocator, first-call dispatch
            _batch_seconds(model, inputs[n], norm)
        times: Dict[int, List[float]] = {n: [] for n in counts}
        for r in range(reps):  # interleaved, order alternating, so drift of the machine hits every count alike
            for n in (counts if r % 2 == 0 else counts[::-1]):
                times[n].append(_batch_seconds(model, inputs[n], norm))
    finally:
        torch.set_num_threads(old)
    med = {n: statistics.median(v) for n, v in times.items()}
    x = np.array(counts, dtype=float)
    y = np.array([med[n] for n in counts])
    slope = float(np.polyfit(x, y, 1)[0])
    return {"call_s": max(slope, 0.0), "counts": counts, "batch_s": {str(n): med[n] for n in counts}}


def first_record(shards: str, split: str = "train") -> Dict:
    for _, rec, _ in ShardStream(shards, split, 0, 1, verify=False).records(0):
        return rec
    raise ValueError(f"{shards}: no {split} record to probe the dense model with")


__all__: Sequence[str] = ["probe_call_seconds", "first_record"]
