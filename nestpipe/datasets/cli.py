"""`nestpipe synth`: write synthetic KuaiRand-27K files (`nestpipe check-raw`, which names the dataset a directory
holds, is the ingest's: nestpipe.ingest.cli)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

SYNTH_EPILOG = """\
scales (users / videos / default interactions):
  tiny     300 / 5,000 / 30,000            (under a second; used by the tests)
  small    2,000 / 100,000 / 400,000       (a few seconds; the demo default)
  medium   27,285 / 1,000,000 / 5,000,000  (benchmarks)
  27k      27,285 / 32,038,725 / 50,000,000 (the real KuaiRand-27K vocabulary; writes all 32M video rows)

The files have the names, headers and value formats of the published KuaiRand-27K release, are byte-identical
for the same scale, seed and --interactions, and log rows are shuffled (not sorted by user or time). The planted
structure (communities, Zipf popularity, session transitions, feedback) is described in docs/synthetic-data.md.

examples:
  nestpipe synth --out data/kuairand-small --scale small --seed 0
  nestpipe synth --out data/kuairand-taste --scale small --set click_taste_boost=0.8   (a user x video cross in clicks)
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "synth",
        help="write synthetic logs and features in the exact KuaiRand-27K format (the bundled default data)",
        description="Write the ten files of a synthetic KuaiRand-27K release with planted, learnable structure.",
        epilog=SYNTH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    p.add_argument("--scale", default="small", choices=["tiny", "small", "medium", "27k"],
                   help="dataset size (default: small)")
    p.add_argument("--seed", type=int, default=0, help="random seed; same seed -> byte-identical files (default: 0)")
    p.add_argument("--interactions", type=_positive_int, default=None, metavar="N",
                   help="total log rows (standard + random logs), overriding the scale's default")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a generator setting (a field of nestpipe.datasets.synth.SynthConfig, docs/synthetic-data.md), "
                        "e.g. --set click_taste_boost=0.8 for a latent user x video cross in the clicks; repeatable")
    p.add_argument("--force", action="store_true",
                   help="write even if DIR already holds files that are not synthetic KuaiRand output")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    p.set_defaults(func=run_synth)



def run_synth(args) -> int:
    from nestpipe.datasets import synth  # start-up time: Polars only for the command that runs

    start = time.perf_counter()
    config = synth.SynthConfig.for_scale(args.scale, seed=args.seed, interactions=args.interactions,
                                         **_settings(args.set, synth.SynthConfig))
    result = synth.generate(args.out, config=config, progress=not args.quiet, force=args.force)
    counts = result["counts"]
    size = sum(os.path.getsize(p) for paths in result["files"].values() for p in paths)
    print(
        f"wrote {sum(len(v) for v in result['files'].values())} KuaiRand-27K files to {result['out_dir']} "
        f"({size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s: {counts['users']:,} users, "
        f"{counts['videos']:,} videos, {counts['log_standard_rows']:,} standard + {counts['log_random_rows']:,} "
        f"random log rows, {counts['communities']} planted communities (seed {args.seed})"
    )
    return 0


def _settings(items, SynthConfig) -> dict:
    """``--set KEY=VALUE`` items -> overrides of ``SynthConfig`` (the class, passed in by the command); an unknown key
    or a value of the wrong type is refused naming it."""
    fields = {f.name: f for f in dataclasses.fields(SynthConfig)}
    out = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        if key not in fields or key in ("seed", "interactions"):
            known = ", ".join(sorted(k for k in fields if k not in ("seed", "interactions")))
            raise SystemExit(f"--set {key}: not a generator setting (--seed and --interactions have their own "
                             f"options); settings: {known}")
        default = getattr(SynthConfig, key)
        if isinstance(default, str):  # a word such as click_taste_of=video, checked by SynthConfig.validated
            out[key] = text
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise SystemExit(f"--set {key}={text}: expected a number, true or false")
        ok = (isinstance(value, bool) if isinstance(default, bool) else
              isinstance(value, int) and not isinstance(value, bool) if isinstance(default, int) else
              isinstance(value, (int, float)) and not isinstance(value, bool))
        if not ok:
            raise SystemExit(f"--set {key}={text}: expected {type(default).__name__} like its default {default!r}")
        out[key] = float(value) if isinstance(default, float) else value
    return out
