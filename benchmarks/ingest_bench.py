"""Ingest throughput and peak memory against bare Polars and the pandas way, each tool in its own subprocess.

    python benchmarks/ingest_bench.py --sizes 5000000 --repeats 3 --workdir /tmp/ingest-bench
    python benchmarks/ingest_bench.py --sizes 30000000 --tools "ingest gr" "ingest ctr" "bare polars"
    python benchmarks/ingest_bench.py --sizes 30000000 --engines local dask     # = --tools "ingest gr" "ingest gr dask"
    python benchmarks/ingest_bench.py --scale 27k --sizes 50000000 --engines dask

For each size: synthetic KuaiRand logs (`--scale`'s vocabulary, `medium` by default; N interactions), then rows/s and peak RSS of
`ingest --task gr`, `ingest --task ctr`, a bare Polars `scan_csv(...).sink_parquet(...)` of the same logs, and
(at sizes <= 5M only; it needs about 3.3 GiB there) pandas `read_csv` + sort + `groupby("user_id").agg(list)` on
every column, the way popular open-source GR preprocessors do it. pandas is only needed here (`pip install pandas`;
left out where it is not installed).
`ingest gr dask` (only when named in --tools): the gr ingest with `--engine dask` (a LocalCluster of --workers
processes); its seconds and peak RSS (driver with the scheduler, nannies and workers) over the local engine's.
Rows are log rows. Peak RSS is the maximum over the tool's process tree, sampled every 50 ms; the largest single
process's peak (for the Dask engine: the largest worker, nanny or driver) is printed beside it.

Writes the record ``benchmarks/results/ingest.json`` (``benchmarks/record.py``): every repeat's figures and ratios.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import Recorder  # noqa: E402

BARE_POLARS = r"""
import glob, sys, polars as pl
from nestpipe.datasets.kuairand import LOG_DTYPES
files = sorted(glob.glob(sys.argv[1] + "/log_*.csv"))
pl.scan_csv(files, schema=LOG_DTYPES).sink_parquet(sys.argv[2])
"""

PANDAS = r"""
import glob, sys, pandas as pd
files = sorted(glob.glob(sys.argv[1] + "/log_*.csv"))
df = pd.concat([pd.read_csv(f) for f in files], ignore_index=True)
df = df.sort_values(["user_id", "time_ms"])
seqs = df.groupby("user_id").agg(list)  # every column to per-user lists, as GR preprocessors do
print(len(seqs))
"""


def measure(cmd, env=None):
    """Run ``cmd``; return (seconds, peak RSS bytes over the process tree, returncode, the largest peak RSS of one
    process of the tree)."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ps = psutil.Process(proc.pid)
    peak, per_process = 0, {}
    while proc.poll() is None:
        try:
            procs = [ps] + ps.children(recursive=True)
            rss = {p.pid: p.memory_info().rss for p in procs}
            peak = max(peak, sum(rss.values()))
            for pid, r in rss.items():
                per_process[pid] = max(per_process.get(pid, 0), r)
        except psutil.Error:
            pass
        time.sleep(0.05)
    err = proc.stderr.read().decode(errors="replace")
    if proc.returncode != 0:
        print(err[-2000:], file=sys.stderr)
    return time.time() - t0, peak, proc.returncode, max(per_process.values(), default=0)


def log_rows(raw):
    n = 0
    for f in glob.glob(os.path.join(raw, "log_*.csv")):
        with open(f, "rb") as fh:
            n += sum(buf.count(b"\n") for buf in iter(lambda: fh.read(1 << 24), b"")) - 1
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[5_000_000, 30_000_000])
    ap.add_argument("--scale", default="medium", help="synth scale of the vocabulary (medium, 27k)")
    ap.add_argument("--engines", nargs="+", choices=["local", "dask"], default=None,
                    help="the gr ingest on these engines only (local = 'ingest gr', dask = 'ingest gr dask')")
    ap.add_argument("--workdir", default="/tmp/nestpipe-ingest-bench")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--pandas-max", type=int, default=5_000_000)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every tool this many times per size (interleaved); ratios are per repeat, then the "
                         "median and range are printed")
    ap.add_argument("--tools", nargs="+", default=None,
                    help="subset of tools to run (names as printed, e.g. 'ingest gr' 'bare polars')")
    args = ap.parse_args()
    rec = Recorder("ingest", script=__file__)
    if args.engines:
        args.tools = [{"local": "ingest gr", "dask": "ingest gr dask"}[e] for e in args.engines]
    py = sys.executable
    results = []
    for n in args.sizes:
        raw = os.path.join(args.workdir, f"raw-{n}" if args.scale == "medium" else f"raw-{args.scale}-{n}")
        if not os.path.exists(os.path.join(raw, "user_features_27k.csv")):
            subprocess.run([py, "-m", "nestpipe", "synth", "--out", raw, "--scale", args.scale, "--interactions",
                            str(n), "--force"], check=True)
        rows = log_rows(raw)
        tools = {
            "ingest gr": [py, "-m", "nestpipe", "ingest", "--raw", raw, "--out", os.path.join(args.workdir, "gr"),
                          "--task", "gr", "--batch-size", "512", "--micro-batches", "8", "--force", "--quiet",
                          "--workers", str(args.workers)],
            "ingest ctr": [py, "-m", "nestpipe", "ingest", "--raw", raw, "--out", os.path.join(args.workdir, "ctr"),
                           "--task", "ctr", "--batch-size", "512", "--micro-batches", "8", "--force", "--quiet",
                           "--workers", str(args.workers)],
            "bare polars": [py, "-c", BARE_POLARS, raw, os.path.join(args.workdir, "bare.parquet")],
            # the same gr ingest on a LocalCluster of --workers processes (--engine dask)
            "ingest gr dask": [py, "-m", "nestpipe", "ingest", "--raw", raw, "--out",
                               os.path.join(args.workdir, "gr-dask"), "--task", "gr", "--batch-size", "512",
                               "--micro-batches", "8", "--force", "--quiet", "--workers", str(args.workers),
                               "--engine", "dask"],
        }
        if "ingest gr dask" not in (args.tools or []):
            tools.pop("ingest gr dask")  # only when asked for: --tools "ingest gr" "ingest gr dask"
        if n <= args.pandas_max and importlib.util.find_spec("pandas") is not None:
            tools["pandas groupby"] = [py, "-c", PANDAS, raw]
        if args.tools:
            tools = {k: v for k, v in tools.items() if k in args.tools}
        reps = []
        for rep in range(args.repeats):
            row = {"rows": rows, "repeat": rep, "loadavg_before": round(os.getloadavg()[0], 2)}
            for name, cmd in tools.items():
                secs, peak, rc, one = measure(cmd)
                row[name] = {"seconds": round(secs, 2), "rows_per_s": round(rows / secs), "peak_rss_gib":
                             round(peak / 2**30, 3), "peak_rss_one_process_gib": round(one / 2**30, 3), "ok": rc == 0}
                print(f"{n:>11,} rows  {name:<15} {secs:8.1f} s  {rows / secs:>12,.0f} rows/s  "
                      f"peak RSS {peak / 2**30:6.2f} GiB (largest process {one / 2**30:.2f})  "
                      f"{'ok' if rc == 0 else 'FAILED'}", flush=True)
            row["loadavg_after"] = round(os.getloadavg()[0], 2)
            ratios = {}
            bare = row.get("bare polars", {}).get("rows_per_s")
            for task in ("gr", "ctr"):
                if bare and f"ingest {task}" in row:
                    ratios[f"{task}_vs_bare_polars"] = round(row[f"ingest {task}"]["rows_per_s"] / bare, 3)
            if "ingest gr dask" in row and "ingest gr" in row:
                ratios["gr_dask_over_local_seconds"] = round(row["ingest gr dask"]["seconds"] / row["ingest gr"]["seconds"], 3)
                ratios["gr_dask_over_local_peak_rss"] = round(
                    row["ingest gr dask"]["peak_rss_gib"] / row["ingest gr"]["peak_rss_gib"], 3)
            if "pandas groupby" in row and "ingest gr" in row:
                ratios["gr_vs_pandas"] = round(row["ingest gr"]["rows_per_s"] / row["pandas groupby"]["rows_per_s"], 3)
            row["ratios"] = ratios
            print(f"  repeat {rep}: ratios {ratios}  load average {row['loadavg_before']} -> {row['loadavg_after']}",
                  flush=True)
            reps.append(row)
            if not args.keep:
                for d in ("gr", "ctr", "gr-dask", "bare.parquet"):
                    p = os.path.join(args.workdir, d)
                    shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else (os.path.exists(p) and os.remove(p))
        summary = {}
        for key in reps[0]["ratios"]:
            vals = sorted(r["ratios"][key] for r in reps)
            summary[key] = {"median": vals[len(vals) // 2] if len(vals) % 2 else
                            round((vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2, 3),
                            "min": vals[0], "max": vals[-1]}
        for name in tools:
            secs = sorted(r[name]["seconds"] for r in reps)
            summary[name] = {"median_s": secs[len(secs) // 2], "min_s": secs[0], "max_s": secs[-1],
                             "peak_rss_gib_max": max(r[name]["peak_rss_gib"] for r in reps)}
        print(f"  {n:,} rows, {len(reps)} repeat(s): {json.dumps(summary)}", flush=True)
        results.append({"rows": rows, "repeats": reps, "summary": summary})
    print(json.dumps(results, indent=1))
    rec.write({"scale": args.scale, "workers": args.workers, "sizes": results})


if __name__ == "__main__":
    main()
