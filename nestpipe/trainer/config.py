"""Trainer configuration: one dataclass per component, assembled in :class:`TrainConfig`.

A config file (``--config FILE``, JSON or TOML) holds the same nested structure as :meth:`TrainConfig.to_dict`;
command-line flags override it. The resolved config is written to ``RUN/config.json`` and is what ``--resume``,
``eval`` and ``export`` read back. Every key is checked in one place, :func:`validate`, when a config is built
(types per field, then allowed values and ranges), so a bad key fails before any rank starts. Each field carries
its meaning as metadata; ``nestpipe train --help-config`` lists them (:func:`describe`).

Test-only negative controls and fault injection are not configuration: see :mod:`nestpipe.trainer.testing_hooks`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import textwrap
import typing
from typing import Any, Dict, List, Optional, Tuple

from nestpipe.trainer.embedding.config import EXCHANGE_KINDS, EmbeddingConfig
from nestpipe.trainer.models import MODEL_SPECS
from nestpipe.utils.jsonio import read_json, write_json_atomic
from nestpipe.utils.options import annotation_name, opt, value_fits

PIPELINE_MODES = ("off", "dbp", "fwp", "nested")
SCHEDULES = ("auto",) + PIPELINE_MODES  # --pipeline: auto chooses one of the modes at start
MODELS = tuple(MODEL_SPECS)

# Keys of configs written before the test-only hooks left the configuration: dropped on load with a warning.
RETIRED_KEYS = {
    "debug_fail_step", "debug_fail_rank", "debug_checkpoint_sleep_s", "debug_step_sleep_s",
    "embedding.debug_requester_salt", "embedding.debug_skip_replica_sync",
    "pipe.debug_skip_dual_buffer_sync", "pipe.debug_update_per_micro_batch", "pipe.debug_replica_refresh_own_keys_only",
}
# keys removed because they did nothing: runs that set them trained exactly as without them
REMOVED_NO_OP_KEYS = {"hstu.dropout": "the model never applied it"}


LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(o: "OptimConfig", step: int, total: int) -> float:
    """The learning-rate multiplier of step ``step`` (0-based) of a ``total``-step run under ``o.schedule``:
    ``(step + 1) / warmup_steps`` during the warm-up, then 1 (constant) or a decay from 1 at the warm-up's end to
    ``final_lr_ratio`` at step ``total - 1`` and after (linear or half a cosine)."""
    if o.warmup_steps > 0 and step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return 1.0
    span = max(total - 1 - o.warmup_steps, 1)
    done = min(max(step - o.warmup_steps, 0) / span, 1.0)
    shape = 1.0 - done if o.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    return o.final_lr_ratio + (1.0 - o.final_lr_ratio) * shape


@dataclasses.dataclass
class OptimConfig:
    """Dense parameters: AdamW (replicated, gradients all-reduced once per batch)."""

    lr: float = opt(4e-3, help="AdamW learning rate", minimum=0)
    betas: Tuple[float, ...] = opt((0.9, 0.999), help="AdamW betas")
    eps: float = opt(1e-8, help="AdamW epsilon", minimum=0)
    weight_decay: float = opt(0.0, help="AdamW weight decay", minimum=0)
    schedule: str = opt(
        "constant", help="learning-rate schedule over the run's steps: constant, or linear / cosine decay from lr "
        "to final_lr_ratio x lr at the last step (after warmup_steps of linear warm-up: lr / warmup_steps, 2 lr / "
        "warmup_steps, ..., lr). The rate of step s depends on s and the run's step count only, so every schedule and "
        "a resumed run use the same rates (a run resumed with a larger --steps follows the new horizon from there)",
        choices=LR_SCHEDULES)
    warmup_steps: int = opt(0, help="steps of linear warm-up to lr before the schedule", minimum=0)
    final_lr_ratio: float = opt(0.0, help="linear / cosine: the rate at the last step as a fraction of lr",
                                minimum=0)
    embedding_follows: bool = opt(
        False, help="scale the sparse tables' row-wise AdaGrad rates (embedding.lr, table_lr) by the same factor")


@dataclasses.dataclass
class PipelineConfig:
    """The nested pipeline (``TrainConfig.pipeline``: off | dbp | fwp | nested); see ``docs/pipeline.md``."""

    depth: int = opt(2, help="how many batches stages 1-3 (data prefetch, H2D, key routing) may run ahead of the "
                     "batch being trained; retrieval always runs at most one batch ahead (two buffers)", minimum=1)
    comm_threads: int = opt(
        2, help="the Frozen-Window Pipeline's communication threads: 2 (one per exchange group, embedding and "
        "gradient All2Alls concurrently) or 1 (both groups from one thread in one fixed order)", choices=(1, 2))
    boundary_prime: int = opt(
        1, help="how many of the next batch's embedding All2Alls start at the batch boundary, while this batch's "
        "dense all-reduce is in flight (a schedule choice; the arithmetic is the same)", minimum=1)
    route_ahead: bool = opt(
        True, help="off and fwp: prepare the next batch and issue its key-routing All2Alls asynchronously during this "
        "batch (waited for at the next step), as a pipelined input distribution does; routing reads keys only, so "
        "nothing in the arithmetic changes")
    micro_batching: str = opt(
        "auto", help="how a batch is split into micro-batches (the same gradient sum, up to summation order): "
        "clustered: the shard's key-centric partition; random: re-partition every batch uniformly at random; whole: "
        "the batch as one micro-batch; auto: whole for off and dbp (no frozen window: micro-batches would only add "
        "passes) where the model's loss does not depend on the partition (no in-batch negatives), else clustered. "
        "Schedules train bitwise-identically at the same micro-batching",
        choices=("auto", "clustered", "random", "whole"))
    trace_steps: int = opt(64, help="steps recorded in the timeline (RUN/trace.json)", minimum=0)
    gantt_steps: int = opt(3, help="steady-state steps drawn in RUN/timeline.png, after the warm-up steps (0: no chart)",
                           minimum=0)
    profile_steps: int = opt(0, help="steps of rank 0 recorded by torch.profiler after the first two (host and, on "
                             "an accelerator, device activity) into RUN/profile-rank0.json (Chrome trace); 0: none",
                             minimum=0)
    baseline_metrics: str = opt("", help="a --pipeline off run's metrics.json: the exposed-time ratios in "
                                "metrics.json are measured against it")


@dataclasses.dataclass
class EarlyStopConfig:
    """Early stopping on the valid split (``nestpipe.trainer.early_stop``)."""

    mode: str = opt("auto", help="auto: stop early where the shards have a valid split (ingest --validation) and "
                    "neither steps nor epochs is set; on: always (the shards need a valid split); off: never",
                    choices=("auto", "on", "off"))
    patience: int = opt(3, help="stop after this many epochs without a better valid score", minimum=1)
    max_epochs: int = opt(50, help="epochs at most", minimum=1)


@dataclasses.dataclass
class _TrainConfigBase:
    """Everything but the model sections (those come from the model registry: ``TrainConfig`` below)."""

    shards: str = opt("", help="shard directory (a `nestpipe ingest` output with manifest.json)")
    out: str = opt("", help="run directory")
    model: str = opt("hstu", help="model to train: " + ", ".join(f"{n} ({s.task} shards)" for n, s in MODEL_SPECS.items()),
                     choices=MODELS)
    pipeline: str = opt("auto", help="schedule: auto (chosen once at start from the cores per rank and a probe of "
                        "the link, see docs/pipeline.md) | off (the synchronous step) | dbp | fwp | nested; all give "
                        "bitwise-identical results at the same pipe.micro_batching", choices=SCHEDULES)
    steps: Optional[int] = opt(None, help="steps to train (null: epochs x batches per rank)", minimum=1)
    epochs: Optional[int] = opt(None, help="epochs to train when steps is null (null: 1)", minimum=1)
    seed: int = opt(0, help="seed of initialisation, negatives and random micro-batching", minimum=0)
    device: str = opt("auto", help="auto | cpu | cuda | npu", choices=("auto", "cpu", "cuda", "npu"))
    dist_backend: str = opt(
        "auto", help="collective backend: auto (cpu gloo, cuda nccl, npu hccl) or gloo (any device; gloo can run "
        "several ranks on one GPU, which NCCL refuses)", choices=("auto", "gloo"))
    dtype: str = opt("float32", help="float32, or float64 (verification against the float64 reference)",
                     choices=("float32", "float64"))
    threads: int = opt(1, help="torch intra-op threads per rank; more than 1 needs pipeline off or auto (auto then "
                               "chooses off: the parallel CPU kernels must not run from several pipeline threads)",
                       minimum=1)
    flush_denormal: bool = opt(True, help="flush subnormal floats to zero (FTZ/DAZ) in the rank's threads")
    tune_kernels: bool = opt(
        True, help="CPU: among kernel paths that compute bitwise the same result, take the fastest on this host, "
        "measured once per host and shape (about a second) and cached under $NESTPIPE_CACHE_DIR or ~/.cache/nestpipe; "
        "off: the fixed rule. NESTPIPE_KERNELS still forces a path (see nestpipe kernels-tune)")
    timeout_s: float = opt(60.0, help="process-group timeout in seconds", minimum=0)
    checkpoint_every: int = opt(0, help="checkpoint every K steps (0: only at the end)", minimum=0)
    sparse_groups: int = opt(
        0, help="2D sparse parallelism: workers per model-parallel group M (world / M replica groups, data-parallel "
        "across groups); 0 or the world size = plain training", minimum=0)
    log_every: int = opt(1, help="write RUN/scalars.jsonl every K steps", minimum=1)
    tensorboard: bool = opt(False, help="also write the scalars as TensorBoard events under RUN/tensorboard "
                            "(needs the tensorboard package: pip install 'nestpipe[tensorboard]')")
    progress: bool = opt(True, help="show a progress bar on rank 0")
    verify_shards: bool = opt(True, help="check every shard's sha256 against the manifest before training")
    embedding: EmbeddingConfig = opt(factory=EmbeddingConfig, help="sparse tables")
    optim: OptimConfig = opt(factory=OptimConfig, help="dense optimizer")
    pipe: PipelineConfig = opt(factory=PipelineConfig, help="the nested pipeline")
    early_stop: EarlyStopConfig = opt(factory=EarlyStopConfig, help="early stopping on the valid split")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any], where: str = "config") -> "TrainConfig":
        """Build and validate a config from its nested dict (unknown keys, wrong types and bad values refused;
        retired test-only keys dropped with a warning)."""
        cfg = _build(cls, _drop_retired(d, where), where)
        validate(cfg, where)
        return cfg


# One section per registered model (``models/<name>.py`` defines its config class and SPEC): adding a model touches
# nothing here.
TrainConfig = dataclasses.make_dataclass(
    "TrainConfig", [(name, spec.config, opt(factory=spec.config, help=spec.help)) for name, spec in MODEL_SPECS.items()],
    bases=(_TrainConfigBase,), namespace={"__module__": __name__, "__doc__": "``nestpipe train`` configuration."})

_SECTIONS = {"embedding": EmbeddingConfig, "optim": OptimConfig, "pipe": PipelineConfig, "early_stop": EarlyStopConfig,
             **{name: spec.config for name, spec in MODEL_SPECS.items()}}


def default_config(model: str) -> Dict[str, Any]:
    """The default config of a run of ``model``, as a nested dict: the defaults of every section, with the model's
    own defaults for shared keys (``ModelSpec.train_defaults``, e.g. the dlrm's dense learning rate) on top."""
    if model not in MODEL_SPECS:
        raise ValueError(f"unknown model {model!r} ({', '.join(MODEL_SPECS)})")
    return merge({**TrainConfig().to_dict(), "model": model}, MODEL_SPECS[model].train_defaults)


def _drop_retired(d: Dict[str, Any], where: str) -> Dict[str, Any]:
    out = {k: (dict(v) if isinstance(v, dict) and k in _SECTIONS else v) for k, v in d.items()}
    dropped = []
    for key in sorted(RETIRED_KEYS):
        parts = key.split(".")
        holder = out if len(parts) == 1 else out.get(parts[0])
        if isinstance(holder, dict) and parts[-1] in holder:
            holder.pop(parts[-1])
            dropped.append(key)
    if dropped:
        print(f"warning: {where}: ignoring {', '.join(dropped)}: test-only hooks are no longer configuration keys "
              "(they are set through nestpipe.trainer.testing_hooks)", file=sys.stderr)
    for key, why in sorted(REMOVED_NO_OP_KEYS.items()):
        section, name = key.split(".")
        if isinstance(out.get(section), dict) and name in out[section]:
            out[section].pop(name)
            print(f"warning: {where}: ignoring {key}: removed because {why}", file=sys.stderr)
    return out


def _build(cls, d: Dict[str, Any], where: str):
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a table of keys for {cls.__name__}, found {d!r}")
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in d.items():
        if k not in names:
            raise ValueError(f"{where}: unknown key {k!r} for {cls.__name__} (known: {sorted(names)}; "
                             "`nestpipe train --help-config` lists them)")
        if k in _SECTIONS and cls is TrainConfig:
            v = _build(_SECTIONS[k], v or {}, f"{where}.{k}")
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[k] = v
    return cls(**kwargs)


def _check_fields(obj: Any, where: str, prefix: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, kind, key = getattr(obj, f.name), hints[f.name], f"{prefix}{f.name}"
        if f.name in _SECTIONS and isinstance(obj, TrainConfig):
            _check_fields(value, where, f"{key}.")
            continue
        if not value_fits(value, kind):
            raise ValueError(f"{where}: {key} = {value!r}: expected {annotation_name(kind)}")
        choices, minimum = f.metadata.get("choices"), f.metadata.get("minimum")
        if choices is not None and value not in choices:
            raise ValueError(f"{where}: {key} = {value!r}: expected one of {', '.join(map(str, choices))}")
        if minimum is not None and value is not None and value < minimum:
            raise ValueError(f"{where}: {key} = {value!r}: must be >= {minimum}")


def validate(cfg: TrainConfig, where: str = "config") -> None:
    """Every check of a config in one place: types per field, allowed values, ranges, and the few rules across
    keys (exchange kinds per table). Raises ValueError naming the source and the key."""
    _check_fields(cfg, where)
    if cfg.threads > 1 and cfg.pipeline not in ("off", "auto"):
        # threads > 1 selects the parallel Numba kernels, whose parallel regions are not safe to enter from the
        # pipeline's several stage threads at once (nestpipe.kernels.cpu)
        raise ValueError(f"{where}: threads = {cfg.threads} with pipeline = {cfg.pipeline}: more than one intra-op "
                         f"thread per rank needs --pipeline off (or auto, which then chooses off); the pipelined "
                         f"schedules run kernels from several threads at once")
    for table, kind in cfg.embedding.kinds.items():
        if kind not in EXCHANGE_KINDS:
            raise ValueError(f"{where}: embedding.kinds.{table} = {kind!r}: expected one of "
                             f"{', '.join(EXCHANGE_KINDS)}")


def check_tables(cfg: TrainConfig, tables, where: str) -> None:
    """The config against the shards' tables (``where`` names the shards): every per-table key names a table."""
    names = sorted(tables)
    unknown = sorted(set(cfg.embedding.table_lr) - set(names))
    if unknown:
        raise ValueError(f"embedding.table_lr: no table named {unknown} in {where} (tables: {', '.join(names)})")
    negative = {t: v for t, v in cfg.embedding.table_lr.items() if float(v) < 0}
    if negative:
        raise ValueError(f"embedding.table_lr {negative}: learning rates must be >= 0")


def describe() -> str:
    """Every config key (dotted), its type, default and meaning: the text of ``nestpipe train --help-config``."""
    lines: List[str] = []

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        default = cls()
        for f in dataclasses.fields(cls):
            if f.name in _SECTIONS and cls is TrainConfig:
                lines.append("")
                lines.append(f"[{f.name}]  {f.metadata.get('help', '')}")
                walk(_SECTIONS[f.name], f"{f.name}.")
                continue
            value = getattr(default, f.name)
            allowed = f.metadata.get("choices")
            head = f"  {prefix}{f.name}  ({annotation_name(hints[f.name])}, default {json.dumps(value)}"
            lines.append(head + (f"; one of {', '.join(map(str, allowed))})" if allowed else ")"))
            lines.extend(textwrap.wrap(f.metadata.get("help", ""), 110, initial_indent="      ",
                                       subsequent_indent="      "))

    walk(TrainConfig, "")
    own = []
    for name, spec in MODEL_SPECS.items():
        flat = [f"{section}.{k} = {json.dumps(v)}" for section, keys in spec.train_defaults.items()
                for k, v in keys.items()]
        if flat:
            own.append(f"  {name}: " + ", ".join(flat))
    if own:
        lines += ["", "Models' own defaults for shared keys (used when that model is trained; --config and --set "
                  "still override them):", *own]
    return ("Keys of `nestpipe train --config FILE` (JSON or TOML, nested as below) and `--set KEY=JSON`:\n"
            + "\n".join(lines) + "\n")


def load_config_file(path: str) -> Dict[str, Any]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: config file not found")
    if path.endswith(".toml"):
        import tomllib  # Python 3.11+: TOML configs need it, JSON ones do not

        with open(path, "rb") as f:
            try:
                return tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"{path}: cannot parse config: {e}") from e
    return read_json(path, "config", expect=dict)


def merge(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def save_config(cfg: TrainConfig, path: str) -> None:
    write_json_atomic(path, cfg.to_dict())


def load_run_config(run: str) -> TrainConfig:
    path = os.path.join(run, "config.json")
    doc = read_json(path, "config.json", hint=f"is {run} the --out directory of `nestpipe train`?", expect=dict)
    for section in ("hstu", "sasrec"):  # runs from before the options: tied item embeddings, no transition term,
        if isinstance(doc.get(section), dict):  # no item bias
            doc[section].setdefault("output_embedding", "tied")
            doc[section].setdefault("transition", 0.0)
            doc[section].setdefault("item_bias", 0.0)
    doc.setdefault("early_stop", {"mode": "off"})  # runs from before early stopping trained their epochs
    return TrainConfig.from_dict(doc, where=path)
