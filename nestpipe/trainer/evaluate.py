"""``nestpipe eval``: quality of a trained run on the eval split, beside a trivial baseline. Writes ``RUN/eval.json``.

Runs in one process from the run's latest complete checkpoint, assembled into full tables (as ``export`` does).

hstu (chronological leave-one-out): the last token of every eval sample is the held-out target; the model reads the
tokens before it and scores the last position against the item catalog by cosine similarity. Full-catalog ranking
when the catalog has at most ``full_catalog_max`` items; above that a sampled protocol: the target against
``sampled_negatives`` uniform random items (drawn from a generator keyed by the seed), stated in the output.
The rank is the number of items scoring strictly higher than the target. HR@k = P(rank < k);
NDCG@k = mean(1 / log2(rank + 2) if rank < k). Baseline: most popular items of the train split (ties by id).

dlrm: AUC and logloss of the target label; baseline: the train split's positive rate as a constant prediction.
"""

from __future__ import annotations

import math
import os
from typing import Dict, Optional

import numpy as np
import torch

from nestpipe.datasets.shards import load_manifest, table_offsets
from nestpipe.trainer.config import load_run_config
from nestpipe.trainer.data import ShardStream, iter_shard
from nestpipe.trainer.embedding.collection import table_dims
from nestpipe.trainer.embedding.placement import to_vocab
from nestpipe.trainer.export import assemble
from nestpipe.trainer.models import build_model, model_spec
from nestpipe.utils.jsonio import write_json_atomic

KS = (10, 50)


def _records(shards: str, split: str, max_batches: Optional[int]):
    stream = ShardStream(shards, split, 0, 1, verify=True)
    n = 0
    for e in stream.entries:
        for rec in iter_shard(os.path.join(shards, e.path)):
            yield rec
            n += 1
            if max_batches is not None and n >= max_batches:
                return


def _rank_metrics(ranks: np.ndarray) -> Dict[str, float]:
    out = {}
    for k in KS:
        hit = ranks < k
        out[f"HR@{k}"] = float(hit.mean()) if len(ranks) else float("nan")
        out[f"NDCG@{k}"] = float(np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0).mean()) if len(ranks) else float("nan")
    return out


@torch.no_grad()
def evaluate_hstu(cfg, man, full, model, max_batches, full_catalog_max=2_000_000, sampled_negatives=1000):
    vocab = man.tables["item"].vocab
    seq = sorted(t for t, s in man.tables.items() if s.kind == "sequence")
    items = torch.nn.functional.normalize(full["embedding.item.weight"].float(), dim=-1)
    counts = np.zeros(vocab, dtype=np.int64)
    for rec in _records(cfg.shards, "train", None):
        np.add.at(counts, to_vocab(rec["item.values"], vocab), 1)
    pop_order = np.lexsort((np.arange(vocab), -counts))
    pop_rank = np.empty(vocab, dtype=np.int64)
    pop_rank[pop_order] = np.arange(vocab)
    sampled = vocab > full_catalog_max
    g = torch.Generator().manual_seed(cfg.seed + 99)
    ranks, base_ranks = [], []
    for rec in _records(cfg.shards, "eval", max_batches):
        off = table_offsets(rec, "item")
        lengths = np.diff(off)
        keep = lengths >= 2
        emb = {}
        idx = np.concatenate([np.arange(off[s], off[s + 1] - 1) for s in range(len(lengths)) if keep[s]])
        for t in seq:
            ids = to_vocab(rec[f"{t}.values"][idx], man.tables[t].vocab)
            emb[t] = full[f"embedding.{t}.weight"].float().index_select(0, torch.from_numpy(ids))
        in_len = torch.from_numpy((lengths[keep] - 1).astype(np.int64))
        hidden = model.encode(emb, in_len)
        last = torch.cumsum(in_len, 0) - 1
        q = torch.nn.functional.normalize(hidden.index_select(0, last), dim=-1)
        target = to_vocab(rec["item.values"][off[1:][keep] - 1], vocab)
        tgt = torch.from_numpy(target)
        if not sampled:
            scores = q @ items.t()
            ts = scores.gather(1, tgt[:, None])
            ranks.append((scores > ts).sum(1).numpy())
        else:
            negs = torch.randint(0, vocab, (len(target), sampled_negatives), generator=g)
            ts = (q * items.index_select(0, tgt)).sum(1, keepdim=True)
            ns = torch.einsum("bd,bnd->bn", q, items.index_select(0, negs.flatten()).view(len(target), -1, q.shape[1]))
            ranks.append((ns > ts).sum(1).numpy())
        base_ranks.append(pop_rank[target] if not sampled else np.zeros(len(target), np.int64))
    r, br = np.concatenate(ranks), np.concatenate(base_ranks)
    return {"protocol": ("sampled: target vs %d uniform random items" % sampled_negatives) if sampled
            else f"full catalog ({vocab} items), chronological leave-one-out",
            "samples": int(len(r)), "model": _rank_metrics(r), "baseline_most_popular": _rank_metrics(br)}


def _auc(y: np.ndarray, p: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, p)) if 0 < y.sum() < len(y) else float("nan")


def _logloss(y: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


@torch.no_grad()
def evaluate_dlrm(cfg, man, full, model, max_batches):
    k = man.labels.index(cfg.dlrm.target)
    pos, n = 0.0, 0
    for rec in _records(cfg.shards, "train", None):
        pos += float(rec["labels"][:, k].sum())
        n += len(rec["labels"])
    rate = pos / max(n, 1)
    ys, ps = [], []
    for rec in _records(cfg.shards, "eval", max_batches):
        b = len(rec["mb"])
        emb = {}
        for t in model.tables:
            off = table_offsets(rec, t)
            ids = torch.from_numpy(to_vocab(rec[f"{t}.values"], man.tables[t].vocab))
            rows = full[f"embedding.{t}.weight"].float().index_select(0, ids)
            sample = torch.from_numpy(np.repeat(np.arange(b), np.diff(off)))
            emb[t] = rows.new_zeros(b, rows.shape[1]).index_add(0, sample, rows)
        logit = model.logits(emb, torch.from_numpy(np.asarray(rec["dense"], np.float32)))
        ps.append(torch.sigmoid(logit).numpy())
        ys.append(np.asarray(rec["labels"][:, k], np.float64))
    y, p = np.concatenate(ys), np.concatenate(ps).astype(np.float64)
    const = np.full_like(y, rate)
    return {"target": cfg.dlrm.target, "samples": int(len(y)),
            "model": {"AUC": _auc(y, p), "logloss": _logloss(y, p)},
            "baseline_constant": {"AUC": 0.5, "logloss": _logloss(y, const), "rate": rate}}


# the evaluation protocol of each shard task: next-item (HR/NDCG) for gr, CTR (AUC/logloss) for ctr
PROTOCOLS = {"gr": evaluate_hstu, "ctr": evaluate_dlrm}


def evaluate_run(run: str, max_batches: Optional[int] = None) -> Dict:
    cfg = load_run_config(run)
    torch.set_num_threads(max(1, cfg.threads))
    man = load_manifest(cfg.shards)
    full = assemble(run)
    model = build_model(cfg, man, table_dims(man, cfg.embedding))
    model.load_state_dict({k[len("dense."):]: v.float() for k, v in full.items() if k.startswith("dense.")})
    model.eval()
    res = PROTOCOLS[model_spec(cfg.model).task](cfg, man, full, model, max_batches)
    res.update({"run": os.path.abspath(run), "step": int(full["meta.step"]), "model_name": cfg.model})
    write_json_atomic(os.path.join(run, "eval.json"), res)
    return res


__all__ = ["evaluate_run", "math"]
