"""The CTR baselines of ``nestpipe eval`` on real or synthetic shards: fit time and quality of each, alone.

    python benchmarks/ctr_baselines.py [--dataset ml-100k | --shards DIR] [--splits valid eval]
                                       [--fm-seeds 0 1 2] [--fm-variant dim=16,lr=0.002 ...] [--no-logistic]
                                       [--cross lbfgs|liblinear|saga] [--tag T]

What ``nestpipe eval`` fits for a CTR run (``nestpipe/trainer/baselines.py``), fitted on the train split of the
shards as the eval fits it (the tables a DLRM embeds: every non-sequence table; the target ``is_click``) and
scored on each split of ``--splits`` the shards have: the logistic regression, the factorization machine (once per
seed of ``--fm-seeds``: its fit is deterministic for a seed, the seeds show how much it varies; with
``--fm-variant``, once per variant of its settings, ``FMConfig`` fields as comma-separated KEY=VALUE), and with
``--cross`` the regression with hashed crosses of every single-id table pair and the DLRM's default ``dot_pairs``,
fitted by that scikit-learn solver (lbfgs: what ``nestpipe eval --pairwise-baseline`` fits). One thread
(``threadpoolctl``, ``torch.set_num_threads(1)``): the fit times are single-core times.

``--dataset ml-100k`` ingests MovieLens-100K (``benchmarks/public_data.py``) as ``benchmarks/real_quality.py``
does (ctr, ``--validation``, the last 23 dates as the eval split) under ``--out``; without the dataset it says so
and exits 0. Writes the record ``benchmarks/results/ctr_baselines-NAME[-TAG].json`` and prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from public_data import dataset  # noqa: E402
from record import Recorder  # noqa: E402

from nestpipe.datasets.shards import load_manifest  # noqa: E402
from nestpipe.trainer import baselines  # noqa: E402
from nestpipe.trainer.evaluate import _auc, _records  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--dataset", default="ml-100k", choices=["ml-100k"])
    src.add_argument("--shards", default=None, help="ctr shards already ingested (e.g. the demo's)")
    ap.add_argument("--splits", nargs="+", default=["valid", "eval"], choices=["valid", "eval"])
    ap.add_argument("--fm-seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--fm-variant", action="append", default=None,
                    help="FMConfig fields as KEY=VALUE[,KEY=VALUE...] (repeatable; default: the defaults)")
    ap.add_argument("--no-logistic", action="store_true", help="leave the plain logistic regression out")
    ap.add_argument("--cross", default=None, choices=["lbfgs", "liblinear", "saga"],
                    help="also fit the regression with hashed crosses with this solver")
    ap.add_argument("--target", default="is_click")
    ap.add_argument("--out", default="/tmp/nestpipe-ctr-baselines")
    ap.add_argument("--tag", default="")
    ap.add_argument("--record", default=None, help="the record's path (default benchmarks/results/...)")
    args = ap.parse_args(argv)
    rec = Recorder("ctr_baselines", argv)

    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    if args.shards:
        shards, name = args.shards, os.path.basename(os.path.normpath(args.shards))
    else:
        raw, why = dataset(args.dataset)
        if raw is None:
            print(f"skipped: {why}")
            return 0
        from nestpipe.ingest import IngestConfig, ingest

        shards, name = os.path.join(args.out, args.dataset, "shards-ctr"), args.dataset
        if not os.path.exists(os.path.join(shards, "manifest.json")):
            ingest(IngestConfig(raw=raw, out=shards, task="ctr", validation=True, progress=False, workers=1,
                                ctr_eval_days=23))
    man = load_manifest(shards)
    tables = sorted(t for t, s in man.tables.items() if s.kind != "sequence")
    vocabs = {t: man.tables[t].vocab for t in tables}
    k = man.labels.index(args.target)
    splits = [s for s in args.splits if s in man.sets]
    scored = {s: list(_records(shards, s, None)) for s in splits}
    labels = {s: np.concatenate([np.asarray(r["labels"][:, k], np.float64) for r in rs]) for s, rs in scored.items()}

    def train():
        return _records(shards, "train", None)

    fitters = {} if args.no_logistic else {"logistic_regression": lambda: baselines.LogisticBaseline(tables, vocabs, k)}
    for variant in args.fm_variant or [""]:
        settings = fm_settings(variant)
        for seed in args.fm_seeds:
            label = "factorization_machine" + (f" {variant}" if variant else "") + f" seed {seed}"
            fitters[label] = (lambda settings=settings, seed=seed: baselines.FactorizationMachineBaseline(
                tables, vocabs, k, baselines.FMConfig(**{"seed": seed, **settings})))
    if args.cross:
        pairs = baselines.cross_pairs([t for t in tables if man.tables[t].kind == "single"], [("user_id", "author_id")])
        fitters[f"logistic_regression_crosses {args.cross}"] = (
            lambda: baselines.CrossLogisticBaseline(tables, vocabs, k, pairs, baselines.CrossConfig(solver=args.cross)))
    figures = {}
    for label, make in fitters.items():
        t0 = time.perf_counter()
        with threadpool_limits(1):
            model = make().fit(train())
        wall = time.perf_counter() - t0
        row = {"fit": model.fit_info, "wall_s": round(wall, 2)}
        for s in splits:
            p = np.concatenate([model.predict(r) for r in scored[s]])
            row[s] = {"AUC": _auc(labels[s], p), "logloss": baselines.logloss(labels[s], p)}
        figures[label] = row
        tail = model.fit_info.get("validation_logloss")
        tail = min(tail.values()) if isinstance(tail, dict) else min(tail, default=float("nan"))
        print(f"{label:44s} fit {model.fit_info['fit_s']:7.1f} s (with reading the shards {wall:7.1f} s)  "
              f"tail logloss {tail:.4f}  " + "  ".join(
                  f"{s} AUC {row[s]['AUC']:.4f} logloss {row[s]['logloss']:.4f}" for s in splits), flush=True)
    for variant in args.fm_variant or [""]:
        prefix = "factorization_machine" + (f" {variant}" if variant else "") + " seed "
        fms = [figures[prefix + str(seed)] for seed in args.fm_seeds]
        if len(fms) > 1:
            for s in splits:
                for m in ("AUC", "logloss"):
                    vals = [f[s][m] for f in fms]
                    print(f"{prefix[:-6]} {s} {m}: mean {np.mean(vals):.4f} over seeds {args.fm_seeds} "
                          f"(min {min(vals):.4f}, max {max(vals):.4f})")
    record = args.record or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                         f"ctr_baselines-{name}{'-' + args.tag if args.tag else ''}.json")
    rec.write(figures, fields={"shards": name, "samples": {s: int(len(v)) for s, v in labels.items()},
                               "train_samples": int(man.stats.get("samples", {}).get("train", 0)),
                               "tables": tables, "target": args.target}, path=record)
    return 0


def fm_settings(spec: str) -> dict:
    """``"dim=16,lr=0.002"`` -> ``{"dim": 16, "lr": 0.002}``, typed as the FMConfig fields."""
    import dataclasses

    types = {f.name: f.type for f in dataclasses.fields(baselines.FMConfig)}
    out = {}
    for item in filter(None, spec.split(",")):
        key, value = item.split("=", 1)
        kind = types[key]  # KeyError: not an FMConfig field
        out[key] = value in ("1", "true", "True") if kind == "bool" else {"int": int, "float": float}[kind](value)
    return out


if __name__ == "__main__":
    sys.exit(main())
