"""Pipeline benchmark: --pipeline off vs dbp vs fwp vs nested, world size 2, (a) plain loopback and (b) a
bandwidth-capped link.

(b) runs the ranks inside a network namespace whose loopback carries a ``tc tbf`` rate cap (root only; skipped with
a message otherwise). The cap is calibrated: an ``off`` run on loopback measures the bytes every rank sends to the
others per step and the non-communication (compute) time per step; the cap is the rate at which those bytes take
as long as the compute, then one ``off`` run under the cap checks it (printed: measured communication vs compute).
Without a cap the two ranks' TCP copies compete for the same cores as compute, so loopback shows little overlap.

    python benchmarks/pipeline_bench.py [--steps 12] [--batch 64] [--seq-len 100] [--micro-batches 8] [--out DIR]

Prints one row per (network, mode): step time, samples/s, exposed communication and lookup per step, their ratio
to off, and speedup over off; writes DIR/results.json and keeps every run directory (trace.json, timeline.png).
TorchRec's TrainPipelineSparseDist is compared when torchrec is importable (not implemented in this script yet:
reported as skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from nestpipe.trainer.pipeline.testing import run_plan, write_run
from nestpipe.trainer.testing import make_shards

MODES = ("off", "dbp", "fwp", "nested")
NS = "nestpipe-bench"


def sets(args):
    return {"embedding": {"replicate_max_rows": 300, "dim": 64}, "hstu": {
        "num_layers": 1, "num_heads": 2, "linear_dim": 32, "max_seq_len": args.seq_len,
        "num_random_negatives": 32, "num_popular_negatives": 32},
        "pipe": {"gantt_steps": 3, "trace_steps": args.steps}}


def run_modes(args, shards, tag, prefix=None, modes=MODES, baseline=None):
    plan = []
    runs = {}
    for m in modes:
        run = os.path.join(args.out, f"{tag}-{m}")
        shutil.rmtree(run, ignore_errors=True)
        s = sets(args)
        if baseline:
            s["pipe"]["baseline_metrics"] = baseline
        write_run(run, shards, "hstu", m, args.steps, s)
        plan.append({"run": run})
        runs[m] = run
    p = run_plan(plan, 2, os.path.join(args.out, f"plan-{tag}.json"), timeout=3600, prefix=prefix)
    if p.returncode != 0:
        sys.exit(f"{tag}: training failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return {m: json.load(open(os.path.join(r, "metrics.json"))) for m, r in runs.items()}


def bytes_per_step(metrics):
    """Bytes all ranks together send over the link per step (every rank's traffic crosses the one loopback)."""
    return sum(sum(r["network_bytes"].values()) / max(r["measured_steps"], 1) for r in metrics["per_rank"])


def compute_s_per_step(metrics):
    return metrics["step_s"] - metrics["exposed_communication_s_per_step"]


def ns(*cmd, check=True):
    return subprocess.run(["ip", "netns", "exec", NS, *cmd], check=check, capture_output=True, text=True)


def make_namespace(rate_bit):
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    subprocess.run(["ip", "netns", "add", NS], check=True)
    ns("ip", "link", "set", "lo", "up")
    ns("tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{int(rate_bit)}bit", "burst", "256kb",
       "latency", "500ms")


def drop_namespace():
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def table(title, res, off_key="off"):
    off = res[off_key]
    print(f"\n{title}")
    print(f"{'mode':8} {'step ms':>8} {'samples/s':>10} {'exp.comm ms':>12} {'comm ms':>8} {'exp.lookup ms':>14} "
          f"{'lookup ms':>10} {'comm/off':>9} {'lookup/off':>10} {'speedup':>8}")
    for m, r in res.items():
        oc, ol = off["exposed_communication_s_per_step"], off["exposed_lookup_s_per_step"]
        print(f"{m:8} {r['step_s'] * 1e3:8.1f} {r['samples_per_s']:10.0f} "
              f"{r['exposed_communication_s_per_step'] * 1e3:12.1f} {r['communication_s_per_step'] * 1e3:8.1f} "
              f"{r['exposed_lookup_s_per_step'] * 1e3:14.2f} {r['lookup_s_per_step'] * 1e3:10.2f} "
              f"{r['exposed_communication_s_per_step'] / oc if oc else float('nan'):9.2f} "
              f"{r['exposed_lookup_s_per_step'] / ol if ol else float('nan'):10.2f} "
              f"{off['step_s'] / r['step_s']:8.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=64, help="sequences per rank per batch")
    ap.add_argument("--seq-len", type=int, default=100)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1_000_000)
    ap.add_argument("--out", default="/tmp/nestpipe-pipeline-bench")
    ap.add_argument("--rate", type=float, default=None, help="skip calibration: cap in bit/s")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    shards = os.path.join(args.out, "shards")
    if not os.path.exists(os.path.join(shards, "manifest.json")):
        t0 = time.time()
        make_shards(shards, "gr", batch_size=args.batch, micro_batches=args.micro_batches, shards=(8, 8),
                    eval_shards=(1,), vocab=args.vocab, seq_len=args.seq_len, seed=7, oov_rate=0.0)
        print(f"shards: {time.time() - t0:.1f} s")
    results = {"config": vars(args)}
    lo = run_modes(args, shards, "loopback")
    results["loopback"] = lo
    table("(a) plain loopback, world 2", lo)
    try:
        torchrec = __import__("torchrec")
        results["torchrec"] = f"torchrec {torchrec.__version__} installed; comparison not implemented here yet"
    except ImportError:
        results["torchrec"] = "torchrec not installed: TorchRec comparison skipped"
    print(results["torchrec"])
    if os.geteuid() != 0 or shutil.which("tc") is None:
        print("(b) bandwidth-capped link skipped: needs root and tc (ip netns + tc tbf)")
    else:
        off = lo["off"]
        B, C = bytes_per_step(off), compute_s_per_step(off)
        rate = args.rate or B * 8 / C
        print(f"\ncalibration: {B / 1e6:.2f} MB per step over the link, compute {C * 1e3:.1f} ms per step "
              f"-> cap {rate / 1e6:.0f} Mbit/s")
        try:
            make_namespace(rate)
            prefix = ["ip", "netns", "exec", NS]
            check = run_modes(args, shards, "cap-calib", prefix, modes=("off",))["off"]
            cc, cm = check["exposed_communication_s_per_step"], compute_s_per_step(check)
            if not args.rate and cc > 0:  # one refinement: communication time scales ~ 1 / rate
                rate = rate * cc / cm
                print(f"under the first cap: communication {cc * 1e3:.1f} ms vs compute {cm * 1e3:.1f} ms per step; "
                      f"refined cap {rate / 1e6:.0f} Mbit/s")
                make_namespace(rate)
            cap = run_modes(args, shards, "cap", prefix)
        finally:
            drop_namespace()
        off = cap["off"]
        print(f"cap: tc tbf rate {rate / 1e6:.0f} Mbit/s burst 256kb latency 500ms; off under the cap: "
              f"communication {off['exposed_communication_s_per_step'] * 1e3:.1f} ms vs compute "
              f"{compute_s_per_step(off) * 1e3:.1f} ms per step")
        results["cap_bit_per_s"] = rate
        results["capped"] = cap
        table(f"(b) capped loopback ({rate / 1e6:.0f} Mbit/s), world 2", cap)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"\nresults: {os.path.join(args.out, 'results.json')}; traces and timeline.png in {args.out}/*-nested")


if __name__ == "__main__":
    main()
