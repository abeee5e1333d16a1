"""CUDA fast paths: Triton kernels (also run on CPU tensors under ``TRITON_INTERPRET=1``, which is how they are
tested on machines without a GPU).

Why hand-written: fbgemm's CUDA build has no standalone row-wise AdaGrad on rows we own, no gather from a store
we own into a buffer, and no sorted intersection + copy; these kernels read each row once and write it once.

Determinism: every output row belongs to exactly one program, which sums in ascending source order; no atomics.
IEEE-rounded ``sqrt_rn``/``div_rn`` keep AdaGrad within rounding of the torch reference.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import triton
import triton.language as tl

from . import reference
from .reference import csr_by_segment  # noqa: F401  (part of this path's op set)

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_BLOCK_R = 16
# Triton's interpreter swaps module-level state of triton.language while a kernel runs, so two threads interpreting
# kernels at once corrupt each other (the pipeline's stage threads do call kernels concurrently); interpreted
# launches are serialised. Compiled launches on a GPU need no lock.
_INTERPRETER_LOCK = threading.Lock() if INTERPRETED else contextlib.nullcontext()


def _block_d(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


@triton.jit
def _gather_kernel(src, rows, out, n, dim, stride_src, stride_out, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = i < n
    r = tl.load(rows + i, mask=live, other=0)
    d = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (d < dim)[None, :]
    v = tl.load(src + r[:, None] * stride_src + d[None, :], mask=mask)
    tl.store(out + i[:, None] * stride_out + d[None, :], v, mask=mask)


@triton.jit
def _adagrad_kernel(
    weights, state, rows, grads, n, dim, stride_w, stride_g, lr, eps, momentum_scale,
    SCALE_STATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = i < n
    r = tl.load(rows + i, mask=live, other=0)
    d = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (d < dim)[None, :]
    g = tl.load(grads + i[:, None] * stride_g + d[None, :], mask=mask, other=0.0)
    mean_sq = tl.div_rn(tl.sum(g * g, axis=1), dim.to(tl.float32))
    s = tl.load(state + r, mask=live, other=0.0) + mean_sq
    tl.store(state + r, s, mask=live)
    if SCALE_STATE:
        s = tl.div_rn(s, momentum_scale)
    multiplier = tl.div_rn(lr + tl.zeros_like(s), tl.sqrt_rn(s) + eps)
    w_ptr = weights + r[:, None] * stride_w + d[None, :]
    w = tl.load(w_ptr, mask=mask)
    tl.store(w_ptr, w - multiplier[:, None] * g, mask=mask)


@triton.jit
def _sync_kernel(
    active_keys, n_active, active_rows, prefetch_keys, n_prefetch, prefetch_rows, dim, stride_a, stride_p, steps,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = j < n_prefetch
    key = tl.load(prefetch_keys + j, mask=live, other=0)
    lo = tl.zeros([BLOCK_R], dtype=tl.int64)
    hi = tl.zeros([BLOCK_R], dtype=tl.int64) + n_active
    for _ in range(steps):  # lower bound: first position with active_keys[pos] >= key
        open_ = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(active_keys + mid, mask=open_ & live, other=0)
        right = v < key
        lo = tl.where(open_ & right, mid + 1, lo)
        hi = tl.where(open_ & (~right), mid, hi)
    inside = live & (lo < n_active)
    found = inside & (tl.load(active_keys + lo, mask=inside, other=0) == key)
    d = tl.arange(0, BLOCK_D)
    mask = found[:, None] & (d < dim)[None, :]
    v = tl.load(active_rows + lo[:, None] * stride_a + d[None, :], mask=mask)
    tl.store(prefetch_rows + j[:, None] * stride_p + d[None, :], v, mask=mask)


@triton.jit
def _segment_sum_kernel(src, src_index, offsets, out, dim, stride_src, stride_out, BLOCK_D: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < dim
    start = tl.load(offsets + s)
    end = tl.load(offsets + s + 1)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(start, end):
        k = tl.load(src_index + i)
        acc += tl.load(src + k * stride_src + d, mask=dmask, other=0.0)
    tl.store(out + s * stride_out + d, acc, mask=dmask)


def _grid(n: int):
    return (max(1, triton.cdiv(n, _BLOCK_R)),)


def gather_rows(weights: torch.Tensor, rows: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
    rows = rows.to(torch.int64).contiguous()
    if out is None:
        out = torch.empty(rows.numel(), weights.shape[1], dtype=weights.dtype, device=weights.device)
    if rows.numel():
        with _INTERPRETER_LOCK:
            _gather_kernel[_grid(rows.numel())](
                weights, rows, out, rows.numel(), weights.shape[1], weights.stride(0), out.stride(0),
                BLOCK_R=_BLOCK_R, BLOCK_D=_block_d(weights.shape[1]),
            )
    return out


def adagrad_update(weights, state, rows, grads, lr: float, eps: float, momentum_scale: float = 1.0) -> None:
    rows = rows.to(torch.int64).contiguous()
    grads = grads.to(torch.float32).contiguous()
    if rows.numel():
        with _INTERPRETER_LOCK:
            _adagrad_kernel[_grid(rows.numel())](
                weights, state, rows, grads, rows.numel(), grads.shape[1], weights.stride(0), grads.stride(0),
                float(lr), float(eps), float(momentum_scale), SCALE_STATE=momentum_scale != 1.0,
                BLOCK_R=_BLOCK_R, BLOCK_D=_block_d(grads.shape[1]),
            )


def dual_buffer_sync(active_keys, active_rows, prefetch_keys, prefetch_rows) -> None:
    """Copies in place; returns nothing so that no device synchronisation is needed."""
    n_a, n_p = active_keys.numel(), prefetch_keys.numel()
    if n_a == 0 or n_p == 0:
        return None
    with _INTERPRETER_LOCK:
        _sync_kernel[_grid(n_p)](
            active_keys.contiguous(), n_a, active_rows, prefetch_keys.contiguous(), n_p, prefetch_rows,
            active_rows.shape[1], active_rows.stride(0), prefetch_rows.stride(0), n_a.bit_length() + 1,
            BLOCK_R=_BLOCK_R, BLOCK_D=_block_d(active_rows.shape[1]),
        )
    return None


def dual_buffer_sync_rows(active_keys, prefetch_keys, src_weight, src_state, dst_weight, dst_state,
                          from_store: bool = False) -> int:
    """The trainer's DBP sync (``nestpipe.kernels.dual_buffer_sync_rows``) on the device: the weights and, where
    given, the AdaGrad state of keys(t) ∩ keys(t+1) copied active -> prefetch buffer by :func:`dual_buffer_sync`'s
    binary-search kernel (the state as rows of width 1). From the store (a host path: on a device the update writes
    the buffer) it is the reference's. Returns the rows copied (one reduction on the device)."""
    if from_store:
        return reference.dual_buffer_sync_rows(active_keys, prefetch_keys, src_weight, src_state, dst_weight,
                                               dst_state, from_store)
    if active_keys.numel() == 0 or prefetch_keys.numel() == 0:
        return 0
    dual_buffer_sync(active_keys, src_weight, prefetch_keys, dst_weight)
    if dst_state is not None:
        dual_buffer_sync(active_keys, src_state.view(-1, 1), prefetch_keys, dst_state.view(-1, 1))
    return int(torch.isin(prefetch_keys, active_keys).sum())


def segment_sum_rows(src: torch.Tensor, src_index: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[s] = sum(src[src_index[i]] for offsets[s] <= i < offsets[s + 1])``, ascending ``i`` from zero. ``src``
    may be any view whose rows are unit-stride (e.g. the overlapping windows of a flat payload)."""
    if src.stride(1) != 1:
        src = src.contiguous()
    out = torch.empty(offsets.numel() - 1, src.shape[1], dtype=src.dtype, device=src.device)
    if out.shape[0]:
        with _INTERPRETER_LOCK:
            _segment_sum_kernel[(out.shape[0],)](
                src, src_index.to(torch.int64).contiguous(), offsets.to(torch.int64).contiguous(), out,
                src.shape[1], src.stride(0), out.stride(0), BLOCK_D=_block_d(src.shape[1]),
            )
    return out


def take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return values.index_select(0, index)
