"""Pipeline benchmark: --pipeline off vs dbp vs fwp vs nested, world size 2, (a) plain loopback and (b) a
bandwidth-capped link.

(b) runs the ranks inside a network namespace whose loopback carries a ``tc tbf`` rate cap (root only; skipped with
a message otherwise). The capped loopback is made to behave like a link of that rate: MTU 1500 and a token bucket
of 16 KB (about ten packets). With a large bucket (e.g. 256 KB on the 64 KB-MTU loopback) every pause of the
link refills the bucket, so a schedule that leaves the link idle while it computes (``off``) gets most of its bytes
through at loopback speed, while a schedule that keeps the link busy (``nested``) pays the full rate: measured here
with 2 x 70 KB All2Alls at 101 Mbit/s, 9.5 ms back to back but 1.0 ms after 10 ms pauses (0.6 ms after 30 ms); with
MTU 1500 and a 16 KB bucket, 11.5 / 10.9 / 10.6 ms (the rate: 140 KB / 12.6 MB/s = 11.1 ms). The cap is calibrated: an ``off`` run on loopback measures the bytes every rank sends to the
others per step and the non-communication (compute) time per step; the cap is the rate at which those bytes take
as long as the compute, then one ``off`` run under the cap checks it (printed: measured communication vs compute).
Without a cap the two ranks' TCP copies compete for the same cores as compute, so loopback shows little overlap.

    python benchmarks/pipeline_bench.py [--steps 20] [--batch 64] [--seq-len 100] [--micro-batches 8] [--out DIR]
        [--torchrec-python /tmp/torchrec-venv-pipe/bin/python] [--no-pooled]

Workloads. GR-shaped (the paper's setting at a configurable scale; ``--batch 128 --seq-len 200`` is the paper's):
per rank ``--batch`` sequences of ``--seq-len`` tokens, a 1M-row item table and a 256-row action table (dim 64;
the action table is replicated by NestPipe, ``embedding.replicate_max_rows``), Zipf(1.2) item ids, micro-batches
from the clustering, HSTU with one layer and 2 heads, 64 negatives shared by the batch (32 uniform + 32 in-batch
popular), sampled softmax, row-wise AdaGrad + AdamW. Pooled (the trainer's comparison workload): 8 tables x 100k
rows x dim 64, batch 1024 per rank, 15-25 ids per feature, 13 dense features, DLRM with MLPs 13-128-64 and
576-256-1, row-wise AdaGrad + AdamW.

Per network: the GR workload in every mode (and ``nested-1t``: nested with one communication thread for both
exchange groups, ``pipe.comm_threads = 1``, for comparison in the same run), the pooled workload
in ``off`` (at the default ``pipe.micro_batching = auto`` its batches train whole: DLRM's loss does not depend on the
partition), ``off-clustered`` (``off`` over the shards' micro-batches), ``nested`` and ``auto``, and, with ``--torchrec-python`` (a python with torchrec 1.8 + fbgemm-gpu-cpu 1.8, e.g.
a separate venv), TorchRec's ``TrainPipelineSparseDist`` on both workloads (``benchmarks/torchrec_runner.py``; on
the GR workload it reads the very sequences NestPipe trains on and runs NestPipe's HSTU module as its dense model).

Prints one row per (network, workload, mode): step time, samples/s, exposed communication and lookup per step, their
ratio to off, and speedup over off; the bound line (nested step vs max(CPU-bound stages, communication)); the
ratios to TorchRec. All ratios compare runs of one invocation (the machine is shared: compare within a run).
Writes DIR/results.json and keeps every run directory (trace.json, timeline.png); the runs' checkpoints are removed
unless ``--keep-checkpoints`` (they hold the tables: about 10 GB for one invocation); writes the record
``benchmarks/results/pipeline.json`` (``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from nestpipe.clustering import assign, table_fields
from nestpipe.utils.host import describe_host, host_line
from nestpipe.datasets.shards import Manifest, TableSpec, pack_tables, save_manifest, write_split_shards
from nestpipe.measure.launcher import run_plan, write_run
from nestpipe.measure.validate_local import make_gr_shards as make_gr_workload_shards

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchrec_runner  # noqa: E402 (benchmarks/ is not a package)
from record import Recorder  # noqa: E402

MODES = ("off", "dbp", "fwp", "nested")
NS = "nestpipe-bench"
PREFIX = ["ip", "netns", "exec", NS]  # a command run inside the capped namespace
WORLD = 2
POOLED = {"tables": 8, "rows": 100_000, "dim": 64, "batch": 1024, "dense": 13, "min_len": 15, "max_len": 25}
NEGATIVES = (32, 32)  # uniform, in-batch popular: 64 shared by the batch


# -- workloads ------------------------------------------------------------------------------------------------------
def make_gr_shards(out, batch, seq_len, micro_batches, vocab, batches_per_rank, zipf=1.2, seed=7, world=WORLD):
    """GR-shaped shards: item (``vocab`` rows) + action (256 rows) tokens, ``batch`` sequences of ``seq_len``; one
    train shard per rank of ``world`` (the simulator's validation harness writes the same workload)."""
    return make_gr_workload_shards(out, batch, seq_len, micro_batches, vocab, batches_per_rank, n_shards=world,
                                   zipf=zipf, seed=seed)


def make_pooled_shards(out, micro_batches, batches_per_rank, seed=11, world=WORLD, pooled=None):
    """The pooled comparison workload (``pooled``: :data:`POOLED` by default) as CTR shards, one train shard per
    rank of ``world`` (micro-batches from the clustering of table t0), the tables in one packed group as ``nestpipe
    ingest`` writes its bag tables (six tar members instead of six per table)."""
    P = pooled or POOLED
    rng = np.random.default_rng(seed)
    names = [f"t{i}" for i in range(P["tables"])]
    tables = {t: TableSpec(P["rows"], P["dim"], "pooled") for t in names}

    def record(split, index):
        B = P["batch"]
        feats = []
        for _t in names:
            lens = rng.integers(P["min_len"], P["max_len"] + 1, size=B).astype(np.int32)
            feats.append((rng.integers(0, P["rows"], size=int(lens.sum())).astype(np.int64), lens))
        off0 = np.concatenate([[0], np.cumsum(feats[0][1])]).astype(np.int64)
        mb = assign(feats[0][0], off0, micro_batches, seed=index).astype(np.int32)
        rec = {"meta": {"index": index, "split": split, "task": "ctr", "samples": B,
                        "micro_batches": micro_batches}, "mb": mb}
        for t, (v, lens) in zip(names, feats):
            for f, arr in table_fields(v, lens, mb).items():
                rec[f"{t}.{f}"] = arr
        d = rng.normal(size=(B, P["dense"])).astype(np.float32)
        rec["dense"] = d
        rec["labels"] = (rng.random(B) < 1 / (1 + np.exp(-0.8 * d[:, 0]))).astype(np.float32)[:, None]
        return pack_tables(rec, "bags", names)

    sets_ = write_split_shards(out, (("train", [batches_per_rank] * world), ("eval", [1])), P["batch"], record)
    save_manifest(out, Manifest(task="ctr", batch_size=P["batch"], micro_batches=micro_batches, tables=tables,
                                sets=sets_, dense_features=[f"d{i}" for i in range(P["dense"])], labels=["is_click"]))


def torchrec_gr_data(shards, path, batches, world=WORLD):
    """Per rank, the first ``batches`` batches that rank trains in NestPipe (item and action token sequences)."""
    from nestpipe.trainer.data import ShardStream

    out = {"batches": np.array(batches)}
    for r in range(world):
        recs = ShardStream(shards, "train", r, world, verify=False).records(0)
        for k in range(batches):
            _, rec, _ = next(recs)
            out[f"r{r}_b{k}_lengths"] = np.asarray(rec["item.lengths"])
            out[f"r{r}_b{k}_item"] = np.asarray(rec["item.values"])
            out[f"r{r}_b{k}_action"] = np.asarray(rec["action.values"])
    np.savez(path, **out)


def sets(args, workload="gr"):
    if workload == "pooled":
        return {"embedding": {"replicate_max_rows": 0, "dim": 64},
                "dlrm": {"bottom_mlp": [128, 64], "top_mlp": [256], "cross_layers": 0},
                "pipe": {"gantt_steps": 3, "trace_steps": args.steps}}
    return {"embedding": {"replicate_max_rows": 300, "dim": 64}, "hstu": {
        "num_layers": 1, "num_heads": 2, "linear_dim": 32, "max_seq_len": args.seq_len,
        "num_random_negatives": NEGATIVES[0], "num_popular_negatives": NEGATIVES[1]},
        "pipe": {"gantt_steps": 3, "trace_steps": args.steps}}


def rotated(modes, k):
    """``modes`` started at position k (round k of ``--repeats``): no schedule always runs last in its round, when
    the machine has been busiest longest."""
    modes = tuple(modes)
    k %= max(len(modes), 1)
    return modes[k:] + modes[:k]


def run_modes(args, shards, tag, prefix=None, modes=MODES, workload="gr", env=None, world=WORLD, pipe_sets=None):
    """Train ``modes`` on ``shards`` in one launch of ``world`` ranks (``prefix``: e.g. into the capped namespace);
    ``pipe_sets``: extra ``pipe`` settings for every run. Returns each mode's metrics.json."""
    # a short unreported run first: one-off costs of a launch (imports, JIT-compiled kernels loaded, allocator) are
    # not charged to whichever mode happens to run first
    warm = os.path.join(args.out, f"{tag}-warmup")
    shutil.rmtree(warm, ignore_errors=True)
    write_run(warm, shards, "hstu" if workload == "gr" else "dlrm", "off", 3, sets(args, workload))
    plan = [{"run": warm}]
    runs = {}
    for m in modes:
        run = os.path.join(args.out, f"{tag}-{m}")
        shutil.rmtree(run, ignore_errors=True)
        cfg = sets(args, workload)
        cfg["pipe"].update(pipe_sets or {})
        if m.endswith("-1t"):
            cfg["pipe"]["comm_threads"] = 1  # the one-comm-thread FWP layout
        if m.endswith("-clustered"):
            cfg["pipe"]["micro_batching"] = "clustered"  # the shards' micro-batches (the default trains off's whole)
        write_run(run, shards, "hstu" if workload == "gr" else "dlrm", m.split("-")[0], args.steps, cfg)
        plan.append({"run": run})
        runs[m] = run
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        p = run_plan(plan, world, os.path.join(args.out, f"plan-{tag}.json"), timeout=3600, prefix=prefix)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if p.returncode != 0:
        sys.exit(f"{tag}: training failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    if not args.keep_checkpoints:  # each GR run's final checkpoint holds the 1M-row table: ~0.5 GB a run
        for r in [warm, *runs.values()]:
            shutil.rmtree(os.path.join(r, "checkpoints"), ignore_errors=True)
    return {m: json.load(open(os.path.join(r, "metrics.json"))) for m, r in runs.items()}


def run_network(args, shards, tag, prefix=None, round_index=0):
    """Everything measured on one network: the GR workload in every mode (+ nested-1t), the pooled workload in off,
    off-clustered, nested and auto, TorchRec on both. Round k runs the modes in an order rotated by k."""
    gr_modes = rotated(tuple(MODES) + ("nested-1t", "auto"), round_index)
    out = {"gr": run_modes(args, shards["gr"], f"{tag}-gr", prefix, modes=gr_modes)}
    if shards.get("pooled"):
        out["pooled"] = run_modes(args, shards["pooled"], f"{tag}-pooled", prefix,
                                  modes=rotated(("off", "off-clustered", "nested", "auto"), round_index),
                                  workload="pooled")
    if args.torchrec_python:
        tr = {}
        common = {"warmup": 3, "steps": args.steps, "timeout": 1500}
        gr = dict(common, workload="gr", data=shards["gr_data"], dim=64, item_rows=args.vocab,
                  max_seq_len=args.seq_len, negatives=sum(NEGATIVES),
                  hstu=sets(args)["hstu"])  # the very HSTU options NestPipe's runs use
        workloads = {"gr": gr, **({"pooled": dict(common, workload="pooled", **POOLED)} if shards.get("pooled") else {})}
        try:
            for w, params in workloads.items():
                # TorchRec's default planner's plan and every table row-wise: NestPipe is compared with the faster
                runs = [torchrec_runner.run(args.torchrec_python, dict(params, sharding=plan), prefix)
                        for plan in ("default", "row_wise")]
                tr[w] = dict(max(runs, key=lambda r: r["samples_per_s"]), plans_run=runs)
        except Exception as e:  # noqa: BLE001 - reported, the rest of the benchmark stands
            tr["error"] = str(e)[-3000:]
            print(f"TorchRec failed: {str(e)[-1500:]}")
        out["torchrec"] = tr
    return out


def run_network_repeated(args, shards, tag, prefix=None):
    """``--repeats`` rounds of :func:`run_network` (every round runs every mode and system once, so the machine's
    load drifts over all of them alike); per (workload, mode) the round with the median samples/s is reported, every
    round is kept under ``rounds``."""
    rounds = [run_network(args, shards, tag, prefix, k) for k in range(args.repeats)]
    if len(rounds) == 1:
        return rounds[0]
    out = {"rounds": rounds}
    # speedup over off within each round (the most robust figure on a shared machine)
    out["speedup_rounds"] = {w: {m: [r[w]["off"]["step_s"] / r[w][m]["step_s"] for r in rounds] for m in rounds[0][w]}
                             for w in rounds[0] if w != "torchrec"}
    for key in rounds[0]:
        if key == "torchrec":
            tr = {}
            for w in rounds[0][key]:
                vals = [r[key][w] for r in rounds if isinstance(r[key].get(w), dict)]
                if vals:
                    tr[w] = sorted(vals, key=lambda v: v["samples_per_s"])[len(vals) // 2]
                    tr[w]["samples_per_s_rounds"] = [v["samples_per_s"] for v in vals]
            out[key] = tr
            continue
        if key == "speedup_rounds":
            continue
        out[key] = {}
        for m in rounds[0][key]:
            vals = sorted((r[key][m] for r in rounds), key=lambda v: v["samples_per_s"])
            med = dict(vals[len(vals) // 2])
            med["samples_per_s_rounds"] = [r[key][m]["samples_per_s"] for r in rounds]
            out[key][m] = med
    return out


def round_lines(res, title):
    if "speedup_rounds" not in res:
        return
    for w, modes in res["speedup_rounds"].items():
        print(f"{title}, {w}: speedup over off within each round: " + "; ".join(
            f"{m} {', '.join(f'{x:.2f}' for x in v)}" for m, v in modes.items() if m != "off"))
    tr = res.get("torchrec", {})
    for w in ("gr", "pooled"):
        if w in tr and "rounds" in res and all(isinstance(r.get("torchrec", {}).get(w), dict) for r in res["rounds"]):
            v = [r[w]["nested"]["samples_per_s"] / r["torchrec"][w]["samples_per_s"] for r in res["rounds"]]
            print(f"{title}, {w}: nested / TorchRec within each round: {', '.join(f'{x:.2f}' for x in v)}")


def torchrec_lines(res, title):
    tr = res.get("torchrec")
    if tr is None:
        print(f"{title}: TorchRec skipped (pass --torchrec-python PATH: a python with torchrec 1.8 + fbgemm-gpu-cpu 1.8)")
        return {}
    out = {}
    for w in ("gr", "pooled"):
        if w not in tr or w not in res:
            continue
        t, n, o, a = tr[w], res[w]["nested"], res[w]["off"], res[w].get("auto")
        r = n["samples_per_s"] / t["samples_per_s"]
        t_cpu = t.get("cpu_ms_per_step_per_rank")
        out[w] = {"torchrec_samples_per_s": t["samples_per_s"], "torchrec_ms_per_step": t["ms_per_step"],
                  "nested_samples_per_s": n["samples_per_s"], "off_samples_per_s": o["samples_per_s"],
                  "nested_over_torchrec": r, "off_over_torchrec": o["samples_per_s"] / t["samples_per_s"],
                  "torchrec_sharding": t["sharding"], "torchrec_plan": t.get("plan"),
                  "torchrec_versions": t.get("versions"),
                  "torchrec_cpu_ms_per_step_per_rank": t_cpu}
        for name, m in (("off", o), ("nested", n), ("auto", a)):
            if m is None:
                continue
            cpu_ms = 1e3 * sum(g["cpu_s"] / max(g["measured_steps"], 1) for g in m["per_rank"]) / len(m["per_rank"])
            out[w][f"{name}_cpu_ms_per_step_per_rank"] = cpu_ms
            if t_cpu:
                out[w][f"{name}_over_torchrec_cpu"] = (sum(t_cpu) / len(t_cpu)) / cpu_ms
        if a is not None:
            out[w]["default_schedule"] = a["pipeline_choice"]
            out[w]["auto_over_torchrec"] = a["samples_per_s"] / t["samples_per_s"]
            print(f"{title}, {w}: NestPipe default schedule (auto -> {a['pipeline']}: {a['pipeline_choice']['reason']}; "
                  f"{a.get('micro_batches')} micro-batch(es) per batch, pipe.micro_batching -> "
                  f"{a.get('micro_batching')}) {a['samples_per_s']:.0f} samples/s: default / TorchRec = {out[w]['auto_over_torchrec']:.2f} in "
                  f"samples/s, {out[w].get('auto_over_torchrec_cpu', float('nan')):.2f} in CPU time per step")
        if "samples_per_s_rounds" in t:
            print(f"{title}, {w}: TorchRec samples/s per round: "
                  f"{', '.join(f'{x:.0f}' for x in t['samples_per_s_rounds'])}")
        print(f"{title}, {w}: TorchRec TrainPipelineSparseDist ({'/'.join(t['sharding'])}) {t['samples_per_s']:.0f} "
              f"samples/s ({t['ms_per_step']:.1f} ms/step); NestPipe nested {n['samples_per_s']:.0f}, off "
              f"{o['samples_per_s']:.0f}: nested / TorchRec = {r:.2f}, off / TorchRec = "
              f"{out[w]['off_over_torchrec']:.2f}")
    return out


def bytes_per_step(metrics):
    """Bytes all ranks together send over the link per step (every rank's traffic crosses the one loopback)."""
    return sum(sum(r["network_bytes"].values()) / max(r["measured_steps"], 1) for r in metrics["per_rank"])


def compute_s_per_step(metrics):
    return metrics["step_s"] - metrics["exposed_communication_s_per_step"]


def ns(*cmd, check=True):
    return subprocess.run(["ip", "netns", "exec", NS, *cmd], check=check, capture_output=True, text=True)


LINK_MTU, LINK_BURST, LINK_LATENCY = 1500, "16kb", "500ms"


def set_link_mtu(mtu: int) -> None:
    global LINK_MTU
    if not 576 <= mtu <= 16384:
        raise SystemExit(f"--link-mtu {mtu}: must be in [576, 16384] (the token bucket holds 16 KB)")
    LINK_MTU = mtu


def tc_line(rate_bit) -> str:
    return (f"ip link set lo mtu {LINK_MTU}; tc qdisc add dev lo root tbf rate {int(rate_bit)}bit burst {LINK_BURST} "
            f"latency {LINK_LATENCY}")


def make_namespace(rate_bit):
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    subprocess.run(["ip", "netns", "add", NS], check=True)
    ns("ip", "link", "set", "lo", "up")
    ns("ip", "link", "set", "lo", "mtu", str(LINK_MTU))
    ns("tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{int(rate_bit)}bit", "burst", LINK_BURST,
       "latency", LINK_LATENCY)


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
              f"{off['step_s'] / r['step_s']:8.2f}"
              + (f"   samples/s per round: {', '.join(f'{x:.0f}' for x in r['samples_per_s_rounds'])}"
                 if "samples_per_s_rounds" in r else ""))


def cpu_stages_s_per_step(metrics):
    """Sum of the CPU-bound stages per step (mean over ranks): all the work of a rank that is not waiting on the
    network, wherever it ran (data, h2d, routing bookkeeping, retrieval, owner and requester work, dense forward/
    backward, updates, dual-buffer sync). Each rank has about one core here, so this is the CPU floor of a step."""
    out = []
    for r in metrics["per_rank"]:
        st, n = r["stages_s"], max(r["measured_steps"], 1)
        route_cpu = st.get("route.total", 0.0) - st.get("route.comm", 0.0)
        keys = ("prefetch", "h2d", "retrieve", "embed.owner", "embed.requester", "grad.owner", "dense.fwd_bwd",
                "update.dense", "update.sparse", "dbp.sync")
        out.append((sum(st.get(k, 0.0) for k in keys) + max(route_cpu, 0.0)) / n)
    return sum(out) / len(out)


def bound_line(res, rate, n_mb):
    """nested step vs max(sum of the CPU-bound stages, communication time), both taken from the off run of the same
    network (off does every stage and every collective one after another, so its figures are the work itself), and,
    under a cap, the link floor (all ranks' bytes per step / rate)."""
    off, nested = res["off"], res.get("nested")
    cpu = cpu_stages_s_per_step(off)
    comm = off["exposed_communication_s_per_step"]
    floor = bytes_per_step(off) * 8 / rate if rate else 0.0
    bound = max(cpu, comm, floor)
    out = {"cpu_stages_s": cpu, "communication_s": comm, "link_floor_s": floor, "bound_s": bound}
    if nested:
        out["nested_step_s"] = nested["step_s"]
        out["nested_over_bound"] = nested["step_s"] / bound
        n = nested
        out["exposed_comm_over_total_comm"] = (n["exposed_communication_s_per_step"] / n["communication_s_per_step"]
                                               if n["communication_s_per_step"] else None)
        out["exposed_comm_over_off_comm"] = n["exposed_communication_s_per_step"] / comm if comm else None
        out["exposed_lookup_over_off_lookup"] = (n["exposed_lookup_s_per_step"] / off["exposed_lookup_s_per_step"]
                                                 if off["exposed_lookup_s_per_step"] else None)
        print(f"bound: max(CPU-bound stages {cpu * 1e3:.1f} ms, communication {comm * 1e3:.1f} ms"
              + (f", link floor {floor * 1e3:.1f} ms" if rate else "") + f") = {bound * 1e3:.1f} ms per step; "
              f"nested {n['step_s'] * 1e3:.1f} ms = {out['nested_over_bound']:.2f}x the bound (target <= 1.25)")
        print(f"nested exposed communication: {out['exposed_comm_over_total_comm']:.2f} of its own communication "
              f"time, {out['exposed_comm_over_off_comm']:.2f} of off's (target <= 2/N = {2 / n_mb:.2f}); exposed lookup "
              f"{out['exposed_lookup_over_off_lookup']:.2f} of off's (target <= 0.10)")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64, help="GR: sequences per rank per batch")
    ap.add_argument("--seq-len", type=int, default=100, help="GR: tokens per sequence")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1_000_000, help="GR: item table rows")
    ap.add_argument("--out", default="/tmp/nestpipe-pipeline-bench")
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep every run's checkpoints (about 0.5 GB per GR run; removed after each plan otherwise)")
    ap.add_argument("--rate", type=float, default=None, help="skip calibration: cap in bit/s")
    ap.add_argument("--no-pooled", action="store_true", help="skip the pooled workload")
    ap.add_argument("--repeats", type=int, default=1, help="rounds per network; the median round is reported")
    ap.add_argument("--no-cap", action="store_true", help="skip (b)")
    ap.add_argument("--link-mtu", type=int, default=LINK_MTU,
                    help="MTU of the capped loopback (the token bucket holds 16 KB, so at most 16384)")
    ap.add_argument("--torchrec-python", default=os.environ.get("TORCHREC_PYTHON"),
                    help="a python with torchrec 1.8 + fbgemm-gpu-cpu 1.8 (e.g. /tmp/torchrec-venv-pipe/bin/python)")
    args = ap.parse_args(argv)
    rec = Recorder("pipeline", argv, __file__)
    set_link_mtu(args.link_mtu)
    if args.torchrec_python and not os.path.exists(args.torchrec_python):
        print(f"--torchrec-python {args.torchrec_python}: not found, TorchRec comparison skipped")
        args.torchrec_python = None
    os.makedirs(args.out, exist_ok=True)
    per_rank = args.steps + 2
    shards = {"gr": os.path.join(args.out, f"shards-gr-{args.batch}x{args.seq_len}-mb{args.micro_batches}-s{per_rank}")}
    if not os.path.exists(os.path.join(shards["gr"], "manifest.json")):
        t0 = time.time()
        make_gr_shards(shards["gr"], args.batch, args.seq_len, args.micro_batches, args.vocab, per_rank)
        print(f"GR shards: {time.time() - t0:.1f} s")
    if not args.no_pooled:
        shards["pooled"] = os.path.join(args.out, f"shards-pooled-mb{args.micro_batches}-s{per_rank}")
        if not os.path.exists(os.path.join(shards["pooled"], "manifest.json")):
            t0 = time.time()
            make_pooled_shards(shards["pooled"], args.micro_batches, per_rank)
            print(f"pooled shards: {time.time() - t0:.1f} s")
    if args.torchrec_python:
        shards["gr_data"] = os.path.join(args.out, "torchrec-gr-data.npz")
        torchrec_gr_data(shards["gr"], shards["gr_data"], min(8, per_rank))
    import importlib.metadata as md

    host = describe_host()
    print(host_line(host))
    results = {"config": vars(args), "load_average_before": os.getloadavg(), "threads_per_rank": 1, "host": host,
               "nestpipe_versions": {n: md.version(n) for n in ("torch", "fbgemm-gpu-cpu", "numba", "numpy")}}
    lo = run_network_repeated(args, shards, "loopback")
    results["loopback"] = lo
    table("(a) plain loopback, world 2, GR-shaped", lo["gr"])
    results["loopback_bound"] = bound_line(lo["gr"], None, args.micro_batches)
    if "pooled" in lo:
        table("(a) plain loopback, world 2, pooled", lo["pooled"])
    results["loopback_torchrec"] = torchrec_lines(lo, "(a) loopback")
    round_lines(lo, "(a) loopback")
    if args.no_cap:
        pass
    elif os.geteuid() != 0 or shutil.which("tc") is None:
        print("(b) bandwidth-capped link skipped: needs root and tc (ip netns + tc tbf)")
    else:
        off = lo["gr"]["off"]
        B, C = bytes_per_step(off), compute_s_per_step(off)
        rate = args.rate or B * 8 / C
        print(f"\ncalibration (GR workload): {B / 1e6:.2f} MB per step over the link, compute {C * 1e3:.1f} ms per "
              f"step -> cap {rate / 1e6:.0f} Mbit/s")
        prefix = PREFIX
        try:
            make_namespace(rate)
            if not args.rate:  # one refinement: communication time scales ~ 1 / rate
                check = run_modes(args, shards["gr"], "cap-calib", prefix, modes=("off",))["off"]
                cc, cm = check["exposed_communication_s_per_step"], compute_s_per_step(check)
                if cc > 0:
                    rate = rate * cc / cm
                    print(f"under the first cap: communication {cc * 1e3:.1f} ms vs compute {cm * 1e3:.1f} ms per "
                          f"step; refined cap {rate / 1e6:.0f} Mbit/s")
                    make_namespace(rate)
            cap = run_network_repeated(args, shards, "cap", prefix)
        finally:
            drop_namespace()
        off = cap["gr"]["off"]
        print(f"\ncap: {tc_line(rate)}; off under the cap: "
              f"communication {off['exposed_communication_s_per_step'] * 1e3:.1f} ms vs compute "
              f"{compute_s_per_step(off) * 1e3:.1f} ms per step")
        results["cap_bit_per_s"] = rate
        results["cap_tc"] = tc_line(rate)
        results["capped"] = cap
        table(f"(b) capped loopback ({rate / 1e6:.0f} Mbit/s), world 2, GR-shaped", cap["gr"])
        results["capped_bound"] = bound_line(cap["gr"], rate, args.micro_batches)
        if "pooled" in cap:
            table(f"(b) capped loopback ({rate / 1e6:.0f} Mbit/s), world 2, pooled", cap["pooled"])
        results["capped_torchrec"] = torchrec_lines(cap, "(b) capped")
        round_lines(cap, "(b) capped")
    results["load_average_after"] = os.getloadavg()
    print(f"load average before {results['load_average_before']}, after {results['load_average_after']}")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"\nresults: {os.path.join(args.out, 'results.json')}; traces and timeline.png in {args.out}/*-nested")
    torchrec = next((w.get("torchrec_versions") for w in (results.get("loopback_torchrec") or {}).values()
                     if w.get("torchrec_versions")), None) or {}
    rec.write(json.loads(json.dumps(results, default=str)),
              extra_versions={f"torchrec env: {k}": str(v) for k, v in torchrec.items()})


if __name__ == "__main__":
    main()
