"""Jagged causal HSTU attention on CUDA: Triton kernels over ragged tiles (also run on CPU tensors under
``TRITON_INTERPRET=1``, which is how they are tested without a GPU).

Same function as :mod:`nestpipe.kernels.attention_cpu` (see :mod:`nestpipe.kernels.attention`). A program owns one
tile row of one (sequence, head): the forward and ``dq`` programs a block of queries and loop over key blocks up to
the diagonal only; the ``dk``/``dv`` program a block of keys and loops over query blocks from the diagonal down.
Blocks past a sequence's end return at once, so no padded tile is computed; inside a diagonal tile the scores
above the diagonal are masked (the tile is the unit of work).

Determinism: no atomics. Every output row is written by the one program that owns it, which sums over its loop in
a fixed order; the bias gradients are summed per (sequence, head, query block) into rows of their own
(distances, time buckets in a fixed order), and those rows are summed by torch in order.

Products use IEEE float32 (``input_precision="ieee"``): TF32 would leave the padded reference's tolerance.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import _INTERPRETER_LOCK

BLOCK = 32  # query and key tile size (equal, so a diagonal tile is square)


@triton.jit
def _buckets(times, start, rows, cols, row_ok, col_ok, M: tl.constexpr):
    """``min(bit_length(max(t_row - t_col, 0)), M - 1)`` of every pair of the tile (integer compares only)."""
    tr = tl.load(times + start + rows, mask=row_ok, other=0)
    tc = tl.load(times + start + cols, mask=col_ok, other=0)
    dt = tr[:, None] - tc[None, :]
    b = tl.zeros(dt.shape, dtype=tl.int32)
    for e in tl.static_range(M - 1):
        b += (dt >= (1 << e)).to(tl.int32)
    return b


@triton.jit
def _scores(q, k, rows, cols, h, bias, P, scale, HAS_BIAS: tl.constexpr, tbias, times, start, row_ok, col_ok,
            M: tl.constexpr, HAS_TBIAS: tl.constexpr):
    z = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    if HAS_BIAS:
        rel = tl.minimum(tl.maximum(rows[:, None] - cols[None, :], 0), P - 1)
        z += tl.load(bias + h * P + rel).to(tl.float32)
    if HAS_TBIAS:
        tb = _buckets(times, start, rows, cols, row_ok, col_ok, M)
        z += tl.load(tbias + h * M + tb).to(tl.float32)
    return z


@triton.jit
def _rows(X, start, idx, ok, h, H, D, dd, d_ok):
    """Pointers to rows ``start + idx`` of head ``h`` of a ``[T, H, D]`` tensor, and those rows as float32 (zero
    past the sequence's end and past ``D``)."""
    ptr = ((start + idx[:, None]).to(tl.int64) * H + h) * D + dd[None, :]
    return ptr, tl.load(X + ptr, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _score_grad(z, sg, da, keep, inv_norm):
    """d loss / d score from d loss / d a, through ``a = silu(z) * inv_norm`` (``sg = sigmoid(z)``); zero outside
    ``keep``."""
    return tl.where(keep, da * inv_norm * sg * (1.0 + z * (1.0 - sg)), 0.0)


@triton.jit
def _fwd(Q, K, V, Out, offsets, bias, tbias, times, H, D, P, scale, inv_norm, HAS_BIAS: tl.constexpr,
         M: tl.constexpr, HAS_TBIAS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m, s, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(offsets + s)
    length = tl.load(offsets + s + 1) - start
    if pid_m * BLOCK >= length:
        return
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    dd = tl.arange(0, BLOCK_D)
    row_ok = rows < length
    d_ok = dd < D
    ptr, q = _rows(Q, start, rows, row_ok, h, H, D, dd, d_ok)
    acc = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    for kb in range(0, (pid_m + 1) * BLOCK, BLOCK):  # key blocks up to the diagonal, never above it
        cols = kb + tl.arange(0, BLOCK)
        col_ok = cols < length
        _, k = _rows(K, start, cols, col_ok, h, H, D, dd, d_ok)
        _, v = _rows(V, start, cols, col_ok, h, H, D, dd, d_ok)
        z = _scores(q, k, rows, cols, h, bias, P, scale, HAS_BIAS, tbias, times, start, row_ok, col_ok, M, HAS_TBIAS)
        a = z * tl.sigmoid(z) * inv_norm
        keep = (cols[None, :] <= rows[:, None]) & row_ok[:, None] & col_ok[None, :]
        a = tl.where(keep, a, 0.0)
        acc += tl.dot(a, v, input_precision="ieee")
    tl.store(Out + ptr, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _bwd_dkdv(Q, K, V, dO, dK, dV, offsets, bias, tbias, times, H, D, P, scale, inv_norm, HAS_BIAS: tl.constexpr,
              M: tl.constexpr, HAS_TBIAS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n, s, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(offsets + s)
    length = tl.load(offsets + s + 1) - start
    if pid_n * BLOCK >= length:
        return
    cols = pid_n * BLOCK + tl.arange(0, BLOCK)
    dd = tl.arange(0, BLOCK_D)
    col_ok = cols < length
    d_ok = dd < D
    kptr, k = _rows(K, start, cols, col_ok, h, H, D, dd, d_ok)
    _, v = _rows(V, start, cols, col_ok, h, H, D, dd, d_ok)
    dk = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    for qb in range(pid_n * BLOCK, length, BLOCK):  # query blocks from the diagonal down
        rows = qb + tl.arange(0, BLOCK)
        row_ok = rows < length
        _, q = _rows(Q, start, rows, row_ok, h, H, D, dd, d_ok)
        _, do = _rows(dO, start, rows, row_ok, h, H, D, dd, d_ok)
        z = _scores(q, k, rows, cols, h, bias, P, scale, HAS_BIAS, tbias, times, start, row_ok, col_ok, M, HAS_TBIAS)
        keep = (cols[None, :] <= rows[:, None]) & row_ok[:, None] & col_ok[None, :]
        sg = tl.sigmoid(z)
        a = tl.where(keep, z * sg * inv_norm, 0.0)
        dv += tl.dot(tl.trans(a), do, input_precision="ieee")
        dz = _score_grad(z, sg, tl.dot(do, tl.trans(v), input_precision="ieee"), keep, inv_norm)
        dk += tl.dot(tl.trans(dz), q, input_precision="ieee") * scale
    tl.store(dK + kptr, dk.to(dK.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])
    tl.store(dV + kptr, dv.to(dV.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])


@triton.jit
def _bwd_dq(Q, K, V, dO, dQ, dBias, dTBias, offsets, bias, tbias, times, H, D, P, NBM, scale, inv_norm,
            HAS_BIAS: tl.constexpr, M: tl.constexpr, HAS_TBIAS: tl.constexpr, BLOCK: tl.constexpr,
            BLOCK_D: tl.constexpr):
    pid_m, s, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(offsets + s)
    length = tl.load(offsets + s + 1) - start
    if pid_m * BLOCK >= length:
        return
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    dd = tl.arange(0, BLOCK_D)
    row_ok = rows < length
    d_ok = dd < D
    qptr, q = _rows(Q, start, rows, row_ok, h, H, D, dd, d_ok)
    _, do = _rows(dO, start, rows, row_ok, h, H, D, dd, d_ok)
    dq = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    # this program's own row of bias-gradient partials: read-modify-written by it alone, in a fixed order
    brow = dBias + ((s.to(tl.int64) * H + h) * NBM + pid_m) * P
    trow = dTBias + ((s.to(tl.int64) * H + h) * NBM + pid_m) * M
    r = tl.arange(0, BLOCK)
    for kb in range(0, (pid_m + 1) * BLOCK, BLOCK):
        cols = kb + tl.arange(0, BLOCK)
        col_ok = cols < length
        _, k = _rows(K, start, cols, col_ok, h, H, D, dd, d_ok)
        _, v = _rows(V, start, cols, col_ok, h, H, D, dd, d_ok)
        z = _scores(q, k, rows, cols, h, bias, P, scale, HAS_BIAS, tbias, times, start, row_ok, col_ok, M, HAS_TBIAS)
        keep = (cols[None, :] <= rows[:, None]) & row_ok[:, None] & col_ok[None, :]
        dz = _score_grad(z, tl.sigmoid(z), tl.dot(do, tl.trans(v), input_precision="ieee"), keep, inv_norm)
        dq += tl.dot(dz, k, input_precision="ieee") * scale
        if HAS_BIAS:
            # the tile's pairs at each distance lie on one diagonal: delta = (row - col) within the tile
            base = pid_m * BLOCK - kb
            for delta in range(-BLOCK + 1, BLOCK):
                rel = base + delta
                if rel >= 0:
                    part = tl.sum(tl.sum(tl.where(r[:, None] - r[None, :] == delta, dz, 0.0), axis=1), axis=0)
                    slot = tl.minimum(rel, P - 1)
                    tl.store(brow + slot, tl.load(brow + slot) + part)
        if HAS_TBIAS:
            tb = _buckets(times, start, rows, cols, row_ok, col_ok, M)
            for e in tl.static_range(M):  # buckets in a fixed order, each its own slot
                part = tl.sum(tl.sum(tl.where(tb == e, dz, 0.0), axis=1), axis=0)
                tl.store(trow + e, tl.load(trow + e) + part)
    tl.store(dQ + qptr, dq.to(dQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _grid(max_len, s, h):
    return (max(triton.cdiv(max(int(max_len), 1), BLOCK), 1), s, h)


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, max_len, scale, inv_norm, pos_bias, time_bias=None, times=None):
        q, k, v = (x.contiguous() for x in (q, k, v))
        offsets = offsets.to(device=q.device, dtype=torch.int64).contiguous()
        t, h, d = q.shape
        s = offsets.numel() - 1
        bias = pos_bias.contiguous() if pos_bias is not None else q.new_zeros(1)
        P = pos_bias.shape[1] if pos_bias is not None else 1
        tbias = time_bias.contiguous() if time_bias is not None else q.new_zeros(1)
        tms = times.to(device=q.device, dtype=torch.int64).contiguous() if times is not None else offsets
        M = time_bias.shape[1] if time_bias is not None else 1
        out = torch.empty_like(q)
        block_d = max(16, triton.next_power_of_2(d))
        if s > 0 and t > 0:
            with _INTERPRETER_LOCK:
                _fwd[_grid(max_len, s, h)](q, k, v, out, offsets, bias, tbias, tms, h, d, P, scale, inv_norm,
                                          HAS_BIAS=pos_bias is not None, M=M, HAS_TBIAS=time_bias is not None,
                                          BLOCK=BLOCK, BLOCK_D=block_d)
        ctx.save_for_backward(q, k, v, offsets, bias, tbias, tms)
        ctx.args = (max_len, scale, inv_norm, pos_bias is not None, P, block_d, time_bias is not None, M)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, offsets, bias, tbias, tms = ctx.saved_tensors
        max_len, scale, inv_norm, has_bias, P, block_d, has_tbias, M = ctx.args
        dout = dout.contiguous()
        t, h, d = q.shape
        s = offsets.numel() - 1
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(q)
        grid = _grid(max_len, s, h)
        nbm = grid[0]
        dbias = torch.zeros((s * h * nbm if has_bias else 1), P, dtype=torch.float32, device=q.device)
        dtbias = torch.zeros((s * h * nbm if has_tbias else 1), M, dtype=torch.float32, device=q.device)
        if s > 0 and t > 0:
            with _INTERPRETER_LOCK:
                _bwd_dkdv[grid](q, k, v, dout, dk, dv, offsets, bias, tbias, tms, h, d, P, scale, inv_norm,
                                HAS_BIAS=has_bias, M=M, HAS_TBIAS=has_tbias, BLOCK=BLOCK, BLOCK_D=block_d)
                _bwd_dq[grid](q, k, v, dout, dq, dbias, dtbias, offsets, bias, tbias, tms, h, d, P, nbm, scale,
                              inv_norm, HAS_BIAS=has_bias, M=M, HAS_TBIAS=has_tbias, BLOCK=BLOCK, BLOCK_D=block_d)
        grad_bias = None
        if has_bias:
            grad_bias = dbias.view(s, h, nbm, P).sum((0, 2)).to(bias.dtype) if s else torch.zeros_like(bias)
        grad_tbias = None
        if has_tbias:
            grad_tbias = dtbias.view(s, h, nbm, M).sum((0, 2)).to(tbias.dtype) if s else torch.zeros_like(tbias)
        return dq, dk, dv, None, None, None, None, grad_bias, grad_tbias, None


def hstu_attention(q, k, v, offsets, max_len: int, scale: float, inv_norm: float, pos_bias=None, time_bias=None,
                   times=None) -> torch.Tensor:
    return _TritonAttention.apply(q, k, v, offsets, max_len, scale, inv_norm, pos_bias, time_bias, times)
