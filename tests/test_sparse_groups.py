"""2D sparse parallelism (``--sparse-groups M``) against an independent single-process float64 reference.

World 4, ``M = 2``: two model-parallel groups of two ranks. The reference keeps one full float64 copy of every
sharded table per group (no placement, no exchange, no store), lets each group's ranks train their group's copy
(loss normalised by the global batch ``B * W``; row-wise AdaGrad, or the momentum-scaled variant with the
accumulator divided by ``G = W / M``), then sets every row that some group's batch contained to the mean of the
``G`` copies (weights and AdaGrad state); dense parameters (AdamW) and replicated tables see the gradient of all
ranks, as in plain training. Negative controls: the same run does not match the plain-training reference (one group),
nor the reference with the other optimizer scale; a run with the replica synchronisation switched off
(the ``skip_replica_sync`` testing hook) matches neither the reference nor has equal replicas. ``M = W`` is plain
training, bitwise. Errors for a world size not divisible by ``M`` and friends are checked on the command line.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from nestpipe.datasets.shards import load_manifest
from nestpipe.trainer import checkpoint
from nestpipe.trainer.config import load_run_config
from nestpipe.trainer.data import ShardStream, prepare_batch
from nestpipe.trainer.embedding.collection import choose_kind
from nestpipe.trainer.export import assemble
from nestpipe.trainer.models import build_model, model_table_dims
from nestpipe.measure.launcher import run_plan, write_run
from nestpipe.trainer.embedding.placement import init_rows
from nestpipe.trainer.checkpoint import replica_mismatches
from nestpipe.trainer.distributed.sparse_groups import momentum_scale, resolve
from nestpipe.trainer.step import model_feats, num_negatives
from reference_training import adamw_step_, compare, micro_batch_embeddings
from shard_sets import make_shards

STEPS = 10
WORLD = 4
M = 2
SETS = {
    "hstu": {"embedding": {"replicate_max_rows": 300, "lr": 0.05}, "optim": {"lr": 0.01, "weight_decay": 0.01},
             "hstu": {"num_layers": 1, "num_random_negatives": 8, "num_popular_negatives": 8}},
    "dlrm": {"embedding": {"replicate_max_rows": 256, "lr": 0.05}, "optim": {"lr": 0.01, "weight_decay": 0.01},
             "dlrm": {"bottom_mlp": [16, 8], "top_mlp": [16], "cross_rank": 4}},
}
# the optimizer option each model's run uses: both options are covered
OPTIMIZER = {"hstu": "rowwise_adagrad_2dsp", "dlrm": "rowwise_adagrad"}


@functools.lru_cache(maxsize=None)
def reference(run: str, group_size: int, sharded_scale: float):
    """Float64 2D-SP on the batches every rank sees: one full copy of each sharded table per group of
    ``group_size`` ranks, averaged over the copies on the rows any group's batch contained. ``group_size = WORLD``
    is plain training."""
    cfg = load_run_config(run)
    man = load_manifest(cfg.shards)
    dims = model_table_dims(cfg, man)
    names = sorted(man.tables)
    ec = cfg.embedding
    G = WORLD // group_size
    kinds = {t: choose_kind(t, man.tables[t].vocab, man.tables[t].kind, ec) for t in names}
    sharded = [t for t in names if kinds[t] != "replicated"]
    copies = {}  # (group, table) -> [weight, state]; replicated tables: one copy, group None
    for tid, t in enumerate(names):
        init = torch.from_numpy(init_rows(cfg.seed, tid, np.arange(man.tables[t].vocab), dims[t], ec.init_scale)).double()
        for g in (range(G) if t in sharded else [None]):
            copies[(g, t)] = [init.clone().requires_grad_(True), torch.zeros(len(init), dtype=torch.float64)]

    def table(g, t):
        return copies[(g if t in sharded else None, t)][0]

    model = build_model(cfg, man, dims).double()
    params = dict(model.named_parameters())
    adam = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in params.items()}
    streams = [ShardStream(cfg.shards, "train", r, WORLD, verify=False).records(0) for r in range(WORLD)]
    B = man.batch_size
    o = cfg.optim
    for step in range(STEPS):
        touched = {(g, t): [] for g in range(G) for t in sharded}
        for r in range(WORLD):
            g = r // group_size
            s, rec, _ = next(streams[r])
            assert s == step
            batch = prepare_batch(rec, man, step, r, cfg.seed, num_negatives(cfg))
            for t in sharded:
                touched[(g, t)].append(batch.keys[t])
            if batch.negatives is not None and "item" in sharded:
                touched[(g, "item")].append(batch.negatives)
            for i, mbd in enumerate(batch.micro):
                emb = micro_batch_embeddings(functools.partial(table, g), man, batch, mbd, dims, names)
                feats = {k: (v.double() if v.is_floating_point() else v)
                         for k, v in model_feats(cfg, man, batch, i, torch.device("cpu")).items()}
                (model(emb, feats).sum() / (B * WORLD)).backward()
        with torch.no_grad():
            for (g, t), (w, v) in copies.items():  # row-wise AdaGrad on every copy with its own gradient
                grad = w.grad if w.grad is not None else torch.zeros_like(w)
                v += grad.square().mean(1)
                scale = sharded_scale if t in sharded else ec.momentum_scale_groups
                w -= (ec.lr_of(t) / ((v / scale).sqrt() + ec.eps))[:, None] * grad
                w.grad = None
            for t in sharded:  # average the copies on every row some group touched
                u = torch.from_numpy(np.unique(np.concatenate([np.concatenate(touched[(g, t)]) for g in range(G)])))
                for x in (0, 1):
                    mean = sum(copies[(g, t)][x][u] for g in range(G)) / G
                    for g in range(G):
                        copies[(g, t)][x][u] = mean
            adamw_step_(params, adam, o, step + 1)
    out = {}
    for t in names:
        w, v = copies[(0 if t in sharded else None, t)]
        out[f"embedding.{t}.weight"], out[f"embedding.{t}.adagrad_state"] = w.detach(), v
    out.update({f"dense.{n}": p.detach() for n, p in params.items()})
    out.update({f"optim.dense.{n}.exp_avg": adam[n][0] for n in params})
    return out, sharded


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("sg")
    shards = {"hstu": str(base / "gr"), "dlrm": str(base / "ctr")}
    make_shards(shards["hstu"], "gr", batch_size=12, micro_batches=3, shards=(10, 11, 10, 12), eval_shards=(1,),
                vocab=400, seq_len=10, seed=5)
    make_shards(shards["dlrm"], "ctr", batch_size=16, micro_batches=4, shards=(10, 11, 10, 12), eval_shards=(1,),
                vocab=400, seed=6)
    out, plan = {}, []

    def add(model, name, pipeline="off", hooks=None, **top):
        sets = json.loads(json.dumps(SETS[model]))
        sets["embedding"]["optimizer"] = OPTIMIZER[model]
        sets["pipe"] = {"gantt_steps": 0, "micro_batching": "clustered"}  # every schedule over the same micro-batches
        sets["dtype"] = "float64"
        for k, v in top.items():
            if isinstance(v, dict):
                sets.setdefault(k, {}).update(v)
            else:
                sets[k] = v
        run = str(base / f"{model}-{name}")
        write_run(run, shards[model], model, pipeline, STEPS, sets)
        plan.append({"run": run, "testing_hooks": hooks or {}})
        out[(model, name)] = run

    for model in ("hstu", "dlrm"):
        add(model, "m2", sparse_groups=M)
    add("hstu", "m2-nosync", sparse_groups=M, hooks={"skip_replica_sync": True})
    add("hstu", "plain", "nested")  # sparse_groups 0: plain training
    add("hstu", "m4", "nested", sparse_groups=WORLD)  # M = world: one group
    p = run_plan(plan, WORLD, str(base / "plan.json"), timeout=500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return out


@pytest.mark.parametrize("model", ["hstu", "dlrm"])
def test_2dsp_matches_float64_reference(runs, model):
    run = runs[(model, "m2")]
    exported = assemble(run)
    G = WORLD // M
    scale = G if OPTIMIZER[model] == "rowwise_adagrad_2dsp" else 1
    ref, sharded = reference(run, M, scale)
    assert sharded, "the test needs sharded tables"
    compare(exported, ref)
    assert replica_mismatches(checkpoint.latest(run), M) == []
    # parameters moved far more than the tolerance
    cfg = load_run_config(run)
    man = load_manifest(cfg.shards)
    dims = model_table_dims(cfg, man)
    for tid, t in enumerate(sorted(man.tables)):
        start = torch.from_numpy(init_rows(cfg.seed, tid, np.arange(man.tables[t].vocab), dims[t],
                                           cfg.embedding.init_scale)).double()
        assert (ref[f"embedding.{t}.weight"] - start).abs().max().item() > 1e-3, t
    m = json.load(open(os.path.join(run, "metrics.json")))
    assert all(r["sparse_groups"]["rows_from_other_groups"] > 0 for r in m["per_rank"])
    # negative controls: plain training (one group) and the other optimizer scale are different computations
    plain, _ = reference(run, WORLD, scale)
    with pytest.raises(AssertionError):
        compare(exported, plain)
    other, _ = reference(run, M, G if scale == 1 else 1)
    with pytest.raises(AssertionError):
        compare(exported, other)


def test_negative_control_without_replica_sync(runs):
    """With the replica synchronisation off the groups' replicas diverge: the replica check and the reference both
    catch it."""
    run = runs[("hstu", "m2-nosync")]
    bad = replica_mismatches(checkpoint.latest(run), M)
    assert any(b.startswith("item/") for b in bad), bad
    ref, _ = reference(runs[("hstu", "m2")], M, WORLD // M)  # the same shards and settings, with the sync
    with pytest.raises(AssertionError):
        compare(assemble(run), ref)


def test_group_size_equal_to_world_is_plain_training_bitwise(runs):
    """``--sparse-groups W`` is one group: no replica groups, no synchronisation, the same bits as plain training
    (even with the 2D-SP optimizer option, whose accumulator scale is then 1). The 2-group run differs."""
    plain, m4 = assemble(runs[("hstu", "plain")]), assemble(runs[("hstu", "m4")])
    assert [k for k in plain if not torch.equal(plain[k], m4[k])] == []
    m = json.load(open(os.path.join(runs[("hstu", "m4")], "metrics.json")))
    assert all("sparse_groups" not in r for r in m["per_rank"])
    m2 = assemble(runs[("hstu", "m2")])
    assert not torch.equal(plain["embedding.item.weight"], m2["embedding.item.weight"])


def test_layout_and_validation():
    lay = resolve(2, 4, rank=3)
    assert (lay.num_groups, lay.group, lay.local_rank, lay.enabled) == (2, 1, 1, True)
    assert lay.group_ranks(1) == [2, 3] and lay.replica_ranks(1) == [1, 3]
    assert resolve(0, 4).group_size == 4 and not resolve(0, 4).enabled and not resolve(4, 4).enabled
    one = resolve(1, 3, rank=2)
    assert (one.num_groups, one.group, one.local_rank, one.replica_ranks(0)) == (3, 2, 0, [0, 1, 2])
    with pytest.raises(ValueError, match="world size 4 is not divisible by 3"):
        resolve(3, 4)
    with pytest.raises(ValueError, match="more workers than the world size 4"):
        resolve(8, 4)
    with pytest.raises(ValueError, match="must be >= 1"):
        resolve(-1, 4)


def _nestpipe(*args):
    return subprocess.run([sys.executable, "-m", "nestpipe", *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_cli_help_and_clear_errors(tmp_path):
    p = _nestpipe("train", "--help")
    assert p.returncode == 0 and "--sparse-groups M" in p.stdout
    assert "number of workers in one model-parallel group" in " ".join(p.stdout.split())
    shards = str(tmp_path / "gr")
    make_shards(shards, "gr", batch_size=8, micro_batches=2, shards=(2, 2), eval_shards=(1,), vocab=100, seq_len=6)
    common = ["train", "--shards", shards, "--model", "hstu", "--nproc-per-node", "4", "--steps", "1", "--no-progress"]
    out = str(tmp_path / "run")
    p = _nestpipe(*common, "--out", out, "--sparse-groups", "3")
    assert p.returncode != 0 and "world size 4 is not divisible by 3" in p.stderr, p.stderr[-2000:]
    assert not os.path.exists(os.path.join(out, "config.json"))  # failed before launching any rank
    # the trainer config's optimizer option (checked before launching too)
    assert momentum_scale("rowwise_adagrad_2dsp", resolve(2, 8), 1) == 4
    assert momentum_scale("rowwise_adagrad", resolve(2, 8), 1) == 1
    with pytest.raises(ValueError, match="embedding.optimizer = 'adam'"):
        momentum_scale("adam", resolve(2, 4), 1)
    with pytest.raises(ValueError, match="leave embedding.momentum_scale_groups at 1"):
        momentum_scale("rowwise_adagrad_2dsp", resolve(2, 4), 3)


def test_the_stage_groups_wait_the_runs_timeout(monkeypatch):
    """Every stage group (plain and 2D-SP) is made with the run's timeout_s: a group made without one waits torch's
    default (30 minutes for gloo), so a stopped peer hung its collectives that long whatever timeout_s said.
    Control: without a timeout the groups are made with None (torch's default)."""
    import datetime

    import torch.distributed as dist

    from nestpipe.trainer.distributed import process_groups, sparse_groups

    made = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "new_group", lambda ranks, timeout=None: made.append(timeout) or object())
    monkeypatch.setattr(process_groups, "_CACHE", {})
    ten = datetime.timedelta(seconds=10)
    sparse_groups.create_stage_groups(sparse_groups.resolve(None, 2, 0), ten)
    assert len(made) == len(process_groups.STAGE_GROUPS) and set(made) == {ten}
    made.clear()
    sparse_groups.create_stage_groups(sparse_groups.resolve(2, 4, 1), ten)  # 2D-SP: groups, dense, replicas
    assert len(made) >= 4 and set(made) == {ten}
    made.clear()
    process_groups._CACHE.clear()
    process_groups.create(3)
    assert set(made) == {None}
