"""CLI: ``nestpipe cluster-report SHARDS``."""

from __future__ import annotations

import argparse
import json
from nestpipe.clustering.report import cluster_report, format_report


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "cluster-report",
        help="per table, All2All redundancy of the shards' stored micro-batch partition vs a random one",
        description=(
            "Read ingested shards and print, per table, the redundancy (sum of per-micro-batch unique rows / "
            "batch unique rows; 1.0 is ideal) of the stored key-centric partition and of a random balanced one."
        ),
    )
    p.add_argument("shards", metavar="SHARDS", help="output directory of `nestpipe ingest` (with manifest.json)")
    p.add_argument("--split", default=None, help="only this set (e.g. train); default: all sets")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches")
    p.add_argument("--seed", type=int, default=0, help="seed of the random baseline partition")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.max_batches is not None and args.max_batches < 1:
        raise ValueError(f"--max-batches must be >= 1, got {args.max_batches}")
    figures = cluster_report(args.shards, split=args.split, max_batches=args.max_batches, seed=args.seed)
    if args.json:
        print(json.dumps([f.to_json() for f in figures], indent=1))
    else:
        print(format_report(figures))
    return 0 if all(f.lists_consistent for f in figures) else 1
