"""Model quality on real public interactions, beside baselines that can express what each model is given.

    python benchmarks/real_quality.py [--dataset ml-100k] [--models hstu sasrec dlrm] [--seeds 0 1 2]
                                      [--split valid|eval] [--set KEY=VALUE] [--set-dlrm KEY=VALUE] [--tag T]
                                      [--ctr-eval-days 23] [--ctr-valid-days D]

The dataset (``benchmarks/public_data.py``: ``ml-100k`` is MovieLens-100K as the atomic files a wheel carries) is
ingested once with the ingest's defaults and ``--validation`` (gr; ctr with ``--ctr-eval-days`` and a valid split of as
many dates, ``--ctr-valid-days``), then every model is
trained per seed with its defaults on 2 processes (early stopping on the valid split: no epoch count is chosen by
hand) and evaluated on ``--split``. Defaults are chosen with ``--split valid``; ``--split eval`` reports the held-out
figures, once. Per seed every eval.json carries 95% bootstrap intervals and paired model - baseline verdicts; this
script adds the paired hstu - sasrec comparison over the same samples.

Writes the record ``benchmarks/results/real_quality-DATASET-SPLIT[-TAG].json`` (command, commit, host, versions, load,
every figure) and prints a table. Without the dataset (no package index reachable) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from public_data import dataset  # noqa: E402
from quality_bench import train  # noqa: E402
from record import Recorder  # noqa: E402

from nestpipe.datasets.shards import load_manifest  # noqa: E402
from nestpipe.ingest import IngestConfig, ingest  # noqa: E402
from nestpipe.trainer import intervals  # noqa: E402
from nestpipe.trainer.config import load_run_config  # noqa: E402
from nestpipe.trainer import baselines  # noqa: E402
from nestpipe.trainer.evaluate import KS, _auc, _records, evaluate_run, load_trained, model_outcomes  # noqa: E402

GR_MODELS = ("hstu", "sasrec")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def hits(ranks: np.ndarray):
    """Per-sample HR@k and NDCG@k outcomes of next-item ranks (what eval.json averages)."""
    out = {}
    for k in KS:
        hit = ranks < k
        out[f"HR@{k}"] = hit.astype(np.float64)
        out[f"NDCG@{k}"] = np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0)
    return out


def paired(a_ranks: np.ndarray, b_ranks: np.ndarray) -> dict:
    """a - b over the same samples: difference, paired 95% interval and verdict per metric."""
    boot = intervals.Bootstrap(len(a_ranks))
    ha, hb = hits(a_ranks), hits(b_ranks)
    out = {}
    for m in ha:
        lo, hi = boot.compare(intervals.mean_metric(ha[m]), intervals.mean_metric(hb[m]))
        out[m] = {"difference": float(ha[m].mean() - hb[m].mean()), "interval": [lo, hi],
                  "verdict": intervals.verdict([lo, hi], m)}
    return out


def breakdown(shards: str, split: str, seed: int, ranks: dict) -> dict:
    """HR@10 of every ranker (``ranks``: name -> per-sample ranks, eval's order) and of the counting baselines, by
    the sample's history length (quartiles), its target's training count (quartiles) and whether the target followed
    the last input item somewhere in training (the transition the successor-counting model reads)."""
    from nestpipe.trainer.evaluate import baseline_ranks, fit_next_item_baselines, next_item_examples

    vocab = load_manifest(shards).tables["item"].vocab
    fitted = fit_next_item_baselines(shards, vocab)
    succ, pop = fitted["successor_counts"], fitted["most_popular"]
    length, count, seen = [], [], []
    all_ranks = {n: [] for n in fitted}
    for _, _, inputs, targets, negs in next_item_examples(shards, vocab, None, 0, seed, split):
        for h, t in zip(inputs, targets):
            length.append(len(h))
            count.append(int(pop.counts[t]))
            items, _ = succ._successors(int(h[-1]))
            seen.append(bool(np.isin(t, items)))
        for n, r in baseline_ranks(fitted, inputs, targets, negs).items():
            all_ranks[n].append(r)
    rankers = {**ranks, **{n: np.concatenate(r) for n, r in all_ranks.items()}}
    length, count, seen = np.array(length), np.array(count), np.array(seen)
    groups = {}
    for name, values in (("history length", length), ("target's training count", count)):
        edges = np.quantile(values, [0.25, 0.5, 0.75])
        bins = np.searchsorted(edges, values, side="right")
        for b in range(4):
            lo = int(values[bins == b].min()) if (bins == b).any() else None
            hi = int(values[bins == b].max()) if (bins == b).any() else None
            groups[f"{name} q{b + 1} [{lo}..{hi}]"] = bins == b
    groups["target followed the last item in training"] = seen
    groups["target never followed it"] = ~seen
    return {g: {"samples": int(m.sum()), **{n: float((r[m] < 10).mean()) if m.any() else None
                                            for n, r in rankers.items()}} for g, m in groups.items()}


def _quartile_groups(name: str, values: np.ndarray) -> dict:
    """``name [lo..hi]`` -> mask, for the quartiles of ``values``; a value on a quartile's edge belongs to the lower
    group, so equal values stay in one group and groups may be fewer than four (all new users: one group)."""
    edges = np.unique(np.quantile(values, [0.25, 0.5, 0.75]))
    bins = np.searchsorted(edges, values, side="left")
    return {f"{name} [{int(values[bins == b].min())}..{int(values[bins == b].max())}]": bins == b
            for b in range(len(edges) + 1) if (bins == b).any()}


def ctr_breakdown(run: str, split: str) -> dict:
    """AUC and logloss of the trained CTR model and of the factorization machine (fitted as eval fits it) by the
    sample's user's and item's training impressions (quartiles): where the model loses to the baseline."""
    cfg = load_run_config(run)
    man = load_manifest(cfg.shards)
    out = model_outcomes(cfg, man, split)
    _, model = load_trained(run, cfg, man)
    k = man.labels.index(cfg.dlrm.target)
    vocabs = {t: man.tables[t].vocab for t in model.tables}
    fm = baselines.FactorizationMachineBaseline(model.tables, vocabs, k).fit(_records(cfg.shards, "train", None))
    keys = [t for t in ("user_id", "video_id") if t in man.tables]
    seen = {t: {} for t in keys}
    for rec in _records(cfg.shards, "train", None):
        for t in keys:
            ids, c = np.unique(np.asarray(rec[f"{t}.values"]), return_counts=True)
            for i, n in zip(ids.tolist(), c.tolist()):
                seen[t][i] = seen[t].get(i, 0) + n
    fm_p, counts = [], {t: [] for t in keys}
    for rec in _records(cfg.shards, split, None):
        fm_p.append(fm.predict(rec))
        for t in keys:
            counts[t] += [seen[t].get(i, 0) for i in np.asarray(rec[f"{t}.values"]).tolist()]
    y, probs = out["labels"], {"dlrm": out["probs"], "factorization_machine": np.concatenate(fm_p)}
    groups = {"all": np.ones(len(y), bool)}
    for t, label in (("user_id", "user's training impressions"), ("video_id", "item's training impressions")):
        if t in keys:
            groups.update(_quartile_groups(label, np.array(counts[t])))
    res = {}
    for g, m in groups.items():
        row = {"samples": int(m.sum()), "click_rate": float(y[m].mean())}
        for name, p in probs.items():
            both = 0 < y[m].sum() < m.sum()
            row[name] = {"AUC": _auc(y[m], p[m]) if both else None, "logloss": baselines.logloss(y[m], p[m])}
        res[g] = row
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="ml-100k", choices=["ml-100k"])
    ap.add_argument("--models", nargs="+", default=list(GR_MODELS) + ["dlrm"], choices=list(GR_MODELS) + ["dlrm"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--split", default="valid", choices=["valid", "eval"])
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for the gr models' runs")
    ap.add_argument("--set-dlrm", action="append", default=[], help="KEY=VALUE for the dlrm runs")
    ap.add_argument("--ctr-eval-days", type=int, default=23, help="ctr: the last D dates are the eval split")
    ap.add_argument("--ctr-valid-days", type=int, default=None,
                    help="ctr: the D dates before the eval dates are the valid split (default: as many as eval's, so "
                    "that valid holds impressions like eval's: on MovieLens-100K mostly of users new in that window)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--tag", default="", help="names the runs and the record (several settings on the same shards)")
    ap.add_argument("--out", default="/tmp/nestpipe-real-quality")
    ap.add_argument("--record", default=RESULTS, help="directory of the result record")
    args = ap.parse_args(argv)

    raw, why = dataset(args.dataset)
    if raw is None:
        print(f"skipped: {why}")
        return 0
    rec = Recorder("real_quality", argv, __file__)
    root = os.path.join(args.out, args.dataset)
    valid_days = args.ctr_valid_days or args.ctr_eval_days
    shards = {"gr": os.path.join(root, "shards-gr"),
              "ctr": os.path.join(root, "shards-ctr" + (f"-valid{valid_days}" if valid_days != 1 else ""))}
    for task, path in shards.items():
        if not os.path.exists(os.path.join(path, "manifest.json")):
            ingest(IngestConfig(raw=raw, out=path, task=task, validation=True, progress=False, workers=2,
                                **({"ctr_eval_days": args.ctr_eval_days, "ctr_valid_days": valid_days}
                                   if task == "ctr" else {})))
    per_seed = {}
    for seed in args.seeds:
        row = {}
        for model in args.models:
            task = "ctr" if model == "dlrm" else "gr"
            run = os.path.join(root, f"{args.tag}{model}{f'-valid{valid_days}' if task == 'ctr' else ''}-seed{seed}")
            seconds = train(shards[task], run, model, None, args.nproc, args.set_dlrm if task == "ctr" else args.set,
                            seed=seed)
            metrics = json.load(open(os.path.join(run, "metrics.json")))
            ev = evaluate_run(run, split=args.split)
            row[model] = {"eval": ev, "train_s": seconds, "steps_run": metrics["steps_run"],
                          "early_stop": {k: v for k, v in metrics.get("early_stop", {}).items() if k != "history"}}
            if model == "dlrm" and args.split == "eval":  # where the reported figures come from (a minute a seed)
                row["ctr_breakdown"] = ctr_breakdown(run, args.split)
        if all(m in args.models for m in GR_MODELS):
            ranks = {}
            for m in GR_MODELS:
                run = os.path.join(root, f"{args.tag}{m}-seed{seed}")
                cfg = load_run_config(run)
                ranks[m] = model_outcomes(cfg, load_manifest(cfg.shards), args.split)["ranks"]
            row["hstu_vs_sasrec"] = paired(ranks["hstu"], ranks["sasrec"])
            row["breakdown_hr10"] = breakdown(shards["gr"], args.split, seed, ranks)
        per_seed[seed] = row
        print(f"seed {seed} done", flush=True)

    table = {}
    gr = [m for m in GR_MODELS if m in args.models]
    if gr:
        ref = per_seed[args.seeds[0]][gr[0]]["eval"]
        for metric in ("HR@10", "NDCG@10", "HR@50", "NDCG@50"):
            for m in gr:
                table[f"{m} {metric}"] = [per_seed[s][m]["eval"]["model"][metric] for s in args.seeds]
            for base in ("successor_counts", "most_popular"):  # fitted on the train split: the same every seed
                table[f"{base} {metric}"] = [ref[f"baseline_{base}"][metric]]
    if "dlrm" in args.models:
        for metric in ("AUC", "logloss"):
            table[f"dlrm {metric}"] = [per_seed[s]["dlrm"]["eval"]["model"][metric] for s in args.seeds]
            strongest = per_seed[args.seeds[0]]["dlrm"]["eval"]["strongest_baseline"]
            table[f"{strongest} {metric}"] = [per_seed[args.seeds[0]]["dlrm"]["eval"][f"baseline_{strongest}"][metric]]
    name = f"real_quality-{args.dataset}-{args.split}{'-' + args.tag.rstrip('-') if args.tag else ''}.json"
    path = rec.write(path=os.path.join(args.record, name), fields={
        "dataset": args.dataset, "split": args.split, "tag": args.tag, "seeds": args.seeds, "sets": args.set,
        "ctr_eval_days": args.ctr_eval_days, "ctr_valid_days": valid_days,
        "sets_dlrm": args.set_dlrm,
        "means": {k: statistics.mean(v) for k, v in table.items()}, "values": table,
        "per_seed": {str(s): {m: ({"model": r["eval"]["model"], "intervals": r["eval"]["intervals"],
                                   "comparisons": r["eval"]["comparisons"], "train_s": r["train_s"],
                                   "steps_run": r["steps_run"], "early_stop": r["early_stop"],
                                   "strongest_baseline": r["eval"]["strongest_baseline"]}
                                  if m in args.models else r) for m, r in row.items()}
                     for s, row in per_seed.items()},
    })
    for k, v in table.items():
        print(f"{k:40s} mean {statistics.mean(v):.4f}  " + " ".join(f"{x:.4f}" for x in v))
    first = per_seed[args.seeds[0]]
    if "ctr_breakdown" in first:
        print(f"dlrm and the factorization machine by sample group (seed {args.seeds[0]}): AUC, logloss")
        for g, row in first["ctr_breakdown"].items():
            print(f"  {g:48s} n={row['samples']:5d} " + " ".join(
                f"{n} {row[n]['AUC'] or float('nan'):.4f} {row[n]['logloss']:.4f}"
                for n in ("dlrm", "factorization_machine")))
    if "breakdown_hr10" in first:
        print(f"HR@10 by sample group (seed {args.seeds[0]}):")
        for g, row in first["breakdown_hr10"].items():
            print(f"  {g:48s} n={row['samples']:5d} " + " ".join(
                f"{n} {v:.3f}" for n, v in row.items() if n != "samples" and v is not None))
    for s in args.seeds:
        if "hstu_vs_sasrec" in per_seed[s]:
            c = per_seed[s]["hstu_vs_sasrec"]
            print(f"seed {s} hstu - sasrec: " + "; ".join(
                f"{m} {c[m]['difference']:+.4f} [{c[m]['interval'][0]:+.4f}, {c[m]['interval'][1]:+.4f}] "
                f"{c[m]['verdict']}" for m in ("HR@10", "NDCG@10")))
        for m in gr:
            v = per_seed[s][m]["eval"]["vs_strongest_baseline"]
            print(f"seed {s} {m} vs {v['baseline']}: HR@10 {v['HR@10']}, NDCG@10 {v['NDCG@10']}; kept epoch "
                  f"{per_seed[s][m]['early_stop'].get('kept_epoch')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
