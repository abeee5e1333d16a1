"""SASRec (Kang and McAuley, 2018): causal softmax self-attention over item (+ author + action) tokens, the
reference sequential recommender that HSTU is judged against.

Inputs, objective and negatives are HSTU's (:mod:`nestpipe.trainer.models.hstu`): token = sum of the sequence
tables' embeddings + a learned absolute position embedding; next-item sampled softmax with cosine similarity and a
temperature against the batch's shared negatives (:func:`nestpipe.trainer.models.common.next_item_loss`), each
sample's loss the mean over its positions. Block (pre-norm): ``x += MHA(LN(x))`` under a causal mask over the
sample's own tokens (softmax over the keys at or before the query), ``x += FFN(LN(x))`` with a ReLU MLP of width
``ffn_mult x D``; a final LayerNorm. No dropout (every schedule must give bitwise-identical results).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import nn

from nestpipe.datasets.shards import Manifest
from nestpipe.trainer.models import hstu
from nestpipe.trainer.models.common import (SEQUENTIAL_TRAIN_DEFAULTS, NextItemObjective, SequentialModel,
                                             padded_tokens, sequential_table_widths, sequential_token_dim)
from nestpipe.trainer.models.spec import ModelSpec
from nestpipe.utils.options import opt


@dataclasses.dataclass
class SASRecConfig(NextItemObjective):
    """SASRec: causal softmax self-attention (the reference sequential model), next-item sampled softmax (the
    objective's fields, the same as hstu's: :class:`NextItemObjective`)."""

    num_layers: int = opt(2, help="self-attention blocks", minimum=1)
    num_heads: int = opt(2, help="attention heads (must divide the embedding dim)", minimum=1)
    ffn_mult: int = opt(1, help="point-wise feed-forward width as a multiple of the embedding dim", minimum=1)
    max_seq_len: int = opt(64, help="longest sequence the positional encoding covers", minimum=1)


class SASRecBlock(nn.Module):
    def __init__(self, dim: int, heads: int, ffn_mult: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"sasrec.num_heads ({heads}) must divide the embedding dim ({dim})")
        self.heads = heads
        self.norm_attn = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm_ffn = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_mult * dim), nn.ReLU(), nn.Linear(ffn_mult * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.norm_attn(x)).view(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        x = x + self.proj(att.transpose(1, 2).reshape(b, n, d))
        return x + self.ffn(self.norm_ffn(x))


class SASRec(SequentialModel):
    def __init__(self, cfg: SASRecConfig, dim: int, sequence_tables: List[str], max_seq_len: int,
                 num_items: int = 0):
        super().__init__("sasrec", cfg, dim, sequence_tables, max_seq_len, num_items)
        self.blocks = nn.ModuleList([SASRecBlock(dim, cfg.num_heads, cfg.ffn_mult) for _ in range(cfg.num_layers)])

    def encode(self, emb: Dict[str, torch.Tensor], lengths: torch.Tensor, times=None) -> torch.Tensor:
        """Jagged tokens -> hidden states, flat ``[nnz, D]`` in the input order (``times`` unused)."""
        x, flat, valid = padded_tokens(emb, self.tables, self.pos, lengths, self.max_len)
        b, n = valid.shape
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=lengths.device))
        # keys: the sample's own tokens at or before the query (a padded query still sees key 0: no empty row)
        mask = causal[None] & valid[:, None, :]
        for block in self.blocks:
            x = block(x, mask)
        return self.norm_out(x).reshape(b * n, self.dim).index_select(0, flat)


def build(cfg, manifest: Manifest, dims: Dict[str, int]) -> SASRec:
    seq = [t for t, s in manifest.tables.items() if s.kind == "sequence"]
    dim = sequential_token_dim("sasrec", cfg.sasrec, seq, dims)
    return SASRec(cfg.sasrec, dim, seq, int(manifest.max_seq_len or cfg.sasrec.max_seq_len),
                 int(manifest.tables["item"].vocab))


def negatives(cfg):
    return (cfg.sasrec.num_random_negatives, cfg.sasrec.num_popular_negatives)


SPEC = ModelSpec(name="sasrec", task="gr", build=build, dense_inputs=hstu.dense_inputs, negatives=negatives,
                 shared_negatives=True, table_widths=lambda cfg: sequential_table_widths(cfg.sasrec),
                 partition_invariant=lambda cfg: cfg.sasrec.in_batch_negatives == 0,
                 train_defaults=SEQUENTIAL_TRAIN_DEFAULTS,
                 config=SASRecConfig, help="the SASRec model (causal softmax attention)")
