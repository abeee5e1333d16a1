"""The 2-rank synchronous trainer against an independent single-process float64 reference.

The reference uses full tables (no placement, no exchange, no store), plain autograd through ``index_select`` and
its own row-wise AdaGrad and AdamW, and sees the same per-rank batches the trainer's ranks see. Negative control:
when requesters route with a different placement than owners use, the comparison must fail.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from nestpipe.datasets.shards import load_manifest
from nestpipe.measure.launcher import run_plan, write_run
from nestpipe.trainer.config import load_run_config, merge
from nestpipe.trainer.data import ShardStream, prepare_batch
from nestpipe.trainer.embedding.collection import choose_kind
from nestpipe.trainer.export import assemble
from nestpipe.trainer.models import build_model, model_table_dims
from nestpipe.trainer.embedding.placement import init_rows
from nestpipe.trainer.step import model_feats, num_negatives
from reference_training import adamw_step_, compare, micro_batch_embeddings
from shard_sets import make_shards

STEPS = 10
WORLD = 2
SETS = {
    "hstu": {"embedding": {"replicate_max_rows": 300, "lr": 0.05}, "optim": {"lr": 0.01, "weight_decay": 0.01},
             "hstu": {"num_random_negatives": 8, "num_popular_negatives": 8, "num_layers": 1},
             "pipe": {"gantt_steps": 0}},
    "dlrm": {"embedding": {"replicate_max_rows": 256, "lr": 0.05}, "optim": {"lr": 0.01, "weight_decay": 0.01},
             "dlrm": {"bottom_mlp": [16, 8], "top_mlp": [16], "cross_rank": 4}, "pipe": {"gantt_steps": 0}},
}
F64 = {"dtype": "float64"}
# warm-up over steps 0..2 (1/3, 2/3, 1), then half a cosine from 1 at step 3 to 0.1 at the last step (STEPS - 1)
SCHEDULE = {"optim": {"schedule": "cosine", "warmup_steps": 3, "final_lr_ratio": 0.1, "embedding_follows": True}}
# name -> (extra settings, testing hooks): every run of both models, trained below in one launch of the ranks
RUNS = {"f64": (F64, {}), "f64-bad": (F64, {"requester_salt": 7}), "f32": ({}, {}),
        "schedule": ({**F64, **SCHEDULE}, {})}


@pytest.fixture(scope="module")
def trained(shard_dirs):
    """{(model, name): run directory}: the runs of RUNS for both models, trained by ``train_worker`` (what ``nestpipe
    train`` runs in each rank; its command line is tested in tests/test_trainer_cli.py) in one launch."""
    base = shard_dirs[0]
    plan, runs = [], {}
    for model in ("hstu", "dlrm"):
        for name, (extra, hooks) in RUNS.items():
            run = str(base / f"run-{model}-{name}")
            write_run(run, str(base / ("gr" if model == "hstu" else "ctr")), model, "auto", STEPS,
                      merge(SETS[model], extra))  # the command line's defaults: --pipeline auto
            plan.append({"run": run, "testing_hooks": hooks})
            runs[(model, name)] = run
    p = run_plan(plan, WORLD, str(base / "plan.json"), timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return runs


def exported(trained, model, name):
    return assemble(trained[(model, name)])  # what `nestpipe export` writes (its CLI: tests/test_trainer_cli.py)


def reference(run: str, rate=lambda step: 1.0):
    """Float64 single-process training on the batches every rank would see. ``rate(step)``: the learning-rate
    multiplier of step ``step`` (0-based) for both optimizers (the reference's own schedule, written out below)."""
    cfg = load_run_config(run)
    man = load_manifest(cfg.shards)
    dims = model_table_dims(cfg, man)
    names = sorted(man.tables)
    ec = cfg.embedding
    tables, states = {}, {}
    for tid, t in enumerate(names):
        v = man.tables[t].vocab
        tables[t] = torch.from_numpy(init_rows(cfg.seed, tid, np.arange(v), dims[t], ec.init_scale)).double()
        tables[t].requires_grad_(True)
        states[t] = torch.zeros(v, dtype=torch.float64)
    model = build_model(cfg, man, dims).double()
    params = dict(model.named_parameters())
    adam = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in params.items()}
    streams = [ShardStream(cfg.shards, "train", r, WORLD, verify=False).records(0) for r in range(WORLD)]
    # the micro-batches the run trained (pipe.micro_batching as resolved for its schedule)
    micro_batching = json.load(open(os.path.join(run, "metrics.json")))["micro_batching"]
    B = man.batch_size
    o = cfg.optim
    for step in range(STEPS):
        for r in range(WORLD):
            s, rec, path = next(streams[r])
            assert s == step
            batch = prepare_batch(rec, man, step, r, cfg.seed, num_negatives(cfg), micro_batching=micro_batching)
            for i, mbd in enumerate(batch.micro):
                emb = micro_batch_embeddings(tables.__getitem__, man, batch, mbd, dims, names)
                feats = {k: (v.double() if v.is_floating_point() else v)
                         for k, v in model_feats(cfg, man, batch, i, torch.device("cpu")).items()}
                (model(emb, feats).sum() / (B * WORLD)).backward()
        with torch.no_grad():
            for t in names:  # row-wise AdaGrad, all rows (untouched rows have a zero gradient)
                g = tables[t].grad
                states[t] += g.square().mean(1)
                # eps outside the square root; M = momentum_scale_groups (1: plain row-wise AdaGrad)
                lr = ec.lr_of(t) * (rate(step) if o.embedding_follows else 1.0)
                tables[t] -= (lr / ((states[t] / ec.momentum_scale_groups).sqrt() + ec.eps))[:, None] * g
                tables[t].grad = None
            adamw_step_(params, adam, o, step + 1, lr=o.lr * rate(step))
    out = {f"embedding.{t}.weight": tables[t].detach() for t in names}
    out.update({f"embedding.{t}.adagrad_state": states[t] for t in names})
    out.update({f"dense.{n}": p.detach() for n, p in params.items()})
    out.update({f"optim.dense.{n}.exp_avg": adam[n][0] for n in params})
    return out


def initial(run: str):
    cfg = load_run_config(run)
    man = load_manifest(cfg.shards)
    dims = model_table_dims(cfg, man)
    return {f"embedding.{t}.weight": torch.from_numpy(
        init_rows(cfg.seed, tid, np.arange(man.tables[t].vocab), dims[t], cfg.embedding.init_scale)).double()
        for tid, t in enumerate(sorted(man.tables))}


@pytest.fixture(scope="module")
def shard_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ref")
    # uneven shards: rank 0 gets 10 + 0, rank 1 gets 11 batches: equalised to 10 each
    gr = make_shards(str(base / "gr"), "gr", batch_size=12, micro_batches=3, shards=(10, 11), eval_shards=(1,),
                     vocab=400, seq_len=10, seed=1)
    ctr = make_shards(str(base / "ctr"), "ctr", batch_size=16, micro_batches=4, shards=(10, 11), eval_shards=(1,),
                      vocab=400, seed=2)
    return base, gr, ctr


@pytest.mark.parametrize("model", ["hstu", "dlrm"])
def test_two_ranks_match_float64_reference(shard_dirs, trained, model):
    run = trained[(model, "f64")]
    got = exported(trained, model, "f64")
    assert got["embedding.item.weight" if model == "hstu" else "embedding.video_id.weight"].dtype == torch.float64
    cfg = load_run_config(run)
    man = load_manifest(cfg.shards)
    kinds = {t: choose_kind(t, s.vocab, s.kind, cfg.embedding) for t, s in man.tables.items()}
    # every exchange kind the model's data allows is exercised
    expected = {"unique", "replicated"} | ({"reduction"} if model == "dlrm" else set())
    assert set(kinds.values()) == expected, kinds
    ref = reference(run)
    compare(got, ref)
    # parameters moved far more than the tolerance
    init = initial(run)
    for k, v in init.items():
        moved = (ref[k] - v).abs().max().item()
        assert moved > 1e-3, (k, moved)
    metrics = json.load(open(os.path.join(run, "metrics.json")))
    assert metrics["steps_run"] == STEPS and len(metrics["samples_per_s_per_rank"]) == WORLD
    assert math.isfinite(metrics["final_loss"])

    # negative control: requesters route with another placement than owners use -> must not match
    with pytest.raises(AssertionError):
        compare(exported(trained, model, "f64-bad"), ref)


@pytest.mark.parametrize("model", ["hstu", "dlrm"])
def test_float32_training_tracks_float64_reference(trained, model):
    """The production dtype: float32 rounding (amplified where a normalising optimizer meets a gradient that is a
    cancelling sum) keeps the 10-step result within 1e-4 absolute / 1e-3 relative of the float64 reference."""
    got = exported(trained, model, "f32")
    assert got["dense." + next(iter(sorted(k[6:] for k in got if k.startswith("dense."))))].dtype == torch.float32
    compare(got, reference(trained[(model, "f32")]), rtol=1e-3, atol=1e-4)


def cosine_rate(step: int, shift: int = 0) -> float:
    step += shift
    if step < 3:
        return (step + 1) / 3
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 3) / (STEPS - 1 - 3)))


def test_learning_rate_factors():
    from nestpipe.trainer.config import OptimConfig, TrainConfig, lr_factor

    total = 11
    assert [lr_factor(OptimConfig(), s, total) for s in (0, 5, 10)] == [1.0, 1.0, 1.0]
    lin = OptimConfig(schedule="linear", final_lr_ratio=0.2)
    assert [round(lr_factor(lin, s, total), 12) for s in (0, 5, 10, 12)] == [1.0, 0.6, 0.2, 0.2]
    cos = OptimConfig(schedule="cosine", warmup_steps=2)
    assert [round(lr_factor(cos, s, total), 12) for s in (0, 1, 2, 10)] == [0.5, 1.0, 1.0, 0.0]
    assert abs(lr_factor(cos, 6, 11) - 0.5) < 1e-12  # half-way through the decay (steps 2..10)
    for s in range(STEPS):
        assert abs(lr_factor(OptimConfig(schedule="cosine", warmup_steps=3, final_lr_ratio=0.1), s, STEPS)
                   - cosine_rate(s)) < 1e-12
    with pytest.raises(ValueError, match="optim.schedule = 'step': expected one of constant, linear, cosine"):
        TrainConfig.from_dict({"optim": {"schedule": "step"}}, where="cfg")


@pytest.mark.parametrize("model", ["hstu", "dlrm"])
def test_learning_rate_schedule_matches_the_reference(trained, model):
    """Warm-up, cosine decay and the sparse tables following it: the trainer's rates per step are the reference's.
    Negative controls: the reference without the schedule, and with the schedule one step late, must not match."""
    run = trained[(model, "schedule")]
    got = exported(trained, model, "schedule")
    compare(got, reference(run, cosine_rate))
    with pytest.raises(AssertionError):
        compare(got, reference(run))
    with pytest.raises(AssertionError):
        compare(got, reference(run, lambda s: cosine_rate(s, shift=-1) if s > 0 else 1 / 3))
