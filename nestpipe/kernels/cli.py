"""``nestpipe kernels-info``: the path each kernel op takes on a device (the same record the trainer stores), and this
host's measured choices; ``nestpipe kernels-tune``: measure them now."""

from __future__ import annotations

import json
import os

from nestpipe.kernels import tuning
from nestpipe.kernels.select import FORCE_ENV, kernel_paths, kernel_rule
from nestpipe.utils.host import describe_host, host_line


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "kernels-info", help="print the kernel path selected for each op on a device, and this host's measured choices",
        description="Print the path (numba, fbgemm, triton, npu or the torch reference) each op takes on a device "
        "kind: the fixed rule's (from the installed packages), the measured choice where this host has one (CPU: "
        "among paths that compute bitwise the same result, cached by `nestpipe kernels-tune` or a training run), and "
        f"the {FORCE_ENV} override in effect. A run records what it executed in RUN/metrics.json (kernel_paths, "
        "kernel_choice).")
    p.add_argument("--device", default="cpu", help="device kind: cpu, cuda or npu (default: cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_info)

    t = subparsers.add_parser(
        "kernels-tune", help="time the bitwise-equal kernel paths on this host and cache the fastest",
        description="Time every op that has more than one path computing bitwise the same result ("
        + ", ".join(f"{op}: {' / '.join(paths)}" for op, paths in tuning.EQUAL_PATHS.items())
        + ") on one shape, check their results are equal, and cache the fastest for this host (CPU model, "
        "instruction sets, cores, library versions) under $NESTPIPE_CACHE_DIR or ~/.cache/nestpipe. Training does "
        "the same on its own shapes at start (train.tune_kernels); this command measures ahead or re-measures.")
    t.add_argument("--rows", type=int, default=1 << 17, help="table rows (default 131072)")
    t.add_argument("--dim", type=int, default=64, help="row width (default 64)")
    t.add_argument("--bags", type=int, default=2048, help="bags per update: batch x ranks (default 2048)")
    t.add_argument("--pooling", type=int, default=20, help="ids per bag (default 20; 1 for sequence tables)")
    t.add_argument("--json", action="store_true", help="print one JSON object")
    t.set_defaults(func=_tune)


def _info(args) -> int:
    paths = kernel_paths(args.device)
    rule = kernel_rule(args.device)
    host = describe_host()
    fp = tuning.host_fingerprint()
    cached = tuning.load_cache(fp)
    if args.json:
        print(json.dumps({"device": args.device, "paths": paths, "rule": rule, FORCE_ENV: os.environ.get(FORCE_ENV, ""),
                          "host": host, "cache": tuning.cache_path(fp), "measured": cached}))
        return 0
    print(host_line(host))
    for op, path in paths.items():
        print(f"{op:18s} {path}" + (f"   (rule: {rule[op]})" if rule[op] != path else ""))
    print(f"measured choices ({tuning.cache_path(fp)}): " + ("none yet" if not cached else ""))
    for shape, ops in sorted(cached.items()):
        for op, c in ops.items():
            times = ", ".join(f"{p} {ms:.3f} ms" for p, ms in c["timings_ms"].items())
            print(f"  {shape:24s} {op:18s} {c['path']:10s} ({times}; rule {c['rule']})")
    return 0


def _tune(args) -> int:
    shape = tuning.TuneShape(args.rows, args.dim, args.bags, args.pooling)
    fp = tuning.host_fingerprint()
    measured = tuning.calibrate(shape)
    path = tuning.store_cache(fp, shape.key(), measured)
    if args.json:
        print(json.dumps({"shape": shape.key(), "measured": measured, "cache": path}))
        return 0
    print(host_line(describe_host()))
    if not measured:
        print("nothing to tune here: no op has two available paths that compute the same result")
    for op, c in measured.items():
        times = ", ".join(f"{p} {ms:.3f} ms" for p, ms in c["timings_ms"].items())
        note = "" if c["equal"] else "  (results differed: the rule's path kept)"
        print(f"{op:18s} {c['path']:10s} {times}; rule {c['rule']}{note}")
    print(f"cached for shape {shape.key()} in {path}")
    return 0
