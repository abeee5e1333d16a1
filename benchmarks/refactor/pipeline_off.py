"""pipeline_bench.py's loopback workloads in --pipeline off only (GR and pooled), no capped network, no TorchRec.

    PYTHONPATH=TREE python benchmarks/refactor/pipeline_off.py BENCHDIR OUTDIR JSON [--steps N] [--workloads gr pooled]

BENCHDIR is a directory holding pipeline_bench.py (a copy of TREE/benchmarks, so nothing is written into TREE).
pipeline_bench.py has no option to choose modes (it always runs GR in off/dbp/fwp/nested/nested-1t/auto and pooled
in off/off-clustered/nested/auto), so this calls its own functions with modes=("off",): the same shards
(make_gr_shards / make_pooled_shards, cached in OUTDIR under the same names as pipeline_bench's --out), the same
configs (sets), the same un-timed 3-step warm-up launch before the measured run (run_modes). The benchmark's record
(benchmarks/results/pipeline.json) is not written. Writes JSON: per workload samples_per_s, step_s and the metrics.
"""
import argparse
import json
import os
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("benchdir")
ap.add_argument("out")
ap.add_argument("json")
ap.add_argument("--steps", type=int, default=20)  # pipeline_bench's default
ap.add_argument("--workloads", nargs="+", default=["gr", "pooled"], choices=["gr", "pooled"])
a = ap.parse_args()

sys.path.insert(0, os.path.abspath(a.benchdir))
import pipeline_bench as pb  # noqa: E402

import nestpipe  # noqa: E402

# pipeline_bench's defaults (its main()), --no-cap, no TorchRec
args = argparse.Namespace(steps=a.steps, batch=64, seq_len=100, micro_batches=8, vocab=1_000_000,
                          out=os.path.abspath(a.out), keep_checkpoints=False, torchrec_python=None)
os.makedirs(args.out, exist_ok=True)
per_rank = args.steps + 2
shards = {
    "gr": os.path.join(args.out, f"shards-gr-{args.batch}x{args.seq_len}-mb{args.micro_batches}-s{per_rank}"),
    "pooled": os.path.join(args.out, f"shards-pooled-mb{args.micro_batches}-s{per_rank}"),
}
t0 = time.time()
if "gr" in a.workloads and not os.path.exists(os.path.join(shards["gr"], "manifest.json")):
    pb.make_gr_shards(shards["gr"], args.batch, args.seq_len, args.micro_batches, args.vocab, per_rank)
if "pooled" in a.workloads and not os.path.exists(os.path.join(shards["pooled"], "manifest.json")):
    pb.make_pooled_shards(shards["pooled"], args.micro_batches, per_rank)
shard_s = time.time() - t0
res = {"nestpipe": nestpipe.__file__, "steps": args.steps, "shard_s": shard_s, "load_before": os.getloadavg()}
for w in a.workloads:
    t0 = time.time()
    m = pb.run_modes(args, shards[w], f"loopback-{w}", None, modes=("off",), workload=w)["off"]
    res[w] = {"samples_per_s": m["samples_per_s"], "step_s": m["step_s"], "wall_s": time.time() - t0, "metrics": m}
    print(f"{w} off: {m['samples_per_s']:.1f} samples/s, step {m['step_s'] * 1e3:.1f} ms "
          f"({time.time() - t0:.1f} s incl. launch + warm-up)", flush=True)
res["load_after"] = os.getloadavg()
with open(a.json, "w") as f:
    json.dump(res, f, indent=1, default=str)
