"""``nestpipe demo``: the main job end to end on the bundled synthetic data.

synth (KuaiRand-27K format, small scale) -> ingest (gr and ctr) -> shard report -> 2-process training of hstu
(gr) and dlrm (ctr) with the default pipeline -> evaluation beside the baselines -> a summary.
The evaluation reports every model beside the strongest simple baseline fitted on the training split: the
successor-counting model for next-item, a regularised logistic regression for CTR (:mod:`nestpipe.trainer.baselines`).
Every step is skipped when its output is already complete, so a rerun continues where it stopped.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from nestpipe.datasets.synth import generate
from nestpipe.utils.options import DefaultsHelpFormatter
from nestpipe.ingest import IngestConfig, ingest
from nestpipe.ingest.report import format_report, shard_report
from nestpipe.trainer.evaluate import evaluate_run
from nestpipe.utils.jsonio import read_json


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="run the main job end to end on generated KuaiRand-format data",
        description="Generate synthetic KuaiRand-27K-format logs, ingest them into clustered WebDataset shards for "
        "both tasks, verify and summarise the shards, train hstu and dlrm on 2 processes with the nested "
        "pipeline, evaluate them beside strong simple baselines (successor counting, logistic regression) and print the metrics.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--out", default="runs/demo", help="working directory of the demo")
    p.add_argument("--scale", default="small", choices=["tiny", "small", "medium"], help="synthetic data scale")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data and of the training runs")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="ingest worker processes")
    p.add_argument("--nproc-per-node", type=int, default=2, help="training processes")
    p.add_argument("--hstu-epochs", type=int, default=3, help="epochs of the HSTU run")
    p.add_argument("--dlrm-epochs", type=int, default=1, help="epochs of the DLRM run")
    p.add_argument("--skip-training", action="store_true", help="stop after the shard reports")
    p.set_defaults(func=run)


# The demo's shards: small enough that every training rank gets several (benchmarks/quality_bench.py uses the same).
DEMO_INGEST = {
    "gr": dict(batch_size=64, micro_batches=4, max_seq_len=64, batches_per_shard=8),
    "ctr": dict(batch_size=512, micro_batches=2, batches_per_shard=50),  # 8 doubles the DLRM time (29 small tables)
}


def _log(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def _train(shards: str, run: str, model: str, epochs: int, nproc: int) -> None:
    if os.path.exists(os.path.join(run, "metrics.json")):
        _log(f"{run} already trained; skipping (delete it to retrain)")
        return
    cmd = [sys.executable, "-m", "nestpipe", "train", "--shards", shards, "--out", run, "--model", model,
           "--nproc-per-node", str(nproc), "--epochs", str(epochs)]
    _log(" ".join(["nestpipe"] + cmd[3:]))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env)


def run(args) -> int:

    t0 = time.time()
    stages = _Stages()
    raw = os.path.join(args.out, "raw")
    if not os.path.exists(os.path.join(raw, "user_features_27k.csv")):
        _log(f"generating {args.scale} synthetic KuaiRand data in {raw}")
        generate(raw, scale=args.scale, seed=args.seed)
    stages.done("synth")
    for task, opts in DEMO_INGEST.items():
        out = os.path.join(args.out, f"shards-{task}")
        _log(f"ingest --task {task} -> {out}")
        ingest(IngestConfig(raw=raw, out=out, task=task, seed=args.seed, workers=args.workers, **opts))
        stages.done(f"ingest {task}")
        rep = shard_report(out)
        print(format_report(rep), flush=True)
        if not rep["ok"]:
            return 1
    if args.skip_training:
        _log(f"done in {time.time() - t0:.1f} s ({stages})")
        return 0


    summary = {}
    for model, task, epochs in (("hstu", "gr", args.hstu_epochs), ("dlrm", "ctr", args.dlrm_epochs)):
        run_dir = os.path.join(args.out, model)
        _train(os.path.join(args.out, f"shards-{task}"), run_dir, model, epochs, args.nproc_per_node)
        stages.done(f"train {model}")
        _log(f"nestpipe eval --run {run_dir}")
        ev = evaluate_run(run_dir)  # also writes RUN/eval.json
        stages.done(f"eval {model}")
        metrics = read_json(os.path.join(run_dir, "metrics.json"), "metrics")
        summary[model] = {"eval": ev, "samples_per_s": metrics.get("samples_per_s")}
    print("\n== NestPipe demo results ==")
    h = summary["hstu"]["eval"]
    hb = h["strongest_baseline"]
    print(f"hstu (gr):  HR@10 {h['model']['HR@10']:.4f} vs {hb.replace('_', '-')} {h[f'baseline_{hb}']['HR@10']:.4f} "
          f"(most-popular {h['baseline_most_popular']['HR@10']:.4f}); NDCG@10 {h['model']['NDCG@10']:.4f} vs "
          f"{h[f'baseline_{hb}']['NDCG@10']:.4f} ({_verdicts(h, ('HR@10', 'NDCG@10'))}); "
          f"{summary['hstu']['samples_per_s'] or 0:,.0f} samples/s")
    if "generator_oracle" in h:
        print(f"            the data's ceiling (the generator's own next-item probabilities): HR@10 "
              f"{h['generator_oracle']['HR@10']:.4f}, NDCG@10 {h['generator_oracle']['NDCG@10']:.4f}")
    d = summary["dlrm"]["eval"]
    db = d["strongest_baseline"]
    lr = d[f"baseline_{db}"]
    print(f"dlrm (ctr): AUC {d['model']['AUC']:.4f} vs {db.replace('_', ' ')} {lr['AUC']:.4f} (constant 0.5000); "
          f"logloss {d['model']['logloss']:.4f} vs {lr['logloss']:.4f} "
          f"(constant {d['baseline_constant']['logloss']:.4f}) ({_verdicts(d, ('AUC', 'logloss'))}); "
          f"{summary['dlrm']['samples_per_s'] or 0:,.0f} samples/s")
    if "bayes_ceiling" in d:
        print(f"            the data's Bayes ceiling (the generator's own click probabilities): AUC "
              f"{d['bayes_ceiling']['AUC']:.4f}, logloss {d['bayes_ceiling']['logloss']:.4f}")
    print(f"runs, traces (trace.json, timeline.png) and metrics are under {args.out}/hstu and {args.out}/dlrm")
    _log(f"done in {time.time() - t0:.1f} s ({stages})")
    return 0


def _verdicts(ev, metrics) -> str:
    """The model against the strongest baseline: each metric's verdict (paired 95% bootstrap interval)."""
    v = ev.get("vs_strongest_baseline", {})
    return "model " + ", ".join(f"{m} {v.get(m, '?')}" for m in metrics)


class _Stages:
    """Seconds per stage of the demo, in order (a stage that had nothing to do shows its few milliseconds)."""

    def __init__(self):
        self.last, self.seconds = time.time(), []

    def done(self, name: str) -> None:
        now = time.time()
        self.seconds.append((name, now - self.last))
        self.last = now

    def __str__(self) -> str:
        return ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds)
