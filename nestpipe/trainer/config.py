"""Trainer configuration: one dataclass per component, assembled in :class:`TrainConfig`.

A config file (``--config FILE``, JSON or TOML) holds the same nested structure as :meth:`TrainConfig.to_dict`;
command-line flags override it. The resolved config is written to ``RUN/config.json`` and is what ``--resume``,
``eval`` and ``export`` read back.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Optional

EXCHANGE_KINDS = ("auto", "unique", "reduction", "replicated")


@dataclasses.dataclass
class EmbeddingConfig:
    """Sparse tables: exchange kind per table, optimizer, initialisation.

    ``kinds`` overrides the automatic choice per table name (``unique`` | ``reduction`` | ``replicated``). Auto:
    tables with at most ``replicate_max_rows`` rows are replicated; ``pooled`` tables are reduction-based;
    ``sequence`` and ``single`` tables are unique-based.
    """

    kinds: Dict[str, str] = dataclasses.field(default_factory=dict)
    # which ranks hold each sharded table's rows: planned (cost-driven planner, default) | hashed (row-wise over
    # every rank) | path to a `nestpipe plan --no-column-split --out FILE` document (nestpipe.trainer.sharding_plan)
    placement: str = "planned"
    replicate_max_rows: int = 1024
    # stores of at most this many rows on a rank are initialised whole at start (larger ones row by row on first
    # touch): the values are the same either way
    eager_init_max_rows: int = 1_000_000
    # Transparent huge pages (MADV_HUGEPAGE, where Linux offers them) for stores of 32 MiB or more: a random row costs
    # a TLB miss, cheaper with 2 MiB pages (nestpipe.kernels.memory). "resident" (default): the stores initialised
    # whole at start (see eager_init_max_rows); lazily initialised ones keep 4 KiB pages, so their memory follows
    # the rows touched (a huge page would make 8192 neighbouring rows resident at the first touch of one).
    # "always": every store; "never": none (NESTPIPE_HUGE_PAGES=0 also turns them off).
    huge_pages: str = "resident"
    # DBP with host-resident buffers (CPU): batch t's update goes to the store in place and the dual-buffer sync copies
    # keys(t) ∩ keys(t+1) from the store, so no write-back pass; false: update the active buffer and write it back
    # (the device path's order). Bitwise the same results either way.
    dbp_update_in_store: bool = True
    dim: Optional[int] = None  # None: each table's manifest dim
    init_scale: float = 0.05
    lr: float = 0.05
    eps: float = 1e-8
    # Explicit accumulator scale of row-wise AdaGrad for every table: w -= lr * g / (sqrt(v / M) + eps); 1 = off.
    momentum_scale_groups: int = 1
    # Sharded tables' optimizer: ``rowwise_adagrad`` or ``rowwise_adagrad_2dsp`` (2D sparse parallelism's
    # momentum-scaled variant: the accumulator is divided by the number of replica groups ``world / sparse_groups``;
    # replicated tables keep plain row-wise AdaGrad). See docs/trainer.md, "2D sparse parallelism".
    optimizer: str = "rowwise_adagrad"
    # debug: requester routes with a different placement salt than owners use (must break correctness).
    debug_requester_salt: int = 0
    # debug (negative control, 2D-SP): skip the cross-group replica synchronisation (replicas diverge).
    debug_skip_replica_sync: bool = False

    def __post_init__(self) -> None:
        if self.huge_pages not in HUGE_PAGES:
            raise ValueError(f"embedding.huge_pages = {self.huge_pages!r}: expected one of {', '.join(HUGE_PAGES)}")


HUGE_PAGES = ("resident", "always", "never")


@dataclasses.dataclass
class HSTUConfig:
    """HSTU-style causal sequential transducer (item + action tokens), next-item sampled softmax."""

    num_layers: int = 2
    num_heads: int = 2
    linear_dim: int = 16  # per head, for u/v/q/k
    max_seq_len: int = 64
    # Uniform random negatives, shared by the batch. In-batch popularity negatives (``num_popular_negatives``)
    # push popular items down, which costs full-catalog HR/NDCG without a logQ correction: off by default
    # (synth tiny, 5 epochs: 224 random + 32 popular give HR@10 0.17, 512 random 0.26, most-popular 0.15).
    num_random_negatives: int = 512
    num_popular_negatives: int = 0
    temperature: float = 0.1
    dropout: float = 0.0


@dataclasses.dataclass
class DLRMConfig:
    """DLRM with a DCNv2 cross network: bottom MLP on dense features, cross layers, top MLP, BCE on the target."""

    bottom_mlp: tuple = (64, 32)
    cross_layers: int = 2
    cross_rank: int = 16  # low-rank DCNv2 (U V^T); 0 = full rank
    top_mlp: tuple = (64, 32)
    target: str = "is_click"


@dataclasses.dataclass
class OptimConfig:
    """Dense parameters: AdamW (replicated, gradients all-reduced once per batch)."""

    lr: float = 4e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


PIPELINE_MODES = ("off", "dbp", "fwp", "nested")


@dataclasses.dataclass
class PipelineConfig:
    """The nested pipeline (``TrainConfig.pipeline``: off | dbp | fwp | nested); see ``docs/pipeline.md``.

    ``depth``: how many batches stages 1-3 (data prefetch, H2D, key routing) may run ahead of the batch being
    trained; retrieval always runs at most one batch ahead (two buffers). ``micro_batching``: ``clustered`` uses the
    shard's key-centric partition, ``random`` re-partitions every batch uniformly at random (same samples, same
    gradient sum up to summation order). ``trace_steps`` steps are recorded in the timeline (Chrome trace JSON and a
    PNG Gantt chart of ``gantt_steps`` steps). ``baseline_metrics``: a ``--pipeline off`` run's metrics.json; the
    exposed-time ratios in metrics.json are then measured against it. ``comm_threads``: the Frozen-Window
    Pipeline's communication threads, 2 (one per exchange group: embedding and gradient All2Alls run concurrently)
    or 1 (both groups from one thread in one fixed order); see ``docs/pipeline.md``. ``boundary_prime``: how many
    of the next batch's embedding All2Alls start at the batch boundary, while this batch's dense all-reduce is in
    flight (the rest start as usual, one micro-batch ahead of the compute); a schedule choice, the arithmetic is
    the same.
    """

    depth: int = 2
    comm_threads: int = 2
    boundary_prime: int = 1
    micro_batching: str = "clustered"  # clustered | random
    trace_steps: int = 64
    gantt_steps: int = 4
    baseline_metrics: str = ""
    # debug (negative controls): skip the dual-buffer sync copy; apply the update after every micro-batch.
    debug_skip_dual_buffer_sync: bool = False
    debug_update_per_micro_batch: bool = False
    # debug (negative control, 2D-SP): the dual-buffer sync refreshes only the group's own keys(t), not every row
    # the replica synchronisation changed (rows touched by any group).
    debug_replica_refresh_own_keys_only: bool = False


@dataclasses.dataclass
class TrainConfig:
    shards: str = ""
    out: str = ""
    model: str = "hstu"
    pipeline: str = "nested"  # off | dbp | fwp | nested
    steps: Optional[int] = None
    epochs: Optional[int] = None
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | npu
    dtype: str = "float32"  # float32 | float64 (float64: verification against the float64 reference)
    threads: int = 1
    # Flush subnormal floats to zero (FTZ/DAZ) in the rank's threads; see nestpipe.trainer.distributed.device.set_flush_denormal.
    flush_denormal: bool = True
    timeout_s: float = 60.0
    checkpoint_every: int = 0
    # 2D sparse parallelism: M = workers per model-parallel group (world / M replica groups, data-parallel across
    # groups); 0 or the world size = plain training. See nestpipe.trainer.distributed.sparse_groups and docs/trainer.md.
    sparse_groups: int = 0
    log_every: int = 1
    progress: bool = True
    verify_shards: bool = True
    embedding: EmbeddingConfig = dataclasses.field(default_factory=EmbeddingConfig)
    hstu: HSTUConfig = dataclasses.field(default_factory=HSTUConfig)
    dlrm: DLRMConfig = dataclasses.field(default_factory=DLRMConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    pipe: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    # debug hooks for failure tests: raise on ``debug_fail_rank`` at step ``debug_fail_step``; sleep inside
    # checkpoint writes (or mid-step) so a test can kill the run there.
    debug_fail_step: int = -1
    debug_fail_rank: int = 0
    debug_checkpoint_sleep_s: float = 0.0
    debug_step_sleep_s: float = 0.0  # sleep between retrieval and forward: a batch is in flight

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any], where: str = "config") -> "TrainConfig":
        return _build(cls, d, where)


_NESTED = {"embedding": EmbeddingConfig, "hstu": HSTUConfig, "dlrm": DLRMConfig, "optim": OptimConfig,
           "pipe": PipelineConfig}


def _build(cls, d: Dict[str, Any], where: str):
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in d.items():
        if k not in names:
            raise ValueError(f"{where}: unknown key {k!r} for {cls.__name__} (known: {sorted(names)})")
        if k in _NESTED and cls is TrainConfig:
            v = _build(_NESTED[k], v or {}, f"{where}.{k}")
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[k] = v
    return cls(**kwargs)


def load_config_file(path: str) -> Dict[str, Any]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: config file not found")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        if path.endswith(".toml"):
            import tomllib

            return tomllib.loads(raw.decode())
        return json.loads(raw)
    except Exception as e:  # noqa: BLE001 - any parse error becomes a clear message
        raise ValueError(f"{path}: cannot parse config: {e}") from e


def merge(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def save_config(cfg: TrainConfig, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(cfg.to_dict(), f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def load_run_config(run: str) -> TrainConfig:
    path = os.path.join(run, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no config.json (is {run} the --out directory of `nestpipe train`?)")
    with open(path) as f:
        return TrainConfig.from_dict(json.load(f), where=path)
