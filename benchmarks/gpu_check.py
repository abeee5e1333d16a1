"""GPU check: the accelerator path on a CUDA machine, in about five minutes (``make gpu-check``).

    python benchmarks/gpu_check.py [--steps 12] [--out /tmp/nestpipe-gpu-check] [--models hstu dlrm] [--no-record]

Without a CUDA device it prints "no CUDA device" and exits 0 (nothing is checked). With one it checks, printing
PASS or FAIL per line and recording every figure (``benchmarks/results/gpu_check.json``):

1. ``hstu`` and ``dlrm`` train at world 1 on the GPU (NCCL) in ``off`` and ``nested``; and at world 2: over NCCL
   where two GPUs exist, else two ranks on the one GPU over gloo with CUDA tensors (``dist_backend = gloo``).
2. ``nested`` agrees with ``off`` on every exported tensor within ``rtol = 1e-4, atol = 1e-6`` (float32: the
   device kernels sum in a fixed order, but cuBLAS may pick other algorithms between runs; the CPU path is bitwise).
3. The kernel paths each run took (``metrics.json`` ``kernel_paths``) are the device ones for the device ops
   (``pool_segments``, ``adagrad_update``, ``dual_buffer_sync_rows`` (nested only): ``triton``), each
   of them taken, never a CPU path. (``gather_rows`` reads
   the owner's host store, in DRAM as in the paper, into pinned memory: a host op by design.)
4. From a ``torch.profiler`` trace of the nested run (``pipe.profile_steps``, rank 0): the share of host-to-device
   copy and exchange time that overlaps device compute (target >= 50%), and the same for ``off`` (reference).
5. samples/s of ``off`` and ``nested`` per model and world.

The machine it is written for has CUDA but no network: its system Python holds torch, Triton and numpy but not
this project nor the other modules its training path imports (scipy for the shard writer's clustering, tqdm). Carry
them over as wheels (34 MiB for Python 3.11) and install them without dependencies:

    benchmarks/gpu_wheels.sh wheels 3.11          # on a machine with a package index: this project + scipy + tqdm
    pip install --no-deps wheels/*.whl            # on the GPU machine (the project's torch pin is not enforced)
    make gpu-check

The check prints the torch, CUDA and Triton versions it ran with. Numba is optional there (the host ops fall back to
NumPy, recorded in ``kernel_paths``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = ("hstu", "dlrm")
RTOL, ATOL = 1e-4, 1e-6
OVERLAP_TARGET = 0.5
# the ops a device run executes on the device (as kernel_paths names them); gather_rows reads the host store
DEVICE_OPS = ("pool_segments", "adagrad_update", "dual_buffer_sync_rows")
SETS = {
    "hstu": {"embedding": {"replicate_max_rows": 0, "lr": 0.05}, "optim": {"lr": 0.01},
             "hstu": {"num_layers": 1, "num_random_negatives": 16, "num_popular_negatives": 16}},
    "dlrm": {"embedding": {"replicate_max_rows": 0, "lr": 0.05}, "optim": {"lr": 0.01},
             "dlrm": {"bottom_mlp": [64], "top_mlp": [64], "cross_layers": 0}},
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="steps per run (at least 6: 2 warm-up + 4 profiled)")
    ap.add_argument("--out", default="/tmp/nestpipe-gpu-check", help="shards, runs and the results")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2], choices=(1, 2))
    ap.add_argument("--profile-steps", type=int, default=4, help="nested steps recorded by torch.profiler")
    ap.add_argument("--no-record", action="store_true", help="write no record under benchmarks/results")
    a = ap.parse_args(argv)
    if a.steps < 2 + a.profile_steps:
        ap.error(f"--steps {a.steps}: at least {2 + a.profile_steps} (2 warm-up steps + --profile-steps)")
    if a.profile_steps < 1:
        ap.error("--profile-steps: at least 1 (the overlap is measured from the profile)")
    return a


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def make_shards(out: str, steps: int) -> Dict[str, str]:
    """Small GR and CTR shards, one train shard per rank of world 2 (world 1 reads both)."""
    from nestpipe.measure.validate_local import make_gr_shards
    import pipeline_bench as pb

    gr, ctr = os.path.join(out, "shards-gr"), os.path.join(out, "shards-ctr")
    if not os.path.exists(os.path.join(gr, "manifest.json")):
        make_gr_shards(gr, 64, 100, 4, 200_000, steps + 2, n_shards=2)
    if not os.path.exists(os.path.join(ctr, "manifest.json")):
        pb.make_pooled_shards(ctr, 4, steps + 2, world=2, pooled=dict(pb.POOLED, batch=1024, rows=200_000))
    return {"hstu": gr, "dlrm": ctr}


def _flat(d: Dict, prefix: str = "") -> List[str]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _flat(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={json.dumps(v)}")
    return out


def train_command(out: str, shards: str, model: str, mode: str, world: int, steps: int, profile_steps: int,
                  gloo: bool) -> List[str]:
    """``nestpipe train`` on the GPU (the launch every user runs: torchrun, the device from the config)."""
    sets = json.loads(json.dumps(SETS[model]))
    sets["pipe"] = {"gantt_steps": 0, "profile_steps": profile_steps}
    if gloo:
        sets["dist_backend"] = "gloo"
    run = os.path.join(out, f"w{world}-{model}-{mode}")
    cmd = [sys.executable, "-m", "nestpipe", "train", "--shards", shards, "--out", run, "--model", model,
           "--pipeline", mode, "--steps", str(steps), "--nproc-per-node", str(world), "--device", "cuda",
           "--no-progress"]
    for kv in _flat(sets):
        cmd += ["--set", kv]
    return cmd


def train(out: str, shards: str, model: str, mode: str, world: int, steps: int, profile_steps: int,
          gloo: bool) -> str:
    import shutil
    import subprocess

    cmd = train_command(out, shards, model, mode, world, steps, profile_steps, gloo)
    run = cmd[cmd.index("--out") + 1]
    shutil.rmtree(run, ignore_errors=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"{run}: training failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return run


def agreement(off_run: str, nested_run: str) -> Dict:
    import torch

    from nestpipe.trainer.export import assemble

    a, b = assemble(off_run), assemble(nested_run)
    worst, bad = 0.0, []
    for k in a:
        if not torch.is_tensor(a[k]) or not a[k].is_floating_point():
            continue
        d = (a[k].double() - b[k].double()).abs()
        worst = max(worst, float(d.max()) if d.numel() else 0.0)
        if not torch.allclose(a[k], b[k], rtol=RTOL, atol=ATOL):
            bad.append(k)
    return {"max_abs_diff": worst, "tensors_outside_bound": bad, "ok": not bad and a.keys() == b.keys()}


def device_paths(run: str, mode: str = "nested") -> Dict:
    """The device ops' paths in ``run``: each taken (the dual-buffer sync only where DBP runs), only ``triton``."""
    m = json.load(open(os.path.join(run, "metrics.json")))
    taken = m.get("kernel_paths", {})
    wrong = {op: paths for op, paths in taken.items() if op in DEVICE_OPS and set(paths) - {"triton"}}
    expected = [op for op in DEVICE_OPS if mode in ("dbp", "nested") or op != "dual_buffer_sync_rows"]
    missing = [op for op in expected if op not in taken]
    return {"kernel_paths": taken, "not_on_device": wrong, "not_taken": missing, "ok": not wrong and not missing}


def check(args) -> Dict:
    import torch

    from nestpipe.trainer.step_profiler import read_overlap

    gpus = torch.cuda.device_count()
    res: Dict = {"device": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__,
                 "cuda": torch.version.cuda, "runs": {}, "checks": []}
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = None
    shards = make_shards(args.out, args.steps)

    def line(name: str, ok: bool, detail: str) -> None:
        res["checks"].append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    for world in args.worlds:
        gloo = world > gpus
        for model in args.models:
            key = f"w{world}-{model}"
            runs = {}
            for mode in ("off", "nested"):
                t0 = time.time()
                try:
                    runs[mode] = train(args.out, shards[model], model, mode, world, args.steps, args.profile_steps,
                                       gloo)
                except RuntimeError as e:
                    line(f"{key} {mode} trains", False, str(e)[-400:])
                    continue
                m = json.load(open(os.path.join(runs[mode], "metrics.json")))
                res["runs"][f"{key}-{mode}"] = {"samples_per_s": m["samples_per_s"], "wall_s": time.time() - t0,
                                                "backend": "gloo" if gloo else "nccl"}
                line(f"{key} {mode} trains", True, f"{m['samples_per_s']:.0f} samples/s "
                                                     f"({'gloo' if gloo else 'nccl'})")
                paths = device_paths(runs[mode], mode)
                line(f"{key} {mode} device kernels", paths["ok"],
                     json.dumps({"not_on_device": paths["not_on_device"], "not_taken": paths["not_taken"]})
                     if not paths["ok"] else "every device op on triton")
                prof = os.path.join(runs[mode], "profile-rank0.json")
                if os.path.exists(prof):
                    ov = read_overlap(prof)
                    res["runs"][f"{key}-{mode}"]["overlap"] = ov
                    if mode == "nested":
                        off_share = res["runs"].get(f"{key}-off", {}).get("overlap", {}).get("share", float("nan"))
                        line(f"{key} nested overlap", ov["share"] >= OVERLAP_TARGET,
                             f"{100 * ov['share']:.0f}% of copy + exchange time overlaps compute (target >= "
                             f"{100 * OVERLAP_TARGET:.0f}%; off: "
                             f"{100 * off_share:.0f}%)")
                else:
                    line(f"{key} {mode} profile", False, f"{prof} missing")
            if len(runs) == 2:
                ag = agreement(runs["off"], runs["nested"])
                res["runs"][f"{key}-agreement"] = ag
                line(f"{key} nested agrees with off", ag["ok"],
                     f"max |diff| {ag['max_abs_diff']:.2e} (bound rtol {RTOL}, atol {ATOL}); outside: "
                     f"{ag['tensors_outside_bound'][:5]}")
    res["passed"] = all(c["ok"] for c in res["checks"]) and bool(res["checks"])
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    if not has_cuda():
        print("no CUDA device: gpu_check needs one (nothing was checked)")
        return 0
    from record import Recorder

    rec = None if args.no_record else Recorder("gpu_check", argv, __file__)
    os.makedirs(args.out, exist_ok=True)
    res = check(args)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"\n{'PASSED' if res['passed'] else 'FAILED'}: {sum(c['ok'] for c in res['checks'])} of "
          f"{len(res['checks'])} checks; results {os.path.join(args.out, 'results.json')}")
    if rec is not None:
        rec.write(json.loads(json.dumps(res, default=str)))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
