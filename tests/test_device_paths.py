"""The trainer's device code path with the CUDA (Triton) and Ascend (npu) kernels forced, on CPU tensors.

Triton runs in its interpreter (``TRITON_INTERPRET=1``); torch_npu is stubbed at import (an empty module on the
ranks' ``PYTHONPATH``), so the npu path's ops (device-generic torch with ordered segment sums) run on CPU tensors.
Both train a few steps of hstu and dlrm at world 2 with what the device would run: the entry update
(``adagrad_bags`` has no device kernel) through ``adagrad_update`` (ordered segment sums, then the row-wise AdaGrad
kernel), pooling and row copies through the device segment sum, store gathers through ``gather_rows``. They are
compared with the CPU path on the same update (``adagrad_bags:reference`` forces the entry update there too):

- every segment sum adds in ascending order on all three paths, so pooling and gradient sums are bitwise the same;
- the row-wise AdaGrad's ``mean(g^2)`` is not: the CPU kernels add 8 interleaved lanes, Triton's ``tl.sum`` a tree,
  the npu path torch's ``mean``. The runs therefore agree to float32 rounding carried through 4 steps:
  ``rtol=1e-4, atol=1e-6`` (measured differences are printed: in Triton's interpreter the runs came out bitwise
  equal, the npu path within the bound); negative control: a 3-step run misses that bound.

Triton's interpreter is not thread-safe; ``triton_kernels`` serialises interpreted launches, so the nested
schedule's stage threads can run it.
"""

import json
import os

import pytest
import torch

from nestpipe.measure.launcher import run_plan, write_run
from nestpipe.trainer.export import assemble
from shard_sets import make_shards

STEPS = 4
SETS = {
    "hstu": {"embedding": {"replicate_max_rows": 0, "lr": 0.05}, "optim": {"lr": 0.01},
             "hstu": {"num_layers": 1, "num_random_negatives": 8, "num_popular_negatives": 0},
             "pipe": {"gantt_steps": 0}},
    "dlrm": {"embedding": {"replicate_max_rows": 0, "lr": 0.05}, "optim": {"lr": 0.01},
             "dlrm": {"bottom_mlp": [8], "top_mlp": [8], "cross_layers": 0}, "pipe": {"gantt_steps": 0}},
}
DEVICE_OPS = "adagrad_bags:reference,adagrad_update:{p},lookup:{p},gather_rows:{p},dual_buffer_sync:{p}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("device")
    shards = {"hstu": str(base / "gr"), "dlrm": str(base / "ctr")}
    make_shards(shards["hstu"], "gr", batch_size=8, micro_batches=2, shards=(3, 3), eval_shards=(1,), vocab=120,
                seq_len=6, seed=1)
    make_shards(shards["dlrm"], "ctr", batch_size=8, micro_batches=2, shards=(3, 3), eval_shards=(1,), vocab=120,
                seed=2)
    stub = base / "stub"
    stub.mkdir()
    (stub / "torch_npu.py").write_text('"""torch_npu stub: the npu kernel path imported on a host without CANN."""\n')
    out = {}
    envs = {"cpu": {"NESTPIPE_KERNELS": "adagrad_bags:reference"},
            "triton": {"NESTPIPE_KERNELS": DEVICE_OPS.format(p="triton"), "TRITON_INTERPRET": "1"},
            "npu": {"NESTPIPE_KERNELS": DEVICE_OPS.format(p="npu"),
                    "PYTHONPATH": os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")])}}
    for path, env in envs.items():
        plan = []
        for model in ("hstu", "dlrm"):
            for steps in ((STEPS, STEPS - 1) if path == "cpu" else (STEPS,)):
                run = str(base / f"{path}-{model}-{steps}")
                write_run(run, shards[model], model, "nested", steps, json.loads(json.dumps(SETS[model])))
                plan.append({"run": run})
                out[(path, model, steps)] = run
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            p = run_plan(plan, 2, str(base / f"plan-{path}.json"), timeout=500)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return out


def _max_rel(a, b):
    return max(float(((a[k] - b[k]).abs() / (b[k].abs() + 1e-6)).max()) for k in a if a[k].is_floating_point())


@pytest.mark.slow
@pytest.mark.parametrize("path", ["triton", "npu"])
@pytest.mark.parametrize("model", ["hstu", "dlrm"])
def test_device_path_trains_like_the_cpu_path(runs, path, model):
    run = runs[(path, model, STEPS)]
    m = json.load(open(os.path.join(run, "metrics.json")))
    taken = m["kernel_paths"]
    # the device kernels ran: the owner update and the exchange's pooling / row copies
    assert taken.get("adagrad_update") == [path] and taken.get("pool_segments") == [path], taken
    assert "adagrad_bags" not in taken, taken
    dev, cpu = assemble(run), assemble(runs[("cpu", model, STEPS)])
    assert dev.keys() == cpu.keys()
    print(f"{path} {model}: max relative difference to the CPU path {_max_rel(dev, cpu):.2e}")
    for k in cpu:
        torch.testing.assert_close(dev[k], cpu[k], rtol=1e-4, atol=1e-6, msg=k)
    # negative control: one step less is far outside the bound
    short = assemble(runs[("cpu", model, STEPS - 1)])
    assert any(not torch.allclose(short[k].double(), cpu[k].double(), rtol=1e-4, atol=1e-6)
               for k in cpu if cpu[k].is_floating_point())
