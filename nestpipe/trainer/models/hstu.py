"""HSTU-style generative recommender: a causal sequential transducer over item (+ author + action) tokens.

Inputs per micro-batch (from the embedding layer, jagged in sample order): ``emb[t]`` ``[nnz, D]`` for every
sequence table (token = sum over tables + a learned position embedding), ``emb["item#neg"]`` ``[K, D]`` for the
batch's shared negatives; ``feats["lengths"]`` ``[b]``, ``feats["item_ids"]`` ``[nnz]``, ``feats["neg_ids"]``
``[K]`` (in-vocabulary ids, to mask negatives equal to the target).

Layer (HSTU, Zhai et al. 2024, simplified): ``u, v, q, k = SiLU(W1 LN(x))``;
``A = SiLU(q k^T / sqrt(d) + rab) / max_seq_len`` under a causal mask; ``x += W2(LN(A v) * u)``. ``rab`` is the
optional relative attention bias, one learned value per head and query-key distance ``i - j`` (distances past
``max_seq_len - 1`` share the last), plus with ``time_bias`` one per head and bucket of the query-key time
difference (``bit_length`` of the seconds between them: log2-spaced, ``TIME_BUCKETS`` of them); both depend on the
pair's differences only, so a prefix's scores do not change when tokens are appended.

Attention (``attention``): ``jagged`` (default) runs on the micro-batch's tokens back to back, never a padded token
nor a score above the causal diagonal (:func:`nestpipe.kernels.hstu_attention`: Numba on CPU, Triton on CUDA);
``padded`` pads every sample to the micro-batch's longest and computes the full ``n x n`` scores with the mask
multiplied in (the reference). Both compute the same function; they differ by float rounding.

Objective: next-item sampled softmax with cosine similarity and a temperature; each sample's loss is the mean over
its positions, so the per-sample loss does not depend on how the batch is partitioned into micro-batches.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from nestpipe.datasets.shards import Manifest
from nestpipe.kernels.attention import hstu_attention, time_buckets
from nestpipe.trainer.embedding.batch import NEG_SLOT, PreparedBatch
from nestpipe.trainer.models.common import (SEQUENTIAL_TRAIN_DEFAULTS, NextItemObjective, SequentialModel,
                                             jagged_tokens, padded_tokens, sequential_table_widths,
                                             sequential_token_dim)
from nestpipe.trainer.models.spec import ModelSpec
from nestpipe.utils.options import opt

NEG = NEG_SLOT


@dataclasses.dataclass
class HSTUConfig(NextItemObjective):
    """HSTU-style causal sequential transducer (item + action tokens), next-item sampled softmax (the objective's
    fields: :class:`NextItemObjective`)."""

    num_layers: int = opt(2, help="HSTU layers", minimum=1)
    num_heads: int = opt(2, help="attention heads per layer", minimum=1)
    linear_dim: int = opt(16, help="per-head dimension of u/v/q/k", minimum=1)
    max_seq_len: int = opt(64, help="longest sequence the positional encoding covers", minimum=1)
    attention: str = opt(
        "jagged", help="jagged: the samples' tokens back to back, only the causal triangle of each computed "
        "(Numba on CPU, Triton on CUDA); padded: every sample padded to the micro-batch's longest, full n x n scores "
        "(the reference)", choices=("jagged", "padded"))
    relative_bias: bool = opt(
        False, help="relative attention bias: a learned score offset per head and query-key distance")
    time_bias: bool = opt(
        False, help="relative time bias: a learned score offset per head and log2 bucket of the seconds between the "
        "query's and the key's events (the shards' per-token time)")


TIME_BUCKETS = 32  # bit lengths 0..31 of the seconds between two events: 0 s, 1 s, 2-3 s, ..., 2**30 s (34 years) and more


def event_seconds(times_ms: torch.Tensor) -> torch.Tensor:
    """Event times in ms -> whole seconds (floored), the unit of the time bias's buckets: training, evaluation and
    serving's cached prefix all convert through here."""
    return torch.div(times_ms.to(torch.int64), 1000, rounding_mode="floor")


class HSTULayer(nn.Module):
    """One HSTU layer, on flat tokens ``[T, D]`` (``forward``) or padded ``[b, n, D]`` (``forward_padded``).

    ``pos_bias`` ``[heads, max_len]`` (with ``relative_bias``): added to the scaled score of a query-key pair at
    distance ``i - j``; ``time_bias`` ``[heads, TIME_BUCKETS]`` (with ``time_bias``): added at the bucket of their
    time difference (``times``, int64 seconds per token, given to every forward)."""

    def __init__(self, dim: int, heads: int, head_dim: int, max_len: int, relative_bias: bool = False,
                 time_bias: bool = False):
        super().__init__()
        self.heads, self.head_dim, self.max_len = heads, head_dim, max_len
        self.norm_in = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * heads * head_dim)
        self.norm_attn = nn.LayerNorm(heads * head_dim)
        self.out = nn.Linear(heads * head_dim, dim)
        self.pos_bias = nn.Parameter(torch.zeros(heads, max_len)) if relative_bias else None
        self.time_bias = nn.Parameter(torch.zeros(heads, TIME_BUCKETS)) if time_bias else None

    def _time_args(self, times: Optional[torch.Tensor]):
        if self.time_bias is None:
            return None, None
        if times is None:
            raise ValueError("this HSTU has a time bias (hstu.time_bias): its inputs need per-token times")
        return self.time_bias, times

    def _uvqk(self, x: torch.Tensor):
        return F.silu(self.uvqk(self.norm_in(x))).split(self.heads * self.head_dim, dim=-1)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, longest: int,
                times: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Jagged: ``x`` ``[T, D]`` (the samples' tokens back to back, sample ``s`` at ``offsets[s]..``)."""
        h, d = self.heads, self.head_dim
        u, v, q, k = self._uvqk(x)
        q, k, v = (y.reshape(-1, h, d) for y in (q, k, v))
        # 1 / max_len: a constant, so the output does not depend on how the batch is partitioned
        av = hstu_attention(q, k, v, offsets, longest, d ** -0.5, 1.0 / self.max_len, self.pos_bias,
                            *self._time_args(times))
        return x + self.out(self.norm_attn(av.reshape(-1, h * d)) * u)

    def forward_padded(self, x: torch.Tensor, mask: torch.Tensor, times: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Padded: ``x`` ``[b, n, D]``, ``mask`` ``[b, n, n]`` (causal and both tokens valid) multiplied in; ``times``
        ``[b, n]`` (with the time bias)."""
        b, n, _ = x.shape
        h, d = self.heads, self.head_dim
        u, v, q, k = self._uvqk(x)
        q, k, v = (y.view(b, n, h, d).transpose(1, 2) for y in (q, k, v))
        z = q @ k.transpose(-1, -2) * d ** -0.5
        if self.pos_bias is not None:
            ar = torch.arange(n, device=x.device)
            z = z + self.pos_bias[:, (ar[:, None] - ar[None, :]).clamp(0, self.max_len - 1)][None]
        tb, times = self._time_args(times)
        if tb is not None:
            z = z + tb[:, time_buckets(times[:, :, None] - times[:, None, :], TIME_BUCKETS)].transpose(0, 1)
        attn = F.silu(z) / self.max_len * mask[:, None, :, :]
        av = (attn @ v).transpose(1, 2).reshape(b, n, h * d)
        return x + self.out(self.norm_attn(av) * u)


    def forward_cached(self, x: torch.Tensor, k_old: Optional[torch.Tensor], v_old: Optional[torch.Tensor],
                       p0: int, times: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Incremental (serving): the ``m`` new tokens ``x`` ``[m, D]`` of one sequence at positions ``p0 ..
        p0 + m - 1``, given the K/V ``[p0, heads, head_dim]`` of the positions before them (``None`` when
        ``p0 == 0``): :meth:`forward_padded`'s formula restricted to the new queries. ``times``: int64 seconds of
        all ``p0 + m`` positions (with the time bias). Returns the new tokens' outputs and the K/V of all ``p0 + m``
        positions."""
        h, d = self.heads, self.head_dim
        u, v, q, k = self._uvqk(x)
        q, k, v = (y.reshape(-1, h, d) for y in (q, k, v))
        k_all = k if k_old is None else torch.cat([k_old, k])
        v_all = v if v_old is None else torch.cat([v_old, v])
        m, n = len(x), len(k_all)
        z = torch.einsum("ihd,jhd->hij", q, k_all) * d ** -0.5  # [h, m, n]
        qi = torch.arange(p0, p0 + m, device=x.device)[:, None]
        kj = torch.arange(n, device=x.device)[None, :]
        if self.pos_bias is not None:
            z = z + self.pos_bias[:, (qi - kj).clamp(0, self.max_len - 1)]
        tb, times = self._time_args(times)
        if tb is not None:
            if times.shape != (n,):
                raise ValueError(f"times must give the {n} cached and new positions' times, got {tuple(times.shape)}")
            z = z + tb[:, time_buckets(times[p0:][:, None] - times[None, :], TIME_BUCKETS)]
        attn = F.silu(z) / self.max_len * (kj <= qi).to(z.dtype)[None]
        av = torch.einsum("hij,jhd->ihd", attn, v_all).reshape(m, h * d)
        return x + self.out(self.norm_attn(av) * u), k_all, v_all


class HSTU(SequentialModel):
    def __init__(self, cfg: HSTUConfig, dim: int, sequence_tables: List[str], max_seq_len: int,
                 num_items: int = 0):
        super().__init__("hstu", cfg, dim, sequence_tables, max_seq_len, num_items)
        self.layers = nn.ModuleList([
            HSTULayer(dim, cfg.num_heads, cfg.linear_dim, max_seq_len, cfg.relative_bias, cfg.time_bias)
            for _ in range(cfg.num_layers)])

    @property
    def needs_times(self) -> bool:
        return self.cfg.time_bias

    # -- encoder ---------------------------------------------------------------------------------------------------
    def encode(self, emb: Dict[str, torch.Tensor], lengths: torch.Tensor,
               times: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Jagged tokens -> hidden states, flat ``[nnz, D]`` in the input order. ``times``: the tokens' event times
        in ms (int64 ``[nnz]``), read with the time bias only."""
        if times is not None:
            times = event_seconds(times)
        if self.cfg.attention == "padded":
            return self.encode_padded(emb, lengths, times)
        x = jagged_tokens(emb, self.tables, self.pos, lengths, self.max_len)
        offsets = torch.cat([lengths.new_zeros(1, dtype=torch.int64), torch.cumsum(lengths.to(torch.int64), 0)])
        longest = int(lengths.max()) if len(lengths) else 0
        for layer in self.layers:
            x = layer(x, offsets, longest, times)
        return self.norm_out(x)

    def encode_padded(self, emb: Dict[str, torch.Tensor], lengths: torch.Tensor,
                      times: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The reference: every sample padded to the micro-batch's longest for the whole layer stack."""
        padded, flat, valid = padded_tokens(emb, self.tables, self.pos, lengths, self.max_len)
        b, n = valid.shape
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=lengths.device))
        mask = (causal[None] & valid[:, None, :] & valid[:, :, None]).to(padded.dtype)
        if times is not None:
            times = times.new_zeros(b * n).index_copy(0, flat, times).view(b, n)
        for layer in self.layers:
            padded = layer.forward_padded(padded, mask, times)
        return self.norm_out(padded).reshape(b * n, self.dim).index_select(0, flat)


def build(cfg, manifest: Manifest, dims: Dict[str, int]) -> HSTU:
    seq = [t for t, s in manifest.tables.items() if s.kind == "sequence"]
    dim = sequential_token_dim("hstu", cfg.hstu, seq, dims)
    return HSTU(cfg.hstu, dim, seq, int(manifest.max_seq_len or cfg.hstu.max_seq_len),
                 int(manifest.tables["item"].vocab))


def dense_inputs(cfg, manifest: Manifest, batch: PreparedBatch, i: int, device: torch.device,
                 dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """Micro-batch ``i``'s non-embedding inputs: sequence lengths, target item ids and the shared negatives (and
    with the time bias the tokens' event times in ms, in the item tokens' order)."""
    mbd = batch.micro[i]
    out = {
        "lengths": torch.from_numpy(mbd.lengths["item"]).to(device),
        "item_ids": torch.from_numpy(batch.keys["item"][mbd.value_key["item"]]).to(device),
        "neg_ids": torch.from_numpy(batch.negatives).to(device),
    }
    if cfg.hstu.time_bias:
        if "time" not in mbd.fields:
            raise ValueError("hstu.time_bias needs per-token times: these shards have no 'time' field (re-ingest "
                             "them with this version's gr ingest)")
        out["times"] = torch.from_numpy(mbd.fields["time"].astype("int64")).to(device)
    return out


def negatives(cfg) -> Tuple[int, int]:
    return (cfg.hstu.num_random_negatives, cfg.hstu.num_popular_negatives)


SPEC = ModelSpec(name="hstu", task="gr", build=build, dense_inputs=dense_inputs, negatives=negatives,
                 shared_negatives=True, table_widths=lambda cfg: sequential_table_widths(cfg.hstu),
                 partition_invariant=lambda cfg: cfg.hstu.in_batch_negatives == 0,
                 train_defaults=SEQUENTIAL_TRAIN_DEFAULTS,
                 config=HSTUConfig, help="the HSTU model")
