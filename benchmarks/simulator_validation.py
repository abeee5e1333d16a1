"""Simulator validation on measured runs: calibrate on one configuration, predict the measured step of the others.

    python benchmarks/simulator_validation.py [--repeats 3] [--steps 14] [--batch 64] [--seq-len 100]
        [--cap-mbit 200] [--no-cap] [--out /tmp/nestpipe-simval]

Workload: the GR-shaped workload of ``benchmarks/pipeline_bench.py`` (item 1M rows + action 256 rows, dim 64, Zipf
1.2 item ids, clustered micro-batches, HSTU 1 layer x 2 heads, 64 shared negatives), shards for 4, 8 and 16
micro-batches of the same sequences. Calibration input: ``--pipeline off``, world 2, 8 micro-batches, plain
loopback (``nestpipe simulate --calibrate RUN`` fits the lookup, collective, dense and overhead costs from it).
Held out: nested / dbp / fwp at world 2, off and nested at 4 and 16 micro-batches, off and nested at world 3, and
off and nested across a ``tc tbf`` cap of ``--cap-mbit`` in a network namespace (root only; skipped with a message
otherwise).

Every configuration is trained ``--repeats`` times, interleaved (A B C A B C ..., one launch of the ranks per world
size and network). The machine is shared: each configuration's fastest repeat (the run least disturbed by other
load) counts, the calibration is the calibration configuration's fastest repeat, and all repeats are printed.
Measured step: the median traced step (``measured.read_run``). Writes the record
``benchmarks/results/simulator_validation.json`` (``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from nestpipe.measure import measured, validate_local
from nestpipe.measure.validate_local import Config
from nestpipe.utils.jsonio import read_json, write_json_atomic

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import Recorder  # noqa: E402


def configs(cap_bit):
    out = [Config(world, pipeline, micro_batches) for world, pipeline, micro_batches in (
        (2, "off", 8), (2, "nested", 8), (2, "dbp", 8), (2, "fwp", 8), (2, "off", 4), (2, "nested", 4), (2, "off", 16),
        (2, "nested", 16), (3, "off", 8), (3, "nested", 8))]
    if cap_bit:
        out += [Config(2, "off", 8, cap_bit), Config(2, "nested", 8, cap_bit)]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=100)
    ap.add_argument("--vocab", type=int, default=1_000_000)
    ap.add_argument("--cap-mbit", type=float, default=200.0)
    ap.add_argument("--no-cap", action="store_true")
    ap.add_argument("--out", default="/tmp/nestpipe-simval")
    ap.add_argument("--predict-only", action="store_true",
                    help="train nothing: predict the runs recorded in OUT/results.json again with the current model")
    args = ap.parse_args(argv)
    if args.predict_only:
        return predict_again(args.out)
    rec = Recorder("simulator_validation", argv, __file__)
    os.makedirs(args.out, exist_ok=True)
    cap = None
    if not args.no_cap:
        ok, why = validate_local.can_cap()
        if ok:
            cap = args.cap_mbit * 1e6
        else:
            print(f"bandwidth-capped configurations skipped: {why} (need root, ip netns and tc)")
    shards = {}
    for n in (4, 8, 16):
        shards[n] = os.path.join(args.out, f"shards-{args.batch}x{args.seq_len}-n{n}")
        if not os.path.exists(os.path.join(shards[n], "manifest.json")):
            validate_local.make_gr_shards(shards[n], args.batch, args.seq_len, n, args.vocab, args.steps + 2)
    cfgs = configs(cap)
    calib = cfgs[0]
    t0, load0 = time.time(), os.getloadavg()[0]
    runs = validate_local.train_configs(os.path.join(args.out, "runs"), shards, cfgs, args.steps, args.seq_len,
                                        repeats=args.repeats)
    load1 = os.getloadavg()[0]
    steps = {c: [measured.read_run(r).step_s for r in rs] for c, rs in runs.items()}
    best = {c: validate_local.fastest(rs) for c, rs in runs.items()}
    rows, hw = validate_local.validate(best[calib], best)
    print(f"\n{len(cfgs)} configurations x {args.repeats} interleaved repeats in {time.time() - t0:.0f} s; load "
          f"average {load0:.1f} -> {load1:.1f} on {os.cpu_count()} cores")
    print(f"calibrated on {calib.tag} (its fastest repeat): lookup {hw.key_s * 1e6:.2f} us/key, exchange "
          f"{hw.row_s * 1e6:.2f} us/row, collective {hw.coll_latency_s * 1e3:.2f} ms + {hw.coll_s_per_byte * 1e9:.2f} "
          f"ns/B, dense {hw.dense_flops / 1e9:.1f} GFLOP/s + {hw.dense_call_s * 1e3:.2f} ms/call, data "
          f"{hw.token_s * 1e9:.0f} ns/token, overhead "
          f"{hw.step_overhead_s * 1e3:.1f} ms, {hw.cores} cores")
    lines = validate_local.format_rows(rows).split("\n")
    print(lines[0] + "   measured repeats (ms)")
    print(lines[1])
    for x, line in zip(rows, lines[2:]):
        print(f"{line}   {', '.join(f'{1e3 * t:.1f}' for t in steps[x.config])}")
    held = [x for x in rows if x.role == "held-out"]
    within = sum(abs(x.error) <= 0.15 for x in held)
    print(f"held-out within 15%: {within} of {len(held)}; median |error| "
          f"{100 * float(np.median([abs(x.error) for x in held])):.1f}%")
    summary = {x.config.tag: {"predicted_ms": x.predicted_s * 1e3, "measured_ms": x.measured_s * 1e3, "error": x.error,
                              "role": x.role, "measured_repeats_ms": [1e3 * t for t in steps[x.config]],
                              "run": best[x.config]} for x in rows}
    write_json_atomic(os.path.join(args.out, "results.json"), {
        "args": vars(args), "load_average": [load0, load1], "summary": summary, "hardware": hw.as_dict()},
        sort_keys=False)
    print(f"results: {os.path.join(args.out, 'results.json')}")
    rec.write({"calibration": calib.tag, "cap_mbit": args.cap_mbit if cap else None, "repeats": args.repeats,
               "steps": args.steps, "held_out_within_15pct": within, "held_out": len(held),
               "median_abs_error": float(np.median([abs(x.error) for x in held])), "hardware": hw.as_dict(),
               "rows": [{"config": tag, **{k: v for k, v in row.items() if k != "run"}}
                        for tag, row in summary.items()]})
    return 0


def predict_again(out: str) -> int:
    """Re-evaluate the measured runs of an earlier invocation (same fastest repeats) with the current model."""
    try:
        doc = read_json(os.path.join(out, "results.json"), "results of an earlier run to predict again", expect=dict)
    except FileNotFoundError as e:
        raise SystemExit(str(e))
    tags = {c.tag: c for c in configs(doc["args"]["cap_mbit"] * 1e6)}
    best = {tags[tag]: row["run"] for tag, row in doc["summary"].items()}
    calib = next(tags[tag] for tag, row in doc["summary"].items() if row["role"] == "calibration")
    rows, hw = validate_local.validate(best[calib], best)
    print(f"calibration: dense {hw.dense_flops / 1e9:.1f} GFLOP/s + {hw.dense_call_s * 1e3:.2f} ms/call, collective "
          f"{hw.coll_latency_s * 1e3:.2f} ms + {hw.coll_s_per_byte * 1e9:.2f} ns/B")
    print(validate_local.format_rows(rows))
    held = [x for x in rows if x.role == "held-out"]
    print(f"held-out within 15%: {sum(abs(x.error) <= 0.15 for x in held)} of {len(held)}; median |error| "
          f"{100 * float(np.median([abs(x.error) for x in held])):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
