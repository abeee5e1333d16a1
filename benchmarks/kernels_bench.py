"""Benchmark of nestpipe.kernels: each op's selected fast path vs the unfused torch composition.

KuaiRand-like sizes by default: batch 512 x sequence 256 tokens of Zipf(1.2) ids over a 32M-row table, dim 64,
one owner holding the whole 32M-row store (about 8.2 GB of float32 weights + 128 MB of AdaGrad state).
Timings are medians of ``--reps`` runs; both sides of every ratio are measured in the same run.
Bandwidths count bytes read + written, like the memory-copy figure printed beside them.

    python benchmarks/kernels_bench.py                       # 32M rows (needs about 9 GB free)
    python benchmarks/kernels_bench.py --store-rows 4000000  # smaller store
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import psutil
import torch

import nestpipe.kernels as K
from nestpipe.kernels import reference as R
from nestpipe.kernels import routing


def timed(fn, reps, rotate=False):
    """Median time of ``fn()`` (or ``fn(i)`` for rep ``i`` when ``rotate``: a new batch each rep, so the store
    rows are not already in the (large) last-level cache from the previous rep)."""
    fn(reps) if rotate else fn()  # warm-up (and JIT compile/cache load) on a batch not timed
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i) if rotate else fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def zipf_ids(n, vocab, seed):
    return torch.from_numpy(np.random.default_rng(seed).zipf(1.2, n) % vocab).to(torch.int64)


def copy_bandwidth(reps):
    src = torch.ones(1024 * 1024 * 1024 // 4)  # 1 GiB: larger than the last-level cache
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store-rows", type=int, default=32_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--world", type=int, default=8, help="owners for the routing benchmark")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--threads", type=int, default=1,
        help="threads for torch and numba alike (default 1: on shared cores, multi-threaded timings of small ops "
        "measure the scheduler more than the kernels)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import numba

    numba.set_num_threads(args.threads)

    need = args.store_rows * (args.dim + 1) * 4
    free = psutil.virtual_memory().available
    if need > 0.8 * free:
        raise SystemExit(f"the store needs {need / 1e9:.1f} GB but only {free / 1e9:.1f} GB is free: use --store-rows")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch / {numba.get_num_threads()} numba threads; paths: {K.kernel_paths('cpu')}")
    vocab, dim, n_tok = args.store_rows, args.dim, args.batch * args.seq
    bw = copy_bandwidth(args.reps)
    print(f"memory copy bandwidth (read + write): {bw / 1e9:.1f} GB/s")

    t0 = time.perf_counter()
    weights = torch.empty(vocab, dim).fill_(0.01)
    state = torch.empty(vocab).fill_(0.1)
    print(f"store: {vocab:,} x {dim} float32 ({weights.numel() * 4 / 1e9:.2f} GB), filled in {time.perf_counter() - t0:.1f} s")

    ids_t, ids_t1 = zipf_ids(n_tok, vocab, 0), zipf_ids(n_tok, vocab, 1)
    # one batch per timed rep (+1 for the warm-up): owner-side unique local rows (one owner holds everything)
    batches = [K.route_keys(zipf_ids(n_tok, vocab, 100 + i), vocab, 1).send_rows for i in range(2 * (args.reps + 1))]
    fast_b, ref_b = batches[: args.reps + 1], batches[args.reps + 1 :]  # each side gets cold batches of its own
    rows = []  # (op, fast s, unfused s, bytes moved by the fast path or None)

    # Key routing: fbgemm bucketize vs a torch stable sort (dedup and hashing are shared by both).
    t_fast = timed(lambda: K.route_keys(ids_t, vocab, args.world), args.reps)
    t_ref = timed(lambda: routing.route(ids_t, None, vocab, args.world, None, use_fbgemm=False), args.reps)
    rows.append((f"route_keys (W={args.world})", t_fast, t_ref, None))

    # One owner holds the whole store: local row = placement hash.
    local_t = K.route_keys(ids_t, vocab, 1).send_rows
    routed = K.route_keys(ids_t, vocab, 1)
    n_unique = local_t.numel()
    print(f"tokens per batch {n_tok:,}, unique rows {n_unique:,}")

    n_fast = statistics.mean(b.numel() for b in fast_b[:-1])
    out = torch.empty(max(b.numel() for b in batches), dim)
    t_fast = timed(lambda i: K.gather_rows(weights, fast_b[i], out[: fast_b[i].numel()]), args.reps, rotate=True)
    t_ref = timed(lambda i: torch.index_select(weights, 0, ref_b[i], out=out[: ref_b[i].numel()]), args.reps, rotate=True)
    t_ref *= n_fast / statistics.mean(b.numel() for b in ref_b[:-1])  # per-row time at the fast side's row count
    rows.append(("gather_rows", t_fast, t_ref, 2 * n_fast * dim * 4))

    grads = torch.randn(out.shape[0], dim) * 1e-3
    t_fast = timed(lambda i: K.adagrad_update(weights, state, fast_b[i], grads[: fast_b[i].numel()], 1e-3), args.reps, rotate=True)
    t_ref = timed(lambda i: R.adagrad_update(weights, state, ref_b[i], grads[: ref_b[i].numel()], 1e-3, 1e-8), args.reps, rotate=True)
    t_ref *= n_fast / statistics.mean(b.numel() for b in ref_b[:-1])
    # weights read + written, grads read, state read + written
    rows.append(("adagrad_update", t_fast, t_ref, n_fast * (3 * dim * 4 + 8)))
    out = out[:n_unique]
    torch.index_select(weights, 0, local_t, out=out)

    buffer_rows = out.clone()
    inverse = routed.inverse
    grad_tok = torch.randn(n_tok, dim)

    def seq_fast():
        r = buffer_rows.clone().requires_grad_(True)
        K.sequence_lookup(r, inverse).backward(grad_tok)

    def seq_ref():
        r = buffer_rows.clone().requires_grad_(True)
        r.index_select(0, inverse).backward(grad_tok)

    rows.append(("sequence_lookup fwd+bwd", timed(seq_fast, args.reps), timed(seq_ref, args.reps), None))

    offsets = torch.arange(0, n_tok + 1, args.seq)
    grad_bag = torch.randn(args.batch, dim)

    def pooled_fast():
        r = buffer_rows.clone().requires_grad_(True)
        K.pooled_lookup(r, inverse, offsets).backward(grad_bag)

    def pooled_ref():
        r = buffer_rows.clone().requires_grad_(True)
        torch.nn.functional.embedding_bag(inverse, r, offsets[:-1], mode="sum").backward(grad_bag)

    rows.append(("pooled_lookup fwd+bwd", timed(pooled_fast, args.reps), timed(pooled_ref, args.reps), None))

    keys_t = routed.unique_keys
    keys_t1 = K.route_keys(ids_t1, vocab, 1).unique_keys
    active = out.clone()
    prefetch = torch.empty(keys_t1.numel(), dim)
    t_fast = timed(lambda: K.dual_buffer_sync(keys_t, active, keys_t1, prefetch), args.reps)
    t_ref = timed(lambda: R.dual_buffer_sync(keys_t, active, keys_t1, prefetch), args.reps)
    n_common = R.dual_buffer_sync(keys_t, active, keys_t1, prefetch)
    rows.append((f"dual_buffer_sync ({n_common:,} common)", t_fast, t_ref, None))

    bw_end = copy_bandwidth(args.reps)
    print(f"memory copy bandwidth at the end: {bw_end / 1e9:.1f} GB/s; percentages use the higher of the two")
    bw = max(bw, bw_end)
    print(f"\n{'op':34s} {'fast ms':>9s} {'unfused ms':>11s} {'speedup':>8s} {'fast GB/s':>10s} {'% of copy':>9s}")
    for op, fast, ref, nbytes in rows:
        gbs = f"{nbytes / fast / 1e9:10.1f} {100 * nbytes / fast / bw:8.0f}%" if nbytes else ""
        print(f"{op:34s} {fast * 1e3:9.2f} {ref * 1e3:11.2f} {ref / fast:7.2f}x {gbs}")


if __name__ == "__main__":
    main()
