"""DLRM with a DCNv2 cross network for the CTR task.

Inputs per micro-batch: ``emb[t]`` ``[b, D_t]`` pooled sums for every ``single``/``pooled`` table (sorted by name),
``feats["dense"]`` ``[b, F]`` (transformed by ``sign(x) * log1p(|x|)``), ``feats["labels"]`` ``[b]`` (the target).
``x0 = [bottom_mlp(dense), emb...]``; cross layers ``x_{l+1} = x0 * (U (V^T x_l) + c) + x_l`` (low rank, or a full
matrix when ``cross_rank == 0``); top MLP to one logit; per-sample binary cross-entropy with logits.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import nn

from nestpipe.trainer.config import DLRMConfig
from nestpipe.trainer.models.common import mlp


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

    def logits(self, emb: Dict[str, torch.Tensor], dense: torch.Tensor) -> torch.Tensor:
        dense = torch.sign(dense) * torch.log1p(dense.abs())
        x0 = torch.cat([self.bottom(dense)] + [emb[t] for t in self.tables], dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.top(x).squeeze(1)

    def forward(self, emb: Dict[str, torch.Tensor], feats: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample loss ``[b]``."""
        logit = self.logits(emb, feats["dense"])
        return F.binary_cross_entropy_with_logits(logit, feats["labels"], reduction="none")
