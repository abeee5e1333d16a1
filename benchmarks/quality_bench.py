"""Model quality against strong simple baselines, over seeds: the demo's data and settings, every model trained.

    python benchmarks/quality_bench.py [--seeds 0 1 2] [--scale small] [--split eval] [--epochs 3] [--out DIR]

Per seed: ``nestpipe synth --scale SCALE --seed S`` (``--synth KEY=VALUE``: a generator setting, the data in a
directory of its own) -> ``nestpipe ingest`` (the demo's settings, ``--validation``
so that ``--split valid`` can be scored) -> ``nestpipe train`` of hstu and sasrec on the gr shards (``--epochs``
each, 2 processes, default configs: the same training budget) and dlrm on the ctr shards (``--dlrm-epochs``) ->
``nestpipe eval --split SPLIT``. Settings are chosen with ``--split valid``; ``--split eval`` reports the held-out
figures. Prints, per metric, the mean and the spread (min..max) over seeds and the ratios the quality targets name
(hstu / successor counts, hstu / sasrec on HR@10 and NDCG@10; dlrm AUC - logistic regression AUC), and writes every
figure, the commands, versions and the load average before and after to ``OUT/results.json`` and the record
``benchmarks/results/quality_synthetic-SCALE-SPLIT[-TAG].json`` (``benchmarks/report.py`` renders README's
synthetic-data quality block from the defaults' record: no ``--set``, ``--synth`` or tag).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import Recorder  # noqa: E402

from nestpipe.datasets.synth import SynthConfig, generate  # noqa: E402
from nestpipe.demo import DEMO_INGEST  # noqa: E402
from nestpipe.ingest import IngestConfig, ingest  # noqa: E402
from nestpipe.trainer.evaluate import evaluate_run  # noqa: E402

GR_MODELS = ("hstu", "sasrec")


def train(shards: str, run: str, model: str, epochs, nproc: int, sets, seed=None):
    """Wall seconds of ``nestpipe train`` (None when ``run`` was already trained: a rerun continues). ``epochs``
    None: the trainer's default (early stopping where the shards have a valid split); ``seed`` None: its default."""
    if os.path.exists(os.path.join(run, "metrics.json")):
        return None
    cmd = [sys.executable, "-m", "nestpipe", "train", "--shards", shards, "--out", run, "--model", model,
           "--nproc-per-node", str(nproc), "--no-progress"]
    cmd += ["--epochs", str(epochs)] if epochs is not None else []
    cmd += ["--seed", str(seed)] if seed is not None else []
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return time.perf_counter() - t0


def synth_overrides(items) -> dict:
    """``--synth KEY=VALUE`` -> SynthConfig overrides (values parsed as JSON, else kept as strings)."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def one_seed(args, seed: int) -> dict:
    synth = synth_overrides(args.synth)
    # data generated with other generator settings lives in a directory of its own
    suffix = "".join(f"-{k}={v}" for k, v in sorted(synth.items()))
    root = os.path.join(args.out, f"{args.scale}-seed{seed}{suffix}")
    raw = os.path.join(root, "raw")
    if not os.path.exists(os.path.join(raw, "user_features_27k.csv")):
        generate(raw, config=SynthConfig.for_scale(args.scale, seed=seed, **synth), progress=False)
    shards = {}
    for task, opts in DEMO_INGEST.items():
        shards[task] = os.path.join(root, f"shards-{task}")
        ingest(IngestConfig(raw=raw, out=shards[task], task=task, seed=seed, workers=2, progress=False,
                            validation=True, **opts))
    out = {"train_s": {}, "step_s": {}}
    for model in args.models:
        run = os.path.join(root, args.tag + model if args.tag else model)
        if model in GR_MODELS:
            out["train_s"][model] = train(shards["gr"], run, model, args.epochs, args.nproc, args.set)
        else:
            out["train_s"][model] = train(shards["ctr"], run, model, args.dlrm_epochs, args.nproc, args.set_dlrm)
        out["step_s"][model] = json.load(open(os.path.join(run, "metrics.json")))["step_s"]
        out[model] = evaluate_run(run, split=args.split)
    return out


def summary(per_seed, models=GR_MODELS + ("dlrm",)) -> dict:
    rows = {}

    def add(name, values):
        rows[name] = {"mean": statistics.mean(values), "min": min(values), "max": max(values), "values": values}

    for model in models:
        add(f"{model} step s", [s["step_s"][model] for s in per_seed])
    # every gr model's figures; the baselines and the oracle from the first gr model's eval (every gr eval carries
    # them, on the same protocol), the ratios where both models ran
    gr = [m for m in GR_MODELS if m in models]
    if gr:
        ref = gr[0]
        for metric in ("HR@10", "NDCG@10", "HR@50", "NDCG@50"):
            for model in gr:
                add(f"{model} {metric}", [s[model]["model"][metric] for s in per_seed])
            for base in ("successor_counts", "most_popular"):
                add(f"{base} {metric}", [s[ref][f"baseline_{base}"][metric] for s in per_seed])
            for model in gr:
                add(f"{model} / successor_counts {metric}",
                    [s[model]["model"][metric] / s[ref]["baseline_successor_counts"][metric] for s in per_seed])
            if "hstu" in gr and "sasrec" in gr:
                add(f"hstu / sasrec {metric}",
                    [s["hstu"]["model"][metric] / s["sasrec"]["model"][metric] for s in per_seed])
            if all("generator_oracle" in s[ref] for s in per_seed):
                # the ceiling of this data: the generator's own next-item probabilities, on the same protocol
                add(f"generator_oracle {metric}", [s[ref]["generator_oracle"][metric] for s in per_seed])
                add(f"generator_oracle / successor_counts {metric}",
                    [s[ref]["generator_oracle"][metric] / s[ref]["baseline_successor_counts"][metric]
                     for s in per_seed])
                for model in gr:
                    add(f"{model} / generator_oracle {metric}",
                        [s[model]["model"][metric] / s[ref]["generator_oracle"][metric] for s in per_seed])
    if "dlrm" not in models:
        return rows
    for metric in ("AUC", "logloss"):
        add(f"dlrm {metric}", [s["dlrm"]["model"][metric] for s in per_seed])
        add(f"logistic_regression {metric}", [s["dlrm"]["baseline_logistic_regression"][metric] for s in per_seed])
        if all("baseline_factorization_machine" in s["dlrm"] for s in per_seed):  # evals since the machine joined
            add(f"factorization_machine {metric}",
                [s["dlrm"]["baseline_factorization_machine"][metric] for s in per_seed])
    add("dlrm AUC - logistic_regression AUC",
        [s["dlrm"]["model"]["AUC"] - s["dlrm"]["baseline_logistic_regression"]["AUC"] for s in per_seed])
    if all("bayes_ceiling" in s["dlrm"] for s in per_seed):
        ceil = [s["dlrm"]["bayes_ceiling"]["AUC"] for s in per_seed]
        lr = [s["dlrm"]["baseline_logistic_regression"]["AUC"] for s in per_seed]
        add("Bayes ceiling AUC", ceil)
        # the DLRM target: AUC >= LR + 0.5 (ceiling - LR), i.e. this share >= 0.5
        add("dlrm share of (ceiling - LR) AUC",
            [(s["dlrm"]["model"]["AUC"] - b) / (c - b) for s, b, c in zip(per_seed, lr, ceil)])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--scale", default="small", choices=["tiny", "small", "medium"])
    ap.add_argument("--split", default="eval", choices=["eval", "valid"])
    ap.add_argument("--epochs", type=int, default=3, help="hstu and sasrec epochs (the demo's default)")
    ap.add_argument("--dlrm-epochs", type=int, default=1)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for the gr models' runs")
    ap.add_argument("--set-dlrm", action="append", default=[], help="KEY=VALUE for the dlrm runs")
    ap.add_argument("--out", default="/tmp/nestpipe-quality")
    ap.add_argument("--models", nargs="+", default=list(GR_MODELS) + ["dlrm"], choices=list(GR_MODELS) + ["dlrm"],
                    help="the models trained and scored (default: all three)")
    ap.add_argument("--synth", action="append", default=[], metavar="KEY=VALUE",
                    help="a generator setting (nestpipe.datasets.synth.SynthConfig), e.g. click_taste_boost=0.8")
    ap.add_argument("--tag", default="", help="prefix of the run directories (several settings on the same shards)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rec = Recorder("quality_synthetic", argv, __file__)
    load0 = os.getloadavg()
    t0 = time.time()
    per_seed = []
    for seed in args.seeds:
        per_seed.append(one_seed(args, seed))
        print(f"seed {seed} done ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    rows = summary(per_seed, tuple(args.models))
    print(f"{args.scale}, split {args.split}, seeds {args.seeds}, {args.epochs} epochs (gr), {args.dlrm_epochs} (dlrm)")
    print(f"{'figure':45s} {'mean':>8s}   spread over seeds")
    for name, r in rows.items():
        print(f"{name:45s} {r['mean']:8.4f}   {r['min']:.4f} .. {r['max']:.4f}")
    try:
        import torch

        versions = {"torch": torch.__version__, "python": platform.python_version()}
    except ImportError:
        versions = {}
    res = {"command": " ".join(sys.argv), "args": vars(args), "summary": rows, "per_seed": per_seed,
           "versions": versions, "load_average": {"before": load0, "after": os.getloadavg()},
           "seconds": round(time.time() - t0, 1)}
    path = os.path.join(args.out, f"results-{args.tag.strip('-')}.json" if args.tag else "results.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"results: {path}")
    name = f"quality_synthetic-{args.scale}-{args.split}{'-' + args.tag.strip('-') if args.tag else ''}.json"
    rec.write(path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name), fields={
        "scale": args.scale, "split": args.split, "seeds": args.seeds, "epochs": args.epochs,
        "dlrm_epochs": args.dlrm_epochs, "models": args.models, "sets": args.set, "sets_dlrm": args.set_dlrm,
        "synth": args.synth, "tag": args.tag, "summary": rows,
        "per_seed": [{m: {k: s[m][k] for k in ("model", "intervals", "comparisons", "strongest_baseline")
                          if k in s[m]} for m in args.models} for s in per_seed]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
