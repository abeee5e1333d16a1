"""Simulator validation on measured runs: calibrate on one configuration, predict the measured step of the others.

    python benchmarks/simulator_validation.py [--rounds 3] [--steps 14] [--batch 64] [--seq-len 100]
        [--cap-mbit 200] [--no-cap] [--out /tmp/nestpipe-simval]

Workload: the GR-shaped workload of ``benchmarks/pipeline_bench.py`` (item 1M rows + action 256 rows, dim 64, Zipf
1.2 item ids, clustered micro-batches, HSTU 1 layer x 2 heads, 64 shared negatives), shards for 4, 8 and 16
micro-batches of the same sequences. Calibration input: ``--pipeline off``, world 2, 8 micro-batches, plain
loopback (``nestpipe simulate --calibrate RUN`` fits the lookup, collective, dense and overhead costs from it).
Held out: nested / dbp / fwp at world 2, off and nested at 4 and 16 micro-batches, off and nested at world 3, and
off and nested across a ``tc tbf`` cap of ``--cap-mbit`` in a network namespace (root only; skipped with a message
otherwise).

Every round trains every configuration once (one launch of the ranks per world size and network). The machine is
shared: per round, the calibration and the predictions use that round's runs; the summary takes each
configuration's fastest round (the run least disturbed by other load), calibrated on the calibration
configuration's fastest round, and prints the per-round errors beside it. Measured step: the median traced step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from nestpipe.planning import measured
from nestpipe.planning import validate_local as v

C = v.Config


def configs(cap_bit):
    out = [C(2, "off", 8), C(2, "nested", 8), C(2, "dbp", 8), C(2, "fwp", 8), C(2, "off", 4), C(2, "nested", 4),
           C(2, "off", 16), C(2, "nested", 16), C(3, "off", 8), C(3, "nested", 8)]
    if cap_bit:
        out += [C(2, "off", 8, cap_bit), C(2, "nested", 8, cap_bit)]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=100)
    ap.add_argument("--vocab", type=int, default=1_000_000)
    ap.add_argument("--cap-mbit", type=float, default=200.0)
    ap.add_argument("--no-cap", action="store_true")
    ap.add_argument("--out", default="/tmp/nestpipe-simval")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cap = None
    if not args.no_cap:
        ok, why = v.can_cap()
        if ok:
            cap = args.cap_mbit * 1e6
        else:
            print(f"bandwidth-capped configurations skipped: {why} (need root, ip netns and tc)")
    shards = {}
    for n in (4, 8, 16):
        shards[n] = os.path.join(args.out, f"shards-{args.batch}x{args.seq_len}-n{n}")
        if not os.path.exists(os.path.join(shards[n], "manifest.json")):
            v.make_gr_shards(shards[n], args.batch, args.seq_len, n, args.vocab, args.steps + 2)
    cfgs = configs(cap)
    calib = cfgs[0]
    rounds = []
    for r in range(args.rounds):
        t0, load0 = time.time(), os.getloadavg()[0]
        runs = v.train_configs(os.path.join(args.out, f"round{r}"), shards, cfgs, args.steps, args.seq_len)
        rows, hw = v.validate(runs[calib], runs)
        print(f"\nround {r}: {time.time() - t0:.0f} s, load average {load0:.1f} -> {os.getloadavg()[0]:.1f} "
              f"(2 cores); calibrated on {calib.tag}")
        print(v.format_rows(rows))
        rounds.append({"runs": {c.tag: run for c, run in runs.items()},
                       "rows": {x.config.tag: (x.predicted_s, x.measured_s) for x in rows}, "hardware": hw.as_dict()})
    # fastest round per configuration; calibration on the calibration configuration's fastest round
    best = {}
    for c in cfgs:
        steps = [measured.read_run(rd["runs"][c.tag]).step_s for rd in rounds]
        best[c] = rounds[int(np.argmin(steps))]["runs"][c.tag]
    rows, hw = v.validate(best[calib], best)
    per_round = {c.tag: [rd["rows"][c.tag][0] / rd["rows"][c.tag][1] - 1 for rd in rounds] for c in cfgs}
    print(f"\nsummary: each configuration's fastest of {args.rounds} rounds, calibrated on {calib.tag}'s fastest")
    print(f"fitted: lookup {hw.key_s * 1e6:.2f} us/key, exchange {hw.row_s * 1e6:.2f} us/row, collective "
          f"{hw.coll_latency_s * 1e3:.2f} ms + {hw.coll_s_per_byte * 1e9:.2f} ns/B, dense "
          f"{hw.dense_flops / 1e9:.1f} GFLOP/s, data {hw.token_s * 1e9:.0f} ns/token, overhead "
          f"{hw.step_overhead_s * 1e3:.1f} ms, {hw.cores} cores")
    lines = v.format_rows(rows).split("\n")
    print(lines[0] + "   per-round errors")
    print(lines[1])
    for x, line in zip(rows, lines[2:]):
        pr = ", ".join(f"{100 * e:+.0f}%" for e in per_round[x.config.tag])
        print(f"{line}   {pr}")
    held = [x for x in rows if x.role == "held-out"]
    within = sum(abs(x.error) <= 0.15 for x in held)
    print(f"held-out within 15%: {within} of {len(held)}; median |error| "
          f"{100 * float(np.median([abs(x.error) for x in held])):.1f}%")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "rounds": rounds, "summary": {x.config.tag: {
            "predicted_ms": x.predicted_s * 1e3, "measured_ms": x.measured_s * 1e3, "error": x.error, "role": x.role,
            "per_round_errors": per_round[x.config.tag]} for x in rows}, "hardware": hw.as_dict()}, f, indent=1)
    print(f"results: {os.path.join(args.out, 'results.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
