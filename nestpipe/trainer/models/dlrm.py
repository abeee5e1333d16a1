"""DLRM with a DCNv2 cross network for the CTR task.

Inputs per micro-batch: ``emb[t]`` ``[b, D_t]`` pooled sums for every ``single``/``pooled`` table (sorted by name),
``feats["dense"]`` ``[b, F]`` (transformed by ``sign(x) * log1p(|x|)``), ``feats["labels"]`` ``[b]`` (the target).
``x0 = [bottom_mlp(dense), emb...]``; cross layers ``x_{l+1} = x0 * (U (V^T x_l) + c) + x_l`` (low rank, or a full
matrix when ``cross_rank == 0``); top MLP to one logit, plus ``<emb[a], emb[b]>`` for every pair of ``dot_pairs``
(factorisation-machine terms straight into the logit); per-sample binary cross-entropy with logits.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

import numpy as np

import torch
import torch.nn.functional as F
from torch import nn

from nestpipe.datasets.shards import Manifest
from nestpipe.trainer.embedding.batch import PreparedBatch
from nestpipe.trainer.models.common import mlp
from nestpipe.trainer.models.spec import ModelSpec
from nestpipe.utils.options import opt



@dataclasses.dataclass
class DLRMConfig:
    """DLRM with a DCNv2 cross network: bottom MLP on dense features, cross layers, top MLP, BCE on the target."""

    bottom_mlp: Tuple[int, ...] = opt((64, 32), help="bottom MLP widths (dense features)")
    cross_layers: int = opt(2, help="DCNv2 cross layers", minimum=0)
    cross_rank: int = opt(16, help="low-rank DCNv2 (U V^T) rank; 0 = full rank", minimum=0)
    top_mlp: Tuple[int, ...] = opt((64, 32), help="top MLP widths")
    dot_pairs: Tuple[str, ...] = opt(("user_id*author_id",), help="table pairs 'a*b' whose embeddings' dot product is "
                                     "added to the logit (a factorisation-machine term: 'user_id*author_id' learns "
                                     "a user's taste for a creator, a cross no linear model over the same columns "
                                     "expresses); pairs whose tables the shards lack are skipped")
    target: str = opt("is_click", help="label column trained on (one of the manifest's labels)")


class CrossLayer(nn.Module):
    def __init__(self, width: int, rank: int):
        super().__init__()
        if rank > 0:
            self.v = nn.Linear(width, rank, bias=False)
            self.u = nn.Linear(rank, width)
        else:
            self.v = nn.Identity()
            self.u = nn.Linear(width, width)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.u(self.v(x)) + x


class DLRM(nn.Module):
    def __init__(self, cfg: DLRMConfig, num_dense: int, sparse_dims: Dict[str, int]):
        super().__init__()
        self.cfg = cfg
        self.tables: List[str] = sorted(sparse_dims)
        self.bottom = mlp([num_dense, *cfg.bottom_mlp])
        width = cfg.bottom_mlp[-1] + sum(sparse_dims[t] for t in self.tables)
        self.cross = nn.ModuleList([CrossLayer(width, cfg.cross_rank) for _ in range(cfg.cross_layers)])
        self.top = mlp([width, *cfg.top_mlp, 1], final_activation=False)
        self.dot_pairs = []
        for spec in cfg.dot_pairs:
            a, _, b = spec.partition("*")
            if not a or not b:
                raise ValueError(f"dlrm.dot_pairs entry {spec!r}: expected 'table_a*table_b'")
            if a in sparse_dims and b in sparse_dims:
                if sparse_dims[a] != sparse_dims[b]:
                    raise ValueError(f"dlrm.dot_pairs {spec!r}: widths {sparse_dims[a]} and {sparse_dims[b]} differ")
                self.dot_pairs.append((a, b))

    def logits(self, emb: Dict[str, torch.Tensor], dense: torch.Tensor) -> torch.Tensor:
        dense = torch.sign(dense) * torch.log1p(dense.abs())
        x0 = torch.cat([self.bottom(dense)] + [emb[t] for t in self.tables], dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        logit = self.top(x).squeeze(1)
        for a, b in self.dot_pairs:
            logit = logit + (emb[a] * emb[b]).sum(1)
        return logit

    def forward(self, emb: Dict[str, torch.Tensor], feats: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample loss ``[b]``."""
        logit = self.logits(emb, feats["dense"])
        return F.binary_cross_entropy_with_logits(logit, feats["labels"], reduction="none")


def build(cfg, manifest: Manifest, dims: Dict[str, int]) -> DLRM:
    if cfg.dlrm.target not in manifest.labels:
        raise ValueError(f"dlrm target {cfg.dlrm.target!r} not among the shards' labels {manifest.labels}")
    sparse = {t: dims[t] for t, s in manifest.tables.items() if s.kind != "sequence"}
    return DLRM(cfg.dlrm, len(manifest.dense_features), sparse)


def dense_inputs(cfg, manifest: Manifest, batch: PreparedBatch, i: int, device: torch.device,
                 dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """Micro-batch ``i``'s non-embedding inputs: dense features and the target label."""
    mbd = batch.micro[i]
    k = manifest.labels.index(cfg.dlrm.target)
    return {
        "dense": torch.from_numpy(np.ascontiguousarray(mbd.fields["dense"], dtype=np.float32)).to(device, dtype),
        "labels": torch.from_numpy(np.ascontiguousarray(mbd.fields["labels"][:, k], dtype=np.float32)).to(device, dtype),
    }


def negatives(cfg) -> Tuple[int, int]:
    return (0, 0)


# The dense learning rate and the rows' initial spread (the pair term starts from the rows' dot products) were chosen
# on the synthetic demo data's valid split; the tables' AdaGrad rate on real interactions' valid split (MovieLens-100K,
# 23 dates before the eval dates; docs/trainer.md gives the figures and their records).
TRAIN_DEFAULTS = {"optim": {"lr": 0.002}, "embedding": {"init_scale": 0.1, "lr": 0.1}}

SPEC = ModelSpec(name="dlrm", task="ctr", build=build, dense_inputs=dense_inputs, negatives=negatives,
                 shared_negatives=False, config=DLRMConfig, help="the DLRM model", train_defaults=TRAIN_DEFAULTS)
