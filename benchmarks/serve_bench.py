"""Latency and throughput of `nestpipe serve` with the prefix cache against the same server without it.

    python benchmarks/serve_bench.py --run RUN [--lengths 64 256 1024] [--candidates 100 200 500]
                                     [--concurrency 1 2 4] [--requests 24] [--out results.json]

RUN: an hstu run trained with the history length to serve (`--max-seq-len 1024` shards; its shape is printed;
the weights do not matter for timing). For each server, cached (`--cache-mb 1024`) and uncached (`--cache-mb 0`:
every request recomputes the user's stored window), each with a fresh `--history` file (the default: every accepted
event written to SQLite), started as a subprocess on a free loopback port, and for every
(history length H, candidates K, concurrency C): C users are prefilled with H - R events (R = --requests), then a
load generator in its own process runs C closed-loop clients, each sending its own user R rank requests of one
new event and K candidates, so the window grows from H - R to H without a rebase. Per point: p50 / p99 latency,
throughput (requests / wall second), the hit rate. "Throughput within SLO": the highest throughput among the points
of one (H, K) whose p99 is within the SLO (50 ms, or the uncached p99 at concurrency 1 when that is above 50 ms).
A run at hand: the jagged end-to-end run `benchmarks/hstu_bench.py` leaves (`/tmp/nestpipe-hstu-bench/e2e-jagged`,
medium data at `--max-seq-len 1024`). Writes the record ``benchmarks/results/serve.json`` (``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

from nestpipe.serving.front import free_port

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import Recorder  # noqa: E402


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def start_server(run: str, cache_mb: float, history: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nestpipe", "serve", "--run", run, "--port", str(port),
                             "--cache-mb", str(cache_mb), "--history", history],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600  # loading a large run on a loaded machine takes minutes
    while True:
        try:
            with urllib.request.urlopen(base + "/healthz", timeout=2):
                return proc, base
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                if proc.poll() is None:  # its stderr stays open while it runs: stop it before reading
                    proc.kill()
                    proc.wait()
                raise SystemExit(f"server did not start: {proc.stderr.read()[-2000:].decode()}")
            time.sleep(0.3)


def events(rng, n: int, t0: int):
    return [{"item_id": int(i), "action": int(a), "time_ms": t0 + k}
            for k, (i, a) in enumerate(zip(rng.integers(0, 100_000, n), rng.integers(0, 64, n)))]


def load(base: str, users, requests: int, k: int, t0: int, q) -> None:
    """The load generator (its own process): one closed-loop client thread per user."""
    lat, hits = [], []
    lock = threading.Lock()

    def client(u):
        rng = np.random.default_rng(u)
        for r in range(requests):
            body = {"user_id": u, "events": events(rng, 1, t0 + r), "candidates": rng.integers(0, 100_000, k).tolist()}
            t = time.perf_counter()
            out = post(base + "/v1/rank", body)
            dt = time.perf_counter() - t
            with lock:
                lat.append(dt)
                hits.append(out["cache"] == "hit")

    threads = [threading.Thread(target=client, args=(u,)) for u in users]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    q.put({"latencies": lat, "hits": hits, "wall": time.perf_counter() - t})


def point(base: str, H: int, K: int, C: int, R: int, user0: int) -> dict:
    users = list(range(user0, user0 + C))
    rng = np.random.default_rng(user0)
    for u in users:
        post(base + "/v1/prefill", {"user_id": u, "events": events(rng, H - R, 0)})
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=load, args=(base, users, R, K, H, q))
    p.start()
    res = q.get()
    p.join()
    lat = np.array(res["latencies"]) * 1e3
    return {"H": H, "K": K, "C": C, "requests": len(lat), "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "throughput_rps": len(lat) / res["wall"],
            "hit_rate": float(np.mean(res["hits"]))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--candidates", type=int, nargs="+", default=[100, 200, 500])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--requests", type=int, default=24, help="rank requests per client and point")
    ap.add_argument("--slo-ms", type=float, default=50.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rec = Recorder("serve", argv, __file__)
    cfg = json.load(open(os.path.join(args.run, "config.json")))
    man = json.load(open(os.path.join(args.run, "manifest.json")))
    shape = {"max_seq_len": man.get("max_seq_len"), "dim": man["tables"]["item"]["dim"],
             "items": man["tables"]["item"]["vocab"], "hstu": cfg.get("hstu")}
    print(f"model: {shape}", flush=True)
    if max(args.lengths) > int(shape["max_seq_len"] or 0):
        raise SystemExit(f"{args.run}: trained with max_seq_len {shape['max_seq_len']} < {max(args.lengths)}")
    load0 = os.getloadavg()
    results = {}
    user0 = 1
    work = tempfile.mkdtemp(prefix="serve-bench-")
    for name, cache_mb in (("cached", 1024.0), ("uncached", 0.0)):
        # a fresh history file per server: the default configuration (every accepted event written to SQLite)
        proc, base = start_server(args.run, cache_mb, os.path.join(work, f"{name}.sqlite"))
        rows = []
        try:
            for H in args.lengths:
                for K in args.candidates:
                    for C in args.concurrency:
                        r = point(base, H, K, C, min(args.requests, H - 1), user0)
                        user0 += C
                        rows.append(r)
                        print(f"{name:8s} H {H:5d} K {K:4d} C {C}: p50 {r['p50_ms']:7.1f} ms, p99 "
                              f"{r['p99_ms']:7.1f} ms, {r['throughput_rps']:6.1f} req/s, hits "
                              f"{r['hit_rate']:.2f}", flush=True)
            stats = json.loads(urllib.request.urlopen(base + "/v1/stats").read())
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        results[name] = {"points": rows, "stats": stats}
    summary = {}
    for H in args.lengths:
        for K in args.candidates:
            pick = lambda n: [r for r in results[n]["points"] if r["H"] == H and r["K"] == K]  # noqa: E731
            unc1 = [r for r in pick("uncached") if r["C"] == 1][0]["p99_ms"]
            slo = max(args.slo_ms, unc1)
            within = {n: max([r["throughput_rps"] for r in pick(n) if r["p99_ms"] <= slo] or [0.0])
                      for n in ("cached", "uncached")}
            c1 = {n: [r for r in pick(n) if r["C"] == 1][0]["p99_ms"] for n in ("cached", "uncached")}
            summary[f"H{H}-K{K}"] = {
                "p99_ms_c1": c1, "p99_ratio_cached_over_uncached_c1": c1["cached"] / c1["uncached"],
                "slo_ms": slo, "throughput_within_slo": within,
                "throughput_ratio": within["cached"] / within["uncached"] if within["uncached"] else None}
            s = summary[f"H{H}-K{K}"]
            print(f"H {H} K {K}: p99 at C=1 cached {c1['cached']:.1f} / uncached {c1['uncached']:.1f} ms "
                  f"({s['p99_ratio_cached_over_uncached_c1']:.2f}); throughput within {slo:.0f} ms p99: "
                  f"{within['cached']:.1f} vs {within['uncached']:.1f} req/s", flush=True)
    out = {"model": shape, "summary": summary, "results": results, "args": vars(args),
           "versions": {"python": platform.python_version()}, "cpus": os.cpu_count(),
           "load_average": {"before": load0, "after": os.getloadavg()}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(f"load average {load0[0]:.2f} before / {os.getloadavg()[0]:.2f} after")
    rec.write(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
