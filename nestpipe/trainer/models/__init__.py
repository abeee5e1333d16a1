"""Dense models consuming the embedding layer's outputs, and the one function that builds them."""

from __future__ import annotations

from typing import Dict

import torch

from nestpipe.datasets.shards import Manifest
from nestpipe.trainer.models.common import init_parameters
from nestpipe.trainer.models.hstu import HSTU
from nestpipe.trainer.models.dlrm import DLRM

MODEL_TASK = {"hstu": "gr", "dlrm": "ctr"}


def build_model(cfg, manifest: Manifest, dims: Dict[str, int]) -> torch.nn.Module:
    """The dense model for ``cfg.model``, initialised from a generator keyed by ``cfg.seed`` (identical on all ranks)."""

    want = MODEL_TASK.get(cfg.model)
    if want is None:
        raise ValueError(f"unknown model {cfg.model!r} (hstu, dlrm)")
    if manifest.task != want:
        raise ValueError(
            f"model {cfg.model!r} trains on {want!r} shards, but {cfg.shards or 'the shards'} hold task "
            f"{manifest.task!r} (use --model {'hstu' if manifest.task == 'gr' else 'dlrm'})"
        )
    if cfg.model == "hstu":
        seq = [t for t, s in manifest.tables.items() if s.kind == "sequence"]
        dset = {dims[t] for t in seq}
        if len(dset) != 1:
            raise ValueError(f"hstu needs one embedding dim for all sequence tables, got {dims}")
        model = HSTU(cfg.hstu, dset.pop(), seq, int(manifest.max_seq_len or cfg.hstu.max_seq_len))
    else:
        if cfg.dlrm.target not in manifest.labels:
            raise ValueError(f"dlrm target {cfg.dlrm.target!r} not among the shards' labels {manifest.labels}")
        sparse = {t: dims[t] for t, s in manifest.tables.items() if s.kind != "sequence"}
        model = DLRM(cfg.dlrm, len(manifest.dense_features), sparse)
    g = torch.Generator()
    g.manual_seed(int(cfg.seed) * 1_000_003 + 17)
    init_parameters(model, g)
    return model
