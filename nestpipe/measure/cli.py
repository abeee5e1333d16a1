"""``nestpipe simulate``: the step-timeline model of every pipeline mode, from the paper's scale down to this
machine. The prediction is :mod:`nestpipe.planning`'s (pure); ``--calibrate RUN`` fits it to a measured run of this
trainer (:mod:`nestpipe.measure.measured`), which is why the command lives above the trainer."""

from __future__ import annotations

import json
import os

from nestpipe.planning import calibration, simulate
from nestpipe.planning._io import parse_overrides
from nestpipe.planning.cost_model import MODES, Scales, Scenario
from nestpipe.planning.hardware import HARDWARE_PRESETS, load_hardware
from nestpipe.planning.timeline import write_gantt
from nestpipe.planning.workload import WORKLOAD_PRESETS, load_workload
from nestpipe.utils.jsonio import write_json_atomic


def add_parser(sub) -> None:
    s = sub.add_parser("simulate", help="predict step time, QPS, scaling and exposed costs from 2 to 4,096 workers",
                       description="Event-based step timeline of off (TorchRec-like), 2D-SP, DBP, FWP, nested and "
                                   "nested + 2D-SP; calibrated on a measured off-mode breakdown (default: the "
                                   "paper's TorchRec breakdown at 1,536 workers). Model: docs/planning.md.")
    s.add_argument("--workload", default="paper-hstu",
                   help=f"preset ({', '.join(WORKLOAD_PRESETS)}) or a JSON/TOML file of WorkloadConfig fields "
                   "(default: paper-hstu)")
    s.add_argument("--hardware", default="ascend-910b",
                   help=f"preset ({', '.join(HARDWARE_PRESETS)}) or a JSON/TOML file of HardwareConfig fields "
                   "(default: ascend-910b)")
    s.add_argument("--set-workload", nargs="*", default=[], metavar="KEY=VALUE",
                   help="override WorkloadConfig fields, e.g. micro_batches=16 (docs/planning.md lists them)")
    s.add_argument("--set-hardware", nargs="*", default=[], metavar="KEY=VALUE",
                   help="override HardwareConfig fields, e.g. net_bw=5e10 all2all=hierarchical")
    cal = s.add_mutually_exclusive_group()
    cal.add_argument("--breakdown", help="JSON {workers, step_ms, lookup_ms, comm_ms} of a measured off-mode step")
    cal.add_argument("--calibrate", metavar="RUN",
                     help="a `nestpipe train --pipeline off` run directory (world >= 2): fit this machine's lookup, "
                          "collective, dense and overhead costs and predict the trainer's step on it")
    cal.add_argument("--uncalibrated", action="store_true", help="use the raw preset model")
    s.add_argument("--workers", type=int, nargs="*", default=None, help="worker counts (default 2 .. 4096)")
    s.add_argument("--modes", nargs="*", default=None, help="subset of off 2dsp dbp fwp nested nested+2dsp")
    s.add_argument("--reference-workers", type=int, default=None, help="scaling-efficiency reference")
    s.add_argument("--no-clustering", action="store_true", help="random micro-batch partition")
    s.add_argument("--gantt-workers", type=int, default=None, help="worker count of the Gantt charts")
    s.add_argument("--out", help="directory for results.json, scaling.png and gantt-MODE.png")
    s.add_argument("--json", action="store_true", help="print the results as JSON")
    s.add_argument("--predict-shards", metavar="DIR",
                   help="with --calibrate: predict training on these shards (e.g. another micro-batch count; default "
                        "the run's)")
    s.add_argument("--link-bit-per-s", type=float, default=None,
                   help="with --calibrate: a bandwidth cap every rank's traffic shares (tc tbf rate, MTU 1500)")
    s.add_argument("--cores", type=int, default=None, help="with --calibrate: cores the ranks share (default: this "
                                                           "machine's)")
    s.set_defaults(func=_simulate)


def _simulate(args) -> int:
    if args.calibrate:
        return _simulate_measured(args)
    wl = load_workload(args.workload, parse_overrides(args.set_workload, "--set-workload"))
    hw = load_hardware(args.hardware, parse_overrides(args.set_hardware, "--set-hardware"))
    if args.uncalibrated:
        bd, scales = None, Scales()
    else:
        bd = calibration.load_breakdown(args.breakdown) if args.breakdown else calibration.PAPER_TORCHREC_1536
        scales = calibration.calibrate(wl, hw, bd)
    modes = args.modes or list(MODES)
    for m in modes:
        if m not in MODES:
            raise ValueError(f"--modes: unknown mode {m!r} (known: {' '.join(MODES)})")
    workers = args.workers or list(simulate.DEFAULT_WORKERS)
    preds = simulate.sweep(wl, hw, scales, modes, workers, args.reference_workers, clustered=not args.no_clustering)
    doc = {"workload": wl.__dict__, "hardware": hw.__dict__, "calibration": bd.__dict__ if bd else None,
           "scales": scales.__dict__, "predictions": [p.as_dict() for p in preds]}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_json_atomic(os.path.join(args.out, "results.json"), doc)
        simulate.plot_scaling(preds, os.path.join(args.out, "scaling.png"),
                              f"{wl.name} on {hw.name}: scaling efficiency")
        gw = args.gantt_workers or (bd.workers if bd else max(workers))
        for m in modes:
            p, sched = simulate.run(wl, hw, Scenario(gw, m, clustered=not args.no_clustering), scales)
            title = f"{m} at {gw} workers (group {p.group_size}, N={p.micro_batches}): step {p.step_ms:.1f} ms"
            write_gantt(os.path.join(args.out, f"gantt-{m.replace('+', '-')}.png"), sched, title=title)
    if args.json:
        print(json.dumps(doc, indent=1, sort_keys=True))
    else:
        print(simulate.format_table(preds))
        if args.out:
            print(f"results, scaling.png and gantt-*.png written to {args.out}")
    return 0


def _simulate_measured(args) -> int:
    """``simulate --calibrate RUN``: the local testbed model fitted to one measured off run (measure/measured.py)."""
    from nestpipe.measure import measured  # start-up time: torch and the trainer only for --calibrate

    hw, wl0, meas = measured.calibrate_run(args.calibrate, args.cores)
    worlds = args.workers or [meas.world]
    modes = args.modes or list(measured.MODES_LOCAL)
    for m in modes:
        if m not in measured.MODES_LOCAL:
            raise ValueError(f"--modes: {m!r} cannot be predicted for this trainer (known: "
                             f"{' '.join(measured.MODES_LOCAL)})")
    shards = args.predict_shards or meas.shards
    preds = []
    for w in worlds:
        wl = wl0 if (w == meas.world and shards == meas.shards) else measured.workload_from_shards(shards, meas.cfg, w)
        for m in modes:
            preds.append(measured.predict(hw, wl, m, args.link_bit_per_s))
    doc = {"calibrated_on": {"run": meas.run, "world": meas.world, "micro_batches": meas.micro_batches,
                             "step_ms": meas.step_s * 1e3},
           "hardware": hw.as_dict(), "predictions": [p.as_dict() for p in preds]}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_json_atomic(os.path.join(args.out, "results.json"), doc)
    if args.json:
        print(json.dumps(doc, indent=1, sort_keys=True))
        return 0
    print(f"calibrated on {meas.run}: --pipeline off, world {meas.world}, {meas.micro_batches} micro-batches, "
          f"step {meas.step_s * 1e3:.1f} ms")
    print(f"  lookup {hw.key_s * 1e6:.3f} us/key, exchange work {hw.row_s * 1e6:.3f} us/row, collective "
          f"{hw.coll_latency_s * 1e3:.3f} ms + {hw.coll_s_per_byte * 1e9:.3f} ns/B, dense {hw.dense_flops / 1e9:.2f} "
          f"GFLOP/s + {hw.dense_call_s * 1e3:.2f} ms per call, data {hw.token_s * 1e9:.1f} ns/token, step overhead "
          f"{hw.step_overhead_s * 1e3:.2f} ms, "
          f"{hw.cores} cores")
    head = f"{'pipeline':<8} {'world':>5} {'N':>3} {'step ms':>9} {'exp.comm ms':>11} {'exp.lookup ms':>13}"
    print(head)
    print("-" * len(head))
    for p in preds:
        print(f"{p.pipeline:<8} {p.world:>5} {p.micro_batches:>3} {p.step_s * 1e3:9.1f} {p.exposed_comm_s * 1e3:11.1f} "
              f"{p.exposed_lookup_s * 1e3:13.2f}")
    return 0
