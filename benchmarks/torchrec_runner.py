"""TorchRec's ``TrainPipelineSparseDist`` on the benchmark workloads, for comparison with NestPipe.

Runs under a python that has torchrec 1.8 + fbgemm-gpu-cpu 1.8 + torch 2.13 (a separate venv: torchrec is not a
dependency of this project), ``world`` ranks (default 2) over gloo on CPU, one intra-op thread per rank:

    TORCHREC_PYTHON benchmarks/torchrec_runner.py '{"workload": "gr", "data": "DATA.npz", ...}'

and prints one line ``RESULT {json}`` (samples/s per rank, ms per step, the sharding plan, the bytes its collectives
sent to other ranks per step and, inside a network namespace, the loopback's own byte count). Callers:
:func:`run` (from the project venv; optional prefix such as ``ip netns exec NS``), used by
``benchmarks/pipeline_bench.py``.

Workloads
- ``pooled``: 8 tables x 100k rows x dim 64 (``EmbeddingBagCollection``, sum pooling), batch 1024 per rank,
  15-25 ids per feature, 13 dense features, bottom MLP 13-128-64, top MLP 576-256-1, BCE; data generated here.
- ``gr``: the GR-shaped workload from ``DATA.npz`` (written by ``pipeline_bench.py`` from the very shards NestPipe
  trains on: per rank and batch the item and action token sequences); ``EmbeddingCollection`` with an item table
  (feature ``item`` and the batch's shared negatives ``item_neg``) and an action table; the dense model is
  NestPipe's own HSTU module (imported from this repository: plain torch), so both systems run the same dense
  arithmetic and differ only in embedding storage, communication and pipelining.
Embeddings: fused row-wise AdaGrad (FBGEMM, applied in backward); dense: AdamW. Sharding: row-wise for every
table (constrained; the stock ``EmbeddingBagCollectionSharder`` offers row-wise only for CUDA, so the pooled
workload uses a sharder subclass that also offers it on CPU; ``EmbeddingCollectionSharder`` offers it on CPU).
On CPU TorchRec's pipelines have no streams: the pipeline's stages run one after another on the one thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(python: str, params: dict, prefix=None, timeout: float = 1800) -> dict:
    """Run the TorchRec side under ``python`` (optionally wrapped by ``prefix``); returns the parsed result."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([*(prefix or []), python, os.path.abspath(__file__), json.dumps(params)], capture_output=True,
                       text=True, timeout=timeout, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"torchrec runner failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


# -- everything below runs under the TorchRec python ----------------------------------------------------------------
def _link_tx_bytes():
    """Bytes the loopback interface sent so far (``/proc/net/dev``): inside a benchmark's network namespace, every
    rank's traffic and nothing else (headers included). None where unreadable."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[8])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _count_collectives(dist):
    """Wrap the ``torch.distributed`` collectives TorchRec's eager CPU path calls (its comm ops call them through
    the module, so the wrappers see every call) and count the bytes each sends to other ranks while
    ``counting["on"]``: an All2All its input less the rank's own split, a reduce-scatter the other ranks' parts, an
    all-gather its input times W - 1, an all-reduce 2 (W - 1) / W of the buffer (ring). Returns the counter."""
    counting = {"on": False, "all_to_all": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0, "all_reduce": 0.0}

    def nbytes(t):
        return t.numel() * t.element_size()

    def peers(group):
        return dist.get_world_size(group), dist.get_rank(group)

    def wrap(name, kind, sent):
        inner = getattr(dist, name)

        def wrapper(*args, **kwargs):
            if counting["on"]:
                counting[kind] += sent(*args, **kwargs)
            return inner(*args, **kwargs)

        setattr(dist, name, wrapper)

    def split_tensor(output, input, output_split_sizes=None, input_split_sizes=None, op=None, group=None, **_):
        # one input tensor in W parts (even unless split sizes are given): all but the rank's own part leaves
        w, r = peers(group)
        if not input_split_sizes:
            return nbytes(input) * (w - 1) / w
        row = nbytes(input) / max(sum(input_split_sizes), 1)
        return row * (sum(input_split_sizes) - input_split_sizes[r])

    def part_list(output, input_list, op=None, group=None, **_):  # one input tensor per rank: all but its own
        _, r = peers(group)
        return sum(nbytes(t) for i, t in enumerate(input_list) if i != r)

    def gathered(output, input, group=None, **_):  # the rank's input, to each of the W - 1 others
        w, _ = peers(group)
        return nbytes(input) * (w - 1)

    def ar(tensor, op=None, group=None, **_):
        w, _ = peers(group)
        return 2 * (w - 1) * nbytes(tensor) / w

    for name, kind, fn in (("all_to_all_single", "all_to_all", split_tensor), ("all_to_all", "all_to_all", part_list),
                           ("reduce_scatter", "reduce_scatter", part_list),
                           ("reduce_scatter_tensor", "reduce_scatter", split_tensor),
                           ("all_gather", "all_gather", gathered), ("all_gather_into_tensor", "all_gather", gathered),
                           ("all_reduce", "all_reduce", ar)):
        wrap(name, kind, fn)
    return counting


def _pooled_batches(rank, a):
    import numpy as np

    rng = np.random.default_rng(1000 + rank)
    out = []
    for _ in range(a.get("distinct_batches", 8)):
        lens, vals = [], []
        for _t in range(a["tables"]):
            ln = rng.integers(a["min_len"], a["max_len"] + 1, size=a["batch"]).astype(np.int64)
            lens.append(ln)
            vals.append(rng.integers(0, a["rows"], size=int(ln.sum())).astype(np.int64))
        d = rng.normal(size=(a["batch"], a["dense"])).astype(np.float32)
        y = (rng.random(a["batch"]) < 1 / (1 + np.exp(-0.8 * d[:, 0]))).astype(np.float32)
        out.append((np.concatenate(lens), np.concatenate(vals), d, y))
    return out


def _worker(rank, world, a, port, q):
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig,
                          KeyedJaggedTensor)
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.types import ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
    from torchrec.streamable import Pipelineable

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dev = torch.device("cpu")

    class Batch(Pipelineable):
        # GR: the action table is narrower than the (untied, 2 x dim) item rows, and an EmbeddingCollection holds
        # tables of one width, so its ids travel as a KJT of their own (``action_features``)
        def __init__(self, sparse_features, action_features=None, **fields):
            self.sparse_features = sparse_features
            self.action_features = action_features
            self.fields = fields

        def to(self, device, non_blocking=False):
            act = self.action_features
            return Batch(self.sparse_features.to(device, non_blocking=non_blocking),
                         None if act is None else act.to(device, non_blocking=non_blocking),
                         **{k: v.to(device, non_blocking=non_blocking) for k, v in self.fields.items()})

        def record_stream(self, stream):
            pass

        def pin_memory(self):
            return self

    class RowWiseEBCSharder(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type):
            return sorted(set(super().sharding_types(compute_device_type)) | {ShardingType.ROW_WISE.value})

    batches = []
    if a["workload"] == "pooled":
        names = [f"t{i}" for i in range(a["tables"])]

        class Head(nn.Module):  # everything after the lookup: one leaf module for the pipeline's FX tracing
            def __init__(self):
                super().__init__()
                self.bottom = nn.Sequential(nn.Linear(a["dense"], 128), nn.ReLU(), nn.Linear(128, a["dim"]), nn.ReLU())
                self.top = nn.Sequential(nn.Linear(a["dim"] * (1 + len(names)), 256), nn.ReLU(), nn.Linear(256, 1))

            def forward(self, kt, fields):
                x = torch.cat([self.bottom(fields["dense"]), kt.values()], dim=1)
                logit = self.top(x).squeeze(1)
                loss = F.binary_cross_entropy_with_logits(logit, fields["labels"], reduction="sum")
                return loss / (len(logit) * world), logit.detach()

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                    name=n, embedding_dim=a["dim"], num_embeddings=a["rows"], feature_names=[n]) for n in names],
                    device=torch.device("meta"))
                self.head = Head()

            def forward(self, batch):
                return self.head(self.ebc(batch.sparse_features), batch.fields)

        for lens, vals, d, y in _pooled_batches(rank, a):
            kjt = KeyedJaggedTensor.from_lengths_sync(keys=names, values=torch.from_numpy(vals),
                                                      lengths=torch.from_numpy(lens))
            batches.append(Batch(kjt, dense=torch.from_numpy(d), labels=torch.from_numpy(y)))
        tables, sharders, B = names, [RowWiseEBCSharder()], a["batch"]
    else:
        sys.path.insert(0, ROOT)
        from nestpipe.trainer.embedding.config import row_shape
        from nestpipe.trainer.models.common import sequential_table_widths
        from nestpipe.trainer.models.hstu import HSTU, HSTUConfig

        data = np.load(a["data"])
        nb = int(data["batches"])
        hcfg = HSTUConfig(**a["hstu"])
        blocks, extra = row_shape(sequential_table_widths(hcfg).get("item", 1))
        item_dim = a["dim"] * blocks + extra  # NestPipe's item rows, as wide (blocks of dim, the bias columns)

        class Head(nn.Module):  # everything after the lookup: one leaf module for the pipeline's FX tracing
            def __init__(self):
                super().__init__()
                # NestPipe's module with NestPipe's defaults for every option the benchmark does not set (history
                # negatives, the logQ correction over the item catalog)
                self.hstu = HSTU(hcfg, a["dim"], ["item", "action"], a["max_seq_len"], a["item_rows"])

            def forward(self, jt, jt_action, f):
                emb = {"item": jt["item"].values(), "action": jt_action["action"].values(),
                       "item#neg": jt["item_neg"].values()}
                per_sample = self.hstu(emb, {"lengths": f["lengths"], "item_ids": f["item_ids"], "neg_ids": f["neg_ids"]})
                return per_sample.sum() / (len(f["lengths"]) * world), per_sample.detach()

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.ec = EmbeddingCollection(tables=[
                    EmbeddingConfig(name="item", embedding_dim=item_dim, num_embeddings=a["item_rows"],
                                    feature_names=["item", "item_neg"])], device=torch.device("meta"))
                self.ec_action = EmbeddingCollection(tables=[
                    EmbeddingConfig(name="action", embedding_dim=a["dim"], num_embeddings=256,
                                    feature_names=["action"])], device=torch.device("meta"))
                self.head = Head()

            def forward(self, batch):
                return self.head(self.ec(batch.sparse_features), self.ec_action(batch.action_features), batch.fields)

        rng = np.random.default_rng(2000 + rank)
        for k in range(nb):
            lens = data[f"r{rank}_b{k}_lengths"].astype(np.int64)
            item = data[f"r{rank}_b{k}_item"].astype(np.int64)
            action = data[f"r{rank}_b{k}_action"].astype(np.int64)
            neg = rng.integers(0, a["item_rows"], size=a["negatives"]).astype(np.int64)
            b = len(lens)
            neg_lens = np.zeros(b, np.int64)
            neg_lens[0] = len(neg)
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=["item", "item_neg"], values=torch.from_numpy(np.concatenate([item, neg])),
                lengths=torch.from_numpy(np.concatenate([lens, neg_lens])))
            kjt_action = KeyedJaggedTensor.from_lengths_sync(
                keys=["action"], values=torch.from_numpy(action), lengths=torch.from_numpy(lens))
            batches.append(Batch(kjt, kjt_action, lengths=torch.from_numpy(lens), item_ids=torch.from_numpy(item),
                                 neg_ids=torch.from_numpy(neg)))
        tables, sharders, B = ["item", "action"], [EmbeddingCollectionSharder()], len(batches[0].fields["lengths"])

    torch.manual_seed(0)
    m = Model()
    dense_numel = sum(p.numel() for p in m.head.parameters())
    emb_params = (list(m.ebc.parameters()) if a["workload"] == "pooled"
                  else [*m.ec.parameters(), *m.ec_action.parameters()])
    apply_optimizer_in_backward(RowWiseAdagrad, emb_params, {"lr": 0.05, "eps": 1e-8})
    # "row_wise": every table row-wise; "default": TorchRec's planner chooses (no constraints)
    sharding = a.get("sharding", "row_wise")
    constraints = ({} if sharding == "default"
                   else {t: ParameterConstraints(sharding_types=[sharding]) for t in tables})
    topo = Topology(world_size=world, compute_device="cpu")
    planner = EmbeddingShardingPlanner(topology=topo, constraints=constraints)
    plan = planner.collective_plan(m, sharders, dist.GroupMember.WORLD)
    model = DistributedModelParallel(m, device=dev, plan=plan, sharders=sharders)
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                      lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    opt = CombinedOptimizer([model.fused_optimizer, dense_opt])
    pipe = TrainPipelineSparseDist(model, opt, dev)

    warm, steps = a["warmup"], a["steps"]

    def it():
        s = 0
        while True:
            yield batches[s % len(batches)]
            s += 1

    itr = iter(it())
    for _ in range(warm):
        pipe.progress(itr)
    counting = _count_collectives(dist)
    dist.barrier()
    link0 = _link_tx_bytes() if rank == 0 else None
    counting["on"] = True
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        pipe.progress(itr)
    dist.barrier()
    el = time.perf_counter() - t0
    cpu = time.process_time() - c0
    shard_types = sorted({str(ps.sharding_type) for mod in plan.plan.values() for ps in mod.values()})
    import importlib.metadata as md

    counting["on"] = False
    link1 = _link_tx_bytes() if link0 is not None else None
    link = link1 - link0 if link1 is not None else None
    wire = {k: v for k, v in counting.items() if k != "on"}
    # the dense gradients' all-reduce (DDP's reducer issues it from C++, out of the wrappers' sight): a ring
    # all-reduce sends 2 (W - 1) / W of the buffer per rank, as NestPipe counts its own
    wire["allreduce.ddp"] = steps * 2 * (world - 1) * dense_numel * 4 / world
    q.put({"rank": rank, "elapsed_s": el, "cpu_s": cpu, "steps": steps, "batch": B, "sharding": shard_types,
           "wire_bytes": wire, "link_bytes": link if rank == 0 else None,
           "plan": sharding, "threads": torch.get_num_threads(),
           "versions": {n: md.version(n) for n in ("torch", "fbgemm-gpu-cpu", "torchrec", "numpy")}})
    dist.destroy_process_group()


def main(argv=None) -> int:
    import socket

    import torch.multiprocessing as mp

    a = json.loads((argv or sys.argv[1:])[0])
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world = int(a.get("world", 2))
    ps = [ctx.Process(target=_worker, args=(r, world, a, port, q)) for r in range(world)]
    for p in ps:
        p.start()
    res = []
    deadline = time.time() + a.get("timeout", 1200)
    try:
        while len(res) < len(ps):
            try:
                res.append(q.get(timeout=2))
                continue
            except Exception:  # queue.Empty
                pass
            dead = [p.exitcode for p in ps if p.exitcode not in (None, 0)]
            if dead or time.time() > deadline:
                raise RuntimeError(f"torchrec ranks failed (exit codes {[p.exitcode for p in ps]})")
        res.sort(key=lambda r: r["rank"])
    finally:
        for p in ps:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    el = max(r["elapsed_s"] for r in res)
    B, steps = res[0]["batch"], res[0]["steps"]
    wire = [r["wire_bytes"] for r in res]
    out = {"workload": a["workload"], "pipeline": "TrainPipelineSparseDist", "world": world, "steps": steps,
           "batch_per_rank": B, "ms_per_step": 1e3 * el / steps, "samples_per_s_per_rank": B * steps / el,
           "samples_per_s": world * B * steps / el, "sharding": res[0]["sharding"], "plan": res[0]["plan"],
           # bytes the ranks' collectives sent to other ranks per step (mean over ranks), by collective
           "wire_bytes_per_step_per_rank": {k: sum(w[k] for w in wire) / (len(wire) * steps) for k in wire[0]},
           "link_bytes_per_step": res[0]["link_bytes"] / steps if res[0]["link_bytes"] is not None else None,
           "cpu_ms_per_step_per_rank": [round(1e3 * r["cpu_s"] / steps, 1) for r in res],
           "threads_per_rank": res[0]["threads"], "versions": res[0]["versions"]}
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
