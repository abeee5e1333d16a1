"""Scaling benchmark: NestPipe and TorchRec at world 2, 4 and 8 (weak scaling: the per-rank batch is fixed) behind
one capped link, and the simulator's predictions for worlds 4 and 8 made from the world-2 run before they are run.

    python benchmarks/scaling_bench.py [--worlds 2 4 8] [--steps 10] [--torchrec-python .venv-torchrec/bin/python]
        [--out /tmp/nestpipe-scaling] [--rate BIT_PER_S] [--tiny]

The link. Every rank of every world runs in one network namespace whose loopback carries a ``tc tbf`` cap (MTU
1500, a 16 KB bucket: ``benchmarks/pipeline_bench.py`` explains why), so all ranks' traffic shares one link of the
cap's rate; and all ranks share this machine's cores. World W therefore stands for a cluster whose per-rank link
bandwidth *and* per-rank compute are both ``2 / W`` of world 2's (one shared link, ``cores / W`` of a core each):
the balance of communication and compute that the cap sets at world 2 is kept as W grows, while the number of
peers per All2All, the per-call costs and the bytes per sample change as they do on a cluster. It is not a
cluster whose ranks each have their own link (that would turn worlds 4 and 8 compute-bound here).
The cap is calibrated once, at world 2, by the pipeline benchmark's rule (an ``off`` run on plain loopback, each batch
routed in its own step, measures the bytes every rank sends per step and the compute per step; the cap is the rate
at which the bytes take as long as the compute, refined once by an ``off`` run under it) and held for worlds 4 and 8.

Workloads (``pipeline_bench.py``'s, smaller so that 8 ranks fit 2 cores): GR, per rank ``--batch`` sequences of
``--seq-len`` tokens, a ``--vocab``-row item table and a 256-row action table, Zipf(1.2) ids, HSTU 1 layer x 2 heads,
64 shared negatives; pooled, 8 tables x 100k rows x dim 64, ``--pooled-batch`` samples per rank, 15-25 ids per
feature, DLRM 13-128-64 / 576-256-1. Per world: NestPipe ``off``, ``nested`` and ``auto`` (its default) on both
workloads (one launch per workload), TorchRec's ``TrainPipelineSparseDist`` with its default plan and with every table
row-wise (``benchmarks/torchrec_runner.py``; the faster counts). One thread per rank for both engines.

Reported per world and workload: samples/s of each engine and their ratio; CPU seconds per step (all ranks) and the
compute share (CPU seconds / (cores x step time)); NestPipe's exposed communication and lookup per step; the bytes
each engine's collectives send to other ranks per sample (NestPipe: its own counters; TorchRec: the runner counts
every ``torch.distributed`` collective its comm ops call, plus DDP's dense all-reduce from the dense parameter
count, and cross-checks against the namespace loopback's byte counter). ``scaling.png``: the ratios against the
world, measured and predicted. Writes ``OUT/results.json``, ``OUT/predictions.json`` (before world 4 starts) and the
record ``benchmarks/results/scaling.json``.

The simulator: ``nestpipe simulate --calibrate`` (``nestpipe.measure.measured``) fitted on the world-2 ``off`` run on
plain loopback (the cap calibration's run), told the machine's cores; it predicts ``off`` (its TorchRec-like
schedule) and ``nested`` under the cap at every world from the shards alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline_bench as pb  # noqa: E402 (benchmarks/ is not a package)
import torchrec_runner  # noqa: E402
from record import Recorder  # noqa: E402

from nestpipe.utils.host import describe_host, host_line  # noqa: E402

WORLDS = (2, 4, 8)
MODES = ("off", "nested", "auto")
TORCHREC_PLANS = ("default", "row_wise")
# the stages a record keeps per NestPipe run (ms per step, mean over ranks)
STAGES = ("dense", "embed.owner", "update.sparse", "route.comm", "embed.comm", "grad.comm", "dense.allreduce.comm",
          "wait.comm")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def make_shards(args) -> Dict[int, Dict[str, str]]:
    """Per world: GR and pooled shards with one train shard per rank (the same seeds at every world)."""
    per_rank = args.steps + 2
    out = {}
    for w in args.worlds:
        gr = os.path.join(args.out, f"shards-gr-w{w}-{args.batch}x{args.seq_len}-v{args.vocab}-s{per_rank}")
        if not os.path.exists(os.path.join(gr, "manifest.json")):
            pb.make_gr_shards(gr, args.batch, args.seq_len, args.micro_batches, args.vocab, per_rank, world=w)
        out[w] = {"gr": gr}
        if args.pooled:
            pooled = os.path.join(args.out, f"shards-pooled-w{w}-b{args.pooled_batch}-s{per_rank}")
            if not os.path.exists(os.path.join(pooled, "manifest.json")):
                pb.make_pooled_shards(pooled, args.micro_batches, per_rank, world=w, pooled=pooled_workload(args))
            out[w]["pooled"] = pooled
    return out


def pooled_workload(args) -> Dict:
    return dict(pb.POOLED, batch=args.pooled_batch)


def calibrate_cap(args, shards_w2: str) -> (float, str):
    """The cap (bit/s) by the pipeline benchmark's rule from a world-2 ``off`` run on plain loopback (and one
    refinement under the cap unless ``--rate``); returns (rate, the loopback run's directory)."""
    # routed in its own step (no route-ahead) over the shards' micro-batches (what GR's off runs by default, spelled
    # out): the simulator's fit needs the routing All2Alls on the compute thread and a per-micro-batch dense time
    off = pb.run_modes(args, shards_w2, "calib-loopback", modes=("off",), world=2,
                       pipe_sets={"route_ahead": False, "micro_batching": "clustered"})["off"]
    run = os.path.join(args.out, "calib-loopback-off")
    if args.rate:
        return args.rate, run
    B, C = pb.bytes_per_step(off), pb.compute_s_per_step(off)
    rate = B * 8 / C
    print(f"calibration (GR, world 2, plain loopback): {B / 1e6:.3f} MB per step over the link, compute "
          f"{C * 1e3:.1f} ms per step -> cap {rate / 1e6:.1f} Mbit/s")
    pb.make_namespace(rate)
    try:
        check = pb.run_modes(args, shards_w2, "calib-cap", pb.PREFIX, modes=("off",), world=2)["off"]
    finally:
        pb.drop_namespace()
    cc, cm = check["exposed_communication_s_per_step"], pb.compute_s_per_step(check)
    if cc > 0:
        rate = rate * cc / cm
        print(f"under the first cap: communication {cc * 1e3:.1f} ms vs compute {cm * 1e3:.1f} ms per step; "
              f"refined cap {rate / 1e6:.1f} Mbit/s (held for every world)")
    return rate, run


def predict(calib_run: str, shards: Dict[int, Dict[str, str]], rate: float, cores: int) -> Dict:
    """The simulator fitted on the world-2 ``off`` run only; ``off`` and ``nested`` under the cap at every world."""
    from nestpipe.measure import measured

    hw, _, meas = measured.calibrate_run(calib_run, cores=cores)
    out = {"calibrated_on": calib_run, "cores": cores, "cap_bit_per_s": rate, "predicted_at": _now(), "worlds": {}}
    for w, s in shards.items():
        wl = measured.workload_from_shards(s["gr"], meas.cfg, w)
        p = {m: measured.predict(hw, wl, m, rate, pb.LINK_MTU) for m in ("off", "nested")}
        out["worlds"][str(w)] = {"off_step_ms": p["off"].step_s * 1e3, "nested_step_ms": p["nested"].step_s * 1e3,
                                 "nested_over_off": p["off"].step_s / p["nested"].step_s,
                                 "ranks_per_core": w / cores}
    return out


def nestpipe_summary(m: Dict, world: int, batch: int, cores: int) -> Dict:
    """One NestPipe run's figures (metrics.json): samples/s, step, CPU, exposed time, bytes per sample."""
    ranks = m["per_rank"]
    steps = [max(r["measured_steps"], 1) for r in ranks]
    cpu_s = sum(r["cpu_s"] / n for r, n in zip(ranks, steps))  # all ranks, per step
    wire = pb.bytes_per_step(m)  # all ranks
    by_kind: Dict[str, float] = {}
    for r, n in zip(ranks, steps):
        for k, v in r["network_bytes"].items():
            by_kind[k] = by_kind.get(k, 0.0) + v / n / (world * batch)
    return {"samples_per_s": m["samples_per_s"], "step_ms": m["step_s"] * 1e3, "cpu_s_per_step": cpu_s,
            "compute_share": cpu_s / (cores * m["step_s"]),
            "exposed_communication_ms": m["exposed_communication_s_per_step"] * 1e3,
            "communication_ms": m["communication_s_per_step"] * 1e3,
            "exposed_lookup_ms": m["exposed_lookup_s_per_step"] * 1e3,
            "wire_bytes_per_sample": wire / (world * batch), "wire_bytes_per_sample_by_stage": by_kind,
            # per step, mean over ranks: where the step's time went (the compute thread's stages and the comm waits)
            "stages_ms": {k: 1e3 * sum(r["stages_s"].get(k, 0.0) / n for r, n in zip(ranks, steps)) / len(ranks)
                          for k in STAGES},
            "pipeline": m.get("pipeline"), "pipeline_choice": m.get("pipeline_choice")}


def torchrec_summary(r: Dict, world: int, cores: int) -> Dict:
    per_rank = r["wire_bytes_per_step_per_rank"]
    B = r["batch_per_rank"]
    step_s = r["ms_per_step"] / 1e3
    cpu_s = sum(r["cpu_ms_per_step_per_rank"]) / 1e3
    link = r.get("link_bytes_per_step")
    return {"samples_per_s": r["samples_per_s"], "step_ms": r["ms_per_step"], "cpu_s_per_step": cpu_s,
            "compute_share": cpu_s / (cores * step_s), "plan": r["plan"], "sharding": r["sharding"],
            "wire_bytes_per_sample": sum(per_rank.values()) / B,
            "wire_bytes_per_sample_by_collective": {k: v / B for k, v in per_rank.items()},
            "link_bytes_per_sample": link / (world * B) if link is not None else None,
            "versions": r.get("versions")}


def run_world(args, world: int, shards: Dict[str, str], gr_data: Optional[str], prefix, cores: int) -> Dict:
    out = {"started_at": _now(), "world": world}
    batches = {"gr": args.batch, "pooled": args.pooled_batch}
    for w in shards:
        ms = pb.run_modes(args, shards[w], f"w{world}-{w}", prefix, modes=MODES, workload=w, world=world)
        out[w] = {"nestpipe": {m: nestpipe_summary(ms[m], world, batches[w], cores) for m in MODES}}
    if args.torchrec_python:
        common = {"warmup": 3, "steps": args.steps, "timeout": 1500, "world": world}
        params = {"gr": dict(common, workload="gr", data=gr_data, dim=64, item_rows=args.vocab,
                             max_seq_len=args.seq_len, negatives=sum(pb.NEGATIVES), hstu=pb.sets(args)["hstu"]),
                  "pooled": dict(common, workload="pooled", **pooled_workload(args))}
        for w in shards:
            try:
                runs = [torchrec_summary(torchrec_runner.run(args.torchrec_python, dict(params[w], sharding=p), prefix),
                                         world, cores) for p in TORCHREC_PLANS]
                out[w]["torchrec"] = dict(max(runs, key=lambda r: r["samples_per_s"]), plans_run=runs)
            except Exception as e:  # noqa: BLE001 - reported; NestPipe's figures stand
                out[w]["torchrec"] = {"error": str(e)[-3000:]}
                print(f"world {world}, {w}: TorchRec failed: {str(e)[-1500:]}")
    return out


def ratios(res: Dict, predictions: Optional[Dict]) -> Dict:
    """Per workload and world: NestPipe (auto, nested) / TorchRec in samples/s, nested / off, bytes per sample, and
    the predicted nested / off with its error."""
    out: Dict[str, Dict[str, Dict]] = {}
    for w_key, r in res.items():
        world = r["world"]
        for wl in ("gr", "pooled"):
            if wl not in r:
                continue
            n, t = r[wl]["nestpipe"], r[wl].get("torchrec", {})
            row = {"nested_over_off": n["nested"]["samples_per_s"] / n["off"]["samples_per_s"],
                   "nestpipe_wire_bytes_per_sample": n["auto"]["wire_bytes_per_sample"]}
            if "samples_per_s" in t:
                row.update(auto_over_torchrec=n["auto"]["samples_per_s"] / t["samples_per_s"],
                           nested_over_torchrec=n["nested"]["samples_per_s"] / t["samples_per_s"],
                           torchrec_wire_bytes_per_sample=t["wire_bytes_per_sample"],
                           wire_bytes_nestpipe_over_torchrec=n["auto"]["wire_bytes_per_sample"]
                           / t["wire_bytes_per_sample"])
            if wl == "gr" and predictions and str(world) in predictions["worlds"]:
                p = predictions["worlds"][str(world)]
                row.update(predicted_nested_over_off=p["nested_over_off"],
                           prediction_error=p["nested_over_off"] / row["nested_over_off"] - 1,
                           predicted_off_step_ms=p["off_step_ms"], predicted_nested_step_ms=p["nested_step_ms"],
                           off_step_ms=n["off"]["step_ms"], nested_step_ms=n["nested"]["step_ms"])
            out.setdefault(wl, {})[str(world)] = row
    return out


def targets(rat: Dict) -> Dict:
    """The issue's targets, evaluated on this invocation's ratios (None where a side is missing)."""
    def series(wl, key):
        return [rat.get(wl, {}).get(w, {}).get(key) for w in sorted(rat.get(wl, {}), key=int)]

    out = {}
    for wl in ("gr", "pooled"):
        s = series(wl, "auto_over_torchrec")
        out[f"{wl}_ratio_does_not_fall"] = (None if len(s) < 2 or None in s else s[-1] >= s[0])
    gr = rat.get("gr", {})
    last = gr.get(max(gr, key=int)) if gr else None
    out["gr_ratio_at_largest_world"] = last.get("auto_over_torchrec") if last else None
    b = series("gr", "wire_bytes_nestpipe_over_torchrec")
    out["gr_wire_bytes_at_most_half"] = None if not b or None in b else all(x <= 0.5 for x in b)
    e = [v.get("prediction_error") for k, v in gr.items() if int(k) > 2]
    out["prediction_within_20pct"] = None if not e or None in e else all(abs(x) <= 0.2 for x in e)
    return out


def plot(rat: Dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for wl, style in (("gr", "-"), ("pooled", "--")):
        rows = rat.get(wl, {})
        ws = sorted(rows, key=int)
        if not ws:
            continue
        x = [int(w) for w in ws]
        for key, label, marker in (("auto_over_torchrec", "NestPipe (auto) / TorchRec", "o"),
                                   ("nested_over_off", "nested / off, measured", "s"),
                                   ("predicted_nested_over_off", "nested / off, predicted from world 2", "x")):
            y = [rows[w].get(key) for w in ws]
            if all(v is not None for v in y):
                ax.plot(x, y, style, marker=marker, label=f"{wl}: {label}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks([2, 4, 8])
    ax.set_xticklabels(["2", "4", "8"])
    ax.set_xlabel("world (ranks; one shared capped link, 2 cores)")
    ax.set_ylabel("samples/s ratio")
    ax.set_title("Weak scaling behind a shared capped link")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(res: Dict, rat: Dict) -> None:
    print(f"\n{'world':>5} {'workload':8} {'NestPipe auto':>14} {'nested':>8} {'off':>8} {'TorchRec':>9} "
          f"{'auto/TR':>8} {'nest/off':>9} {'pred':>6} {'B/sample NP':>12} {'B/sample TR':>12} "
          f"{'exp.comm ms':>11} {'CPU share NP/TR':>16}")
    for r in res.values():
        for wl in ("gr", "pooled"):
            if wl not in r:
                continue
            n, t = r[wl]["nestpipe"], r[wl].get("torchrec", {})
            q = rat[wl][str(r["world"])]

            def f(x, fmt):
                return format(x, fmt) if isinstance(x, (int, float)) else "-"

            print(f"{r['world']:>5} {wl:8} {n['auto']['samples_per_s']:14.0f} {n['nested']['samples_per_s']:8.0f} "
                  f"{n['off']['samples_per_s']:8.0f} {f(t.get('samples_per_s'), '9.0f')} "
                  f"{f(q.get('auto_over_torchrec'), '8.2f')} {q['nested_over_off']:9.2f} "
                  f"{f(q.get('predicted_nested_over_off'), '6.2f')} {n['auto']['wire_bytes_per_sample']:12.0f} "
                  f"{f(t.get('wire_bytes_per_sample'), '12.0f')} {n['auto']['exposed_communication_ms']:11.1f} "
                  f"{n['auto']['compute_share']:7.2f}/{f(t.get('compute_share'), '.2f'):>8}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS), help="world sizes (the first calibrates)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--batch", type=int, default=32, help="GR: sequences per rank per batch")
    ap.add_argument("--seq-len", type=int, default=64, help="GR: tokens per sequence")
    ap.add_argument("--vocab", type=int, default=200_000, help="GR: item table rows")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--pooled-batch", type=int, default=256, help="pooled: samples per rank per batch")
    ap.add_argument("--no-pooled", dest="pooled", action="store_false", help="GR workload only")
    ap.add_argument("--rate", type=float, default=None, help="skip the cap calibration: cap in bit/s")
    ap.add_argument("--out", default="/tmp/nestpipe-scaling")
    ap.add_argument("--keep-checkpoints", action="store_true")
    ap.add_argument("--tiny", action="store_true",
                    help="a few steps of a tiny workload (checks that the harness runs; writes no record)")
    ap.add_argument("--no-record", action="store_true", help="write no record under benchmarks/results")
    ap.add_argument("--torchrec-python", default=os.environ.get("TORCHREC_PYTHON"),
                    help="a python with torchrec 1.8 + fbgemm-gpu-cpu 1.8 (scripts: benchmarks/torchrec_env.sh)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.steps, args.batch, args.seq_len, args.vocab, args.pooled_batch = 2, 8, 16, 5000, 32
    if args.worlds[0] != 2:
        raise SystemExit("--worlds: the first world calibrates the cap and the simulator and must be 2")
    if os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None:
        raise SystemExit("scaling_bench needs root, ip and tc (a network namespace with a tc tbf cap)")
    if args.torchrec_python and not os.path.exists(args.torchrec_python):
        print(f"--torchrec-python {args.torchrec_python}: not found, TorchRec side skipped")
        args.torchrec_python = None
    if not args.torchrec_python:
        print("TorchRec side skipped: pass --torchrec-python PATH (benchmarks/torchrec_env.sh builds one)")
    rec = Recorder("scaling", argv, __file__) if not (args.no_record or args.tiny) else None
    os.makedirs(args.out, exist_ok=True)
    host = describe_host()
    cores = int(host["usable_cpus"])
    print(host_line(host))
    t0 = time.time()
    shards = make_shards(args)
    print(f"shards for worlds {args.worlds}: {time.time() - t0:.1f} s")
    gr_data = {}
    if args.torchrec_python:
        for w in args.worlds:
            gr_data[w] = os.path.join(args.out, f"torchrec-gr-w{w}.npz")
            pb.torchrec_gr_data(shards[w]["gr"], gr_data[w], min(8, args.steps + 2), world=w)
    results = {"config": vars(args), "host": host, "cores": cores, "load_average_before": os.getloadavg()}
    rate, calib_run = calibrate_cap(args, shards[2]["gr"])
    results["cap_bit_per_s"], results["cap_tc"] = rate, pb.tc_line(rate)
    predictions = predict(calib_run, shards, rate, cores)
    with open(os.path.join(args.out, "predictions.json"), "w") as f:  # before any world > 2 runs
        json.dump(predictions, f, indent=1)
    print("simulator (fitted on the world-2 off run): predicted nested / off under the cap: " + ", ".join(
        f"world {w} {p['nested_over_off']:.2f}" for w, p in predictions["worlds"].items()))
    results["predictions"] = predictions
    res = {}
    pb.make_namespace(rate)
    try:
        for w in args.worlds:
            res[str(w)] = run_world(args, w, shards[w], gr_data.get(w), pb.PREFIX, cores)
            print(f"world {w}: done ({_now()})")
    finally:
        pb.drop_namespace()
    results["worlds"] = res
    rat = ratios(res, predictions)
    results["ratios"] = rat
    results["targets"] = targets(rat)
    results["load_average_after"] = os.getloadavg()
    print_table(res, rat)
    print(f"\ncap: {pb.tc_line(rate)} (one link shared by every rank, calibrated at world 2)")
    print("targets: " + json.dumps(results["targets"]))
    png = os.path.join(args.out, "scaling.png")
    plot(rat, png)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"results: {os.path.join(args.out, 'results.json')}; plot {png}")
    if rec is not None:
        docs_png = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "scaling.png")
        shutil.copyfile(png, docs_png)
        torchrec = next((r[w]["torchrec"].get("versions") for r in res.values() for w in ("gr", "pooled")
                         if w in r and r[w].get("torchrec", {}).get("versions")), None) or {}
        rec.write(json.loads(json.dumps(results, default=str)),
                  extra_versions={f"torchrec env: {k}": str(v) for k, v in torchrec.items()})
    return results


if __name__ == "__main__":
    main()
