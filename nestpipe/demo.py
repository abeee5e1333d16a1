"""``nestpipe demo``: the main job end to end on the bundled synthetic data.

synth (KuaiRand format, small scale) -> ingest (gr and ctr) -> shard report; then training and evaluation when
the trainer is installed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="run the main job end to end on generated KuaiRand-format data",
        description="Generate synthetic KuaiRand-27K-format logs, ingest them into clustered WebDataset shards for "
        "both tasks, verify and summarise the shards, then train and evaluate when the trainer is available.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", default="runs/demo", help="working directory of the demo")
    p.add_argument("--scale", default="small", choices=["tiny", "small", "medium"], help="synthetic data scale")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.set_defaults(func=run)


def run(args) -> int:
    from nestpipe.datasets.synth import generate
    from nestpipe.ingest import IngestConfig, ingest
    from nestpipe.ingest.report import format_report, shard_report

    t0 = time.time()
    raw = os.path.join(args.out, "raw")
    if not os.path.exists(os.path.join(raw, "user_features_27k.csv")):
        print(f"[demo] generating {args.scale} synthetic KuaiRand data in {raw}", file=sys.stderr)
        generate(raw, scale=args.scale, seed=args.seed)
    reports = []
    for task, extra in (("gr", {"max_seq_len": 64}), ("ctr", {})):
        out = os.path.join(args.out, f"shards-{task}")
        print(f"[demo] ingest --task {task} -> {out}", file=sys.stderr)
        ingest(IngestConfig(raw=raw, out=out, task=task, batch_size=256, micro_batches=8, seed=args.seed,
                            workers=args.workers, **extra))
        rep = shard_report(out)
        print(format_report(rep))
        reports.append(rep)
        if not rep["ok"]:
            return 1
    print(f"[demo] done in {time.time() - t0:.1f} s", file=sys.stderr)
    return 0
