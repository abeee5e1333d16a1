"""Run several trainings in one launch of ``world`` ranks (tests and benchmarks: one process start, many runs).

    python -m torch.distributed.run --standalone --nproc-per-node W -m nestpipe.measure.launcher PLAN.json

``PLAN.json`` is a list of ``{"run": RUN, "resume": bool, "testing_hooks": {...}}`` (hooks optional: the test-only
negative controls and faults of :mod:`nestpipe.trainer.testing_hooks`, set for that run only); every
``RUN/config.json`` is written beforehand (:func:`write_run`). The runs execute one after another on the same ranks
through the trainer's own :func:`~nestpipe.trainer.loop.train_worker`, exactly as ``nestpipe train`` would run them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List, Optional

import torch.distributed as dist

from nestpipe.trainer import testing_hooks
from nestpipe.trainer.config import TrainConfig, default_config, load_run_config, merge, save_config
from nestpipe.trainer.distributed import process_groups
from nestpipe.trainer.distributed import device as devmod
from nestpipe.trainer import dense_optim
from nestpipe.trainer.loop import train_worker
from nestpipe.utils.jsonio import read_json, write_json_atomic


def write_run(out: str, shards: str, model: str, pipeline: str, steps: int, sets: Optional[Dict] = None,
              checkpoint_every: int = 0) -> str:
    d = default_config(model)
    d = merge(d, {"shards": os.path.abspath(shards), "out": os.path.abspath(out), "model": model,
                  "pipeline": pipeline, "steps": steps, "checkpoint_every": checkpoint_every, "progress": False,
                  "verify_shards": False})
    d = merge(d, sets or {})
    cfg = TrainConfig.from_dict(d)
    os.makedirs(out, exist_ok=True)
    save_config(cfg, os.path.join(out, "config.json"))
    return out


def run_plan(plan: List[Dict], world: int, plan_path: str, timeout: float = 300,
             prefix: Optional[List[str]] = None) -> subprocess.CompletedProcess:
    """Launch ``world`` ranks that run ``plan``; ``prefix`` wraps the command (e.g. ``ip netns exec NS``)."""
    write_json_atomic(plan_path, plan, indent=None, sort_keys=False)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [*(prefix or []), sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(world), "--monitor-interval", "0.5", "-m", "nestpipe.measure.launcher", plan_path]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def main(argv=None) -> int:
    plan_path = (argv or sys.argv[1:])[0]
    plan = read_json(plan_path, "run plan", expect=list)
    dense_optim.skip_dynamo_import()  # as nestpipe train's rank processes
    dev = devmod.resolve("cpu")
    # before any thread starts (they inherit it); every run of a plan must ask for the same mode
    modes = {load_run_config(item["run"]).flush_denormal for item in plan}
    if len(modes) != 1:
        raise SystemExit("a plan's runs must agree on flush_denormal (threads started by one run keep its mode)")
    devmod.set_flush_denormal(modes.pop())
    rank, world = devmod.init_distributed(dev, 120)
    try:
        for item in plan:
            cfg = load_run_config(item["run"])
            train_worker(cfg, dev, rank, world, bool(item.get("resume")),
                         hooks=testing_hooks.make(**item.get("testing_hooks", {})))
            if world > 1:
                dist.barrier()
    finally:
        process_groups.forget()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Every run of the plan is complete (metrics written atomically) by now. Leave without interpreter and C++ static
    # teardown, as nestpipe.trainer.launch does: a native thread still joinable then (gloo's transport loops, the
    # kernels' thread pools) can abort a rank with "terminate called without an active exception" after the plan
    # finished, and torchrun would report the launch failed (seen once in a full suite, a world-4 plan).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
