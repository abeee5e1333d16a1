"""Render docs/benchmarks.md and README.md's results blocks from the benchmark records under ``benchmarks/results/``.

    python benchmarks/report.py           # rewrite docs/benchmarks.md and the blocks between the markers in README.md
    python benchmarks/report.py --check   # exit 1 (naming the file) where either differs from the records

Only a benchmark writes a record (``benchmarks/record.py``: command, commit, host, versions, load, figures), and only
this script writes docs/benchmarks.md and the README blocks, so no figure there can be edited by hand and go stale
(``tests/test_report.py`` renders both and fails on a difference). Every section shows the latest record of its
benchmark; a benchmark without a record shows the command that makes one. A README block is the text between
``<!-- BEGIN results:NAME -->`` and ``<!-- END results:NAME -->``.

README blocks: ``quality`` (``real_quality.py`` records: the models and the baselines on real public data, per
dataset, the eval split where a record of it exists, else the valid split), ``quality-synthetic`` (the
``quality_bench.py`` record of the synthetic demo data with the defaults) and ``summary`` (one line per benchmark
record: its headline ratios, measured within one run).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
from typing import Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs", "benchmarks.md")
BLOCK = re.compile(r"(<!-- BEGIN results:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END results:(?P=name) -->)", re.S)


def _records(pattern: str, results: str) -> List[Dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(results, pattern))):
        with open(path) as f:
            rec = json.load(f)
        rec["_file"] = os.path.relpath(path, ROOT) if os.path.abspath(path).startswith(ROOT) else path
        out.append(rec)
    return out


def _record(name: str, results: str) -> Optional[Dict]:
    recs = _records(f"{name}.json", results)
    return recs[0] if recs else None


def _at(rec: Dict) -> str:
    return rec["commit"][:12] + (" (with uncommitted changes)" if rec["commit"].endswith("+dirty") else "")


def _load(rec: Dict) -> str:
    def one(x):
        return f"{x[0]:.2f}" if isinstance(x, (list, tuple)) else f"{x:.2f}"

    if "load_before" not in rec:
        return ""
    return f"load {one(rec['load_before'])} -> {one(rec['load_after'])}"


LIBS = ("torch", "numpy", "numba", "fbgemm-gpu-cpu")


def provenance(rec: Dict, libs=LIBS) -> str:
    """The record's line: commit, date, host, versions, load, wall time (the command is shown above it)."""
    v = rec.get("versions", {})
    vers = ", ".join(f"{k} {v[k]}" for k in ("python", *libs) if k in v)
    extra = ", ".join(f"{k[len('torchrec env: '):]} {val}" for k, val in v.items() if k.startswith("torchrec env: ")
                      and k[len("torchrec env: "):] in ("torchrec", "fbgemm-gpu-cpu", "torch"))
    parts = [f"at {_at(rec)}"]
    if rec.get("date"):
        parts.append(rec["date"][:10])
    host = f"on {rec['host']}"
    if rec.get("cpu"):
        host += f" ({rec['cpu']}, {rec['cpus']} cores)"
    else:
        host += f" ({rec['cpus']} cores)"
    parts.append(host)
    line = ", ".join(parts) + f"; {vers}" + (f"; TorchRec environment: {extra}" if extra else "")
    tail = [x for x in (_load(rec), f"{rec['seconds']:.0f} s" if rec.get("seconds") else "") if x]
    if tail:
        line += "; " + ", ".join(tail)
    out = f"Record `{rec['_file']}`, measured {line}."
    # the load at the start only: the end's 1-minute average counts the benchmark's own processes (8 ranks, say)
    before = rec.get("load_before")
    before = before[0] if isinstance(before, (list, tuple)) else before
    if before and before > rec["cpus"]:
        out += (" The load average was above the core count when it started: other work shared the cores, so "
                "absolute times are slow and ratios scatter more than on a quiet machine.")
    return out


def _table(header: List[str], rows: List[List]) -> List[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------------------------------------ sections
# Each: (record name, title, the command that makes the record, what is measured, render(rec) -> lines, caveats,
# summary(rec) -> one line for README). Text beside a table states no figure: figures come from the record only.

def ingest_lines(rec: Dict) -> List[str]:
    f = rec["figures"]
    lines = []
    for size in f["sizes"]:
        reps = size["repeats"]
        tools = [k for k in reps[0] if isinstance(reps[0][k], dict) and "seconds" in reps[0][k]]
        rows = []
        for t in tools:
            secs = [r[t]["seconds"] for r in reps]
            rows.append([t, " / ".join(f"{s:.1f}" for s in secs), f"{_med([r[t]['rows_per_s'] for r in reps]):,.0f}",
                         f"{max(r[t]['peak_rss_gib'] for r in reps):.2f}",
                         f"{max(r[t]['peak_rss_one_process_gib'] for r in reps):.2f}"])
        lines.append(f"{size['rows']:,} log rows, {len(reps)} interleaved repeat(s), `--workers {f['workers']}`:")
        lines.append("")
        lines += _table(["tool", "seconds per repeat", "rows/s (median)", "peak RSS GiB, process tree",
                         "largest process GiB"], rows)
        lines.append("")
        labels = {"gr_vs_bare_polars": "ingest gr rows/s / bare Polars rows/s",
                  "ctr_vs_bare_polars": "ingest ctr rows/s / bare Polars rows/s",
                  "gr_vs_pandas": "ingest gr rows/s / pandas rows/s",
                  "gr_dask_over_local_seconds": "Dask engine seconds / local engine seconds (gr)",
                  "gr_dask_over_local_peak_rss": "Dask engine peak RSS / local engine peak RSS (gr)"}
        rows = [[labels.get(k, k), " / ".join(f"{r['ratios'][k]:.3f}" for r in reps),
                 f"**{size['summary'][k]['median']:.3f}**"] for k in reps[0]["ratios"]]
        lines += _table(["ratio (within each repeat)", "per repeat", "median"], rows)
        lines.append("")
    return lines


def ingest_summary(rec: Dict) -> str:
    s = rec["figures"]["sizes"][0]["summary"]
    parts = []
    if "gr_vs_bare_polars" in s:
        parts.append(f"gr ingest {s['gr_vs_bare_polars']['median']:.3f} of bare Polars' rows/s")
    if "ctr_vs_bare_polars" in s:
        parts.append(f"ctr {s['ctr_vs_bare_polars']['median']:.3f}")
    if "gr_dask_over_local_seconds" in s:
        parts.append(f"Dask engine {s['gr_dask_over_local_seconds']['median']:.3f}x the local engine's seconds, "
                     f"{s['gr_dask_over_local_peak_rss']['median']:.3f}x its peak RSS")
    return f"{rec['figures']['sizes'][0]['rows']:,} log rows: " + "; ".join(parts)


def clustering_lines(rec: Dict) -> List[str]:
    f = rec["figures"]
    methods = sorted((m for m in f["rows"][0]["methods"] if m != "random"), key=lambda m: (m != "minhash", m))
    rows = []
    for r in f["rows"]:
        cells = [r["data"], r["task"], r["n"], f"{r['methods']['random']['R']:.4f}"]
        for m in methods:
            x = r["methods"][m]
            cells.append(f"{x['R']:.4f} / {100 * x['cut']:.1f}% / {x['ms']:.1f}")
        rows.append(cells)
    lines = [f"Synth scale `{f['scale']}` (seed {f['seed']}), {f['batches']} batches of {f['batch']} samples per row:",
             ""]
    lines += _table(["data", "task", "N", "random R"]
                    + [f"{m}{' (default)' if m == 'minhash' else ''} R / cut / ms" for m in methods], rows)
    lines += ["", "Targets as the benchmark judged them: " + "; ".join(f["verdicts"]) + "."]
    return lines


def clustering_summary(rec: Dict) -> str:
    for r in rec["figures"]["rows"]:
        if r["data"] == "community" and r["task"] == "gr" and r["n"] == 8 and "minhash" in r["methods"]:
            m = r["methods"]["minhash"]
            return (f"the default (minhash) removes {100 * m['cut']:.1f}% of a random partition's excess rows on the "
                    f"synthetic community GR data at N=8, in {m['ms']:.1f} ms per 512-sample batch on one core")
    return "no community GR row at N=8"


def synth_lines(rec: Dict) -> List[str]:
    rows = [[s["scale"], f"{s['log_rows']:,}", f"{s['video_rows']:,}", f"{s['seconds']:.1f}",
             f"{s['log_rows'] / s['seconds']:,.0f}", f"{s['peak_rss_mib']:,.0f}", f"{s['written_mib']:,.0f}"]
            for s in rec["figures"]["scales"]]
    return _table(["scale", "log rows", "video rows", "seconds", "log rows/s", "peak RSS MiB", "MiB written"], rows)


def synth_summary(rec: Dict) -> str:
    s = rec["figures"]["scales"][-1]
    return f"`synth --scale {s['scale']}`: {s['log_rows']:,} log rows in {s['seconds']:.1f} s, peak RSS " \
           f"{s['peak_rss_mib']:,.0f} MiB"


def trainer_lines(rec: Dict) -> List[str]:
    f = rec["figures"]
    w = f["workload"]
    lines = [f"{w['tables']} tables x {w['rows']:,} rows x dim {w['dim']}, batch {w['batch']} per rank, "
             f"{w['min_len']}-{w['max_len']} ids per feature, {w['steps']} timed steps after {w['warmup']}:", ""]
    rows = []
    if "nestpipe" in f:
        n = f["nestpipe"]
        rows.append([f"NestPipe `off` ({n['micro_batches']} micro-batch(es))", f"{n['ms_per_step']:.1f}",
                     f"{n['samples_per_s_per_rank']:.0f}", " / ".join(f"{x:.1f}" for x in n["cpu_ms_per_step_per_rank"])])
    for r in f.get("torchrec_runs", []):
        rows.append([f"TorchRec `TrainPipelineSparseDist`, {r['plan_kind']} plan", f"{r['ms_per_step']:.1f}",
                     f"{r['samples_per_s_per_rank']:.0f}", " / ".join(f"{x:.1f}" for x in r["cpu_ms_per_step_per_rank"])])
    lines += _table(["side", "ms per step", "samples/s per rank", "CPU ms per step, per rank"], rows)
    lines.append("")
    if "ratio_nestpipe_over_torchrec" in f:
        lines.append(f"NestPipe / TorchRec ({f['torchrec']['plan_kind']} plan, the faster): "
                     f"**{f['ratio_nestpipe_over_torchrec']:.2f} in samples/s**, "
                     f"TorchRec's CPU time per step {f['cpu_ratio_torchrec_over_nestpipe']:.2f}x NestPipe's.")
    else:
        lines.append("TorchRec side not run in this record (no `--torchrec-python`): no ratio.")
    forced = f.get("nestpipe_forced") or []
    if forced and "ratio_nestpipe_over_torchrec" in f:
        lines += ["", "NestPipe's kernel paths in this invocation, each against the same TorchRec run: the per-host "
                  "choice " + ", ".join(f"`{op}` {c['path']} ({c['source']})" for op, c in
                                        f["nestpipe"].get("kernel_choice", {}).items())
                  + f": {f['ratio_nestpipe_over_torchrec']:.2f}; "
                  + "; ".join(f"`{r['forced']}` forced: {r['ratio_over_torchrec']:.2f}" for r in forced) + "."]
    elif "nestpipe" in f and f["nestpipe"].get("kernel_choice"):
        lines += ["", "NestPipe's kernel paths (the per-host choice): " + ", ".join(
            f"`{op}` {c['path']} ({c['source']})" for op, c in f["nestpipe"]["kernel_choice"].items()) + "."]
    if "nestpipe" in f:
        lines += ["", "NestPipe's stage timers (wall time, rank 0), ms per step: " + ", ".join(
            f"{k} {v:.1f}" for k, v in f["nestpipe"]["stages_ms_per_step_rank0"].items() if v >= 0.05) + "."]
    return lines


def trainer_summary(rec: Dict) -> str:
    f = rec["figures"]
    if "ratio_nestpipe_over_torchrec" not in f:
        return "NestPipe alone (TorchRec not run)"
    return (f"NestPipe `off` / TorchRec ({f['torchrec']['plan_kind']} plan) on the pooled workload: "
            f"{f['ratio_nestpipe_over_torchrec']:.2f} in samples/s; TorchRec's CPU time per step "
            f"{f['cpu_ratio_torchrec_over_nestpipe']:.2f}x NestPipe's")


def _pipe_rows(net: Dict, tr: Dict) -> List[List]:
    rows = []
    for w in ("gr", "pooled"):
        if w not in net:
            continue
        res = net[w]
        off = res["off"]
        order = ("off", "dbp", "fwp", "nested", "nested-1t", "off-clustered", "auto")
        for m, r in sorted(res.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
            rows.append([w, m + (f" -> {r['pipeline']}" if m == "auto" and "pipeline" in r else ""),
                         f"{r['step_s'] * 1e3:.1f}", f"{r['samples_per_s']:.0f}",
                         f"{r['exposed_communication_s_per_step'] * 1e3:.1f}",
                         f"{r['exposed_lookup_s_per_step'] * 1e3:.2f}", f"{off['step_s'] / r['step_s']:.2f}"])
        t = (net.get("torchrec") or {}).get(w)
        if isinstance(t, dict) and "ms_per_step" in t:
            plan = t.get("sharding", "")
            plan = ", ".join(sorted(set(plan))) if isinstance(plan, list) else plan
            rows.append([w, f"TorchRec ({plan})", f"{t['ms_per_step']:.1f}",
                         f"{t['samples_per_s']:.0f}", "", "", f"{off['step_s'] * 1e3 / t['ms_per_step']:.2f}"])
    return rows


def pipeline_lines(rec: Dict) -> List[str]:
    f = rec["figures"]
    c = f["config"]
    lines = [f"World 2, gloo, one thread per rank; GR: {c['batch']} sequences x {c['seq_len']} tokens per rank, "
             f"{c['micro_batches']} micro-batches, {c['steps']} steps; {c['repeats']} round(s) per network.", ""]
    head = ["workload", "mode", "step ms", "samples/s", "exposed comm ms", "exposed lookup ms", "off step / this step"]
    for key, title in (("loopback", "Plain loopback"), ("capped", "Capped loopback")):
        if key not in f:
            continue
        net = f[key]
        t = title + (f" ({f['cap_tc']})" if key == "capped" and f.get("cap_tc") else "")
        lines += [f"{t}:", ""] + _table(head, _pipe_rows(net, net)) + [""]
        b = f.get(f"{key}_bound")
        if b and "nested_over_bound" in b:
            lines.append(f"Bound ({key}): nested step {b['nested_over_bound']:.2f}x max(CPU-bound stages "
                         f"{b['cpu_stages_s'] * 1e3:.1f} ms, communication {b['communication_s'] * 1e3:.1f} ms"
                         + (f", link floor {b['link_floor_s'] * 1e3:.1f} ms" if b.get("link_floor_s") else "")
                         + "); nested exposed communication "
                         f"{b.get('exposed_comm_over_off_comm', float('nan')):.2f} of off's.")
            lines.append("")
        tr = f.get(f"{key}_torchrec") or {}
        for w, r in tr.items():
            if not isinstance(r, dict) or "nested_over_torchrec" not in r:
                continue
            line = (f"{key}, {w}: nested / TorchRec {r['nested_over_torchrec']:.2f}, off / TorchRec "
                    f"{r['off_over_torchrec']:.2f}")
            if "auto_over_torchrec" in r:
                line += f", default (auto) / TorchRec **{r['auto_over_torchrec']:.2f}**"
            if r.get("auto_over_torchrec_cpu") is not None:
                line += f" ({r['auto_over_torchrec_cpu']:.2f} in CPU time)"
            lines += [line + " in samples/s.", ""]
    if "capped" not in f:
        lines += ["The capped network was not run in this record (it needs root, `ip netns` and `tc`).", ""]
    if not any((f.get(k) or {}) for k in ("loopback_torchrec", "capped_torchrec")):
        lines += ["TorchRec was not run in this record (no `--torchrec-python`).", ""]
    return lines[:-1] if lines and lines[-1] == "" else lines


def pipeline_summary(rec: Dict) -> str:
    f = rec["figures"]
    parts = []
    for key in ("loopback", "capped"):
        net = f.get(key)
        if not net:
            continue
        for w in ("gr", "pooled"):
            if w in net and "nested" in net[w]:
                parts.append(f"{key} {w} nested / off {net[w]['off']['step_s'] / net[w]['nested']['step_s']:.2f}")
        for w, r in (f.get(f"{key}_torchrec") or {}).items():
            if isinstance(r, dict) and "auto_over_torchrec" in r:
                parts.append(f"{key} {w} default / TorchRec {r['auto_over_torchrec']:.2f}")
    return "; ".join(parts) + " (samples/s, world 2)"


def hstu_lines(rec: Dict) -> List[str]:
    f = rec["figures"]
    rows = []
    for L, r in sorted(f["lengths"].items(), key=lambda kv: int(kv[0])):
        s, a = r["stack_s_per_batch"], r["attention_s_per_batch"]
        rows.append([L, f"{r['padding_fraction']:.3f}", f"{r['flop_ratio_R']:.2f}", f"{s['jagged'] * 1e3:.1f}",
                     f"{s['padded'] * 1e3:.1f}", f"{s['bucketed'] * 1e3:.1f}",
                     f"**{r['stack_speedup_jagged_over_padded']:.2f}** ({r['stack_speedup_over_R']:.2f} R)",
                     f"{r['stack_speedup_jagged_over_bucketed']:.2f}",
                     f"{a['jagged'] * 1e3:.1f} / {a['padded'] * 1e3:.1f} ({r['attention_speedup_over_R']:.2f} R)"])
    lines = _table(["max_seq_len", "padding fraction", "R", "jagged ms", "padded ms", "bucketed ms",
                    "jagged / padded", "jagged / bucketed", "attention alone ms, jagged / padded"], rows)
    e = f.get("end_to_end")
    if e:
        lines += ["", f"End to end (`nestpipe train`, world 2, `off`, on the longest length's shards): step "
                  f"{e['jagged']['step_s']:.2f} s jagged vs {e['padded']['step_s']:.2f} s padded, "
                  f"**{e['speedup']:.2f}x**; {e['measured_saving_s']:.2f} s saved per step against the layer "
                  f"benchmark's {e['layer_predicted_saving_s']:.2f} s per batch."]
    return lines


def hstu_summary(rec: Dict) -> str:
    f = rec["figures"]
    parts = ["layer stack jagged / padded " + ", ".join(
        f"{r['stack_speedup_jagged_over_padded']:.2f} at {L} tokens"
        for L, r in sorted(f["lengths"].items(), key=lambda kv: int(kv[0])))]
    if f.get("end_to_end"):
        parts.append(f"end to end (training step) {f['end_to_end']['speedup']:.2f}x")
    return "; ".join(parts)


def serve_lines(rec: Dict) -> List[str]:
    f = rec["figures"]
    m = f["model"]
    lines = [f"Model: max_seq_len {m['max_seq_len']}, dim {m['dim']}, {m['items']:,} items; "
             f"{f['args']['requests']} requests per client and point, concurrency "
             f"{', '.join(map(str, f['args']['concurrency']))}.", ""]
    rows = []
    for key, s in sorted(f["summary"].items(), key=lambda kv: tuple(map(int, kv[0][1:].split("-K")))):
        H, K = key[1:].split("-K")
        ratio = s["throughput_ratio"]
        rows.append([H, K, f"{s['p99_ms_c1']['cached']:.1f} / {s['p99_ms_c1']['uncached']:.1f}",
                     f"**{s['p99_ratio_cached_over_uncached_c1']:.2f}**", f"{s['slo_ms']:.0f}",
                     f"{s['throughput_within_slo']['cached']:.0f} / {s['throughput_within_slo']['uncached']:.0f}",
                     f"**{ratio:.2f}**" if ratio is not None else "n/a"])
    lines += _table(["H (events)", "K (candidates)", "p99 ms at C=1, cached / uncached", "ratio",
                     "SLO ms", "req/s within the SLO, cached / uncached", "ratio"], rows)
    return lines


def serve_summary(rec: Dict) -> str:
    s = rec["figures"]["summary"]
    key = max(s, key=lambda k: (int(k[1:].split("-K")[0]), int(k.split("-K")[1])))
    x = s[key]
    H, K = key[1:].split("-K")
    ratio = f"{x['throughput_ratio']:.2f}x" if x["throughput_ratio"] is not None else "n/a"
    return (f"at {H} events and {K} candidates the prefix cache gives p99 {x['p99_ratio_cached_over_uncached_c1']:.2f} "
            f"of the uncached server's and {ratio} its throughput within the SLO")


def kernels_lines(rec: Dict) -> List[str]:
    f = rec["figures"]
    lines = []
    if "ops" in f:
        lines += [f"Store {f['store_rows']:,} x {f['dim']} float32 ({f['pages']}); batch {f['batch']} x {f['seq']} "
                  f"Zipf tokens ({f['unique_rows']:,} unique rows); {f['reps']} reps; clock: {f['clock']}; paths "
                  + ", ".join(f"{k} `{v}`" for k, v in f["paths"].items()) + f"; memory copy {f['copy_gb_per_s']} GB/s.",
                  ""]
        rows = [[o["op"], f"{o['fast_ms']:.2f}", f"{o['unfused_ms']:.2f}",
                 f"{o['speedup']:.2f}x [{o['speedup_min']:.2f}-{o['speedup_max']:.2f}]",
                 f"{100 * o['copy_share']:.0f}% [{100 * o['copy_share_min']:.0f}-{100 * o['copy_share_max']:.0f}]"
                 if "copy_share" in o else ""] for o in f["ops"]]
        lines += _table(["op", "selected path ms", "unfused torch ms", "speedup [min-max]", "% of copy bandwidth"],
                        rows)
    b = f.get("adagrad_bags")
    if b:
        lines += ["", f"`adagrad_bags` (the pooled owner update), {b['rows']:,} x {b['dim']} table, {b['bags']:,} bags "
                  f"of 15-25 ids, {b['reps']} reps: Numba {b['numba_ms']:.2f} ms, fbgemm's TBE backward "
                  f"{b['fbgemm_tbe_ms']:.2f} ms: **fbgemm / Numba {b['fbgemm_over_numba']:.2f}** "
                  f"[{b['ratio_min']:.2f}-{b['ratio_max']:.2f}]; tables bitwise equal: {b['bitwise_equal']}."]
    return lines


def kernels_tuning_lines(rec: Dict) -> List[str]:
    rows = []
    for name, sh in rec["figures"]["shapes"].items():
        for op, r in sh["ops"].items():
            rows.append([name, f"`{sh['shape']}`", f"`{op}`", ", ".join(f"{p} {ms:.2f}" for p, ms in
                                                                    r["timings_ms"].items()),
                         "yes" if r["bitwise_equal"] else "**no**", sh["choice"].get(op, "-"), sh["rule"].get(op, "-")])
    lines = _table(["workload", "shape", "op", "ms per call (thread CPU, median)", "results bitwise equal",
                    "chosen", "rule"], rows)
    lines += ["", "One calibration (every op of the shape): " + ", ".join(
        f"{name} {sh['calibration_s']:.2f} s" for name, sh in rec["figures"]["shapes"].items()) + "."]
    return lines


def kernels_tuning_summary(rec: Dict) -> str:
    sh = rec["figures"]["shapes"]
    pooled = sh.get("pooled") or next(iter(sh.values()))
    return "per-host choice on the pooled shape: " + ", ".join(f"`{op}` {p} (rule {pooled['rule'][op]})"
                                                               for op, p in pooled["choice"].items())


def kernels_summary(rec: Dict) -> str:
    f = rec["figures"]
    parts = [f"{o['op'].split(' ')[0]} {o['speedup']:.2f}x the unfused torch ops" for o in f.get("ops", [])
             if not o["op"].startswith("gather_rows")]
    if f.get("adagrad_bags"):
        parts.append(f"adagrad_bags {f['adagrad_bags']['fbgemm_over_numba']:.2f}x fbgemm's TBE backward")
    return "; ".join(parts) + ", one thread on CPU"


def simval_lines(rec: Dict) -> List[str]:
    f = rec["figures"]
    rows = [[r["config"], r["role"], f"{r['measured_ms']:.1f}", f"{r['predicted_ms']:.1f}",
             "" if r["role"] == "calibration" else f"{100 * r['error']:+.1f}%",
             ", ".join(f"{x:.1f}" for x in r["measured_repeats_ms"])] for r in f["rows"]]
    lines = _table(["configuration", "role", "measured ms (fastest repeat)", "predicted ms", "error",
                    "measured repeats ms"], rows)
    lines += ["", f"Held out within 15%: **{f['held_out_within_15pct']} of {f['held_out']}**, median |error| "
              f"**{100 * f['median_abs_error']:.1f}%** (calibrated on {f['calibration']}; "
              + (f"cap {f['cap_mbit']:.0f} Mbit/s" if f.get("cap_mbit") else "no capped configurations") + ")."]
    return lines


def simval_summary(rec: Dict) -> str:
    f = rec["figures"]
    return (f"step time predicted from one calibration run: {f['held_out_within_15pct']} of {f['held_out']} held-out "
            f"configurations within 15%, median |error| {100 * f['median_abs_error']:.1f}%")


def scaling_lines(rec: Dict) -> List[str]:
    f = rec["figures"]
    rows = []
    for w_key in sorted(f["worlds"], key=int):
        r = f["worlds"][w_key]
        for wl in ("gr", "pooled"):
            if wl not in r:
                continue
            n, t, q = r[wl]["nestpipe"], r[wl].get("torchrec", {}), f["ratios"][wl][w_key]
            rows.append([w_key, wl, f"{n['auto']['samples_per_s']:.0f} ({n['auto']['pipeline']})",
                         f"{n['nested']['samples_per_s']:.0f}", f"{n['off']['samples_per_s']:.0f}",
                         f"{t['samples_per_s']:.0f} ({t['plan']})" if "samples_per_s" in t else "-",
                         f"**{q['auto_over_torchrec']:.2f}**" if "auto_over_torchrec" in q else "-",
                         f"{q['nested_over_off']:.2f}",
                         f"{q['predicted_nested_over_off']:.2f} ({100 * q['prediction_error']:+.0f}%)"
                         if "predicted_nested_over_off" in q else "-",
                         f"{n['auto']['wire_bytes_per_sample']:.0f} / "
                         + (f"{t['wire_bytes_per_sample']:.0f}" if "wire_bytes_per_sample" in t else "-"),
                         f"{n['auto']['exposed_communication_ms']:.1f}",
                         f"{n['auto']['compute_share']:.2f} / "
                         + (f"{t['compute_share']:.2f}" if "compute_share" in t else "-")])
    lines = _table(["world", "workload", "NestPipe auto samples/s", "nested", "off", "TorchRec samples/s (plan)",
                    "auto / TorchRec", "nested / off", "predicted nested / off (error)",
                    "bytes per sample NestPipe / TorchRec", "NestPipe exposed comm ms", "CPU share NestPipe / TorchRec"],
                   rows)
    tg = f["targets"]

    def yes(x):
        return "not measured" if x is None else ("holds" if x else "**fails**")

    lines += ["", f"Cap: `{f['cap_tc']}` ({f['cap_bit_per_s'] / 1e6:.1f} Mbit/s, calibrated at world 2, held for every "
              f"world). Targets: GR ratio does not fall with the world {yes(tg['gr_ratio_does_not_fall'])}, pooled "
              f"{yes(tg['pooled_ratio_does_not_fall'])}; GR NestPipe / TorchRec at the largest world "
              + (f"{tg['gr_ratio_at_largest_world']:.2f}" if tg["gr_ratio_at_largest_world"] is not None else "-")
              + f" (target >= 1.5); GR bytes per sample <= 0.5x TorchRec's {yes(tg['gr_wire_bytes_at_most_half'])}; "
              f"simulator within 20% at worlds > 2 {yes(tg['prediction_within_20pct'])}.", "",
              "![NestPipe / TorchRec and nested / off against the world](scaling.png)"]
    gr = f["ratios"].get("gr", {})
    if gr and all("predicted_off_step_ms" in v for v in gr.values()):
        rows = []
        for w in sorted(gr, key=int):
            q, n = gr[w], f["worlds"][w]["gr"]["nestpipe"]
            dense = {m: n[m].get("stages_ms", {}).get("dense") for m in ("off", "nested")}
            rows.append([w, f"{q['off_step_ms']:.0f} / {q['predicted_off_step_ms']:.0f}",
                         f"{q['nested_step_ms']:.0f} / {q['predicted_nested_step_ms']:.0f}",
                         f"{dense['off']:.0f} / {dense['nested']:.0f}" if None not in dense.values() else "-",
                         f"{n['nested']['exposed_communication_ms']:.0f} of {n['nested']['communication_ms']:.0f}"])
        lines += ["", "The simulator's step against the measured one (GR; fitted on the world-2 `off` run on plain "
                  "loopback), and the dense stage of `off` and `nested` (the compute thread's forward and backward; "
                  "in `nested` it shares the rank's core with the exchange threads):", ""]
        lines += _table(["world", "off step ms measured / predicted", "nested step ms measured / predicted",
                         "dense ms off / nested", "nested exposed of total comm ms"], rows)
    return lines


def scaling_summary(rec: Dict) -> str:
    f = rec["figures"]
    def word(x):  # one invocation: within 5% is called a tie
        return "tie" if abs(x - 1) <= 0.05 else ("NestPipe faster" if x > 1 else "TorchRec faster")

    parts = []
    for wl in ("gr", "pooled"):
        q = f["ratios"].get(wl, {})
        if q and all("auto_over_torchrec" in v for v in q.values()):
            parts.append(f"{wl} NestPipe / TorchRec " + ", ".join(
                f"{v['auto_over_torchrec']:.2f} at world {w} ({word(v['auto_over_torchrec'])})"
                for w, v in sorted(q.items(), key=lambda kv: int(kv[0]))))
    return ("; ".join(parts) + " behind one shared capped link (within 5% is called a tie)" if parts
            else "NestPipe only (no TorchRec side)")


def chaos_lines(rec: Dict) -> List[str]:
    f = rec["figures"]
    rows = [[cls, s["trials"], s["ok"], s["refused"], s.get("skipped", 0), s["silent_losses"], s["raw_tracebacks"],
             s["left_behind"]] for cls, s in f["summary"].items()]
    return _table(["fault class", "trials", "every verdict holds", "run failed (one message)", "skipped",
                   "silent losses", "raw tracebacks", "processes left behind"], rows)


def chaos_training_lines(rec: Dict) -> List[str]:
    lines = chaos_lines(rec)
    timed = [t for t in rec["figures"]["trials"] if t["class"] in ("kill_rank", "kill_in_checkpoint", "stop_rank")]
    hit = [t for t in timed if t["fault"].get("rank") is not None]
    if timed:
        lines += ["", f"{len(hit)} of {len(timed)} kill and stop trials reached a running rank (in the others the "
                      "drawn moment came after the ranks had exited; such a run is compared with the reference as it "
                      "is)."]
    stops = [t for t in rec["figures"]["trials"] if t["class"] == "stop_rank" and "peers_gave_up_after_s" in t]
    if stops:
        gave = sorted(t["peers_gave_up_after_s"] for t in stops)
        lines += ["", f"A stopped rank's peers gave up {gave[0]:.0f} to {gave[-1]:.0f} s after the stop "
                      f"(median {statistics.median(gave):.0f} s; `timeout_s = 10` plus the heartbeat read), naming it "
                      "in the run's last line."]
    return lines


def chaos_serving_lines(rec: Dict) -> List[str]:
    rows = []
    for t in rec["figures"]["trials"]:
        fl, c = t["fault"], t.get("counts", {})
        rows.append([t["seed"], f"{fl.get('capacity_rps', 0):.0f}", f"{fl.get('offered_rps', 0):.0f}",
                     fl.get("requests", ""), c.get("valid_200", ""), c.get("valid_503", ""),
                     f"{c.get('malformed_4xx', '')} / {c.get('malformed_503', '')}",
                     t.get("p50_ms", ""), t.get("p99_ms", ""), t.get("wrong_count", ""),
                     "yes" if t.get("keeps_answering") else "**no**", "yes" if t.get("history_intact") else "**no**",
                     "holds" if t["ok"] else "**fails**"])
    return _table(["seed", "capacity (req/s)", "offered (req/s)", "requests", "valid: 200", "valid: 503",
                   "malformed: 4xx / 503", "p50 ms (200s)", "p99 ms (200s)", "wrong answers", "answers after the kill",
                   "history intact after restart", "verdict"], rows)


def chaos_summary(rec: Dict) -> str:
    f = rec["figures"]
    n = len(f["trials"])
    ok = sum(t["ok"] for t in f["trials"])
    silent = sum(s["silent_losses"] for s in f["summary"].values())
    left = sum(s["left_behind"] for s in f["summary"].values())
    tb = sum(s["raw_tracebacks"] for s in f["summary"].values())
    return (f"{ok} of {n} seeded fault trials hold every verdict; {silent} silent losses, {tb} raw tracebacks, "
            f"{left} processes left behind")


SECTIONS = [
    dict(name="ingest", title="Ingest", anchor="ingest",
         command='python benchmarks/ingest_bench.py --sizes 5000000 --repeats 3 --tools "ingest gr" "bare polars" '
                 '"ingest gr dask"',
         what="Synthetic KuaiRand logs (`synth --scale medium --interactions N`), each tool in its own subprocess: "
              "`nestpipe ingest --task gr` and `--task ctr` (B=512, N=8), the same gr ingest with `--engine dask` "
              "(a LocalCluster of `--workers` processes), a bare Polars `scan_csv(...).sink_parquet(...)` of the "
              "same logs, and pandas `read_csv` + sort + `groupby(\"user_id\").agg(list)` where pandas is installed. "
              "Peak RSS is summed over each tool's process tree (sampled every 50 ms).",
         render=ingest_lines, summary=ingest_summary, libs=("polars", "pyarrow", "numpy", "numba", "dask"),
         means="The ingest does far more than the bare Polars copy (samples, key clustering and cost-balanced "
               "micro-batches, shards with checksums): the ratio says what that work costs against a lower bound, "
               "not a like-for-like race. The Dask engine writes byte-identical shards; its cluster's start-up weighs "
               "more at small sizes. Repeats interleave the tools, so load drift hits all alike."),
    dict(name="clustering", title="Key-centric clustering", anchor="clustering",
         command="python benchmarks/clustering_bench.py --scale small",
         what="Micro-batch partitions of 512-sample batches, one core: R = sum of per-micro-batch unique rows / batch "
              "unique rows (1.0 is the lower bound); cut = share of a random partition's excess (R - 1) removed; ms "
              "= median over batches of the best of 3. Community data: synth `small` (GR windows of at most 256; "
              "CTR tables user, video, 50-id history, hour). Zipf data: independent windows, Zipf(1.2) over 1M ids.",
         render=clustering_lines, summary=clustering_summary, libs=("numpy", "numba", "polars"),
         means="On data with shared structure (the community data) the default removes most of random's excess; on "
               "structureless Zipf windows little is there to remove, so random is close to the best partition "
               "found."),
    dict(name="synth", title="Synthetic data generation", anchor="synth",
         command="python benchmarks/synth_bench.py --scale tiny small medium",
         what="`nestpipe synth` (the generator alone) per scale, each in its own subprocess: wall time, peak RSS, "
              "bytes written.",
         render=synth_lines, summary=synth_summary, libs=("numpy", "polars"),
         means="Memory is bounded by the generator's chunk sizes, not by the scale. No baseline: a throughput "
               "figure for planning, on a shared machine."),
    dict(name="trainer", title="Trainer vs TorchRec", anchor="trainer-vs-torchrec",
         command="python benchmarks/trainer_bench.py --steps 30 --torchrec-python .venv-torchrec/bin/python",
         what="The pooled workload (8 tables x 100k x 64, batch 1024 per rank, 13 dense features, MLPs 13-128-64 and "
              "576-256-1, row-wise AdaGrad + AdamW, 2 gloo ranks x 1 thread) on identical pre-generated batches: "
              "NestPipe's synchronous step (`--pipeline off`) and TorchRec 1.8's `TrainPipelineSparseDist` (its "
              "default and row-wise plans, fused row-wise AdaGrad) from the environment `make torchrec-env` builds "
              "(`benchmarks/torchrec_env.sh`), one after the other in the same invocation; NestPipe is compared "
              "with TorchRec's faster plan.",
         render=trainer_lines, summary=trainer_summary,
         means="Both sides run the same dense model and the same row-wise AdaGrad arithmetic (NestPipe's bag update "
               "is bitwise equal to fbgemm's TBE backward, see Kernels); the ratio measures the engines around them. "
               "With other work on the cores, CPU time per step is the steadier comparison (it leaves out the time a "
               "rank waits for a core). fbgemm's CPU kernels differ in speed between hosts (vector instruction "
               "sets), so a ratio holds for the record's host only."),
    dict(name="pipeline", title="Pipeline schedules", anchor="pipeline",
         command="python benchmarks/pipeline_bench.py --repeats 1 --torchrec-python .venv-torchrec/bin/python",
         what="`--pipeline off / dbp / fwp / nested` (and `nested-1t`, `auto`) at world 2 on the GR-shaped workload "
              "(1M-row item table, Zipf 1.2, HSTU 1 layer x 2 heads, 64 shared negatives) and the pooled workload "
              "of the trainer comparison, (a) on plain loopback and (b) on a loopback capped by `tc tbf` in a "
              "network namespace (root only), the cap calibrated so that `off`'s communication takes about its "
              "compute; TorchRec's `TrainPipelineSparseDist` on both workloads where `--torchrec-python` is given.",
         render=pipeline_lines, summary=pipeline_summary,
         means="With one core per rank the pipeline's threads take turns with the compute on that core, so on plain "
               "loopback there is little waiting to hide; the capped link is where overlap can pay. `auto` picks "
               "the schedule at start (its choice is shown beside it). Compare within the record: the machine is "
               "shared."),
    dict(name="scaling", title="Scaling", anchor="scaling",
         command="python benchmarks/scaling_bench.py --torchrec-python .venv-torchrec/bin/python",
         what="Weak scaling (per-rank batch fixed) at world 2, 4 and 8 of a smaller GR workload (32 sequences x 64 "
              "tokens per rank, 200k-row item table) and the pooled one (256 samples per rank), NestPipe `off`, "
              "`nested` and `auto` against TorchRec's faster plan (default or row-wise), every rank of every world in "
              "one network namespace whose loopback carries one `tc tbf` cap, calibrated once at world 2 so that "
              "`off`'s communication takes about its compute. Bytes per sample: what each engine's collectives send "
              "to other ranks (NestPipe's counters; TorchRec's collectives counted by its runner, DDP's all-reduce "
              "from the dense parameter count). The simulator is fitted on the world-2 `off` run only and its "
              "predictions are written before world 4 runs.",
         render=scaling_lines, summary=scaling_summary,
         means="All ranks share one link and two cores: world W stands for a cluster whose per-rank bandwidth and "
               "per-rank compute are both 2 / W of world 2's, so the cap's balance of communication and compute is "
               "kept while the peers per All2All, the per-call costs and the bytes per sample grow as on a cluster. "
               "It does not stand for ranks with a link each. One invocation, one round: compare within it."),
    dict(name="hstu", title="HSTU jagged attention", anchor="hstu-attention",
         command="python benchmarks/hstu_bench.py --lengths 256 1024 --batches 4 --repeats 2 --e2e-steps 8",
         what="The default HSTU layer stack (2 layers, 2 heads x 16) forward + backward per 128-sample batch on "
              "the shards' real length mix (synth `medium`, ingested at each `--max-seq-len`), one thread: "
              "`attention=jagged`, `padded` (the stack on padded tokens) and `bucketed` (power-of-two length "
              "buckets, each padded to its own longest), alternating per micro-batch; R = padded / causal jagged "
              "attention FLOPs. End to end: `nestpipe train` with either attention.",
         render=hstu_lines, summary=hstu_summary,
         means="The layer's speedup follows R, the padding the jagged form skips; end to end the rest of the step "
               "(the sampled-softmax objective, the embeddings, the exchanges) is the same work with either "
               "attention, so the time saved per step, not the ratio, is what carries over."),
    dict(name="serve", title="Online ranking", anchor="online-ranking",
         command="python benchmarks/serve_bench.py --run /tmp/nestpipe-hstu-bench/e2e-jagged --lengths 256 1024 "
                 "--candidates 200 --requests 16",
         what="`nestpipe serve` (one thread, the default SQLite history) with the prefix cache (`--cache-mb 1024`) "
              "and without (`--cache-mb 0`: every request recomputes the stored window), C closed-loop clients per "
              "point, each prefilled with H - R events, then R rank requests of one new event and K candidates. RUN "
              "is the jagged end-to-end run that `hstu_bench.py` leaves (medium data, `--max-seq-len 1024`; the "
              "weights do not matter for timing).",
         render=serve_lines, summary=serve_summary,
         means="With short histories the window's forward is about as cheap as the HTTP round trip and the "
               "scoring, so the cache gains little; with long ones the uncached server recomputes the window on "
               "every request. p99 over a few dozen requests per point is a rough figure."),
    dict(name="kernels", title="Kernels on the trainer's path", anchor="kernels",
         command="python benchmarks/kernels_bench.py --quick --no-gather-variants",
         what="The ops the trainer runs on CPU, each against the unfused torch composition, alternating rep by rep "
              "on fresh Zipf batches, thread CPU time: the store's row gather (`gather_rows`), the owner's entry "
              "update of sequence tables (`adagrad_update`), the prefetch buffer's sync from the store "
              "(`dual_buffer_sync_rows`), and the owner's bag update of pooled tables (`adagrad_bags`) against "
              "fbgemm's TBE CPU backward. Bandwidths count bytes read + written of the rows moved, against a 512 MiB "
              "copy sampled between reps.",
         render=kernels_lines, summary=kernels_summary,
         means="`gather_rows` runs `torch.index_select` on CPU (the reference path), so its row is a bandwidth "
               "figure, not a speedup. Only CPU paths are measured: the Triton and NPU paths have not run on "
               "hardware."),
    dict(name="kernels-tuning", title="Per-host kernel choice", anchor="per-host-kernel-choice",
         command="python benchmarks/kernels_bench.py --tuning",
         what="Every op with two paths that compute bitwise the same result (`nestpipe.kernels.tuning.EQUAL_PATHS`), "
              "timed by the trainer's own calibration (paths alternating, thread CPU time, results compared bitwise) "
              "on the trainer benchmark's pooled shape and a GR (unique-based) shape, and the choice it makes.",
         render=kernels_tuning_lines, summary=kernels_tuning_summary,
         means="The choice holds for this record's host: the cache is keyed by the host's fingerprint, and another "
               "host measures again. Only equal paths are compared, so the choice changes time, never a result."),
    dict(name="chaos-ingest", title="Faults on purpose: ingest", anchor="faults-on-purpose-ingest",
         command="python benchmarks/chaos.py --family ingest --trials-per-class 20",
         what="Seeded faults against `nestpipe ingest --workers 2` on the synthetic KuaiRand logs (`nestpipe synth "
              "--scale tiny`), one per trial (`benchmarks/chaos_ingest.py`): input fuzz (a flipped byte, a truncation, "
              "a duplicated, dropped, extra-field or non-UTF-8 line in the CSVs; a flipped byte or a truncation of a "
              "log as Parquet), SIGKILL of the driver or of one worker at a moment drawn over the clean run's "
              "duration (local and Dask engines), the output on a tmpfs too small for it, an output under a "
              "read-only filesystem or that is a file. Verdicts: a failed run says why in one message naming the "
              "file or path; a second run on the same fuzzed input writes the same bytes; line-level faults change "
              "the rows read by exactly the lines added or removed and a malformed line is in `rejects.csv` with a "
              "reason; after a kill or a full disk the same command resumes to shards byte-identical to the clean "
              "run's, and a shard present after the fault is a finished one; no process outlives the run.",
         render=chaos_lines, summary=chaos_summary, libs=("polars", "pyarrow", "numpy", "dask"),
         means="Every trial's seed is in the record (`--replay SEED --classes CLASS` runs one again). A fault that "
               "leaves the input valid (a flipped byte inside a number) holds when the run is deterministic and "
               "clean: no checksum travels with a CSV. The disk classes need root (a tmpfs mount); without it they "
               "are counted as skipped."),
    dict(name="chaos-formats", title="Faults on purpose: the other input formats",
         anchor="faults-on-purpose-the-other-input-formats",
         command="python benchmarks/chaos.py --family formats --trials-per-class 20",
         what="The same input fuzz on the other public formats `nestpipe ingest` converts: per trial a format drawn "
              "among MovieLens 100K / 1M / CSV, atomic files and Amazon ratings CSV and review JSON lines (2014, 2023 "
              "gzipped), written small by `nestpipe.ingest.formats.samples` (~530 interactions), then a flipped byte "
              "or a cut in a drawn file, or a line of the interactions file replaced by one that is not a record "
              "(`--max-reject-fraction 0.05`: one bad record of these few is 0.2%). Verdicts: the ingest succeeds "
              "deterministically or fails in one message naming the file or what is wrong with the input as a "
              "whole; a replaced line is in `rejects.csv` by file and line with a reason and its raw text; no "
              "process outlives the run.",
         render=chaos_lines, summary=chaos_summary, libs=("polars", "pyarrow", "numpy"),
         means="A flipped byte that leaves a valid record (a digit for a digit) passes as data: none of these "
               "formats carries a checksum. Seeds are in the record."),
    dict(name="chaos-training", title="Faults on purpose: training", anchor="faults-on-purpose-training",
         command="python benchmarks/chaos.py --family training --trials-per-class 10",
         what="Seeded faults against `nestpipe train` (hstu, world 2 over gloo, 12 steps, a checkpoint every 4, "
              "`timeout_s = 10`) on the ingest's shards (`benchmarks/chaos_training.py`): SIGKILL of a drawn rank at "
              "a moment drawn over the clean run's duration, or inside a drawn checkpoint's write; SIGSTOP of a rank "
              "(a hang); a training shard cut at a random byte; a file of a finished run's checkpoint truncated or "
              "changed, then `--resume --steps 16`. Verdicts: a failed run ends in one summary line naming the rank, "
              "the shard or the damaged checkpoint file; `--resume` (or the run again when no checkpoint was "
              "complete) exports every tensor bitwise equal to an uninterrupted run's; no process is left behind.",
         render=chaos_training_lines, summary=chaos_summary, libs=("torch", "numpy"),
         means="Bitwise equality is the reference: the same run uninterrupted. A damaged checkpoint is found by "
               "the sha256 and size `meta.json` records for each of its files, and the one before it is used."),
    dict(name="chaos-serving", title="Faults on purpose: serving", anchor="faults-on-purpose-serving",
         command="python benchmarks/chaos.py --family serving --trials-per-class 10",
         what="`nestpipe serve --replicas 2 --max-in-flight 16` with the trained hstu (`benchmarks/chaos_serving.py`): "
              "capacity measured by 6 closed-loop clients for 4 s, then an open-loop generator on loopback at twice "
              "that rate for 8 s (bounded requests, 30 s client timeout), one request in five malformed, one replica "
              "SIGKILLed at a drawn moment; then every user ranked, the server restarted, every user ranked again "
              "from the history store alone. Verdicts: valid requests get 200 with one score per candidate or 503 "
              "with a reason, malformed ones a 4xx (or the overload's 503) with a reason, never a 200, another 5xx "
              "or a dropped connection; "
              "every user is answered after the kill; the restarted server's scores equal the running one's "
              "(rtol = atol = 1e-4); no process left behind.",
         render=chaos_serving_lines, summary=chaos_summary, libs=("torch", "numpy"),
         means="Latency percentiles are of the valid requests answered 200 while the server was offered twice what "
               "it can serve: the admission limit refuses the excess with 503 at once. The p99 is the killed "
               "replica's restart: the front holds its users' requests (retrying) until it is back, seconds on this "
               "host; p50 is the admitted requests' time under overload. A 2-core host runs the load generator, the "
               "front and both replicas, beside other work (the record's load)."),
    dict(name="simulator_validation", title="Simulator validation", anchor="simulator-validation",
         command="python benchmarks/simulator_validation.py --repeats 2 --steps 10",
         what="`nestpipe simulate --calibrate RUN` fitted on one measured `--pipeline off` run (world 2, 8 "
              "micro-batches, plain loopback) of the GR-shaped pipeline workload, then predicting the measured step "
              "of held-out configurations (other schedules, micro-batch counts, world 3, a capped link where root "
              "can make one); each configuration's fastest repeat counts.",
         render=simval_lines, summary=simval_summary,
         means="The calibration and the held-out runs share the machine with other work; the fastest repeat is the "
               "least disturbed. Paper-scale predictions are checked by `tests/test_planning_validation.py`, not "
               "here."),
]


def _seed_mean(per_seed: Dict, key: str, group: str, *path: str) -> Optional[float]:
    vals = []
    for s in per_seed.values():
        v = s.get(key, {}).get(group)
        for p in path:
            v = None if v is None else v.get(p)
        if v is not None:
            vals.append(v)
    return statistics.mean(vals) if vals else None


def _f(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.4f}"


def _group_order(name: str):
    """Records keep their keys sorted as text: "all" first, then by label and by the range's lower bound."""
    label, _, rest = name.partition(" [")
    return (name != "all", label, int(rest.split("..")[0]) if rest else 0)


def breakdown_lines(rec: Dict) -> List[str]:
    """Where the models lose: the eval record's per-group figures, averaged over seeds (the groups are the same
    samples every seed)."""
    per_seed = rec["per_seed"]
    first = next(iter(per_seed.values()))
    lines = []
    if "breakdown_hr10" in first:
        names = [n for n in ("hstu", "sasrec", "successor_counts", "most_popular")
                 if n in next(iter(first["breakdown_hr10"].values()))]
        rows = [[g, v["samples"], *(_f(_seed_mean(per_seed, "breakdown_hr10", g, n)) for n in names)]
                for g, v in sorted(first["breakdown_hr10"].items(), key=lambda kv: _group_order(kv[0]))]
        lines += [f"Next-item HR@10 by sample group ({rec['split']} split, mean of the seeds): the sample's history "
                  f"length, its target's training count, and whether the target ever followed the sample's last "
                  f"item in training (what the successor-counting baseline reads).", ""]
        lines += _table(["group", "samples", *(n.replace("_", " ") for n in names)], rows) + [""]
    if "ctr_breakdown" in first:
        names = ("dlrm", "factorization_machine")
        rows = [[g, v["samples"], f"{v['click_rate']:.3f}",
                 *(_f(_seed_mean(per_seed, "ctr_breakdown", g, n, m)) for n in names for m in ("AUC", "logloss"))]
                for g, v in sorted(first["ctr_breakdown"].items(), key=lambda kv: _group_order(kv[0]))]
        lines += [f"dlrm and the factorization machine by sample group ({rec['split']} split, mean of the seeds): "
                  f"the impressions of the sample's user and of its item in the training split.", ""]
        lines += _table(["group", "samples", "click rate", "dlrm AUC", "dlrm logloss", "FM AUC", "FM logloss"],
                        rows) + [""]
    return lines


def tried_lines(records: List[Dict], dataset: str) -> List[str]:
    """Every setting scored on the valid split of ``dataset``: the records of ``real_quality.py --split valid``."""
    rows = []
    for rec in records:
        if rec["dataset"] != dataset or rec["split"] != "valid":
            continue
        m = rec["means"]
        sets = "; ".join(f"`{s}`" for s in rec.get("sets", []) + rec.get("sets_dlrm", [])) or "the defaults then"
        names = [n for n in ("hstu", "sasrec", "successor_counts") if f"{n} HR@10" in m]
        gr = " / ".join(f"{m[f'{n} HR@10']:.4f}, {m[f'{n} NDCG@10']:.4f}" for n in names)
        ctr = ""
        if "dlrm AUC" in m:
            base = next((b for b in ("factorization_machine", "logistic_regression_crosses", "logistic_regression")
                         if f"{b} AUC" in m), None)
            ctr = f"{m['dlrm AUC']:.4f}, {m['dlrm logloss']:.4f}"
            if base:
                ctr += f" (vs {base.replace('_', ' ')} {m[f'{base} AUC']:.4f}, {m[f'{base} logloss']:.4f})"
        label = " / ".join(n.replace("successor_counts", "counts") for n in names)
        rows.append([rec["_file"].split("/")[-1], sets, label, gr, ctr,
                     rec.get("ctr_valid_days", 1) if ctr else "", _at(rec)])
    if not rows:
        return []
    return (["Settings scored on the valid split (`--split valid`, mean of the seeds; next-item: HR@10, NDCG@10; "
             "dlrm: AUC, logloss, beside the strongest CTR baseline that record fitted; the CTR valid split's "
             "dates):", ""]
            + _table(["record", "settings", "models", "HR@10, NDCG@10", "dlrm AUC, logloss", "ctr valid dates",
                      "commit"], rows) + [""])


def quality_section(results: str) -> List[str]:
    body = render_quality(results).rstrip("\n")
    lines = ["## Model quality on real data", "",
             "The models with their defaults on MovieLens-100K beside the baselines fitted on the same training data "
             "(`benchmarks/real_quality.py`; the same block as README's), then where each model loses and every "
             "setting scored on the valid split.", "", body, ""]
    records = _records("real_quality-*.json", results)
    for dataset in sorted({r["dataset"] for r in records}):
        shown = [r for r in records if r["dataset"] == dataset and r["split"] == "eval" and not r.get("tag")
                 and not r.get("sets") and not r.get("sets_dlrm")]
        if shown:
            lines += breakdown_lines(shown[0])
        lines += tried_lines(records, dataset)
    return lines


def render_docs(results: str = RESULTS) -> str:
    lines = ["# Benchmarks", "",
             "<!-- Generated by `python benchmarks/report.py` from benchmarks/results/*.json: do not edit by hand. -->",
             "",
             "Every figure below is read from the latest record its benchmark wrote under `benchmarks/results/` "
             "(`benchmarks/record.py`: the command, the commit, the host, the library versions, the load average "
             "at start and end). The machines are shared 2-core hosts: absolute times are noisy, so each benchmark "
             "measures its baseline and its candidate in the same run and reports their ratio. To refresh a "
             "section, run its command from the repository root and then `python benchmarks/report.py`; earlier "
             "figures live in git history and, in brief, in `docs/changelog.md`.", ""]
    for s in SECTIONS:
        rec = _record(s["name"], results)
        lines += [f"## {s['title']}", "", s["what"], "", f"Command: `{rec['command'] if rec else s['command']}`", ""]
        if rec is None:
            lines += ["No record yet: run the command above.", ""]
            continue
        body = s["render"](rec)
        while body and body[-1] == "":
            body.pop()
        lines += body + [""]
        lines += [provenance(rec, s.get("libs", LIBS)), "", s["means"], ""]
    lines += quality_section(results)
    lines += ["## Model quality on the synthetic demo data", "",
              "The quick start's data and settings over seeds (`benchmarks/quality_bench.py`; the same block as "
              "README's). No model default and no generator setting is chosen by these figures.", "",
              render_quality_synthetic(results).rstrip("\n"), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def render_summary(results: str = RESULTS) -> str:
    lines = []
    for s in SECTIONS:
        rec = _record(s["name"], results)
        if rec is None:
            continue
        lines.append(f"- **{s['title']}**: {s['summary'](rec)}; `{rec['_file']}` at {_at(rec)}, {_load(rec)}.")
    if not lines:
        return "No benchmark record yet.\n"
    return "\n".join(lines) + "\n"


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
        lines.append(f"`{rec['command']}` at {_at(rec)} on {rec['host']} ({rec['cpus']} cores; "
                     f"torch {rec['versions']['torch']}); record `{rec['_file']}`.")
        lines.append("")
    return "\n".join(lines)


def render_quality_synthetic(results: str = RESULTS) -> str:
    """The synthetic demo data's quality block: ``quality_bench.py``'s record of the defaults (no setting, generator
    option or tag), the eval split where recorded."""
    recs = [r for r in _records("quality_synthetic-*.json", results)
            if not r.get("sets") and not r.get("sets_dlrm") and not r.get("synth") and not r.get("tag")]
    if not recs:
        return "No synthetic-data quality record yet (`python benchmarks/quality_bench.py`).\n"
    rec = max(recs, key=lambda r: (r["split"] == "eval", r["date"]))
    rows, per_seed = rec["summary"], rec["per_seed"]

    def cell(name: str) -> str:
        r = rows.get(name)
        return "" if r is None else f"{r['mean']:.4f} [{r['min']:.4f}..{r['max']:.4f}]"

    def verdicts(model: str, baseline: str, metric: str) -> str:
        return "/".join(s[model]["comparisons"][f"baseline_{baseline}"][metric]["verdict"] for s in per_seed
                        if model in s and f"baseline_{baseline}" in s[model].get("comparisons", {}))

    lines = [f"**Synthetic demo data** (`synth --scale {rec['scale']}`, the demo's ingest; hstu and sasrec "
             f"{rec['epochs']} epochs, dlrm {rec['dlrm_epochs']}), {rec['split']} split, mean of seeds "
             f"{', '.join(map(str, rec['seeds']))} [min..max over seeds]; verdicts per seed against the "
             f"successor-counting baseline, paired over the same samples:", "",
             "| | HR@10 | NDCG@10 | vs successor counts (HR@10, NDCG@10) |", "|---|---|---|---|"]
    for model in ("hstu", "sasrec"):
        if f"{model} HR@10" in rows:
            lines.append(f"| {model} | {cell(f'{model} HR@10')} | {cell(f'{model} NDCG@10')} | "
                         f"{verdicts(model, 'successor_counts', 'HR@10')}, "
                         f"{verdicts(model, 'successor_counts', 'NDCG@10')} |")
    for name, label in (("successor_counts", "successor counts"), ("most_popular", "most popular"),
                        ("generator_oracle", "the generator's own next-item probabilities (ceiling)")):
        if f"{name} HR@10" in rows:
            lines.append(f"| {label} | {cell(f'{name} HR@10')} | {cell(f'{name} NDCG@10')} | |")
    if "dlrm AUC" in rows:
        strongest = per_seed[0]["dlrm"].get("strongest_baseline", "logistic_regression")
        lines += ["", f"dlrm: AUC {cell('dlrm AUC')}, logloss {cell('dlrm logloss')}; the strongest CTR baseline "
                  f"({strongest}): AUC {cell(f'{strongest} AUC')}, logloss {cell(f'{strongest} logloss')}; dlrm "
                  f"per seed (AUC, logloss): " + "; ".join(
                      f"{s['dlrm']['comparisons'][f'baseline_{strongest}']['AUC']['verdict']}, "
                      f"{s['dlrm']['comparisons'][f'baseline_{strongest}']['logloss']['verdict']}" for s in per_seed)
                  + (f"; the generator's own click probabilities (Bayes ceiling): AUC {cell('Bayes ceiling AUC')}"
                     if "Bayes ceiling AUC" in rows else "") + "."]
    lines += ["", f"`{rec['command']}` at {_at(rec)} on {rec['host']} ({rec['cpus']} cores; "
              f"torch {rec['versions']['torch']}); record `{rec['_file']}`.", ""]
    return "\n".join(lines)


RENDERERS: Dict[str, Callable[[str], str]] = {"quality": render_quality, "quality-synthetic": render_quality_synthetic,
                                              "summary": render_summary}


def render_readme(text: str, results: str = RESULTS) -> str:
    def block(m):
        name = m.group("name")
        if name not in RENDERERS:
            raise SystemExit(f"README.md: unknown results block {name!r} (known: {', '.join(RENDERERS)})")
        return m.group(1) + RENDERERS[name](results) + m.group(4)

    return BLOCK.sub(block, text)


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 where README.md or docs/benchmarks.md differs")
    ap.add_argument("--readme", default=README)
    ap.add_argument("--docs", default=DOCS)
    ap.add_argument("--results", default=RESULTS)
    args = ap.parse_args(argv)
    with open(args.readme) as f:
        readme = f.read()
    new_readme = render_readme(readme, args.results)
    try:
        with open(args.docs) as f:
            docs = f.read()
    except FileNotFoundError:
        docs = ""
    new_docs = render_docs(args.results)
    if args.check:
        bad = []
        if new_readme != readme:
            names = [m.group("name") for m in BLOCK.finditer(readme)]
            bad.append(f"{args.readme}: results blocks {names} differ from the records")
        if new_docs != docs:
            bad.append(f"{args.docs} differs from the records")
        for b in bad:
            print(b + "; run `python benchmarks/report.py`", file=sys.stderr)
        return 1 if bad else 0
    if new_readme != readme:
        _write(args.readme, new_readme)
    if new_docs != docs:
        _write(args.docs, new_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
