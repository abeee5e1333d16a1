"""Faults on purpose: seeded, randomised trials with a verdict each, printed as a table and recorded.

    python benchmarks/chaos.py [--trials-per-class 20] [--classes CLASS ...] [--seed 0] [--out /tmp/nestpipe-chaos]

The fault classes and their verdicts are described where they are made: ``chaos_ingest.py`` (input fuzz across CSV
and Parquet, SIGKILL of the driver or a worker with the local and Dask engines, a full disk, an unwritable output),
``chaos_training.py`` (SIGKILL of a rank at a moment drawn over the run, checkpoint writes included; SIGSTOP of a
rank; a shard truncated at a random byte; a checkpoint file damaged), ``chaos_serving.py`` (a load generator at
twice the measured capacity, a replica killed mid-run, malformed requests mixed in). Every trial's verdict counts in
the table: a silent loss (a result that differs from its reference without an error), a raw traceback as the only
message, a process left behind.

Every trial's seed is recorded, so ``--replay SEED --classes CLASS`` runs it again. Writes ``OUT/results.json`` and
the record ``benchmarks/results/chaos.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chaos_ingest  # noqa: E402
import chaos_serving  # noqa: E402
import chaos_training  # noqa: E402
from record import Recorder  # noqa: E402

FAMILIES = {"ingest": chaos_ingest.CLASSES, "formats": chaos_ingest.FORMAT_CLASSES,
            "training": chaos_training.CLASSES, "serving": chaos_serving.CLASSES}
CLASSES = tuple(c for classes in FAMILIES.values() for c in classes)
VERDICTS = ("one_message", "deterministic", "no_process_left", "accounted")


def run_trial(work: str, ctx: Dict, cls: str, seed: int) -> Dict:
    if cls in chaos_ingest.FORMAT_CLASSES:  # their own small inputs
        return chaos_ingest.format_trial(work, cls, seed)
    if "ingest" not in ctx:  # the clean input and its shards: every other family starts from them
        ctx["ingest"] = chaos_ingest.References(work)
    if cls in chaos_ingest.CLASSES + chaos_ingest.FORMAT_CLASSES:
        return chaos_ingest.run_trial(work, ctx["ingest"], cls, seed)
    if cls in chaos_training.CLASSES:
        if "training" not in ctx:
            ctx["training"] = chaos_training.Reference(work, ctx["ingest"].get("local")["out"])
        return chaos_training.run_trial(work, ctx["training"], cls, seed)
    if cls in chaos_serving.CLASSES:  # the trained model the training family compares with
        if "training" not in ctx:
            ctx["training"] = chaos_training.Reference(work, ctx["ingest"].get("local")["out"])
        return chaos_serving.run_trial(work, ctx["training"].get()["out"], cls, seed)
    raise ValueError(f"unknown fault class {cls!r}")


def campaign(out: str, classes, trials: int, seed: int, replay: Optional[int] = None) -> Dict:
    os.makedirs(out, exist_ok=True)
    ctx: Dict = {}
    rows = []
    for cls in classes:
        seeds = [replay] if replay is not None else [seed * 1000 + k for k in range(trials)]
        for s in seeds:
            v = run_trial(out, ctx, cls, s)
            rows.append(v)
            verdicts = {k: v[k] for k in VERDICTS + ("message", "rerun_rc", "partial_shards", "wrong_answers",
                                                     "keeps_answering", "history_intact") if k in v}
            print(f"{cls:22} seed {s:6} {'ok  ' if v['ok'] else 'FAIL'} rc {v['rc']} {json.dumps(v['fault'])}"
                  + ("" if v["ok"] else f"  {json.dumps(verdicts)}"), flush=True)
    res = {"trials": rows, "summary": summarise(rows)}
    if "ingest" in ctx:
        ref = ctx["ingest"].get("local")
        res["clean_input_rows"] = ref["rows"]
        res["clean_ingest_s"] = {e: r["seconds"] for e, r in ctx["ingest"]._refs.items()}
    if "training" in ctx:
        res["clean_training"] = {str(k): {kk: vv for kk, vv in r.items() if kk != "out"}
                                 for k, r in ctx["training"].runs.items()}
    return res


def summarise(rows: List[Dict]) -> Dict:
    out = {}
    for cls in sorted({r["class"] for r in rows}, key=lambda c: CLASSES.index(c) if c in CLASSES else 99):
        rs = [r for r in rows if r["class"] == cls]
        out[cls] = {"trials": len(rs), "ok": sum(r["ok"] for r in rs),
                    "refused": sum(r["rc"] not in (0, None) for r in rs),
                    "skipped": sum(bool(r.get("skipped")) for r in rs),
                    "silent_losses": sum(r.get("accounted") is False or r.get("deterministic") is False for r in rs),
                    "raw_tracebacks": sum(r.get("one_message") is False for r in rs),
                    "left_behind": sum(r.get("no_process_left") is False for r in rs)}
    return out


def print_table(summary: Dict) -> None:
    print(f"\n{'class':22} {'trials':>6} {'ok':>4} {'failed':>7} {'skipped':>8} {'silent losses':>14} "
          f"{'tracebacks':>11} {'left behind':>12}")
    for cls, s in summary.items():
        print(f"{cls:22} {s['trials']:6} {s['ok']:4} {s['refused']:7} {s['skipped']:8} {s['silent_losses']:14} "
              f"{s['raw_tracebacks']:11} {s['left_behind']:12}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials-per-class", type=int, default=20)
    ap.add_argument("--family", choices=sorted(FAMILIES), default=None,
                    help="run every class of one family (ingest, formats, training, serving), recorded as "
                         "chaos-FAMILY")
    ap.add_argument("--classes", nargs="+", default=None, choices=CLASSES, metavar="CLASS",
                    help=f"the classes to run (default: all): {', '.join(CLASSES)}")
    ap.add_argument("--seed", type=int, default=0, help="campaign seed: trial k of a class uses seed*1000 + k")
    ap.add_argument("--replay", type=int, default=None, help="run only the trial with this seed")
    ap.add_argument("--out", default="/tmp/nestpipe-chaos")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args(argv)
    classes = a.classes or (FAMILIES[a.family] if a.family else CLASSES)
    if a.family and a.classes and set(a.classes) - set(FAMILIES[a.family]):
        ap.error(f"--classes outside the {a.family} family: {sorted(set(a.classes) - set(FAMILIES[a.family]))}")
    name = f"chaos-{a.family}" if a.family else "chaos"  # --family F --classes ...: F's classes in that order
    rec = None if (a.no_record or a.replay is not None) else Recorder(name, argv, __file__)
    res = campaign(a.out, classes, a.trials_per_class, a.seed, a.replay)
    print_table(res["summary"])
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    if rec is not None:
        rec.write(res)
    return 0 if all(r["ok"] for r in res["trials"]) else 1


if __name__ == "__main__":
    sys.exit(main())
