"""``nestpipe simulate``: the step-timeline model of every pipeline mode, from the paper's scale down to this
machine. The prediction is :mod:`nestpipe.planning`'s (pure); ``--calibrate RUN`` fits it to a measured run of this
trainer (:mod:`nestpipe.measure.measured`), which is why the command lives above the trainer.

``nestpipe measure sequence-cost``: this machine's per-sequence cost model of the HSTU layer stack
(:mod:`nestpipe.measure.sequence_cost`), printed as the ``--sequence-cost A,B`` argument of ``nestpipe ingest``."""

from __future__ import annotations

import argparse
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
    _add_measure_parser(sub)


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


SEQUENCE_COST_LENGTHS = (16, 32, 64, 128, 256, 512, 1024)


def _add_measure_parser(sub) -> None:
    m = sub.add_parser("measure", help="calibrations of this machine whose results are options of other commands",
                       description="Measure a cost on this machine and print it as the option of the command that "
                                   "takes it. `nestpipe measure WHAT --help` explains each measurement.")
    m.set_defaults(func=lambda args: (m.print_help(), 2)[1])
    what = m.add_subparsers(dest="what", metavar="WHAT")
    s = what.add_parser(
        "sequence-cost", help="the per-sequence cost a n^2 + b n of the HSTU layer stack (for `nestpipe ingest "
                              "--sequence-cost A,B`)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Times the forward + backward of the default HSTU layer stack (jagged attention; 2 layers, 2 "
                    "heads) per sequence, on micro-batches of equal-length sequences of each --lengths value (the "
                    "best of --repeats timings after one warm-up), and fits c(n) = a n^2 + b n seconds by "
                    "non-negative least squares of the relative errors: a is attention's causal triangle, b the "
                    "per-token work.\n\n"
                    "`nestpipe ingest --task gr --balance tokens` (the gr default) composes batches and micro-batches "
                    "of nearly equal cost under this model; the result is its `--sequence-cost A,B` argument (printed "
                    "last). Only the ratio b / a changes which samples share a batch; without the option the ingest "
                    "uses the fit recorded in nestpipe.datasets.sequence_cost.DEFAULT_COST, so that shards do not "
                    "depend on the machine that wrote them.")
    s.add_argument("--lengths", type=int, nargs="+", default=list(SEQUENCE_COST_LENGTHS), metavar="N",
                   help="sequence lengths to time, at least two distinct values >= 1 (default: "
                        f"{' '.join(map(str, SEQUENCE_COST_LENGTHS))})")
    s.add_argument("--dim", type=int, default=64, help="embedding dim of the layer stack (default: 64, the ingest's)")
    s.add_argument("--tokens-per-call", type=int, default=4096,
                   help="tokens per timed micro-batch: each holds max(1, this // n) sequences of length n "
                        "(default: 4096)")
    s.add_argument("--repeats", type=int, default=3, help="timings per length; the best counts (default: 3)")
    s.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads while timing (default: 1, as the recorded default fit)")
    s.add_argument("--json", action="store_true", help="print the measurement and the fit as JSON")
    s.add_argument("--out", default=None, help="also write the JSON document to this file")
    s.set_defaults(func=_measure_sequence_cost)


def _measure_sequence_cost(args) -> int:
    """``nestpipe measure sequence-cost``: time, fit, print the fit and the ingest argument that uses it."""
    lengths = sorted(set(args.lengths))
    if min(lengths) < 1:
        raise ValueError(f"--lengths must be >= 1, got {min(lengths)}")
    if len(lengths) < 2:
        raise ValueError("--lengths needs at least two distinct lengths: the fit has two terms (a n^2 and b n)")
    for name in ("dim", "tokens_per_call", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    import torch  # start-up time: torch and the model only when measuring

    from nestpipe.measure.sequence_cost import fit, relative_errors, sequence_seconds  # start-up time: torch, HSTU

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    try:
        secs = sequence_seconds(lengths, args.dim, args.tokens_per_call, args.repeats)
    finally:
        torch.set_num_threads(threads)
    cost = fit(secs)
    if cost.a + cost.b <= 0:
        raise RuntimeError(f"the fit of {secs} has no positive term")
    err = relative_errors(cost, secs)
    flag = f"{cost.a:.2g},{cost.b:.2g}"
    doc = {"seconds_per_sequence": {str(n): s for n, s in secs.items()}, "fit": cost.to_dict(),
           "relative_errors": {str(n): e for n, e in err.items()}, "sequence_cost": flag,
           "b_over_a_tokens": cost.b / cost.a if cost.a else None,
           "settings": {"dim": args.dim, "tokens_per_call": args.tokens_per_call, "repeats": args.repeats,
                        "threads": args.threads},
           "torch": torch.__version__, "load_before": list(load_before), "load_after": list(os.getloadavg())}
    if args.out:
        write_json_atomic(args.out, doc)
    if args.json:
        print(json.dumps(doc, indent=1, sort_keys=True))
        return 0
    for n, s in secs.items():
        print(f"n {n:5d}: {s * 1e3:8.3f} ms per sequence, model {cost(n) * 1e3:8.3f} ms ({err[n]:+.1%})")
    print(f"a = {cost.a:.3g} s/token^2, b = {cost.b:.3g} s/token (b / a = {cost.b / cost.a:.0f} tokens)" if cost.a
          else f"a = 0, b = {cost.b:.3g} s/token")
    print(f"load average {load_before[0]:.2f} before / {doc['load_after'][0]:.2f} after (timings on a busy machine "
          "are noisy)")
    print(f"nestpipe ingest ... --sequence-cost {flag}")
    return 0
