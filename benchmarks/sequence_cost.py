"""Fit the per-sequence cost model of cost-balanced GR batches on this machine.

    python benchmarks/sequence_cost.py [--lengths 16 32 64 128 256 512 1024] [--dim 64]

Times the default HSTU layer stack's forward + backward (jagged attention, one thread) per sequence of each length,
fits ``c(n) = a n^2 + b n`` (:mod:`nestpipe.measure.sequence_cost`) and prints the fit, its relative error per
length and the ``--sequence-cost A,B`` argument of ``nestpipe ingest`` that uses it.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from nestpipe.measure.sequence_cost import fit, relative_errors, sequence_seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--out", default="", help="also write the figures here (JSON)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load = os.getloadavg()
    secs = sequence_seconds(args.lengths, args.dim)
    cost = fit(secs)
    err = relative_errors(cost, secs)
    for n, s in secs.items():
        print(f"n {n:5d}: {s * 1e3:8.3f} ms per sequence, model {cost(n) * 1e3:8.3f} ms ({err[n]:+.1%})")
    print(f"a = {cost.a:.3g} s/token^2, b = {cost.b:.3g} s/token (b / a = {cost.b / cost.a:.0f} tokens)" if cost.a
          else f"a = 0, b = {cost.b:.3g} s/token")
    print(f"nestpipe ingest ... --sequence-cost {cost.a:.2g},{cost.b:.2g}")
    print(f"load average {load[0]:.2f} before / {os.getloadavg()[0]:.2f} after")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"seconds": secs, "fit": cost.to_dict(), "relative_errors": err, "torch": torch.__version__,
                       "load_before": load, "load_after": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
