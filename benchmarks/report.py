"""Render the results README.md shows from the benchmark records under ``benchmarks/results/``.

    python benchmarks/report.py           # rewrite the blocks between the markers in README.md
    python benchmarks/report.py --check   # exit 1 (naming the block) where README.md differs from the records

A block is the text between ``<!-- BEGIN results:NAME -->`` and ``<!-- END results:NAME -->``; only a benchmark writes
a record, and only this script writes a block, so no figure in a block can be edited by hand and go stale
(``tests/test_report.py`` renders every block and fails on a difference).

Blocks: ``quality`` (``real_quality.py`` records: the models and the baselines on real public data, per dataset, the
eval split where a record of it exists, else the valid split).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
README = os.path.join(os.path.dirname(HERE), "README.md")
BLOCK = re.compile(r"(<!-- BEGIN results:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END results:(?P=name) -->)", re.S)


def _records(pattern: str, results: str) -> List[Dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(results, pattern))):
        with open(path) as f:
            rec = json.load(f)
        rec["_file"] = os.path.relpath(path, os.path.dirname(HERE))
        out.append(rec)
    return out


def _ci(per_seed: Dict, model: str, key: str, metric: str) -> str:
    """The per-seed 95% bootstrap intervals of ``key`` (``model`` or ``baseline_X``), their bounds averaged."""
    ivs = [s[model]["intervals"][key][metric] for s in per_seed.values() if model in s]
    if not ivs:
        return ""
    return f" [{statistics.mean(i[0] for i in ivs):.4f}, {statistics.mean(i[1] for i in ivs):.4f}]"


def _verdicts(per_seed: Dict, model: str, baseline: str, metric: str) -> str:
    v = [s[model]["comparisons"][f"baseline_{baseline}"][metric]["verdict"] for s in per_seed.values() if model in s]
    return "/".join(v)


def render_quality(results: str = RESULTS) -> str:
    records = _records("real_quality-*.json", results)
    chosen: Dict[str, Dict] = {}
    for rec in records:  # per dataset: the eval split where recorded, else valid; the defaults (no --set) first
        key = rec["dataset"]
        rank = (rec["split"] == "eval", not rec.get("sets") and not rec.get("sets_dlrm"), not rec.get("tag"))
        if key not in chosen or rank > chosen[key][0]:
            chosen[key] = (rank, rec)
    if not chosen:
        return "No real-data quality record yet (`python benchmarks/real_quality.py`).\n"
    lines = []
    for dataset, (_, rec) in sorted(chosen.items()):
        seeds = rec["seeds"]
        per_seed = rec["per_seed"]
        lines.append(f"**{dataset}**, {rec['split']} split, mean of training seeds {', '.join(map(str, seeds))} "
                     f"(95% bootstrap interval over the split's users, bounds averaged over seeds; verdicts against "
                     f"the successor-counting baseline per seed, paired over the same users: \"tie\" where the "
                     f"paired interval covers 0):")
        lines.append("")
        lines.append("| | HR@10 | NDCG@10 | vs successor counts (HR@10, NDCG@10) |")
        lines.append("|---|---|---|---|")
        means = rec["means"]
        for model in ("hstu", "sasrec"):
            if f"{model} HR@10" not in means:
                continue
            lines.append(
                f"| {model} | {means[f'{model} HR@10']:.4f}{_ci(per_seed, model, 'model', 'HR@10')} "
                f"| {means[f'{model} NDCG@10']:.4f}{_ci(per_seed, model, 'model', 'NDCG@10')} "
                f"| {_verdicts(per_seed, model, 'successor_counts', 'HR@10')}, "
                f"{_verdicts(per_seed, model, 'successor_counts', 'NDCG@10')} |")
        first = next(iter(per_seed.values()))
        ref = "hstu" if "hstu" in first else "sasrec"
        for base, label in (("successor_counts", "successor counts"), ("most_popular", "most popular")):
            if f"{base} HR@10" in means:
                lines.append(f"| {label} | {means[f'{base} HR@10']:.4f}"
                             f"{_ci({'s': first}, ref, f'baseline_{base}', 'HR@10')} "
                             f"| {means[f'{base} NDCG@10']:.4f}{_ci({'s': first}, ref, f'baseline_{base}', 'NDCG@10')} "
                             f"| |")
        pair = [s.get("hstu_vs_sasrec") for s in per_seed.values() if s.get("hstu_vs_sasrec")]
        if pair:
            lines.append("")
            lines.append("hstu - sasrec, paired per seed: " + "; ".join(
                f"HR@10 {p['HR@10']['difference']:+.4f} {p['HR@10']['verdict']}, NDCG@10 "
                f"{p['NDCG@10']['difference']:+.4f} {p['NDCG@10']['verdict']}" for p in pair) + ".")
        if "dlrm AUC" in means:
            strongest = next(s["dlrm"]["strongest_baseline"] for s in per_seed.values() if "dlrm" in s)
            lines.append("")
            verdicts = [(s["dlrm"]["comparisons"][f"baseline_{strongest}"]["AUC"]["verdict"],
                         s["dlrm"]["comparisons"][f"baseline_{strongest}"]["logloss"]["verdict"])
                        for s in per_seed.values() if "dlrm" in s]
            lines.append(f"dlrm: AUC {means['dlrm AUC']:.4f}, logloss {means['dlrm logloss']:.4f}; the strongest CTR "
                         f"baseline ({strongest}; the regression with pairwise crosses is fitted only with "
                         f"`--pairwise-baseline`): AUC {means[f'{strongest} AUC']:.4f}, logloss "
                         f"{means[f'{strongest} logloss']:.4f}; dlrm per seed (AUC, logloss): "
                         + "; ".join(f"{a}, {b}" for a, b in verdicts) + ".")
        lines.append("")
        at = rec["commit"][:12] + (" (with uncommitted changes)" if rec["commit"].endswith("+dirty") else "")
        lines.append(f"`{rec['command']}` at {at} on {rec['host']} ({rec['cpus']} cores; "
                     f"torch {rec['versions']['torch']}); record `{rec['_file']}`.")
        lines.append("")
    return "\n".join(lines)


RENDERERS = {"quality": render_quality}


def render_readme(text: str, results: str = RESULTS) -> str:
    def block(m):
        name = m.group("name")
        if name not in RENDERERS:
            raise SystemExit(f"README.md: unknown results block {name!r} (known: {', '.join(RENDERERS)})")
        return m.group(1) + RENDERERS[name](results) + m.group(4)

    return BLOCK.sub(block, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 where README.md differs from the records")
    ap.add_argument("--readme", default=README)
    args = ap.parse_args(argv)
    with open(args.readme) as f:
        text = f.read()
    new = render_readme(text)
    if args.check:
        if new != text:
            names = [m.group("name") for m in BLOCK.finditer(text)]
            print(f"{args.readme}: results blocks {names} differ from benchmarks/results; run "
                  "`python benchmarks/report.py`", file=sys.stderr)
            return 1
        return 0
    if new != text:
        with open(args.readme + ".tmp", "w") as f:
            f.write(new)
        os.replace(args.readme + ".tmp", args.readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
