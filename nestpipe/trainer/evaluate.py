"""``nestpipe eval``: quality of a trained run on the eval split, beside strong simple baselines fitted on the train
split and scored on exactly the model's protocol (:mod:`nestpipe.trainer.baselines`). Writes ``RUN/eval.json``.

Runs in one process from the run's latest complete checkpoint, assembled into full tables (as ``export`` does).

Next item (gr: hstu, sasrec; chronological leave-one-out): the last token of every eval sample is the held-out
target; the model reads the tokens before it and scores the last position against the item catalog by cosine
similarity. Full-catalog
ranking when the catalog has at most ``full_catalog_max`` items; above that a sampled protocol: the target against
``sampled_negatives`` uniform random items (drawn from a generator keyed by the seed; the baselines rank against the
same items), stated in the output. The rank is the number of items scoring strictly higher than the target.
HR@k = P(rank < k); NDCG@k = mean(1 / log2(rank + 2) if rank < k). Baselines: most popular items of the train
split, and the successor-counting model (most frequent successors of the last input item, back-filled with the
input's own most frequent items, then popularity). On synthetic data also the ceiling: the generator's own
next-item probabilities ranked on the same protocol (``generator_oracle``).

CTR (dlrm): AUC and logloss of the target label; baselines: the train split's positive rate as a constant, a
regularised logistic regression over the model's own features, a factorization machine over the same inputs (a
factorised pairwise interaction of every pair of them), and on request (``pairwise``) the regression with hashed
crosses of every pair of the model's single-id tables and of its ``dot_pairs`` (settings and fit time recorded);
the strongest baseline is the one of highest AUC on the scored samples. On synthetic data (``nestpipe synth``) also
the Bayes ceiling: the generator's own click probabilities on the eval dates.

Every metric of the model, of each baseline and of the generator oracle gets a 95% bootstrap interval over the
scored samples (``intervals``), and every model - baseline difference a paired interval over the same resamples
with a verdict, "tie" when it covers 0 (``comparisons``; :mod:`nestpipe.trainer.intervals`).
"""

from __future__ import annotations

import math
import os
from typing import Dict, Optional

import numpy as np
import torch

from nestpipe.datasets.shards import table_offsets
from nestpipe.trainer.run_files import run_manifest
from nestpipe.datasets.synth import TRUTH_FILE, next_item_oracle
from nestpipe.trainer import baselines, intervals
from nestpipe.trainer.config import load_run_config
from nestpipe.trainer.data import ShardStream, iter_shard
from nestpipe.trainer.embedding.placement import to_vocab
from nestpipe.trainer.export import assemble
from nestpipe.trainer.models import build_model, model_spec, model_table_dims
from nestpipe.utils.jsonio import read_json, write_json_atomic

KS = (10, 50)
# the bootstrap of every eval.json: fixed, so that a run's intervals are reproducible
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0


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


def _rank_scorer(ranks: np.ndarray) -> Dict[str, intervals.Metric]:
    """The metrics of :func:`_rank_metrics` as per-sample means, for the bootstrap."""
    ranks = np.asarray(ranks)
    out = {}
    for k in KS:
        hit = ranks < k
        out[f"HR@{k}"] = intervals.mean_metric(hit)
        out[f"NDCG@{k}"] = intervals.mean_metric(np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0))
    return out


def add_intervals(res: Dict, scorers: Dict[str, Dict[str, intervals.Metric]], samples: int,
                  resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Dict:
    """Add ``intervals`` (every scorer's metrics, 95% percentile bootstrap), ``comparisons`` (model - each other
    scorer, paired) and ``vs_strongest_baseline`` (the verdicts against ``res["strongest_baseline"]``) to ``res``.
    ``scorers`` is keyed by ``res``'s field names (``model``, ``baseline_<name>``, ...)."""
    boot = intervals.Bootstrap(samples, resamples=resamples, seed=seed)
    points = {name: res[name] for name in scorers}
    iv, comp = intervals.report(boot, scorers, points, reference="model")
    res["intervals"] = {**boot.describe(), **iv}
    res["comparisons"] = comp
    best = f"baseline_{res['strongest_baseline']}"
    res["vs_strongest_baseline"] = {"baseline": res["strongest_baseline"],
                                    **{m: c["verdict"] for m, c in comp.get(best, {}).items()}}
    return res


def summary_lines(res: Dict) -> list:
    """One line per model - baseline comparison of an eval.json: the difference, its paired interval, the verdict."""
    comp = res.get("comparisons", {})
    lines = []
    for name, ms in comp.items():
        strongest = " (strongest baseline)" if name == f"baseline_{res.get('strongest_baseline')}" else ""
        parts = [f"{m} {c['difference']:+.4f} [{c['interval'][0]:+.4f}, {c['interval'][1]:+.4f}] {c['verdict']}"
                 for m, c in ms.items()]
        lines.append(f"model vs {name}{strongest}: " + "; ".join(parts))
    return lines


def next_item_examples(shards: str, vocab: int, max_batches: Optional[int], negatives: int, seed: int,
                       split: str = "eval"):
    """The next-item protocol, shared by the model and every baseline: per eval record ``(record, keep, inputs,
    targets, negatives)``: ``keep`` the samples with at least two tokens, ``inputs`` their tokens before the last
    (what is read), ``targets`` their last item (held out), ``negatives`` ``[len(targets), negatives]`` uniform
    items from a generator keyed by ``seed`` (sampled protocol; None when ``negatives == 0``: full catalog)."""
    g = torch.Generator().manual_seed(seed + 99)
    for rec in _records(shards, split, max_batches):
        keep = np.diff(table_offsets(rec, "item")) >= 2
        windows = [w for w, k in zip(baselines.item_windows(rec, vocab), keep) if k]
        targets = np.array([w[-1] for w in windows], dtype=np.int64)
        negs = torch.randint(0, vocab, (len(targets), negatives), generator=g).numpy() if negatives else None
        yield rec, keep, [w[:-1] for w in windows], targets, negs


def fit_next_item_baselines(shards: str, vocab: int) -> Dict[str, object]:
    pop, succ = baselines.fit_next_item(_records(shards, "train", None), vocab)
    return {"most_popular": pop, "successor_counts": succ}


def baseline_ranks(fitted: Dict[str, object], inputs, targets, negs) -> Dict[str, np.ndarray]:
    return {name: np.array([b.rank(h, int(t), None if negs is None else negs[j])
                            for j, (h, t) in enumerate(zip(inputs, targets))], dtype=np.int64)
            for name, b in fitted.items()}


def next_item_baselines(shards: str, vocab: int, max_batches: Optional[int] = None, negatives: int = 0,
                        seed: int = 0, split: str = "eval") -> Dict[str, Dict[str, float]]:
    """HR / NDCG of every next-item baseline on the eval split (the protocol of :func:`next_item_examples`)."""
    fitted = fit_next_item_baselines(shards, vocab)
    ranks: Dict[str, list] = {n: [] for n in fitted}
    for _, _, inputs, targets, negs in next_item_examples(shards, vocab, max_batches, negatives, seed, split):
        for n, r in baseline_ranks(fitted, inputs, targets, negs).items():
            ranks[n].append(r)
    return {n: _rank_metrics(np.concatenate(r)) for n, r in ranks.items()}


def next_item_queries(cfg, man, full, model, rec, keep, split: str) -> torch.Tensor:
    """The model's normalised query ``[kept samples, D]`` (with ``item_bias`` a 1 appended: see
    :func:`next_item_candidates`) of one eval record: each kept sample's tokens but the last
    (the protocol of :func:`next_item_examples`) encoded, the last position's hidden state."""
    off = table_offsets(rec, "item")
    lengths = np.diff(off)
    idx = np.concatenate([np.arange(off[s], off[s + 1] - 1) for s in range(len(lengths)) if keep[s]])
    emb = {}
    for t in sorted(t for t, s in man.tables.items() if s.kind == "sequence"):
        ids = to_vocab(rec[f"{t}.values"][idx], man.tables[t].vocab)
        emb[t] = full[f"embedding.{t}.weight"].float().index_select(0, torch.from_numpy(ids))
    in_len = torch.from_numpy((lengths[keep] - 1).astype(np.int64))
    times = None
    if model.needs_times:
        if "time" not in rec:
            raise ValueError(f"{cfg.shards}: {split} batches have no 'time' field, which hstu.time_bias needs "
                             "(re-ingest them with this version's gr ingest)")
        times = torch.from_numpy(np.asarray(rec["time"])[idx].astype(np.int64))
    last = torch.cumsum(in_len, 0) - 1
    hidden = model.encode(model.token_inputs(emb), in_len, times).index_select(0, last)
    q = torch.nn.functional.normalize(model.queries(hidden, emb["item"].index_select(0, last)), dim=-1)
    return torch.cat([q, q.new_ones(len(q), 1)], dim=1) if model.item_bias else q


def next_item_candidates(model, item_rows: torch.Tensor) -> torch.Tensor:
    """``[V, D']``: every item as a candidate, so that its dot product with a query of :func:`next_item_queries`
    ranks as the training logit does: the unit candidate vector; with ``item_bias``, that over the score
    temperature and the item's offset beside it (the query's last value is 1)."""
    items = torch.nn.functional.normalize(model.candidates(item_rows), dim=-1)
    bias = model.candidate_bias(item_rows)
    return items if bias is None else torch.cat([items / model.score_temperature, bias[:, None]], dim=1)


@torch.no_grad()
def evaluate_next_item(cfg, man, full, model, max_batches, split="eval", full_catalog_max=2_000_000,
                  sampled_negatives=1000):
    vocab = man.tables["item"].vocab
    items = next_item_candidates(model, full["embedding.item.weight"].float())
    fitted = fit_next_item_baselines(cfg.shards, vocab)
    sampled = vocab > full_catalog_max
    oracle = _next_item_oracle(cfg.shards)
    ranks, base, ceiling = [], {n: [] for n in fitted}, []
    read = 0
    for rec, keep, inputs, target, negs in next_item_examples(cfg.shards, vocab, max_batches,
                                                              sampled_negatives if sampled else 0, cfg.seed, split):
        read += len(table_offsets(rec, "item")) - 1
        ranks.append(model_ranks(next_item_queries(cfg, man, full, model, rec, keep, split), items, target, negs))
        for n, r in baseline_ranks(fitted, inputs, target, negs).items():
            base[n].append(r)
        if oracle is not None:
            ceiling.append(baseline_ranks({"oracle": oracle}, inputs, target, negs)["oracle"])
    r = np.concatenate(ranks)
    res = {"protocol": ("sampled: target vs %d uniform random items" % sampled_negatives) if sampled
           else f"full catalog ({vocab} items), chronological leave-one-out",
           "samples": int(len(r)), "split_samples": read, "too_short": read - int(len(r)),
           "samples_note": "every sample of the split is read; those with fewer than two items (nothing to predict "
                           "from) are counted in too_short",
           "model": _rank_metrics(r)}
    scorers = {"model": _rank_scorer(r)}
    for name, rs in base.items():
        rs = np.concatenate(rs)
        res[f"baseline_{name}"] = _rank_metrics(rs)
        scorers[f"baseline_{name}"] = _rank_scorer(rs)
    res["strongest_baseline"] = max(base, key=lambda n: (res[f"baseline_{n}"]["NDCG@10"], n))
    if oracle is not None:
        ceiling = np.concatenate(ceiling)
        res["generator_oracle"] = {**_rank_metrics(ceiling), "note": (
            "the generator's own next-item probabilities (nestpipe.datasets.synth.NextItemOracle): the successor "
            "of the last input item, then the fresh-draw popularity in the input's community (with session topics, "
            "weighted by the topic's posterior given the input)")}
        scorers["generator_oracle"] = _rank_scorer(ceiling)
    return add_intervals(res, scorers, len(r))


def model_ranks(q: torch.Tensor, items: torch.Tensor, target: np.ndarray, negs: Optional[np.ndarray]) -> np.ndarray:
    """The rank of each target among the candidates (``next_item_candidates``) for queries ``q``: the number of items
    scoring strictly higher, over the full catalog (``negs`` None) or over the sample's sampled negatives."""
    tgt = torch.from_numpy(target)
    if negs is None:
        scores = q @ items.t()
        return (scores > scores.gather(1, tgt[:, None])).sum(1).numpy()
    neg = torch.from_numpy(negs)
    ts = (q * items.index_select(0, tgt)).sum(1, keepdim=True)
    ns = torch.einsum("bd,bnd->bn", q, items.index_select(0, neg.flatten()).view(len(target), -1, q.shape[1]))
    return (ns > ts).sum(1).numpy()


def click_probabilities(model, full, man, rec) -> np.ndarray:
    """The CTR model's click probability for every sample of a record, from the assembled tables ``full``."""
    b = len(rec["mb"])
    emb = {}
    for t in model.tables:
        off = table_offsets(rec, t)
        ids = torch.from_numpy(to_vocab(rec[f"{t}.values"], man.tables[t].vocab))
        rows = full[f"embedding.{t}.weight"].float().index_select(0, ids)
        sample = torch.from_numpy(np.repeat(np.arange(b), np.diff(off)))
        emb[t] = rows.new_zeros(b, rows.shape[1]).index_add(0, sample, rows)
    logit = model.logits(emb, torch.from_numpy(np.asarray(rec["dense"], np.float32)))
    return torch.sigmoid(logit).numpy()


@torch.no_grad()
def model_outcomes(cfg, man, split: str, full_catalog_max: int = 2_000_000,
                   sampled_negatives: int = 1000) -> Dict[str, np.ndarray]:
    """The model's per-sample outcomes on ``split`` from the run's latest checkpoint (``cfg.out``), computed as
    ``nestpipe eval`` computes them (the same protocol, the same samples in the same order, the same arithmetic):
    ``{"ranks"}`` for next-item models, ``{"labels", "probs"}`` for CTR models."""
    full, model = load_trained(cfg.out, cfg, man)
    if man.task == "gr":
        vocab = man.tables["item"].vocab
        items = next_item_candidates(model, full["embedding.item.weight"].float())
        negatives = sampled_negatives if vocab > full_catalog_max else 0
        ranks = [model_ranks(next_item_queries(cfg, man, full, model, rec, keep, split), items, target, negs)
                 for rec, keep, _, target, negs in next_item_examples(cfg.shards, vocab, None, negatives, cfg.seed,
                                                                      split)]
        return {"ranks": np.concatenate(ranks)}
    k = man.labels.index(cfg.dlrm.target)
    ys, ps = [], []
    for rec in _records(cfg.shards, split, None):
        ps.append(click_probabilities(model, full, man, rec))
        ys.append(np.asarray(rec["labels"][:, k], np.float64))
    return {"labels": np.concatenate(ys), "probs": np.concatenate(ps).astype(np.float64)}


def model_score(cfg, man, split: str, metric: str) -> float:
    """One metric of the model alone on ``split`` (:func:`model_outcomes`): ``HR@k`` / ``NDCG@k`` for next-item
    models, ``AUC`` / ``logloss`` for CTR models. What early stopping scores each epoch by."""
    out = model_outcomes(cfg, man, split)
    if "ranks" in out:
        return _rank_metrics(out["ranks"])[metric]
    y, p = out["labels"], out["probs"]
    return {"AUC": _auc(y, p), "logloss": baselines.logloss(y, p)}[metric]


def _next_item_oracle(shards: str):
    """Synthetic data only: the generator's next-item ranking, from ``SHARDS/synth_truth.json`` (None if absent or
    written before the file recorded the generator's config)."""
    path = os.path.join(shards, TRUTH_FILE)
    return next_item_oracle(read_json(path, "synthetic truth")) if os.path.isfile(path) else None


def _auc(y: np.ndarray, p: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, p)) if 0 < y.sum() < len(y) else float("nan")


@torch.no_grad()
def evaluate_ctr(cfg, man, full, model, max_batches, split="eval",
                  logistic: Optional[baselines.LogisticConfig] = None, cross: Optional[baselines.CrossConfig] = None,
                  pairwise: bool = False, fm: Optional[baselines.FMConfig] = None):
    """CTR protocol (module docstring). The factorization machine (``fm``) is fitted every time; ``pairwise``: also
    the logistic regression with hashed crosses (``cross`` given implies it), off by default for its cost (lbfgs on
    a column per cross: minutes from 30k training samples on, docs/trainer.md)."""
    k = man.labels.index(cfg.dlrm.target)
    pos, n = 0.0, 0
    for rec in _records(cfg.shards, "train", None):
        pos += float(rec["labels"][:, k].sum())
        n += len(rec["labels"])
    rate = pos / max(n, 1)
    vocabs = {t: man.tables[t].vocab for t in model.tables}
    lr = baselines.LogisticBaseline(model.tables, vocabs, k, logistic).fit(_records(cfg.shards, "train", None))
    fitted = {"logistic_regression": lr,
              "factorization_machine": baselines.FactorizationMachineBaseline(
                  model.tables, vocabs, k, fm).fit(_records(cfg.shards, "train", None))}
    if pairwise or cross is not None:
        pairs = baselines.cross_pairs([t for t in model.tables if man.tables[t].kind == "single"], model.dot_pairs)
        fitted["logistic_regression_crosses"] = baselines.CrossLogisticBaseline(
            model.tables, vocabs, k, pairs, cross).fit(_records(cfg.shards, "train", None))
    ys, ps, preds = [], [], {name: [] for name in fitted}
    for rec in _records(cfg.shards, split, max_batches):
        ps.append(click_probabilities(model, full, man, rec))
        ys.append(np.asarray(rec["labels"][:, k], np.float64))
        for name, b in fitted.items():
            preds[name].append(b.predict(rec))
    y, p = np.concatenate(ys), np.concatenate(ps).astype(np.float64)
    probs = {"constant": np.full_like(y, rate), **{name: np.concatenate(v) for name, v in preds.items()}}
    res = {"target": cfg.dlrm.target, "samples": int(len(y)),
           "model": {"AUC": _auc(y, p), "logloss": baselines.logloss(y, p)},
           "baseline_constant": {"AUC": 0.5, "logloss": baselines.logloss(y, probs["constant"]), "rate": rate},
           **{f"baseline_{name}": {"AUC": _auc(y, probs[name]), "logloss": baselines.logloss(y, probs[name]),
                                   "fit": b.fit_info}
              for name, b in fitted.items()},
           **_bayes_ceiling(cfg, man, split, len(y))}
    res["strongest_baseline"] = strongest_ctr_baseline(res, list(probs))
    res["strongest_baseline_by"] = "AUC on the scored samples (then logloss)"
    scorers = {name: {"AUC": intervals.auc_metric(y, q), "logloss": intervals.logloss_metric(y, q)}
               for name, q in [("model", p)] + [(f"baseline_{n}", q) for n, q in probs.items()]}
    return add_intervals(res, scorers, len(y))


def strongest_ctr_baseline(res: Dict, names) -> str:
    """The baseline of highest AUC (NaN counts as lowest), ties to the lower logloss, then the name."""
    def key(n):
        auc = res[f"baseline_{n}"]["AUC"]
        return (auc if np.isfinite(auc) else -np.inf, -res[f"baseline_{n}"]["logloss"], n)

    return max(names, key=key)


def _bayes_ceiling(cfg, man, split: str, samples: int) -> Dict:
    """Synthetic data only (``SHARDS/synth_truth.json``, copied there by the ingest from ``nestpipe synth``'s output):
    the AUC and logloss of the generator's own click probabilities on the split's dates (eval: the last D dates;
    valid: the date before them)."""
    path = os.path.join(cfg.shards, TRUTH_FILE)
    days = int((man.options or {}).get("ctr_eval_days", 0))
    if split not in ("eval", "valid") or cfg.dlrm.target != "is_click" or not os.path.isfile(path):
        return {}
    if split == "valid" and int((man.options or {}).get("ctr_valid_days", 1)) != 1:  # the truth has one valid date
        return {}
    key = "bayes_ceiling_by_eval_days" if split == "eval" else "bayes_ceiling_valid_by_eval_days"
    entry = read_json(path, "synthetic truth").get(key, {}).get(str(days))
    if not entry:  # a truth file written before the valid entries existed
        return {}
    dates = f"the last {days} dates" if split == "eval" else f"the date {entry['first_date']} (the valid split)"
    return {"bayes_ceiling": {**entry, "note": f"every interaction of {dates} ({entry['rows']} rows; "
                              f"the {split} split scored here: {samples} samples, every one of the split)"}}


# the evaluation protocol of each shard task: next-item (HR/NDCG) for gr, CTR (AUC/logloss) for ctr
PROTOCOLS = {"gr": evaluate_next_item, "ctr": evaluate_ctr}


def load_trained(run: str, cfg, man):
    """The run's assembled tensors and its dense model with the trained parameters, in eval mode."""
    full = assemble(run)
    model = build_model(cfg, man, model_table_dims(cfg, man))
    model.load_state_dict({k[len("dense."):]: v.float() for k, v in full.items() if k.startswith("dense.")})
    model.eval()
    return full, model


def evaluate_run(run: str, max_batches: Optional[int] = None, split: str = "eval",
                 shards: Optional[str] = None, pairwise: bool = False) -> Dict:
    """Evaluate ``run`` on ``split`` (``eval``, or ``valid`` for shards ingested with ``--validation``); writes
    ``RUN/eval.json`` (``RUN/eval-valid.json`` for the valid split). ``shards``: where the run's shards are now,
    when they moved. ``pairwise``: CTR runs also get the logistic regression with hashed crosses (slow; the
    factorization machine, a baseline of pairwise interactions too, is fitted by every CTR eval)."""
    cfg = load_run_config(run)
    torch.set_num_threads(max(1, cfg.threads))
    man, cfg.shards = run_manifest(run, cfg, shards, need_data=True)
    if split not in man.sets:
        raise ValueError(f"{cfg.shards}: no {split!r} split (splits: {sorted(man.sets)})"
                         + ("; ingest with --validation to carve one from the training data" if split == "valid"
                            else ""))
    full, model = load_trained(run, cfg, man)
    extra = {"pairwise": pairwise} if model_spec(cfg.model).task == "ctr" else {}
    res = PROTOCOLS[model_spec(cfg.model).task](cfg, man, full, model, max_batches, split, **extra)
    res.update({"run": os.path.abspath(run), "step": int(full["meta.step"]), "model_name": cfg.model, "split": split})
    write_json_atomic(os.path.join(run, "eval.json" if split == "eval" else f"eval-{split}.json"), res)
    return res


__all__ = ["evaluate_run", "math"]
