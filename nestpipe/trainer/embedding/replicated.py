"""Replicated (data-parallel) small tables, e.g. the 256-row GR action table.

Every rank holds the full table and its row-wise AdaGrad state; both are identical on all ranks at every step
boundary. Micro-batch gradients accumulate in ``weight.grad`` (autograd, micro-batches in order); the batch's
gradient is all-reduced together with the dense gradients (one all-reduce per batch) and every rank applies the
same row-wise AdaGrad to the whole table (untouched rows get a zero gradient and stay bit-identical).
"""

from __future__ import annotations

import numpy as np
import torch

from nestpipe.trainer.embedding.store import rowwise_adagrad
from nestpipe.trainer.embedding.placement import init_rows


def owner_order(dest: np.ndarray, world: int) -> np.ndarray:
    """``np.argsort(dest, kind="stable")`` for owner ranks in ``[0, world)``: the same permutation (a stable sort is
    unique), computed on a 16-bit copy so numpy uses its linear-time radix sort instead of a comparison sort."""
    if world <= 1 << 15:
        dest = dest.astype(np.int16)
    return np.argsort(dest, kind="stable")


def owner_bounds(dest: np.ndarray, world: int) -> np.ndarray:
    """``[world + 1]`` start of every owner's run in ``dest`` sorted by owner."""
    out = np.zeros(world + 1, dtype=np.int64)
    np.cumsum(np.bincount(dest, minlength=world), out=out[1:])
    return out


class ReplicatedTable:
    def __init__(self, name: str, table_id: int, vocab: int, dim: int, seed: int, init_scale: float,
                 device: torch.device, dtype: torch.dtype = torch.float32):
        self.name = name
        self.table_id = table_id
        self.vocab = vocab
        self.dim = dim
        w = init_rows(seed, table_id, np.arange(vocab, dtype=np.int64), dim, init_scale)
        self.weight = torch.from_numpy(w).to(device=device, dtype=dtype).requires_grad_(True)
        self.state = torch.zeros(vocab, dtype=dtype, device=device)

    def lookup(self, ids: torch.Tensor, value_sample: torch.Tensor, num_samples: int, pooled: bool) -> torch.Tensor:
        rows = self.weight.index_select(0, ids)
        if not pooled:
            return rows
        return rows.new_zeros(num_samples, self.dim).index_add(0, value_sample, rows)

    @torch.no_grad()
    def update(self, grad: torch.Tensor, lr: float, eps: float, groups: int = 1) -> None:
        w, s = rowwise_adagrad(self.weight.detach(), self.state, grad, lr, eps, groups)
        self.weight.data.copy_(w)
        self.state.copy_(s)
        self.weight.grad = None
