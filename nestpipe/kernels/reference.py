"""Plain-torch references: the unfused compositions every fast path must equal.

Formulas (float32 throughout):
  * row-wise AdaGrad, for each (unique) local row ``r`` with summed gradient ``g`` (length ``D``):
        state[r] += sum(g * g) / D
        multiplier = lr / (sqrt(state[r] / M) + eps)          # M = 1 is plain row-wise AdaGrad
        w[r]     -= multiplier * g
    ``eps`` is added outside the square root, as in fbgemm's row-wise AdaGrad; ``M > 1`` is the momentum-scaled
    variant for 2D sparse parallelism (the accumulator of a shard replicated over ``M`` groups grows ``M`` times
    faster).
  * segment sums (pooled forward, every backward) add rows in ascending source order, left to right, starting
    from zero. On CPU ``index_add_`` is that serial loop; on other devices the reference computes on the CPU and
    copies back, so the reference is deterministic everywhere.
"""

from __future__ import annotations

import numpy as np
import torch

from .ranges import concat_ranges


def gather_rows(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``weights[rows]`` as a new contiguous tensor."""
    return weights.index_select(0, rows)


def adagrad_update(
    weights: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    eps: float,
    momentum_scale: float = 1.0,
    check_distinct: bool = True,
) -> None:
    """Unfused row-wise AdaGrad (index_select, math, index_copy_), in place. ``rows`` must be distinct (checked
    unless ``check_distinct`` is False, as the benchmark does to time the bare composition)."""
    if check_distinct and torch.unique(rows).numel() != rows.numel():
        raise ValueError("adagrad_update needs distinct rows (sum the gradients of duplicate rows first)")
    new_state = state.index_select(0, rows) + grads.pow(2).sum(1) / grads.shape[1]
    state.index_copy_(0, rows, new_state)
    scaled = new_state / momentum_scale if momentum_scale != 1.0 else new_state
    multiplier = lr / (scaled.sqrt() + eps)
    weights.index_copy_(0, rows, weights.index_select(0, rows) - multiplier.unsqueeze(1) * grads)


def dual_buffer_sync(
    active_keys: torch.Tensor, active_rows: torch.Tensor, prefetch_keys: torch.Tensor, prefetch_rows: torch.Tensor
) -> int:
    """Copy the rows of keys present in both (strictly ascending) key lists from active to prefetch.

    Returns the number of rows copied.
    """
    if active_keys.numel() == 0 or prefetch_keys.numel() == 0:
        return 0
    pos = torch.searchsorted(active_keys, prefetch_keys).clamp_(max=active_keys.numel() - 1)
    hit = active_keys[pos] == prefetch_keys
    targets = hit.nonzero().squeeze(1)
    prefetch_rows.index_copy_(0, targets, active_rows.index_select(0, pos[targets]))
    return int(targets.numel())


def dual_buffer_sync_rows(active_keys: torch.Tensor, prefetch_keys: torch.Tensor, src_weight: torch.Tensor,
                          src_state: torch.Tensor, dst_weight: torch.Tensor, dst_state: torch.Tensor,
                          from_store: bool) -> int:
    """DBP's sync of rows and their AdaGrad state: for every key in both (strictly ascending) key lists, copy the
    source row into the prefetch buffer's row of that key. The source row of active key ``i`` is row ``i`` of
    ``src_*`` (the active buffer) or, ``from_store``, row ``active_keys[i]`` (the store: keys are its local rows).
    Returns the number of rows copied."""
    if active_keys.numel() == 0 or prefetch_keys.numel() == 0:
        return 0
    pos = torch.searchsorted(active_keys, prefetch_keys).clamp_(max=active_keys.numel() - 1)
    hit = active_keys[pos] == prefetch_keys
    targets = hit.nonzero().squeeze(1)
    src = prefetch_keys[targets] if from_store else pos[targets]
    dst_weight.index_copy_(0, targets, src_weight.index_select(0, src))
    if dst_state is not None:
        dst_state.index_copy_(0, targets, src_state.index_select(0, src))
    return int(targets.numel())


def adagrad_bags(weight: torch.Tensor, state: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                 grad_output: torch.Tensor, lr: float, eps: float) -> None:
    """Row-wise AdaGrad from bag gradients, in place: row ``r``'s gradient is the sum of ``grad_output[b]`` over
    every occurrence of ``r`` in bag ``b`` (``indices[offsets[b]:offsets[b + 1]]``), summed by ``index_add_``
    in occurrence order; then ``v += mean(g^2)``, ``w -= lr / (sqrt(v) + eps) * g`` on the touched rows."""
    bag_of = torch.repeat_interleave(torch.arange(len(offsets) - 1, device=indices.device), offsets.diff())
    rows, inv = torch.unique(indices, return_inverse=True)
    grad = torch.zeros(len(rows), weight.shape[1], dtype=grad_output.dtype, device=weight.device)
    grad.index_add_(0, inv, grad_output.index_select(0, bag_of))
    s = state.index_select(0, rows) + grad.square().mean(dim=1)
    state.index_copy_(0, rows, s)
    weight.index_copy_(0, rows, weight.index_select(0, rows) - (lr / (torch.sqrt(s) + eps)).unsqueeze(1) * grad)


def micro_batch_values(offsets, samples, inverse, keys, num_keys):
    """One table's values of one micro-batch (see :func:`nestpipe.kernels.micro_batch_values`), in NumPy."""
    offsets = np.asarray(offsets, dtype=np.int64)
    keys = np.asarray(keys, dtype=np.int64)
    lengths = offsets[samples + 1] - offsets[samples]
    value_index = concat_ranges(offsets[samples], lengths)
    value_key = np.asarray(inverse)[value_index].astype(np.int64)
    value_sample = np.repeat(np.arange(len(samples), dtype=np.int64), lengths)
    if len(keys) and (keys.min() < 0 or keys.max() >= num_keys or np.any(keys[1:] <= keys[:-1])):
        return lengths, value_key, value_sample, np.full(len(value_key), -1, np.int64), value_index, 1
    posmap = np.full(num_keys, -1, dtype=np.int64)
    posmap[keys] = np.arange(len(keys), dtype=np.int64)
    if len(value_key) and (value_key.min() < 0 or value_key.max() >= num_keys):
        return lengths, value_key, value_sample, np.full(len(value_key), -1, np.int64), value_index, 2
    value_pos = posmap[value_key]
    status = 3 if len(value_pos) and value_pos.min() < 0 else 0
    return lengths, value_key, value_sample, value_pos, value_index, status


def pooled_owner_plan(got, at, size, b, b0, out_at, grad_off, dim, rows_all):
    """The owner's plan of one pooled store (see :func:`nestpipe.kernels.pooled_owner_plan`), in NumPy."""
    got = np.asarray(got)
    at, size, b = (np.asarray(x, dtype=np.int64) for x in (at, size, b))
    counts = got[concat_ranges(at, b)].astype(np.int64)
    entries = got[concat_ranges(at + b, size - b)].astype(np.int64) + np.repeat(np.asarray(b0, np.int64), size - b)
    out = np.repeat(np.asarray(out_at, np.int64), b) + dim * concat_ranges(np.zeros_like(b), b)
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    grad = out + np.repeat(np.asarray(grad_off, np.int64), b)
    if len(entries) and (entries.min() < 0 or entries.max() >= len(rows_all)):
        return offsets, entries, out, grad, np.zeros(len(entries), np.int64), 2
    status = 1 if (len(counts) and counts.min() < 0) or offsets[-1] != len(entries) else 0
    return offsets, entries, out, grad, np.asarray(rows_all, np.int64)[entries], status


def dedup_rows(rows):
    """Stable dedup of int64 numpy ``rows`` by one stable argsort: ``(order, uniq, starts, inv_sorted, inv)`` with
    ``rows[order]`` sorted (equal rows in ascending position), ``uniq`` the distinct rows, ``starts`` their first
    positions in ``order``, and the position in ``uniq`` of every row in sorted order (``inv_sorted``) and in input
    order (``inv``). The fused CPU kernel (``cpu.dedup_rows``) returns exactly these arrays."""
    order = np.argsort(rows, kind="stable")
    srt = rows[order]
    first = np.ones(len(srt), dtype=bool)
    first[1:] = srt[1:] != srt[:-1]
    starts = np.flatnonzero(first)
    uniq = srt[starts]
    inv_sorted = np.repeat(np.arange(len(uniq), dtype=np.int64), np.diff(np.append(starts, len(rows))))
    inv = np.empty(len(rows), dtype=np.int64)
    inv[order] = inv_sorted
    return order, uniq, starts, inv_sorted, inv


def csr_by_segment(segment_of: torch.Tensor, num_segments: int):
    """Stable sort (deterministic on every device) + counts: ``(order, offsets)``, segment ``i`` owning
    ``order[offsets[i]:offsets[i + 1]]`` in ascending element order."""
    order = torch.sort(segment_of, stable=True).indices
    offsets = torch.zeros(num_segments + 1, dtype=torch.int64, device=segment_of.device)
    offsets[1:] = torch.cumsum(torch.bincount(segment_of, minlength=num_segments), 0)
    return order, offsets


def segment_sum_rows(src: torch.Tensor, src_index: torch.Tensor, num_segments: int, segment_of: torch.Tensor):
    """``out[s] = sum of src[src_index[i]] over i with segment_of[i] == s``, in ascending ``i`` (serial order)."""
    device = src.device
    out = torch.zeros(num_segments, src.shape[1], dtype=src.dtype)
    out.index_add_(0, segment_of.cpu(), src.cpu().index_select(0, src_index.cpu()))
    return out.to(device)


def sequence_lookup(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Forward of the jagged lookup: one row per token."""
    return rows.index_select(0, inverse)


def sequence_lookup_backward(grad_out: torch.Tensor, inverse: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Serial ``index_add_`` of the token gradients in token order (on the CPU; copied back elsewhere)."""
    out = torch.zeros(num_rows, grad_out.shape[1], dtype=grad_out.dtype)
    out.index_add_(0, inverse.cpu(), grad_out.cpu())
    return out.to(grad_out.device)


def bag_of_token(offsets: torch.Tensor) -> torch.Tensor:
    """Bag id of every token given bag offsets ``[B + 1]``."""
    return torch.repeat_interleave(torch.arange(offsets.numel() - 1, device=offsets.device), offsets.diff())


def pooled_lookup(rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Forward of the pooled lookup: ``out[b] = sum of rows[inverse[i]]`` for ``offsets[b] <= i < offsets[b+1]``."""
    return segment_sum_rows(rows, inverse, offsets.numel() - 1, bag_of_token(offsets))


def pooled_lookup_backward(
    grad_out: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor, num_rows: int
) -> torch.Tensor:
    return segment_sum_rows(grad_out, bag_of_token(offsets), num_rows, inverse)
