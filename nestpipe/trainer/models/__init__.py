"""Dense models consuming the embedding layer's outputs: the registry of model specs and the one build function."""

from __future__ import annotations

from typing import Dict

import torch

from nestpipe.datasets.shards import Manifest
from nestpipe.trainer.embedding.collection import table_dims
from nestpipe.trainer.models import dlrm, hstu, sasrec
from nestpipe.trainer.models.common import init_parameters
from nestpipe.trainer.models.spec import ModelSpec

MODEL_SPECS: Dict[str, ModelSpec] = {spec.name: spec for spec in (hstu.SPEC, sasrec.SPEC, dlrm.SPEC)}
MODEL_TASK = {name: spec.task for name, spec in MODEL_SPECS.items()}
DEFAULT_MODEL = {"gr": "hstu", "ctr": "dlrm"}  # what `nestpipe train` trains on a task's shards unless told


def model_spec(name: str) -> ModelSpec:
    if name not in MODEL_SPECS:
        raise ValueError(f"unknown model {name!r} ({', '.join(MODEL_SPECS)})")
    return MODEL_SPECS[name]


def model_table_dims(cfg, manifest: Manifest) -> Dict[str, int]:
    """Row width of every embedding table for ``cfg.model`` (the trainer, export and eval use this one rule)."""
    return table_dims(manifest, cfg.embedding, model_spec(cfg.model).table_widths(cfg))


def build_model(cfg, manifest: Manifest, dims: Dict[str, int]) -> torch.nn.Module:
    """The dense model for ``cfg.model``, initialised from a generator keyed by ``cfg.seed`` (identical on all ranks)."""
    spec = model_spec(cfg.model)
    if manifest.task != spec.task:
        right = [name for name, s in MODEL_SPECS.items() if s.task == manifest.task]
        raise ValueError(
            f"model {cfg.model!r} trains on {spec.task!r} shards, but {cfg.shards or 'the shards'} hold task "
            f"{manifest.task!r} (use --model {' or '.join(right) or '?'})"
        )
    model = spec.build(cfg, manifest, dims)
    g = torch.Generator()
    g.manual_seed(int(cfg.seed) * 1_000_003 + 17)
    init_parameters(model, g)
    return model
