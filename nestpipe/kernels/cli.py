"""``nestpipe kernels-info``: the path each kernel op takes on a device (the same record the trainer stores)."""

from __future__ import annotations

import json
import os

from nestpipe.kernels.select import FORCE_ENV, kernel_paths
from nestpipe.utils.host import describe_host, host_line


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "kernels-info", help="print the kernel path selected for each op on a device",
        description="Print the path (numba, fbgemm, triton, npu or the torch reference) that nestpipe.kernels' fixed "
        "rule selects for each op on a device kind, from the installed packages only (never timings), and the "
        f"{FORCE_ENV} override in effect. A run records what it actually executed in RUN/metrics.json "
        "(kernel_paths).")
    p.add_argument("--device", default="cpu", help="device kind: cpu, cuda or npu (default: cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run)


def _run(args) -> int:
    paths = kernel_paths(args.device)
    host = describe_host()
    if args.json:
        print(json.dumps({"device": args.device, "paths": paths, FORCE_ENV: os.environ.get(FORCE_ENV, ""),
                          "host": host}))
    else:
        print(host_line(host))
        for op, path in paths.items():
            print(f"{op:18s} {path}")
    return 0
