"""HSTU's pointwise causal attention over jagged sequences: one op, a path per device, a padded reference.

``hstu_attention(q, k, v, offsets, ...)`` with ``q, k, v`` ``[T, H, d]`` (the tokens of S sequences back to back,
sequence ``s`` at rows ``offsets[s] .. offsets[s + 1] - 1``) returns ``out [T, H, d]``::

    out_i = sum_{j <= i, same sequence} silu(scale * q_i . k_j + pos_bias[h, min(i - j, P - 1)]
                                               + time_bias[h, bucket(times[i] - times[j])]) * inv_norm * v_j

    bucket(dt) = min(bit_length(max(dt, 0)), M - 1)      (dt = 0 -> 0, 1 -> 1, 2..3 -> 2, 4..7 -> 3, ...)

with ``time_bias`` ``[H, M]`` and ``times`` ``[T]`` int64 (any unit; the HSTU model passes seconds): HSTU's
relative time bias, log2-spaced buckets of the query-key time difference. Integer arithmetic only, so every path
computes the same bucket of every pair.

Paths (:func:`nestpipe.kernels.select.select_path`, op ``hstu_attention``): on CPU ``numba`` (exact causal loops,
:mod:`nestpipe.kernels.attention_cpu`) for micro-batches whose longest sequence has at most ``EXACT_MAX_LEN``
tokens and ``blocked`` (:func:`blocked_attention`: tiles on and below each sequence's diagonal, batched torch ops)
for longer ones; ``triton`` on CUDA (ragged tiles, :mod:`nestpipe.kernels.attention_triton`); ``reference``
elsewhere: :func:`padded_reference`, the padded batched matmuls (every sequence padded to the longest, the full
``n x n`` score matrix, the causal mask multiplied in), which autograd differentiates. The paths agree to float
rounding (tested). The path taken is noted per call (``blocked`` or ``numba`` on CPU).

Both biases depend only on the pair's distance ``i - j`` (clamped to ``P - 1``) and time difference, never on
absolute positions or times, so the scores of a cached prefix stay valid when tokens are appended.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from .select import note, select_path


def time_buckets(dt: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``min(bit_length(max(dt, 0)), num_buckets - 1)`` of an integer tensor, exactly (``frexp`` of a float64 holds
    every integer below 2**53 exactly; its exponent is the bit length)."""
    return torch.frexp(dt.clamp(min=0).to(torch.float64))[1].to(torch.int64).clamp_(max=num_buckets - 1)


def _check(q, k, v, offsets, pos_bias, time_bias=None, times=None):
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one [T, H, d] shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError("offsets must be [S + 1] (0, the end of sequence 0, ..., T)")
    if pos_bias is not None and (pos_bias.dim() != 2 or pos_bias.shape[0] != q.shape[1]):
        raise ValueError(f"pos_bias must be [H={q.shape[1]}, P], got {tuple(pos_bias.shape)}")
    if (time_bias is None) != (times is None):
        raise ValueError("time_bias and times go together")
    if time_bias is not None:
        if time_bias.dim() != 2 or time_bias.shape[0] != q.shape[1] or time_bias.shape[1] < 1:
            raise ValueError(f"time_bias must be [H={q.shape[1]}, M >= 1], got {tuple(time_bias.shape)}")
        if times.shape != (q.shape[0],) or times.dtype != torch.int64:
            raise ValueError(f"times must be int64 [T={q.shape[0]}], got {times.dtype} {tuple(times.shape)}")


def hstu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_len: int,
                   scale: float, inv_norm: float, pos_bias: Optional[torch.Tensor] = None,
                   time_bias: Optional[torch.Tensor] = None, times: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The jagged causal attention (module docstring). ``offsets`` int64 ``[S + 1]`` with ``offsets[0] == 0`` and
    ``offsets[-1] == T``; ``max_len`` at least the longest sequence; ``pos_bias`` ``[H, P]`` or None;
    ``time_bias`` ``[H, M]`` with ``times`` int64 ``[T]``, or both None."""
    _check(q, k, v, offsets, pos_bias, time_bias, times)
    path = select_path("hstu_attention", q.device)
    if path in ("numba", "blocked") and q.device.type == "cpu":
        if path == "numba" and max_len <= EXACT_MAX_LEN and q.dtype in (torch.float32, torch.float64):
            note("hstu_attention", "numba")
            return _NumbaAttention.apply(q, k, v, offsets, int(max_len), float(scale), float(inv_norm), pos_bias,
                                         time_bias, times)
        note("hstu_attention", "blocked")
        return blocked_attention(q, k, v, offsets, scale, inv_norm, pos_bias, block_size(max_len),
                                 time_bias=time_bias, times=times)
    if path == "triton" and q.dtype in (torch.float32, torch.float16, torch.bfloat16):
        from . import attention_triton  # optional: triton

        note("hstu_attention", "triton")
        return attention_triton.hstu_attention(q, k, v, offsets, int(max_len), float(scale), float(inv_norm),
                                               pos_bias, time_bias, times)
    note("hstu_attention", "reference")  # what runs: the rule's path, when it cannot take these tensors, falls back
    return padded_reference(q, k, v, offsets, scale, inv_norm, pos_bias, time_bias, times)


# The CPU rule, by the micro-batch's longest sequence (a shape, the same in every schedule): up to 64 tokens the
# exact Numba loops (no tile waste, no per-op overhead), longer the blocked tiles (batched matmuls and torch's
# vectorised SiLU, faster per score than the scalar loops, whose SiLU is not vectorised), 32-token tiles up to 512
# tokens, 64 beyond. `python benchmarks/hstu_bench.py --cpu-paths` times the paths (docs/kernels.md).
EXACT_MAX_LEN = 64


def block_size(max_len: int) -> int:
    return 32 if max_len <= 512 else 64


def padded_reference(q, k, v, offsets, scale: float, inv_norm: float, pos_bias=None, time_bias=None,
                     times=None) -> torch.Tensor:
    """The padded computation: sequences padded to the longest ``n``, the full ``[S, H, n, n]`` scores, the causal and
    validity mask multiplied in after the activation (what a dense attention layer does)."""
    lengths = offsets.diff()
    s, t = lengths.numel(), q.shape[0]
    n = int(lengths.max()) if s else 0
    h, d = q.shape[1], q.shape[2]
    if t == 0 or n == 0:
        empty = (q.sum() + k.sum() + v.sum() + (pos_bias.sum() if pos_bias is not None else 0.0)
                 + (time_bias.sum() if time_bias is not None else 0.0))
        return q.new_zeros(q.shape) + 0.0 * empty  # connected to every input: zero gradients, not None
    sample = torch.repeat_interleave(torch.arange(s, device=q.device), lengths)
    pos = torch.arange(t, device=q.device) - offsets[:-1].index_select(0, sample)
    flat = sample * n + pos

    def pad(x):
        return x.new_zeros(s * n, h, d).index_copy(0, flat, x).view(s, n, h, d).transpose(1, 2)

    qp, kp, vp = pad(q), pad(k), pad(v)
    ar = torch.arange(n, device=q.device)
    valid = ar[None, :] < lengths[:, None]
    mask = (ar[:, None] >= ar[None, :])[None] & valid[:, None, :] & valid[:, :, None]
    z = qp @ kp.transpose(-1, -2) * scale
    if pos_bias is not None:
        rel = (ar[:, None] - ar[None, :]).clamp(0, pos_bias.shape[1] - 1)
        z = z + pos_bias[:, rel][None]
    if time_bias is not None:
        tp = times.new_zeros(s * n).index_copy(0, flat, times).view(s, n)
        z = z + time_bias[:, time_buckets(tp[:, :, None] - tp[:, None, :], time_bias.shape[1])].transpose(0, 1)
    a = F.silu(z).mul_(inv_norm) * mask[:, None].to(z.dtype)
    out = (a @ vp).transpose(1, 2).reshape(s * n, h, d)
    return out.index_select(0, flat)


class _NumbaAttention(torch.autograd.Function):
    """Forward and backward through the CPU kernels; the backward recomputes the scores (nothing ``n^2`` kept)."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, max_len, scale, inv_norm, pos_bias, time_bias=None, times=None):
        from . import attention_cpu  # optional: numba

        qn, kn, vn = (x.detach().contiguous().numpy() for x in (q, k, v))
        off = offsets.detach().to(torch.int64).contiguous().numpy()
        bias = (pos_bias.detach().to(q.dtype).contiguous().numpy() if pos_bias is not None
                else np.zeros((q.shape[1], 0), dtype=qn.dtype))
        # without a time bias both stay None: attention_cpu substitutes its empty table
        tbias = time_bias.detach().to(q.dtype).contiguous().numpy() if time_bias is not None else None
        tn = times.detach().contiguous().numpy() if times is not None else None
        kt = kn.transpose(1, 2, 0).copy()
        out = attention_cpu.forward(qn, kt, vn, off, scale, inv_norm, bias, max_len, torch.get_num_threads(),
                                    tbias=tbias, times=tn)
        ctx.save_for_backward(q, k, v, offsets)
        ctx.kt = kt  # the backward's scores read k transposed too
        ctx.bias = bias
        ctx.has_bias = pos_bias is not None
        ctx.tbias, ctx.times = tbias, tn
        ctx.args = (max_len, scale, inv_norm)
        return torch.from_numpy(out)

    @staticmethod
    def backward(ctx, dout):
        from . import attention_cpu  # optional: numba

        q, k, v, offsets = ctx.saved_tensors
        max_len, scale, inv_norm = ctx.args
        qn, kn, vn = (x.detach().contiguous().numpy() for x in (q, k, v))
        off = offsets.to(torch.int64).contiguous().numpy()
        vt = vn.transpose(1, 2, 0).copy()
        dq, dkt, dvt, dbias, dtbias = attention_cpu.backward(
            qn, kn, ctx.kt, vt, dout.detach().contiguous().numpy(), off, scale, inv_norm, ctx.bias, max_len,
            torch.get_num_threads(), tbias=ctx.tbias, times=ctx.times)
        dk = torch.from_numpy(dkt).permute(2, 0, 1).contiguous()
        dv = torch.from_numpy(dvt).permute(2, 0, 1).contiguous()
        s = len(off) - 1

        def table_grad(rows, table):  # the per-(sequence, head) rows summed over sequences, in order
            return torch.from_numpy(rows).view(s, q.shape[1], -1).sum(0) if s else torch.zeros(table.shape,
                                                                                                 dtype=q.dtype)

        grad_bias = table_grad(dbias, ctx.bias) if ctx.has_bias else None
        grad_tbias = table_grad(dtbias, ctx.tbias) if ctx.tbias is not None else None
        return torch.from_numpy(dq), dk, dv, None, None, None, None, grad_bias, grad_tbias, None


def _tiles(lengths: np.ndarray, block: int):
    """Block and tile bookkeeping of :func:`blocked_attention` (host arrays): the token index of every slot of every
    block (``-1`` past its sequence's end), and the (query block, key block) pairs on or below each sequence's
    diagonal, diagonal tiles first."""
    nb = (lengths + block - 1) // block
    first = np.concatenate([[0], np.cumsum(nb)]).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    seq = np.repeat(np.arange(len(lengths)), nb)
    within = np.arange(int(first[-1])) - first[seq]
    slot = within[:, None] * block + np.arange(block)[None, :]
    tokens = np.where(slot < lengths[seq][:, None], starts[seq][:, None] + slot, -1)
    qb = np.repeat(np.arange(int(first[-1])), within + 1)  # query block b of a sequence: key blocks 0..b
    kb = np.concatenate([np.arange(f, f + w + 1) for f, w in zip(first[seq], within)]) if len(seq) else qb
    diag = qb == kb
    order = np.concatenate([np.flatnonzero(diag), np.flatnonzero(~diag)])
    return tokens, qb[order], kb[order], int(diag.sum()), (qb[order] - kb[order]) * block


def blocked_attention(q, k, v, offsets, scale: float, inv_norm: float, pos_bias=None, block: int = 32,
                      causal_shift: int = 0, time_bias=None, times=None):
    """Jagged attention from batched tensor ops: each sequence cut into blocks of ``block`` tokens, scores computed
    for the tiles on and below each sequence's diagonal only (batched matmuls), the causal mask applied inside the
    diagonal tiles; autograd differentiates it. Waste: the upper half of diagonal tiles and the unused slots of a
    sequence's last block. ``causal_shift``: as in :func:`nestpipe.kernels.attention_cpu.forward` (tests only)."""
    t, h, d = q.shape
    lengths = offsets.diff().cpu().numpy()
    if t == 0 or not len(lengths):
        return padded_reference(q, k, v, offsets, scale, inv_norm, pos_bias, time_bias, times)
    tokens, tq, tk, ndiag, shift = _tiles(lengths, block)
    dev = q.device
    idx = torch.from_numpy(np.where(tokens < 0, t, tokens)).to(dev)

    def blocks(x):  # [NB, H, B, d]; the slot past the end reads a zero row
        return torch.cat([x, x.new_zeros(1, h, d)]).index_select(0, idx.flatten()).view(*idx.shape, h, d).transpose(1, 2)

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    tq_t, tk_t = torch.from_numpy(tq).to(dev), torch.from_numpy(tk).to(dev)
    # in place where autograd keeps no operand (the matmul saves its inputs, SiLU its input, a scalar product
    # nothing): the same values, fewer tile-sized copies
    z = (qb.index_select(0, tq_t) @ kb.index_select(0, tk_t).transpose(-1, -2)).mul_(scale)
    ar = torch.arange(block, device=dev)
    if pos_bias is not None:
        rel = (torch.from_numpy(shift).to(dev)[:, None, None] + (ar[:, None] - ar[None, :])[None])
        z = z + pos_bias[:, rel.clamp(0, pos_bias.shape[1] - 1)].transpose(0, 1)
    if time_bias is not None:  # slots past a sequence's end read time 0: masked below (diagonal) or never a key
        tb = torch.cat([times, times.new_zeros(1)]).index_select(0, idx.flatten()).view(idx.shape)
        dt = tb.index_select(0, tq_t)[:, :, None] - tb.index_select(0, tk_t)[:, None, :]
        z = z + time_bias[:, time_buckets(dt, time_bias.shape[1])].transpose(0, 1)
    a = F.silu(z).mul_(inv_norm)
    # diagonal tiles (the first ndiag): causal, and keys past the sequence's end (their v is zero, but not their
    # score's gradient to the bias) masked
    key_ok = torch.from_numpy(tokens >= 0).to(dev).index_select(0, tk_t[:ndiag])
    mask = (ar[:, None] + causal_shift >= ar[None, :])[None] & key_ok[:, None, :]
    a[:ndiag].mul_(mask[:, None].to(a.dtype))
    tiles = a @ vb.index_select(0, tk_t)
    outb = torch.zeros_like(qb).index_add(0, tq_t, tiles)  # ascending tile order per query block
    flat = outb.transpose(1, 2).reshape(-1, h, d)
    keep = torch.from_numpy(np.flatnonzero(tokens.reshape(-1) >= 0)).to(dev)
    return flat.index_select(0, keep)
