"""Trainer benchmark: NestPipe's synchronous step (``--pipeline off``) against TorchRec on the same workload.

Workload (the TorchRec comparison): 8 pooled tables x 100k rows x dim 64, batch 1024 per rank, about 20 ids per
feature (lengths uniform in [15, 25], ids uniform), 13 dense features, bottom MLP 13-128-64, top MLP 576-256-1
(concatenation, no cross layers), BCE loss, row-wise AdaGrad on the tables and AdamW on the dense part, 2 ranks on
gloo, 1 thread per rank. Both sides train on the same pre-generated batches (``make_batches``: same seed, same ids,
lengths, dense features and labels), cycled; the first ``--warmup`` steps are not timed.

- NestPipe: ``nestpipe.trainer.step.train_step`` on in-memory records of the shard format (micro-batches from
  ``--micro-batches``; 1 = the whole batch), all tables reduction-based. Its time includes the host preparation
  (``prepare_batch``), key routing, retrieval, exchange, dense fwd/bwd and both updates; as the trainer runs
  ``off``, each step prepares the next batch and issues its routing All2Alls (``pipe.route_ahead``).
- TorchRec (when ``--torchrec-python`` points at a python with torchrec 1.8 + fbgemm-gpu-cpu, e.g. a separate venv,
  never the project's): ``EmbeddingBagCollection`` under ``DistributedModelParallel`` with the default CPU plan,
  fused row-wise AdaGrad (``apply_optimizer_in_backward``), ``TrainPipelineSparseDist``.

samples/s per rank = batch x timed steps / wall time of the timed steps (the slower rank). Both sides run in the
same invocation, one after the other, on the same 2 shared cores: compare the ratio measured in one run.

    python benchmarks/trainer_bench.py --torchrec-python /tmp/torchrec-venv/bin/python
    python benchmarks/trainer_bench.py --big        # a step with the full KuaiRand-27K item vocabulary (see --help)
    python benchmarks/trainer_bench.py --big --big-materialize-all --tier dram mmap --big-pipelines off nested \
        --memory-limit-gib 6                         # the memory-mapped tier against DRAM, below the table's size

``--big``: one ``item`` table of 32,038,725 rows x dim 64 sharded over 2 ranks; the default HSTU keeps untied input
and output embeddings, so each row holds 128 floats (+ row-wise AdaGrad state): 16.5 GB of rows, about 8.3 GB per
rank, created lazily (pages are touched on first use) unless ``--big-materialize-all``), HSTU-shaped sequence
batches (unique-based exchange) of Zipf(1.2) ids; reports step time and peak RSS per rank. ``--tier mmap``: the
same with ``embedding.tier = mmap`` (row files in ``--big-store-dir``, a DRAM cache of ``--big-cache-fraction`` of
the rank's shard bytes, the page cache dropped before the first timed step: cold, then warm), in a memory cgroup of
``--memory-limit-gib`` where one can be made; with ``--tier dram mmap`` both in one invocation and the ratio of their
embedding stages (retrieve + update + dual-buffer sync) per schedule of ``--big-pipelines``.

Writes the record ``benchmarks/results/trainer.json`` (``trainer-big.json`` with ``--big``; ``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from nestpipe.utils.host import describe_host, host_line

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from record import Recorder  # noqa: E402


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# -- the shared workload ---------------------------------------------------------------------------------------------
def make_batches(rank: int, n: int, batch: int, tables: int, rows: int, dense: int, min_len: int, max_len: int,
                 seed: int = 0):
    """``n`` batches for ``rank``: per table (lengths [B], ids [sum]), dense [B, F] float32, labels [B] float32."""
    rng = np.random.default_rng(seed * 1000 + rank)
    out = []
    for _ in range(n):
        feats = []
        for _t in range(tables):
            lens = rng.integers(min_len, max_len + 1, size=batch).astype(np.int64)
            feats.append((lens, rng.integers(0, rows, size=int(lens.sum())).astype(np.int64)))
        d = rng.normal(size=(batch, dense)).astype(np.float32)
        logit = 0.8 * d[:, 0] - 0.5 * d[:, 1] + 0.3 * (feats[0][1][np.cumsum(feats[0][0]) - 1] % 2)
        y = (rng.random(batch) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        out.append({"feats": feats, "dense": d, "labels": y})
    return out


# -- NestPipe side ---------------------------------------------------------------------------------------------------
def _record(b, micro_batches: int, tables):
    """A shard-format record (as ``nestpipe ingest`` writes for CTR) from one generated batch."""
    # here, not at the top: the TorchRec side imports this module under its own Python, without nestpipe
    from nestpipe.clustering import tables_fields

    B = len(b["dense"])
    mb = (np.arange(B) % micro_batches).astype(np.int32)
    rec = {"meta": {"micro_batches": micro_batches}, "mb": mb, "dense": b["dense"],
           "labels": b["labels"][:, None]}
    fields = tables_fields({name: (ids, lens) for name, (lens, ids) in zip(tables, b["feats"])}, mb)
    return _add_fields(rec, fields)


def _add_fields(rec, fields):
    """``rec`` with every table's shard fields as ``TABLE.FIELD`` members."""
    for name, table in fields.items():
        rec.update({f"{name}.{field}": arr for field, arr in table.items()})
    return rec


def nestpipe_worker(rank: int, world: int, a, port: int, q):
    import torch
    import torch.distributed as dist

    from nestpipe.datasets.shards import Manifest, TableSpec
    from nestpipe.kernels import tuning
    from nestpipe.trainer.config import TrainConfig
    from nestpipe.trainer.models import model_spec
    from nestpipe.trainer.pipeline import auto
    from nestpipe.trainer.step import build_state, train_step

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # what `nestpipe train` (default --pipeline auto) would run on this machine; this benchmark times `off`
    schedule = auto.choose("auto", torch.device("cpu"), world).to_dict()
    tables = [f"t{i}" for i in range(a.tables)]
    man = Manifest(task="ctr", batch_size=a.batch, micro_batches=a.micro_batches,
                   tables={t: TableSpec(a.rows, a.dim, "pooled") for t in tables}, sets={},
                   dense_features=[f"d{i}" for i in range(a.dense)], labels=["is_click"])
    cfg = TrainConfig(model="dlrm", pipeline="off", threads=1)
    cfg.embedding.replicate_max_rows = 0
    cfg.embedding.placement = a.placement
    cfg.dlrm.bottom_mlp, cfg.dlrm.top_mlp, cfg.dlrm.cross_layers = (128, a.dim), (256,), 0
    state = build_state(cfg, man, rank, world, torch.device("cpu"))
    # the kernel paths `nestpipe train` takes (train.tune_kernels): this host's measured choice among equal paths
    lay = state.emb.slot_layout
    kernel_choice = tuning.choose_for_run(
        tuning.TuneShape.of_run(lay.store_rows, lay.store_dims, a.batch, world, pooled=True), torch.device("cpu"),
        rank, world, tune=not a.no_tune_kernels)
    # the micro-batching `nestpipe train` resolves for off (pipe.micro_batching = auto: DLRM trains a batch whole)
    state.micro_batching = auto.micro_batching_for(cfg.pipe.micro_batching, "off",
                                                   model_spec(cfg.model).partition_invariant(cfg))
    recs = [_record(b, a.micro_batches, tables)
            for b in make_batches(rank, a.distinct_batches, a.batch, a.tables, a.rows, a.dense, a.min_len, a.max_len)]
    times = []
    prof = None
    warm = {}
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            warm = dict(state.timer.total)
            cpu0 = time.process_time()
        if step == a.warmup and rank == 0 and os.environ.get("NP_BENCH_PROFILE"):
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        dist.barrier()
        t0 = time.perf_counter()
        # as the trainer's runner calls it: the next batch prepared and routed during this one (pipe.route_ahead)
        nxt = (recs[(step + 1) % len(recs)], "") if cfg.pipe.route_ahead and step + 1 < a.warmup + a.steps else None
        loss = train_step(state, step, recs[step % len(recs)], next_record=nxt)
        times.append(time.perf_counter() - t0)
    if prof is not None:
        prof.disable()
        prof.dump_stats(os.environ["NP_BENCH_PROFILE"])
    cpu = time.process_time() - cpu0
    dist.barrier()
    el = sum(times[a.warmup:])
    stages = {k: (v - warm.get(k, 0.0)) / a.steps for k, v in state.timer.total.items()}
    from nestpipe.trainer.sharding_plan import table_owners

    layout = {t: list(table_owners(state.emb.plan, t)) or list(range(world)) for t in tables}
    q.put({"rank": rank, "elapsed": el, "cpu_s": cpu, "steps": a.steps, "loss": loss, "stage_s_per_step": stages,
           "layout": layout, "default_schedule": schedule, "micro_batching": state.micro_batching,
           "kernel_choice": kernel_choice,
           "micro_batches": 1 if state.micro_batching == "whole" else a.micro_batches})
    dist.destroy_process_group()


def run_ranks(target, a, world=2, on_start=None):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, a, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    if on_start is not None:
        on_start(procs)
    res, t0 = [], time.time()
    while len(res) < len(procs):
        try:
            res.append(q.get(timeout=1))
        except Exception:  # queue.Empty: check the ranks are alive
            if any(p.exitcode not in (None, 0) for p in procs) or time.time() - t0 > a.timeout:
                for p in procs:
                    p.terminate()
                raise RuntimeError("a rank failed or timed out (its traceback is above)")
    for p in procs:
        p.join(timeout=60)
        if p.exitcode not in (0, None):
            raise RuntimeError(f"rank process exited with {p.exitcode}")
    return sorted(res, key=lambda r: r["rank"])


def bench_nestpipe(a):
    res = run_ranks(nestpipe_worker, a)
    el = max(r["elapsed"] for r in res)
    import torch

    from nestpipe.kernels import kernel_paths

    return {"samples_per_s_per_rank": a.batch * a.steps / el, "kernel_paths": kernel_paths(torch.device("cpu")),
            "kernel_choice": res[0]["kernel_choice"], "ms_per_step": 1000 * el / a.steps,
            # process CPU time (all threads) per step: less sensitive than wall time to other load on shared cores
            "cpu_ms_per_step_per_rank": [round(1000 * r["cpu_s"] / a.steps, 1) for r in res],
            "final_loss": res[0]["loss"], "placement": a.placement,
            # owners of every table's row shards: one rank = table-wise, all ranks = row-wise
            "layout": res[0]["layout"], "default_schedule": res[0]["default_schedule"],
            "micro_batching": res[0]["micro_batching"], "micro_batches": res[0]["micro_batches"],
            "stages_ms_per_step_rank0": {k: round(1000 * v, 2) for k, v in
                                                                      sorted(res[0]["stage_s_per_step"].items())},
            "versions": _versions(("torch", "fbgemm-gpu-cpu", "numba", "numpy")), "threads_per_rank": 1}


def bench_nestpipe_forced(a, paths: str) -> dict:
    """NestPipe's step with ``paths`` forced on both ranks (``NESTPIPE_KERNELS``, inherited by the spawned ranks)."""
    saved = os.environ.get("NESTPIPE_KERNELS")
    os.environ["NESTPIPE_KERNELS"] = paths
    try:
        r = bench_nestpipe(a)
    finally:
        if saved is None:
            os.environ.pop("NESTPIPE_KERNELS")
        else:
            os.environ["NESTPIPE_KERNELS"] = saved
    print(f"NestPipe with {paths} forced: {r['samples_per_s_per_rank']:.0f} samples/s per rank "
          f"({r['ms_per_step']:.1f} ms/step)", flush=True)
    return {"forced": paths, **{k: r[k] for k in ("samples_per_s_per_rank", "ms_per_step", "cpu_ms_per_step_per_rank",
                                                  "stages_ms_per_step_rank0")}}


def _versions(names) -> dict:
    import importlib.metadata as md

    out = {}
    for n in names:
        try:
            out[n] = md.version(n)
        except md.PackageNotFoundError:
            out[n] = None
    return out


# -- the full KuaiRand-27K item vocabulary ------------------------------------------------------------------------
def _gr_record(rng, B, seq, vocab):
    # here, not at the top: the TorchRec side imports this module under its own Python, without nestpipe
    from nestpipe.clustering import tables_fields

    lens = np.full(B, seq, dtype=np.int64)
    item = ((rng.zipf(1.2, B * seq) - 1) % vocab).astype(np.int64)
    action = rng.integers(0, 256, B * seq).astype(np.int64)
    mb = np.zeros(B, dtype=np.int32)
    rec = {"meta": {"micro_batches": 1}, "mb": mb}
    return _add_fields(rec, tables_fields({"item": (item, lens), "action": (action, lens)}, mb))


def big_worker(rank: int, world: int, a, port: int, q):
    import resource

    import psutil
    import torch
    import torch.distributed as dist

    from nestpipe.datasets.shards import Manifest, TableSpec
    from nestpipe.trainer.config import TrainConfig
    from nestpipe.trainer.distributed import sparse_groups
    from nestpipe.trainer.pipeline.scheduler import PipelineRunner
    from nestpipe.trainer.step import build_state

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    proc = psutil.Process()
    man = Manifest(task="gr", batch_size=a.big_batch, micro_batches=1, max_seq_len=a.big_seq,
                   tables={"item": TableSpec(a.big_rows, 64, "sequence"), "action": TableSpec(256, 64, "sequence")},
                   sets={})
    emb = {}
    if a.big_tier == "mmap":
        emb = {"tier": "mmap", "dram_cache_mb": a.big_cache_mb, "store_dir": a.big_store_dir}
    cfg = TrainConfig.from_dict({"model": "hstu", "pipeline": "off", "threads": 1, "out": a.big_store_dir,
                                 "embedding": emb})
    t0 = time.perf_counter()
    groups = sparse_groups.create_stage_groups(sparse_groups.resolve(None, world, rank))
    state = build_state(cfg, man, rank, world, torch.device("cpu"), groups=groups)
    store = state.emb.stores["item"]
    info = {"rank": rank, "tier": a.big_tier, "local_rows": store.num_rows, "build_s": time.perf_counter() - t0,
            "rss_after_build_gib": proc.memory_info().rss / 2**30}
    if a.big_materialize_all:
        t0 = time.perf_counter()
        if a.big_tier == "mmap":
            store.materialize_all()
        else:
            for lo in range(0, store.num_rows, 1 << 18):
                store.materialize(torch.arange(lo, min(store.num_rows, lo + (1 << 18))))
        info["materialize_all_s"] = time.perf_counter() - t0
    if a.big_tier == "mmap":
        info["cache_rows"] = store.cache_rows
        info["cache_gib"] = store.cache_rows * (store.dim + 1) * 4 / 2**30
        info["store_files_gib"] = sum(os.path.getsize(p) for p in store.paths) / 2**30
        info["cache_fraction_of_shard"] = round(info["cache_gib"] / info["store_files_gib"], 4)
        store.drop_page_cache()  # the first timed step reads cold
        info["page_cache_resident_gib_before"] = _resident_gib(store.paths)
    rng = np.random.default_rng(100 + rank)
    records = [_gr_record(rng, a.big_batch, a.big_seq, a.big_rows) for _ in range(a.big_steps * len(a.big_pipelines))]
    info["runs"] = {}
    step0 = 0
    for mode in a.big_pipelines:
        runner = PipelineRunner(state, mode)
        dist.barrier()
        before = state.timer.snapshot()
        times, t_prev = [], time.perf_counter()
        feed = ((step0 + i, records[step0 + i], "") for i in range(a.big_steps))
        for step, loss in runner.run(feed, step0, step0 + a.big_steps):
            now = time.perf_counter()
            times.append(now - t_prev)
            t_prev = now
        dist.barrier()
        t = state.timer.minus(before)
        stages = {k: round(1000 * v / a.big_steps, 1) for k, v in sorted(t.total.items())}
        emb_ms = sum(stages.get(k, 0.0) for k in ("retrieve", "update.sparse", "dbp.sync"))
        info["runs"][mode] = {"step_s": [round(x, 3) for x in times], "loss": loss, "stages_ms_per_step": stages,
                              "embedding_stages_ms_per_step": round(emb_ms, 1),
                              "exposed_tier_ms_per_step": round(1000 * t.exposed_tier() / a.big_steps, 1),
                              "exposed_tier_share_of_step": round(t.exposed_tier() / max(sum(times), 1e-9), 4)}
        if a.big_tier == "mmap":
            info["runs"][mode]["cache"] = dict(store.stats)
            info["runs"][mode]["page_cache_resident_gib_after"] = _resident_gib(store.paths)
        step0 += a.big_steps
    info.update({"rss_gib": proc.memory_info().rss / 2**30,
                 "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                 "dense_model_gib": sum(p.numel() * 4 for p in state.model.parameters()) / 2**30})
    if a.big_tier == "dram":
        info["store_bytes_gib"] = (store.weight.numel() * 4 + store.state.numel() * 4) / 2**30
        info["materialized_rows"] = int(store.materialized.sum())
    q.put(info)
    dist.destroy_process_group()


def _resident_gib(paths):
    """Page-cache residency of files (util-linux ``fincore``), or None where it is not installed."""
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *paths],
                             capture_output=True, text=True, timeout=60)
        return round(sum(int(x) for x in out.stdout.split()) / 2**30, 3) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


class _MemoryCgroup:
    """A memory cgroup (v2 ``memory.max``, else v1 ``memory.limit_in_bytes``) for the benchmark's rank processes:
    their anonymous memory and page cache together stay under ``limit`` bytes. None where it cannot be made."""

    def __init__(self, limit: int):
        self.path, self.procs = None, None
        name = f"nestpipe-bench-{os.getpid()}"
        for root, limit_file in (("/sys/fs/cgroup", "memory.max"), ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")):
            if not os.path.exists(os.path.join(root, limit_file if root.endswith("memory") else "cgroup.controllers")):
                continue
            path = os.path.join(root, name)
            try:
                os.makedirs(path, exist_ok=True)
                with open(os.path.join(path, limit_file), "w") as f:
                    f.write(str(int(limit)))
            except OSError:
                continue
            self.path, self.kind = path, limit_file
            return

    def add(self, pid: int) -> None:
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def close(self) -> None:
        if self.path:
            try:
                os.rmdir(self.path)
            except OSError:
                pass


def bench_big(a):
    """The big step per tier of ``--tier``, one after another (``mmap`` in a memory cgroup below the table's size
    when ``--memory-limit-gib`` is given and a cgroup can be made)."""
    out = {"rows": a.big_rows, "dim": 64, "row_floats": 128, "world": 2, "batch_per_rank": a.big_batch,
           "seq_len": a.big_seq, "full_store_gib": a.big_rows * (128 + 1) * 4 / 2**30, "pipelines": a.big_pipelines,
           "tiers": {}}
    # the item rows of the default HSTU are [input | output] embeddings (untied): 128 floats, + AdaGrad state
    shard_gib = a.big_rows / 2 * (2 * 64 + 1) * 4 / 2**30
    for tier in a.tier:
        a.big_tier = tier
        cg = None
        if tier == "mmap":
            a.big_cache_mb = a.big_cache_fraction * shard_gib * 1024
            if a.memory_limit_gib:
                cg = _MemoryCgroup(int(a.memory_limit_gib * 2**30))
                if cg.path is None:
                    print("no memory cgroup could be made: page-cache residency is reported instead")
                    cg = None
        try:
            res = run_ranks(big_worker, a, on_start=(lambda procs: [cg.add(p.pid) for p in procs]) if cg else None)
        except RuntimeError as e:
            if cg:  # a rank killed without a traceback: most likely the cgroup's out-of-memory killer
                raise RuntimeError(f"{e}; the ranks ran in a memory cgroup of {a.memory_limit_gib} GiB (cache "
                                   f"{a.big_cache_mb:.0f} MiB per rank): an out-of-memory kill shows in dmesg") from e
            raise
        finally:
            if cg:
                cg.close()
        out["tiers"][tier] = {"per_rank": res, "cache_mb_per_rank": a.big_cache_mb if tier == "mmap" else None,
                              "memory_limit_gib": a.memory_limit_gib if cg else None}
    if "dram" in out["tiers"] and "mmap" in out["tiers"]:
        ratios = {}
        for mode in a.big_pipelines:
            d = max(r["runs"][mode]["embedding_stages_ms_per_step"] for r in out["tiers"]["dram"]["per_rank"])
            m = max(r["runs"][mode]["embedding_stages_ms_per_step"] for r in out["tiers"]["mmap"]["per_rank"])
            ratios[f"embedding_stages_mmap_over_dram_{mode}"] = round(m / max(d, 1e-9), 2)
        out["ratios"] = ratios
    return out



# -- TorchRec side (runs under --torchrec-python) ------------------------------------------------------------------
TORCHREC_SCRIPT = r'''
import json, os, sys, time
import numpy as np
import torch, torch.distributed as dist
import torch.multiprocessing as mp
sys.path.insert(0, os.environ["NP_BENCH_DIR"])
from trainer_bench import make_batches

def worker(rank, world, a, port, q):
    import torch.nn as nn
    import torch.nn.functional as F
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    names = [f"t{i}" for i in range(a["tables"])]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, embedding_dim=a["dim"],
                num_embeddings=a["rows"], feature_names=[n]) for n in names], device=torch.device("meta"))
            self.bottom = nn.Sequential(nn.Linear(a["dense"], 128), nn.ReLU(), nn.Linear(128, a["dim"]), nn.ReLU())
            self.top = nn.Sequential(nn.Linear(a["dim"] * (1 + len(names)), 256), nn.ReLU(), nn.Linear(256, 1))

        def forward(self, batch):
            kt = self.ebc(batch.sparse_features)
            x = torch.cat([self.bottom(batch.dense_features), kt.values()], dim=1)
            logit = self.top(x).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(logit, batch.labels, reduction="sum") / (a["batch"] * world)
            return loss, logit.detach()

    torch.manual_seed(0)
    m = Model()
    apply_optimizer_in_backward(RowWiseAdagrad, m.ebc.parameters(), {"lr": 0.05, "eps": 1e-8})
    if a["torchrec_plan"] == "row_wise":
        # every table row-wise over both ranks (the stock sharder offers row-wise on CUDA only: a subclass adds it)
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.planner.types import ParameterConstraints
        from torchrec.distributed.types import ShardingType

        class RowWiseEBCSharder(EmbeddingBagCollectionSharder):
            def sharding_types(self, compute_device_type):
                return sorted(set(super().sharding_types(compute_device_type)) | {ShardingType.ROW_WISE.value})

        sharders = [RowWiseEBCSharder()]
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                           constraints={n: ParameterConstraints(sharding_types=["row_wise"])
                                                        for n in names})
        plan = planner.collective_plan(m, sharders, dist.GroupMember.WORLD)
        model = DistributedModelParallel(m, device=torch.device("cpu"), plan=plan, sharders=sharders)
    else:  # TorchRec's default planner on CPU
        model = DistributedModelParallel(m, device=torch.device("cpu"))
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                      lambda ps: torch.optim.AdamW(ps, lr=4e-3))
    opt = CombinedOptimizer([model.fused_optimizer, dense_opt])
    pipe = TrainPipelineSparseDist(model, opt, torch.device("cpu"))
    raw = make_batches(rank, a["distinct_batches"], a["batch"], a["tables"], a["rows"], a["dense"],
                       a["min_len"], a["max_len"])
    batches = []
    for b in raw:
        lens = torch.from_numpy(np.concatenate([l for l, _ in b["feats"]]))
        vals = torch.from_numpy(np.concatenate([v for _, v in b["feats"]]))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=names, values=vals, lengths=lens)
        batches.append(Batch(dense_features=torch.from_numpy(b["dense"]), sparse_features=kjt,
                             labels=torch.from_numpy(b["labels"])))
    total = a["warmup"] + a["steps"]

    def it():
        for s in range(total + 4):
            yield batches[s % len(batches)]

    itr = iter(it())
    times = []
    for s in range(total):
        if s == a["warmup"]:
            cpu0 = time.process_time()
        dist.barrier()
        t0 = time.perf_counter()
        pipe.progress(itr)
        times.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    dist.barrier()
    import importlib.metadata as md
    versions = {n: md.version(n) for n in ("torch", "fbgemm-gpu-cpu", "torchrec", "numpy")}
    q.put({"rank": rank, "elapsed": sum(times[a["warmup"]:]), "cpu_s": cpu, "versions": versions,
           "threads": torch.get_num_threads(),
           "plan": str(model.plan)[:2000] if rank == 0 else ""})
    dist.destroy_process_group()

if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, 2, a, port, q)) for r in range(2)]
    for p in ps: p.start()
    res, t0 = [], time.time()
    while len(res) < len(ps):
        try:
            res.append(q.get(timeout=1))
        except Exception:
            if any(p.exitcode not in (None, 0) for p in ps) or time.time() - t0 > a["timeout"]:
                for p in ps: p.terminate()
                sys.exit("a TorchRec rank failed or timed out")
    res.sort(key=lambda r: r["rank"])
    for p in ps: p.join(timeout=60)
    print("RESULT " + json.dumps(res))
'''


def bench_torchrec(a, plan: str):
    """TorchRec's side with ``plan``: ``default`` (its planner's choice on CPU) or ``row_wise`` (every table)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "torchrec_side.py")
        with open(path, "w") as f:
            f.write(TORCHREC_SCRIPT)
        keys = ("tables", "rows", "dim", "batch", "dense", "min_len", "max_len", "distinct_batches", "warmup",
                "steps", "timeout")
        # this module imports nestpipe.utils.host (stdlib only): the repository root goes on the path
        env = dict(os.environ, NP_BENCH_DIR=HERE, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, ROOT]))
        params = dict({k: getattr(a, k) for k in keys}, torchrec_plan=plan)
        p = subprocess.run([a.torchrec_python, path, json.dumps(params)],
                           capture_output=True, text=True, env=env, timeout=a.timeout + 120)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        raise RuntimeError(f"TorchRec side failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    res = json.loads(line[0][len("RESULT "):])
    el = max(r["elapsed"] for r in res)
    return {"plan_kind": plan, "samples_per_s_per_rank": a.batch * a.steps / el, "ms_per_step": 1000 * el / a.steps,
            "cpu_ms_per_step_per_rank": [round(1000 * r["cpu_s"] / a.steps, 1) for r in res], "plan": res[0]["plan"],
            "versions": res[0]["versions"], "threads_per_rank": res[0]["threads"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024, help="samples per rank")
    p.add_argument("--dense", type=int, default=13)
    p.add_argument("--min-len", type=int, default=15)
    p.add_argument("--max-len", type=int, default=25)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8, help="untimed steps (default: one pass over the distinct batches, so every touched row is initialised)")
    p.add_argument("--distinct-batches", type=int, default=8)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--placement", default="planned",
                   help="NestPipe embedding.placement: planned (default), hashed (row-wise over all ranks) or a plan file")
    p.add_argument("--pipeline", default="off", choices=["off"], help="NestPipe mode (the synchronous step)")
    p.add_argument("--torchrec-python", default=os.environ.get("TORCHREC_PYTHON"),
                   help="a python with torchrec 1.8 + fbgemm-gpu-cpu (e.g. /tmp/torchrec-venv/bin/python)")
    p.add_argument("--skip-nestpipe", action="store_true")
    p.add_argument("--forced-paths", nargs="+", default=[], metavar="OP:PATH[,OP:PATH]",
                   help="also time NestPipe with each of these kernel paths forced (NESTPIPE_KERNELS syntax, e.g. "
                   "adagrad_bags:numba adagrad_bags:fbgemm), in this invocation, each beside the measured choice "
                   "and compared with the same TorchRec run")
    p.add_argument("--no-tune-kernels", action="store_true",
                   help="NestPipe takes the fixed rule's kernel paths (default: the per-host measured choice among "
                   "bitwise-equal paths, as nestpipe train does; NESTPIPE_KERNELS forces one)")
    p.add_argument("--big", action="store_true", help="the 32M-row KuaiRand-27K item vocabulary step (see above)")
    p.add_argument("--big-rows", type=int, default=32_038_725)
    p.add_argument("--big-batch", type=int, default=128)
    p.add_argument("--big-seq", type=int, default=200)
    p.add_argument("--big-steps", type=int, default=4)
    p.add_argument("--tier", nargs="+", choices=["dram", "mmap"], default=["dram"],
                   help="--big: the embedding tier(s) to run, one after another in this invocation")
    p.add_argument("--big-pipelines", nargs="+", default=["off"], choices=["off", "nested"],
                   help="--big: schedules run one after another on the same state (steps each: --big-steps)")
    p.add_argument("--big-cache-fraction", type=float, default=0.25,
                   help="--tier mmap: the DRAM cache as a fraction of a rank's shard bytes (rows + AdaGrad state)")
    p.add_argument("--big-store-dir", default="/tmp/nestpipe-big-store", help="--tier mmap: the row files' directory")
    p.add_argument("--memory-limit-gib", type=float, default=0.0,
                   help="--tier mmap: run the ranks in a memory cgroup of this many GiB (anonymous memory + page "
                        "cache), where one can be made")
    p.add_argument("--big-materialize-all", action="store_true",
                   help="initialise every row of the store before the steps (the whole 8.3 GB resident)")
    p.add_argument("--torchrec-plans", nargs="+", default=["default", "row_wise"], choices=["default", "row_wise"],
                   help="TorchRec sharding plans to run; NestPipe is compared with the fastest")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    # as `nestpipe train` does (launch.py): Numba's parallel kernels get the rank's one thread, not an all-core pool
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    rec = Recorder("trainer-big" if a.big else "trainer", argv, __file__)
    host = describe_host()
    print(host_line(host))
    out = {"workload": {k: getattr(a, k) for k in ("tables", "rows", "dim", "batch", "dense", "min_len", "max_len",
                                                   "micro_batches", "steps", "warmup")},
           "load_average_before": os.getloadavg(), "host": host}
    if a.big:
        out["big"] = bench_big(a)
        print(json.dumps(out["big"], indent=1))
    else:
        if not a.skip_nestpipe:
            out["nestpipe"] = bench_nestpipe(a)
            print(f"NestPipe --pipeline off ({out['nestpipe']['micro_batches']} micro-batch(es) per batch, "
                  f"pipe.micro_batching {out['nestpipe']['micro_batching']}): "
                  f"{out['nestpipe']['samples_per_s_per_rank']:.0f} samples/s per rank "
                  f"({out['nestpipe']['ms_per_step']:.1f} ms/step; CPU ms/step per rank "
                  f"{out['nestpipe']['cpu_ms_per_step_per_rank']})", flush=True)
            print("  stages (ms/step, rank 0): " + json.dumps(out["nestpipe"]["stages_ms_per_step_rank0"]), flush=True)
            print(f"  placement {a.placement}: table owners " + json.dumps(out["nestpipe"]["layout"]), flush=True)
            ds = out["nestpipe"]["default_schedule"]
            print(f"  NestPipe's default schedule on this machine: auto -> {ds['schedule']} ({ds['reason']})"
                  + ("" if ds["schedule"] == "off" else "; this benchmark times off: see pipeline_bench.py for "
                     "the pipelined schedules"), flush=True)
            print(f"  versions {out['nestpipe']['versions']}", flush=True)
            print("  kernel choice: " + ", ".join(f"{op} {c['path']} ({c['source']})" for op, c in
                                                  out["nestpipe"]["kernel_choice"].items()), flush=True)
            out["nestpipe_forced"] = [bench_nestpipe_forced(a, paths) for paths in a.forced_paths]
        if a.torchrec_python:
            runs = [bench_torchrec(a, plan) for plan in a.torchrec_plans]
            for r in runs:
                print(f"TorchRec TrainPipelineSparseDist, {r['plan_kind']} plan: {r['samples_per_s_per_rank']:.0f} "
                      f"samples/s per rank ({r['ms_per_step']:.1f} ms/step; CPU ms/step per rank "
                      f"{r['cpu_ms_per_step_per_rank']})", flush=True)
            out["torchrec_runs"] = runs
            out["torchrec"] = max(runs, key=lambda r: r["samples_per_s_per_rank"])  # compared with the faster plan
            print(f"TorchRec versions: {out['torchrec']['versions']}; threads per rank "
                  f"{out['torchrec']['threads_per_rank']}", flush=True)
            if "nestpipe" in out:
                out["ratio_nestpipe_over_torchrec"] = (out["nestpipe"]["samples_per_s_per_rank"]
                                                       / out["torchrec"]["samples_per_s_per_rank"])
                cpu_n = sum(out["nestpipe"]["cpu_ms_per_step_per_rank"])
                cpu_t = sum(out["torchrec"]["cpu_ms_per_step_per_rank"])
                out["cpu_ratio_torchrec_over_nestpipe"] = cpu_t / cpu_n
                print(f"ratio NestPipe / TorchRec ({out['torchrec']['plan_kind']} plan, the faster; this run): "
                      f"{out['ratio_nestpipe_over_torchrec']:.2f} in samples/s; "
                      f"{out['cpu_ratio_torchrec_over_nestpipe']:.2f} in CPU time per step (TorchRec / NestPipe)")
            for r in out.get("nestpipe_forced", []):
                r["ratio_over_torchrec"] = r["samples_per_s_per_rank"] / out["torchrec"]["samples_per_s_per_rank"]
                print(f"  with {r['forced']} forced: NestPipe / TorchRec {r['ratio_over_torchrec']:.2f}")
        else:
            print("TorchRec side skipped: pass --torchrec-python PATH (a venv with torchrec 1.8, fbgemm-gpu-cpu 1.8)")
    out["load_average_after"] = os.getloadavg()
    print(f"load average before {out['load_average_before']}, after {out['load_average_after']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    torchrec = out.get("torchrec", {}).get("versions", {})
    rec.write(out, extra_versions={f"torchrec env: {k}": v for k, v in torchrec.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
