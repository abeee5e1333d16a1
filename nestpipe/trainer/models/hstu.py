"""HSTU-style generative recommender: a causal sequential transducer over item (+ author + action) tokens.

Inputs per micro-batch (from the embedding layer, jagged in sample order): ``emb[t]`` ``[nnz, D]`` for every
sequence table (token = sum over tables + a learned position embedding), ``emb["item#neg"]`` ``[K, D]`` for the
batch's shared negatives; ``feats["lengths"]`` ``[b]``, ``feats["item_ids"]`` ``[nnz]``, ``feats["neg_ids"]``
``[K]`` (in-vocabulary ids, to mask negatives equal to the target).

Layer (HSTU, Zhai et al. 2024, simplified): ``u, v, q, k = SiLU(W1 LN(x))``; ``A = SiLU(q k^T / sqrt(d)) / max_seq_len``
under a causal mask; ``x += W2(LN(A v) * u)``. Objective: next-item sampled softmax with cosine similarity and a
temperature; each sample's loss is the mean over its positions, so the per-sample loss does not depend on how
the batch is partitioned into micro-batches.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from nestpipe.datasets.shards import Manifest
from nestpipe.trainer.embedding.batch import NEG_SLOT, PreparedBatch
from nestpipe.trainer.models.spec import ModelSpec
from nestpipe.utils.options import opt

NEG = NEG_SLOT


@dataclasses.dataclass
class HSTUConfig:
    """HSTU-style causal sequential transducer (item + action tokens), next-item sampled softmax."""

    num_layers: int = opt(2, help="HSTU layers", minimum=1)
    num_heads: int = opt(2, help="attention heads per layer", minimum=1)
    linear_dim: int = opt(16, help="per-head dimension of u/v/q/k", minimum=1)
    max_seq_len: int = opt(64, help="longest sequence the positional encoding covers", minimum=1)
    num_random_negatives: int = opt(512, help="uniform random negatives, shared by the batch", minimum=0)
    num_popular_negatives: int = opt(
        0, help="in-batch popularity negatives (they push popular items down, which costs full-catalog HR/NDCG "
        "without a logQ correction: off by default)", minimum=0)
    temperature: float = opt(0.1, help="softmax temperature of the sampled softmax", minimum=0)
    dropout: float = opt(0.0, help="dropout probability", minimum=0)


class HSTULayer(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.norm_in = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * heads * head_dim)
        self.norm_attn = nn.LayerNorm(heads * head_dim)
        self.out = nn.Linear(heads * head_dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, max_len: int) -> torch.Tensor:
        b, n, _ = x.shape
        h, d = self.heads, self.head_dim
        u, v, q, k = F.silu(self.uvqk(self.norm_in(x))).split(h * d, dim=-1)
        q = q.view(b, n, h, d).transpose(1, 2)
        k = k.view(b, n, h, d).transpose(1, 2)
        v = v.view(b, n, h, d).transpose(1, 2)
        attn = F.silu(q @ k.transpose(-1, -2) / d ** 0.5) / max_len  # a constant: partition-independent
        attn = attn * mask[:, None, :, :]
        av = (attn @ v).transpose(1, 2).reshape(b, n, h * d)
        return x + self.out(self.norm_attn(av) * u)


class HSTU(nn.Module):
    def __init__(self, cfg: HSTUConfig, dim: int, sequence_tables: List[str], max_seq_len: int):
        super().__init__()
        self.cfg = cfg
        self.dim = dim
        self.tables = sorted(sequence_tables)
        if "item" not in self.tables:
            raise ValueError(f"hstu needs a sequence table named 'item' (got {self.tables})")
        self.max_len = max_seq_len
        self.pos = nn.Parameter(torch.zeros(max_seq_len, dim))
        self.layers = nn.ModuleList([HSTULayer(dim, cfg.num_heads, cfg.linear_dim) for _ in range(cfg.num_layers)])
        self.norm_out = nn.LayerNorm(dim)

    # -- encoder ---------------------------------------------------------------------------------------------------
    def encode(self, emb: Dict[str, torch.Tensor], lengths: torch.Tensor) -> torch.Tensor:
        """Jagged tokens -> hidden states, flat ``[nnz, D]`` in the input order."""
        b = len(lengths)
        n = int(lengths.max()) if b else 0
        sample = torch.repeat_interleave(torch.arange(b, device=lengths.device), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        pos = torch.arange(len(sample), device=lengths.device) - starts[sample]
        x = emb[self.tables[0]]
        for t in self.tables[1:]:
            x = x + emb[t]
        x = x + self.pos.index_select(0, pos.clamp(max=self.max_len - 1))
        flat = sample * n + pos
        padded = x.new_zeros(b * n, self.dim).index_copy(0, flat, x).view(b, n, self.dim)
        valid = torch.arange(n, device=lengths.device)[None, :] < lengths[:, None]
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=lengths.device))
        mask = (causal[None] & valid[:, None, :] & valid[:, :, None]).to(x.dtype)
        for layer in self.layers:
            padded = layer(padded, mask, self.max_len)
        return self.norm_out(padded).reshape(b * n, self.dim).index_select(0, flat)

    # -- training objective ---------------------------------------------------------------------------------------
    def forward(self, emb: Dict[str, torch.Tensor], feats: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample loss ``[b]``: mean next-item sampled-softmax loss over the sample's positions."""
        lengths = feats["lengths"]
        hidden = self.encode(emb, lengths)
        b = len(lengths)
        sample = torch.repeat_interleave(torch.arange(b, device=lengths.device), lengths)
        ends = torch.cumsum(lengths, 0) - 1
        is_query = torch.ones(len(sample), dtype=torch.bool, device=lengths.device)
        is_query[ends] = False
        q_idx = torch.nonzero(is_query).flatten()
        query = F.normalize(hidden.index_select(0, q_idx), dim=-1)
        target = F.normalize(emb["item"].index_select(0, q_idx + 1), dim=-1)
        negs = F.normalize(emb[NEG], dim=-1)
        tau = self.cfg.temperature
        pos_logit = (query * target).sum(-1, keepdim=True) / tau
        neg_logit = query @ negs.t() / tau
        same = feats["item_ids"].index_select(0, q_idx + 1)[:, None] == feats["neg_ids"][None, :]
        neg_logit = neg_logit.masked_fill(same, -1e9)
        logits = torch.cat([pos_logit, neg_logit], dim=1)
        token_loss = torch.logsumexp(logits, dim=1) - logits[:, 0]
        q_sample = sample.index_select(0, q_idx)
        per_sample = token_loss.new_zeros(b).index_add(0, q_sample, token_loss)
        count = torch.zeros(b, dtype=token_loss.dtype, device=lengths.device).index_add(
            0, q_sample, torch.ones_like(token_loss))
        return per_sample / count.clamp(min=1)


def build(cfg, manifest: Manifest, dims: Dict[str, int]) -> HSTU:
    seq = [t for t, s in manifest.tables.items() if s.kind == "sequence"]
    dset = {dims[t] for t in seq}
    if len(dset) != 1:
        raise ValueError(f"hstu needs one embedding dim for all sequence tables, got {dims}")
    return HSTU(cfg.hstu, dset.pop(), seq, int(manifest.max_seq_len or cfg.hstu.max_seq_len))


def dense_inputs(cfg, manifest: Manifest, batch: PreparedBatch, i: int, device: torch.device,
                 dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """Micro-batch ``i``'s non-embedding inputs: sequence lengths, target item ids and the shared negatives."""
    mbd = batch.micro[i]
    return {
        "lengths": torch.from_numpy(mbd.lengths["item"]).to(device),
        "item_ids": torch.from_numpy(batch.keys["item"][mbd.value_key["item"]]).to(device),
        "neg_ids": torch.from_numpy(batch.negatives).to(device),
    }


def negatives(cfg) -> Tuple[int, int]:
    return (cfg.hstu.num_random_negatives, cfg.hstu.num_popular_negatives)


SPEC = ModelSpec(name="hstu", task="gr", build=build, dense_inputs=dense_inputs, negatives=negatives,
                 shared_negatives=True)
