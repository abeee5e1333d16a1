"""Benchmark of the nestpipe.kernels ops the trainer runs: each op's selected path vs the unfused torch composition.

The ops: ``gather_rows`` (the store's row gather), ``adagrad_update`` (the owner's entry update: sequence tables),
``dual_buffer_sync_rows`` (the prefetch buffer's sync from the store) and ``adagrad_bags`` (the owner's bag update
of pooled tables, against fbgemm's TBE CPU backward, the op under TorchRec's fused row-wise AdaGrad). The other
kernels of the package are not on the trainer's CPU path and are not timed here.

KuaiRand-like sizes by default: batch 512 x sequence 256 tokens of Zipf(1.2) ids over a 32M-row table, dim 64,
one owner holding the whole 32M-row store (about 8.2 GB of float32 weights + 128 MB of AdaGrad state).

Method (every ratio printed is measured in this one run):
  * fast path and reference alternate rep by rep (which one goes first alternates too), after two warm-up calls
    each; medians over ``--reps`` reps, with the spread (min-max of the per-rep ratios) beside them;
  * gather and AdaGrad use a fresh batch for every call (each side its own), so a batch's rows are not
    cache-hot from a previous call; Zipf's hot rows recur across batches and stay cached, as in training;
  * the clock is the CPU time of the benchmark thread with one thread (the cores here are shared: wall time
    includes time the process waits for a core), wall time with ``--threads`` > 1;
  * bandwidths count bytes read + written of the rows moved; the memory copy (a 512 MiB tensor into another, a
    working set above the last-level cache) is measured the same way, on the same clock, interleaved with the
    gather and AdaGrad reps; percentages divide by its median.

    python benchmarks/kernels_bench.py            # 32M rows (needs about 9.5 GB free), a few minutes
    python benchmarks/kernels_bench.py --quick    # 4M-row store, fewer reps: under a minute
    python benchmarks/kernels_bench.py --default-pages   # the store on 4 KiB pages (torch.empty), for comparison
    python benchmarks/kernels_bench.py --bags     # only the pooled owner update: Numba kernel vs fbgemm's TBE backward
    python benchmarks/kernels_bench.py --tuning   # the per-host choice: every bitwise-equal pair on the trainer's shapes

``--tuning``: every op with bitwise-equal paths (``nestpipe.kernels.tuning.EQUAL_PATHS``) timed by the trainer's own
calibration (``tuning.time_op``: alternating paths, thread CPU time, results compared bitwise) on the shapes of
``trainer_bench.py`` (pooled: 100k x 64 rows, 2 x 1,024 bags of 15-25 ids) and of its GR workload (unique-based: bags of
one row), with the choice the calibration makes and how long it took.

Writes the record ``benchmarks/results/kernels.json`` (``kernels-bags.json`` with ``--bags``, ``kernels-tuning.json``
with ``--tuning``; ``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import psutil
import torch

import nestpipe.kernels as K
from nestpipe.kernels import reference as R

from nestpipe.utils.host import describe_host, host_line
from nestpipe.kernels.memory import host_empty, host_zeros, huge_pages_mode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import Recorder  # noqa: E402

COPY_BYTES = 512 * 1024 * 1024


def zipf_ids(n, vocab, seed):
    return torch.from_numpy(np.random.default_rng(seed).zipf(1.2, n) % vocab).to(torch.int64)


def quantiles(values):
    v = sorted(values)
    return statistics.median(v), v[0], v[-1]


class Bench:
    def __init__(self, clock, reps):
        self.clock, self.reps = clock, reps
        self.copy_src = torch.ones(COPY_BYTES // 4)
        self.copy_dst = torch.empty_like(self.copy_src)
        self.copy_dst.copy_(self.copy_src)  # fault the destination's pages in before timing
        self.copy_bw = []  # (read + written bytes) / s of every copy sample

    def time(self, fn, *args):
        t0 = self.clock()
        fn(*args)
        return self.clock() - t0

    def copy_sample(self):
        self.copy_bw.append(2 * COPY_BYTES / self.time(self.copy_dst.copy_, self.copy_src))

    def interleaved(self, fns, batches=None, copy=False):
        """Per-rep times of each function in ``fns`` (a dict), run in alternating order rep by rep. With
        ``batches`` (lists of fresh batches, ``reps + 2`` each, as many lists as functions) every call gets a batch
        of its own and the time is per row (s / row); the lists rotate among the functions rep by rep, so no
        function keeps a luckier list. A batch may be a tuple (its first element counts the rows).
        ``copy``: take a memory-copy sample every rep."""
        names = list(fns)
        for w in range(2):  # warm-up (JIT load, allocator) on batches not timed
            for k, name in enumerate(names):
                fns[name](batches[k][self.reps + w]) if batches else fns[name]()
        times = {name: [] for name in names}
        for i in range(self.reps):
            for name in names if i % 2 == 0 else names[::-1]:
                if batches:
                    b = batches[(names.index(name) + i) % len(names)][i]
                    n = (b[0] if isinstance(b, tuple) else b).numel()
                    times[name].append(self.time(fns[name], b) / max(1, n))
                else:
                    times[name].append(self.time(fns[name]))
            if copy:
                self.copy_sample()
        return times


def anon_huge_bytes() -> int:
    """AnonHugePages of /proc/meminfo (0 where there is none): shows whether huge pages were really obtained."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def bags_bench(reps: int, rows: int, dim: int, bags: int) -> dict:
    """``adagrad_bags``, the owner update of pooled tables: the Numba kernel against fbgemm's TBE CPU backward (the
    op under TorchRec's fused row-wise AdaGrad) on one table of the trainer benchmark's pooled workload (``bags``
    bags of 15-25 uniform ids), a fresh batch per call, interleaved, thread CPU time; checks bitwise equality."""
    import fbgemm_gpu  # noqa: F401  (required here: the comparison is the point)

    from nestpipe.kernels import tbe

    rng = np.random.default_rng(0)
    batches = []
    for _ in range(reps + 2):
        lens = rng.integers(15, 26, size=bags)
        idx = torch.from_numpy(rng.integers(0, rows, size=int(lens.sum())))
        off = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]))
        batches.append((idx, off, torch.from_numpy(rng.standard_normal((bags, dim), dtype=np.float32))))
    weights = {k: torch.from_numpy(rng.standard_normal((rows, dim), dtype=np.float32) * 0.01) for k in ("a", "b")}
    weights["b"].copy_(weights["a"])
    state = {k: torch.full((rows,), 0.1) for k in ("a", "b")}
    times = {"numba": [], "fbgemm": []}
    for i in range(reps + 2):
        idx, off, g = batches[i]
        order = ("numba", "fbgemm") if i % 2 == 0 else ("fbgemm", "numba")
        for name in order:
            w, s = (weights["a"], state["a"]) if name == "numba" else (weights["b"], state["b"])
            t0 = time.thread_time()
            if name == "numba":
                with K.forced({"adagrad_bags": "numba"}):
                    K.adagrad_bags(w, s, idx, off, g, 0.01)
            else:
                tbe.adagrad_bags(w, s, idx, off, g, 0.01, 1e-8)
            if i >= 2:
                times[name].append(time.thread_time() - t0)
    same = torch.equal(weights["a"], weights["b"]) and torch.equal(state["a"], state["b"])
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(host_line(describe_host()))
    print(f"adagrad_bags, {rows:,} x {dim} table, {bags} bags of 15-25 ids, {reps} reps (thread CPU ms, median): "
          f"numba {med['numba']:.2f}, fbgemm TBE backward {med['fbgemm']:.2f}; fbgemm / numba "
          f"{med['fbgemm'] / med['numba']:.2f}; tables bitwise equal after {reps + 2} updates: {same}")
    ratios = [f / n for f, n in zip(times["fbgemm"], times["numba"])]
    return {"rows": rows, "dim": dim, "bags": bags, "reps": reps, "numba_ms": round(med["numba"], 3),
            "fbgemm_tbe_ms": round(med["fbgemm"], 3), "fbgemm_over_numba": round(med["fbgemm"] / med["numba"], 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3), "bitwise_equal": same}


def tuning_bench(reps: int) -> dict:
    """The calibration's own timing of every bitwise-equal pair, on the trainer benchmark's pooled shape and a GR
    (unique-based) shape, and the choice it makes; how long one calibration takes."""
    from nestpipe.kernels import tuning

    print(host_line(describe_host()))
    out = {"shapes": {}}
    for name, shape in (("pooled", tuning.TuneShape(100_000, 64, 2 * 1024, 20)),
                        ("gr", tuning.TuneShape(tuning.MAX_ROWS, 128, 2 * 64 * 100, 1))):
        res = {}
        for op in tuning.EQUAL_PATHS:
            paths = tuning.candidates(op)
            if not paths:
                continue
            timings, equal = tuning.time_op(op, shape, paths, reps=reps)
            res[op] = {"timings_ms": timings, "bitwise_equal": equal}
            print(f"{name:7s} {op:18s} " + ", ".join(f"{p} {ms:.3f} ms" for p, ms in timings.items())
                  + f"; bitwise equal: {equal}")
        t0 = time.perf_counter()
        chosen = tuning.calibrate(shape)
        took = time.perf_counter() - t0
        print(f"{name:7s} calibration ({shape.key()}): {took:.2f} s, chooses "
              + ", ".join(f"{op} {c['path']} (rule {c['rule']})" for op, c in chosen.items()))
        out["shapes"][name] = {"shape": shape.key(), "ops": res, "calibration_s": round(took, 3),
                               "choice": {op: c["path"] for op, c in chosen.items()},
                               "rule": {op: c["rule"] for op, c in chosen.items()}}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-bags", action="store_true", help="leave out the pooled owner update (adagrad_bags)")
    ap.add_argument("--bags", action="store_true",
                    help="only the pooled owner update: adagrad_bags' Numba kernel vs fbgemm's TBE CPU backward on "
                    "one table of the trainer benchmark (100k x 64, 2,048 bags), bitwise equality checked")
    ap.add_argument("--store-rows", type=int, default=None, help="default 32M (4M with --quick)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--reps", type=int, default=None, help="timed reps per op (default 15, 7 with --quick)")
    ap.add_argument("--quick", action="store_true", help="4M-row store and fewer reps (under a minute)")
    ap.add_argument("--default-pages", action="store_true",
                    help="allocate the store with torch.empty (4 KiB pages) instead of the trainer's store allocator "
                         "(nestpipe.kernels.memory: transparent huge pages where Linux offers them)")
    ap.add_argument("--no-gather-variants", action="store_true", help="skip the table of gather alternatives")
    ap.add_argument("--prefetch-grid", action="store_true",
                    help="also time the row-wise AdaGrad loop over a grid of software-prefetch settings (cache level, "
                    "lines per row, rows ahead), each call cold (after a 512 MiB copy)")
    ap.add_argument(
        "--threads", type=int, default=1,
        help="threads for torch and numba alike (default 1: the cores here are shared; with more than one the "
        "clock is wall time)",
    )
    ap.add_argument("--tuning", action="store_true",
                    help="only the per-host choice: every bitwise-equal pair of paths timed on the trainer's shapes")
    args = ap.parse_args()
    rec = Recorder("kernels-tuning" if args.tuning else "kernels-bags" if args.bags else "kernels", script=__file__)
    store_rows = args.store_rows or (4_000_000 if args.quick else 32_000_000)
    reps = args.reps or (7 if args.quick else 15)
    torch.set_num_threads(args.threads)
    if args.bags:
        rec.write({"adagrad_bags": bags_bench(reps, 100_000, args.dim, 2048), "threads": args.threads})
        return
    if args.tuning:
        rec.write(tuning_bench(reps))
        return
    import numba

    from nestpipe.kernels import cpu

    numba.set_num_threads(args.threads)
    clock_name = "thread CPU time" if args.threads == 1 else "wall time"
    bench = Bench(time.thread_time if args.threads == 1 else time.perf_counter, reps)

    need = store_rows * (args.dim + 1) * 4
    free = psutil.virtual_memory().available
    if need > 0.8 * free:
        raise SystemExit(f"the store needs {need / 1e9:.1f} GB but only {free / 1e9:.1f} GB is free: use --store-rows")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch / {numba.get_num_threads()} numba threads, "
          f"clock: {clock_name}, {reps} reps; paths: {K.kernel_paths('cpu')}")
    vocab, dim, n_tok = store_rows, args.dim, args.batch * args.seq

    t0 = time.perf_counter()
    huge_before = anon_huge_bytes()
    if args.default_pages:
        weights, state = torch.empty(vocab, dim), torch.empty(vocab)
    else:  # what RowStore allocates
        weights, state = host_empty((vocab, dim)), host_zeros((vocab,))
    weights.fill_(0.01)
    state.fill_(0.1)
    pages = "default pages" if args.default_pages else f"store allocator, huge pages: {huge_pages_mode()}"
    pages += f"; AnonHugePages grew by {(anon_huge_bytes() - huge_before) / 2**30:.2f} GiB"
    print(f"store: {vocab:,} x {dim} float32 ({weights.numel() * 4 / 1e9:.2f} GB, {pages}), "
          f"filled in {time.perf_counter() - t0:.1f} s")

    seed = iter(range(100, 1_000_000))

    def fresh_batches():  # owner-side sorted unique local rows (one owner holds everything), reps + 2 batches
        return [K.route_keys(zipf_ids(n_tok, vocab, next(seed)), vocab, 1).send_rows for _ in range(reps + 2)]

    ids_t, ids_t1 = zipf_ids(n_tok, vocab, 0), zipf_ids(n_tok, vocab, 1)
    routed = K.route_keys(ids_t, vocab, 1)
    n_unique = routed.send_rows.numel()
    print(f"tokens per batch {n_tok:,}, unique rows {n_unique:,}")
    out = torch.empty(3 * n_unique, dim)
    results = []  # (op, {"fast": per-rep s, "ref": per-rep s}, rows per call or None, bytes per row or None)

    # Row gather (selected path vs index_select, the same op on CPU today).
    t = bench.interleaved({
        "fast": lambda b: K.gather_rows(weights, b, out[: b.numel()]),
        "ref": lambda b: torch.index_select(weights, 0, b, out=out[: b.numel()]),
    }, [fresh_batches(), fresh_batches()], copy=True)
    results.append(("gather_rows", t, n_unique, 2 * dim * 4))

    grads = torch.randn(out.shape[0], dim) * 1e-3
    t = bench.interleaved({
        "fast": lambda b: K.adagrad_update(weights, state, b, grads[: b.numel()], 1e-3),
        "ref": lambda b: R.adagrad_update(weights, state, b, grads[: b.numel()], 1e-3, 1e-8, check_distinct=False),
    }, [fresh_batches(), fresh_batches()], copy=True)
    # weights read + written, grads read, state read + written
    results.append(("adagrad_update", t, n_unique, 3 * dim * 4 + 8))

    # the trainer's form: local rows of batches t and t+1, rows copied from the store into the prefetch buffer
    rows_t, rows_t1 = routed.send_rows, K.route_keys(ids_t1, vocab, 1).send_rows
    n_common = int(np.intersect1d(rows_t.numpy(), rows_t1.numpy()).size)
    prefetch_w = torch.empty(rows_t1.numel(), dim)
    t = bench.interleaved({
        "fast": lambda: K.dual_buffer_sync_rows(rows_t, rows_t1, weights, None, prefetch_w, None, from_store=True),
        "ref": lambda: R.dual_buffer_sync_rows(rows_t, rows_t1, weights, None, prefetch_w, None, True),
    })
    results.append((f"dual_buffer_sync_rows ({n_common:,} common rows)", t, None, None))

    bw = statistics.median(bench.copy_bw)
    bw_med, bw_min, bw_max = quantiles(bench.copy_bw)
    print(f"memory copy (read + write, {COPY_BYTES >> 20} MiB, {len(bench.copy_bw)} samples): "
          f"median {bw_med / 1e9:.1f} GB/s [{bw_min / 1e9:.1f}-{bw_max / 1e9:.1f}]")
    print(f"\n{'op':34s} {'fast ms':>8s} {'unfused ms':>10s} {'speedup [min-max]':>20s} {'fast GB/s':>10s} "
          f"{'% of copy [min-max]':>20s}")
    ops = []
    for op, t, n_rows, row_bytes in results:
        scale = n_rows or 1  # rotating ops: per-row times, shown at this batch's row count
        fast, ref = statistics.median(t["fast"]) * scale, statistics.median(t["ref"]) * scale
        s_med, s_min, s_max = quantiles([r / f for f, r in zip(t["fast"], t["ref"])])
        line = f"{op:34s} {fast * 1e3:8.2f} {ref * 1e3:10.2f} {s_med:7.2f}x [{s_min:.2f}-{s_max:.2f}]"
        row = {"op": op, "fast_ms": round(fast * 1e3, 3), "unfused_ms": round(ref * 1e3, 3),
               "speedup": round(s_med, 3), "speedup_min": round(s_min, 3), "speedup_max": round(s_max, 3)}
        if row_bytes:
            g_med, g_min, g_max = quantiles([row_bytes / x for x in t["fast"]])
            line += f" {g_med / 1e9:10.2f} {100 * g_med / bw:8.0f}% [{100 * g_min / bw:.0f}-{100 * g_max / bw:.0f}]"
            row.update(gb_per_s=round(g_med / 1e9, 3), copy_share=round(g_med / bw, 3),
                       copy_share_min=round(g_min / bw, 3), copy_share_max=round(g_max / bw, 3))
        print(line)
        ops.append(row)
    figures = {"store_rows": vocab, "dim": dim, "batch": args.batch, "seq": args.seq, "unique_rows": n_unique,
               "reps": reps, "threads": args.threads, "clock": clock_name, "pages": pages,
               "paths": {op: K.kernel_paths("cpu")[op] for op in ("gather_rows", "adagrad_update", "adagrad_bags",
                                                                  "dual_buffer_sync")},
               "copy_gb_per_s": round(bw_med / 1e9, 2), "ops": ops}
    if not args.no_bags:
        figures["adagrad_bags"] = bags_bench(reps, 100_000, args.dim, 2048)
    rec.write(figures)

    if args.prefetch_grid:
        prefetch_grid(bench, weights, state, grads, fresh_batches, reps, dim)
    if args.no_gather_variants:
        return
    # Gather alternatives on fresh sorted batches, interleaved, each against the same copy median.
    # Every batch is (sorted rows, the same rows shuffled, a contiguous run of as many rows at a random offset).
    wn, on = weights.numpy(), out.numpy()
    variants = {
        "torch index_select (selected)": lambda b: torch.index_select(weights, 0, b[0], out=out[: b[0].numel()]),
        "fbgemm index_select_dim0": lambda b: torch.ops.fbgemm.index_select_dim0(weights, b[0]),
        "numba loop": lambda b: cpu._gather(wn, b[0].numpy(), on, 0),
        f"numba loop, prefetch {cpu.PREFETCH_DISTANCE} rows ahead": lambda b: cpu._gather(wn, b[0].numpy(), on, cpu.PREFETCH_DISTANCE),
    }

    def unsorted_direct(b):  # rows in request order (shuffled): index_select as they come
        torch.index_select(weights, 0, b[1], out=out[: b[1].numel()])

    def unsorted_via_sort(b):  # sort, gather in ascending row order, scatter into the requested order
        order = torch.argsort(b[1])
        out[: b[1].numel()].index_copy_(0, order, weights.index_select(0, b[1][order]))

    def contiguous(b):  # control: as many rows, but one contiguous run
        torch.index_select(weights, 0, b[2], out=out[: b[2].numel()])

    def strided(b):  # control: as many rows, 17 rows (4.3 KB) apart: a 4 KiB page each, within about 100 MB
        torch.index_select(weights, 0, b[3], out=out[: b[3].numel()])

    variants["unsorted rows, index_select as given"] = unsorted_direct
    variants["unsorted rows, sort + gather + scatter"] = unsorted_via_sort
    variants["control: contiguous rows, index_select"] = contiguous
    variants["control: rows 4.3 KB apart, index_select"] = strided
    gen = torch.Generator().manual_seed(7)

    def triple(b):
        start = int(torch.randint(0, max(1, vocab - b.numel()), (1,), generator=gen))
        wide = int(torch.randint(0, max(1, vocab - 17 * b.numel()), (1,), generator=gen))
        return (b, b[torch.randperm(b.numel(), generator=gen)], torch.arange(start, start + b.numel()),
                torch.arange(wide, wide + 17 * b.numel(), 17))

    batches = [[triple(b) for b in fresh_batches()] for _ in variants]
    t = bench.interleaved(variants, batches, copy=True)
    bw = statistics.median(bench.copy_bw)
    print(f"\ngather alternatives (fresh batches, bytes read + written / {clock_name}; copy median now "
          f"{bw / 1e9:.1f} GB/s)")
    for name in variants:
        g_med, g_min, g_max = quantiles([2 * dim * 4 / x for x in t[name]])
        print(f"  {name:44s} {g_med / 1e9:6.2f} GB/s {100 * g_med / bw:5.0f}% of copy "
              f"[{100 * g_min / bw:.0f}-{100 * g_max / bw:.0f}]")


def _adagrad_with_prefetch(locality: int, lines: int):
    """The fused row-wise AdaGrad loop (serial; the row body of ``nestpipe.kernels.cpu``) with its software prefetch
    parameterised: ``llvm.prefetch`` at ``locality`` (3: all cache levels ... 0: non-temporal) of the first
    ``lines`` 64-byte lines of the row ``distance`` rows ahead, and of its AdaGrad state."""
    import numba

    from nestpipe.kernels import cpu

    prefetch = cpu.prefetch_intrinsic(locality)
    apply_row = cpu._apply_row

    @numba.njit(nogil=True)
    def kernel(weights, state, rows, grads, lr, eps, distance):
        n, dim = grads.shape
        inv_dim = np.float32(dim)
        flat = weights.reshape(-1)
        for i in range(n):
            if distance > 0 and i + distance < n:
                ahead = rows[i + distance]
                prefetch(state, ahead)
                for k in range(lines):
                    prefetch(flat, ahead * dim + 16 * k)
            apply_row(weights, state, rows[i], grads[i], dim, inv_dim, lr, eps, np.float32(1.0), False)

    return kernel


def prefetch_grid(bench, weights, state, grads, fresh_batches, reps, dim):
    """% of the copy bandwidth of the AdaGrad loop per prefetch setting, every call after a cache-evicting copy."""
    settings = [(loc, lines, dist) for loc in (3, 1, 0) for lines in (1, 2, 4) for dist in (0, 8, 16, 32)
                if not (dist == 0 and (loc, lines) != (3, 4))]
    kernels = {(loc, lines): _adagrad_with_prefetch(loc, lines) for loc, lines, _ in settings}
    w, st = weights.numpy(), state.numpy()
    lr, eps = np.float32(1e-3), np.float32(1e-8)
    batches = fresh_batches()
    for b in batches[:2]:  # compile every variant before timing
        for loc, lines in kernels:
            kernels[(loc, lines)](w, st, b.numpy(), grads[: b.numel()].numpy(), lr, eps, 8)
    times = {s: [] for s in settings}
    for i in range(reps):
        order = settings if i % 2 == 0 else settings[::-1]
        for s in order:
            b = batches[i % len(batches)]  # one batch per rep for every setting (the copy evicts it in between)
            rows, g = b.numpy(), grads[: b.numel()].numpy()
            bench.copy_sample()  # evicts the cache, and samples the copy bandwidth
            t0 = bench.clock()
            kernels[s[:2]](w, st, rows, g, lr, eps, s[2])
            times[s].append((bench.clock() - t0) / b.numel())
    bw = statistics.median(bench.copy_bw)
    print(f"\nrow-wise AdaGrad loop by software prefetch (cold calls; copy median {bw / 1e9:.1f} GB/s):")
    row_bytes = 3 * dim * 4 + 8
    for s in sorted(settings, key=lambda s: statistics.median(times[s])):
        g_med, g_min, g_max = quantiles([row_bytes / x for x in times[s]])
        label = "no prefetch" if s[2] == 0 else f"locality {s[0]}, {s[1]} line(s), {s[2]:2d} rows ahead"
        print(f"  {label:40s} {g_med / 1e9:6.2f} GB/s {100 * g_med / bw:5.0f}% of copy "
              f"[{100 * g_min / bw:.0f}-{100 * g_max / bw:.0f}]")


if __name__ == "__main__":
    main()
