"""nestpipe.kernels: the embedding hot paths, each with a plain-torch reference and a fast path per device.

What the trainer calls (docs/kernels.md lists each op's caller and path per device):

* :func:`place_keys`: the requester's key routing arithmetic (owner rank and local row of every key), with each
  table's :func:`affine_params`.
* :func:`micro_batch_values`, :func:`dedup_rows`, :func:`csr_by_segment`, :func:`pooled_owner_plan`: the host-side
  bookkeeping of a batch's keys and the owner's plans (NumPy arrays, whatever the device).
* :func:`gather_rows`: store rows at local ids -> a contiguous buffer (the DRAM store's gather).
* :func:`pool_segments`: the owner's ordered segment sums and row copies into the All2All payload.
* :func:`adagrad_bags`: row-wise AdaGrad from per-bag gradients (the bag update; fbgemm's TBE CPU backward's
  arithmetic), in place.
* :func:`adagrad_update` (and :func:`entry_grads_from_pairs`): fused row-wise AdaGrad into the store from per-pair
  gradients (the entry update; optionally momentum-scaled for 2D-SP).
* :func:`dual_buffer_sync_rows`: copy the rows of keys(t) ∩ keys(t+1) into the prefetch buffer (DBP's hand-over).
* :func:`hstu_attention`: HSTU's causal pointwise attention over jagged sequences, forward and backward (the dense
  model's hot path; :mod:`nestpipe.kernels.attention`).
* :func:`select_path` / :func:`kernel_paths` / :func:`taken_paths`: the fixed path rule, its table and the record
  of what ran, for run metadata.

Also public, not on the trainer's path: the rest of :mod:`nestpipe.kernels.row_placement` (:func:`placement`,
:func:`placement_hash`, :func:`block_size`, :func:`owner_num_rows`, :func:`map_into_vocab`: the placement rule in
full); :func:`route_keys` (dedup a batch's raw keys and bucket them by owner ->
:class:`RoutedKeys`); :func:`gather_to_device` (a gather into pinned host memory and an asynchronous copy to the
device); :func:`sequence_lookup` / :func:`pooled_lookup` (lookups by inverse index with an order-stable backward);
:func:`dual_buffer_sync` (the key/row form of the sync).

Paths are chosen per op from the device of the tensors (see :mod:`nestpipe.kernels.select`), never by timing.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch

from . import reference
from .ranges import concat_ranges, row_runs
from .attention import hstu_attention
from .row_placement import (
    MAX_VOCAB,
    affine_params,
    block_size,
    map_into_vocab,
    owner_num_rows,
    placement,
    placement_hash,
    splitmix64,
)
from .routing import RoutedKeys, route
from .select import OPS, forced, kernel_paths, kernel_rule, note, reset_taken, select_path, taken_paths

__all__ = [
    "MAX_VOCAB", "OPS", "RoutedKeys", "place_keys", "adagrad_bags", "adagrad_update", "affine_params", "block_size", "dual_buffer_sync",
    "dual_buffer_sync_rows", "gather_rows", "gather_to_device", "kernel_paths", "kernel_rule", "map_into_vocab", "owner_num_rows", "placement",
    "placement_hash", "pool_segments", "pooled_lookup", "route_keys", "select_path", "sequence_lookup", "splitmix64",
    "dedup_rows", "csr_by_segment", "micro_batch_values", "pooled_owner_plan", "taken_paths", "reset_taken", "forced",
    "hstu_attention", "concat_ranges", "row_runs",
]


def backend(path: str):
    """The module implementing ``path`` (``reference`` has no module of segment primitives: see callers)."""
    # each backend is an optional dependency (Numba, Triton, torch_npu): imported only when its path is taken
    if path == "numba":
        from . import cpu  # optional: numba

        return cpu
    if path == "triton":
        from . import triton_kernels  # optional: triton

        return triton_kernels
    if path == "npu":
        from . import npu  # optional: torch_npu

        return npu
    raise ValueError(f"path {path!r} has no kernel module")


def route_keys(
    ids: torch.Tensor,
    vocabs: Union[int, Sequence[int]],
    world: int,
    table_lengths: Optional[Sequence[int]] = None,
    table_ids: Optional[Sequence[int]] = None,
) -> RoutedKeys:
    """Route a batch's keys: ``ids`` holds the ids of table 0, then table 1, ... (``table_lengths`` each; one
    table when None); ``vocabs`` one size per table (or one for all); ``table_ids`` the tables' global ids used by
    the placement hash (default ``0..T-1``)."""
    path = note("route_keys", select_path("route_keys", ids.device))
    return route(ids, table_lengths, vocabs, world, table_ids, use_fbgemm=path == "fbgemm")


def place_keys(ids: np.ndarray, a: int, b: int, vocab: int, rows_per_shard: int,
               owners: Sequence[int] = ()) -> Tuple[np.ndarray, np.ndarray]:
    """The trainer's key routing arithmetic (:mod:`nestpipe.kernels.row_placement`, steps 2 and 3): for in-vocabulary
    int64 ``ids`` (``0 <= id < vocab <= 2**31``, so ``a * id`` fits int64), ``p = (a id + b) mod vocab``, shard
    ``p // rows_per_shard`` (mapped through ``owners`` when given) and local row ``p % rows_per_shard``. Returns
    ``(owner rank, local row)`` as int64 NumPy arrays."""
    owners_arr = np.asarray(owners, dtype=np.int64)
    if note("place_keys", select_path("place_keys", "cpu")) == "numba":
        return backend("numba").place_keys(ids, a, b, vocab, rows_per_shard, owners_arr)
    p = (np.asarray(ids, dtype=np.int64) * np.int64(a) + np.int64(b)) % np.int64(vocab)
    shard = p // np.int64(rows_per_shard)
    return (owners_arr[shard] if len(owners_arr) else shard), p % np.int64(rows_per_shard)


def gather_rows(weights: torch.Tensor, rows: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``weights[rows]`` into a contiguous buffer (``out`` when given, e.g. pinned memory). Same device as
    ``weights``."""
    if weights.dim() != 2:
        raise ValueError(f"weights must be [rows, dim], got shape {tuple(weights.shape)}")
    path = note("gather_rows", select_path("gather_rows", weights.device))
    if path == "reference":  # torch's index_select (on CPU too: a Numba loop gains nothing on a memory-bound copy)
        if out is None:
            return reference.gather_rows(weights, rows.to(weights.device))
        return torch.index_select(weights, 0, rows.to(weights.device, torch.int64), out=out)
    if path == "numba":
        raise ValueError("gather_rows has no numba path (it is torch's index_select on the CPU)")
    return backend(path).gather_rows(weights, rows.to(weights.device), out)


def gather_to_device(
    weights: torch.Tensor, rows: torch.Tensor, device: Union[str, torch.device], staging: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Gather host-store rows into ``staging`` (pinned when CUDA is available; allocated when None) and copy them
    to ``device`` asynchronously. ``staging`` must not be reused before the copy's stream has passed it."""
    device = torch.device(device)
    if staging is None:
        staging = torch.empty(rows.numel(), weights.shape[1], dtype=weights.dtype, pin_memory=device.type == "cuda")
    gathered = gather_rows(weights, rows.cpu(), staging)
    return gathered.to(device, non_blocking=True) if device.type != "cpu" else gathered


def adagrad_update(
    weights: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    eps: float = 1e-8,
    momentum_scale: float = 1.0,
    grad_segments: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    grad_pairs: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> None:
    """Fused row-wise AdaGrad into the store, in place (formula in :mod:`nestpipe.kernels.reference`).

    ``weights`` [R, D] and ``state`` [R] float32 contiguous; ``rows`` [n] distinct local row ids; ``grads`` [n, D]
    the summed gradient of each row (moved to the store's device when elsewhere). ``momentum_scale`` = M > 1
    divides the accumulator by M before the square root (2D sparse parallelism with M replica groups).

    ``grad_segments = (order, offsets)`` (int64, ``offsets`` [n + 1] from 0 to ``len(order)``): ``grads`` [m, D]
    holds per-entry gradients and row ``i``'s gradient is the sum of ``grads[order[j]]`` for
    ``offsets[i] <= j < offsets[i + 1]``, added in ascending ``j`` from zero (what a serial ``index_add_`` into
    zeros computes). The CPU path sums inside the update loop, so the row gradients are never materialised.

    ``grad_pairs = (entry_offsets, pair_src)`` (with ``grad_segments``; int64): ``grads`` is a flat 1-D source and
    entry ``e``'s gradient is the sum of ``grads[pair_src[p]:pair_src[p] + D]`` for
    ``entry_offsets[e] <= p < entry_offsets[e + 1]``, added in ascending ``p`` from zero (what serial ``index_add_``
    into zeroed per-entry gradients computes); entries then sum per row as above. The CPU path materialises
    neither the per-entry nor the per-row gradients.
    """
    if weights.dtype != torch.float32 or state.dtype != torch.float32:
        raise ValueError("the store's weights and AdaGrad state must be float32")
    if state.dim() != 1 or state.shape[0] != weights.shape[0]:
        raise ValueError(f"state must be [{weights.shape[0]}], got {tuple(state.shape)}")
    if momentum_scale <= 0:
        raise ValueError(f"momentum_scale must be positive, got {momentum_scale}")
    path = note("adagrad_update", select_path("adagrad_update", weights.device))
    update = (lr, eps, momentum_scale)
    # each gradient layout is either applied by a fused pass of its own or reduced to the next one:
    # per-pair sources -> per-entry gradients -> per-row gradients -> the row update
    if grad_pairs is not None:
        grads = _pairs_to_entries(path, weights, state, rows, grads, grad_segments, grad_pairs, update)
        if grads is None:
            return
    if grad_segments is not None:
        grads = _entries_to_rows(path, weights, state, rows, grads, grad_segments, update)
        if grads is None:
            return
    if grads.dim() != 2 or grads.shape != (rows.numel(), weights.shape[1]):
        raise ValueError(f"grads must be [{rows.numel()}, {weights.shape[1]}], got {tuple(grads.shape)}")
    grads = grads.to(weights.device)
    rows = rows.to(weights.device)
    if path == "reference":
        reference.adagrad_update(weights, state, rows, grads.float(), *update)
    else:
        backend(path).adagrad_update(weights, state, rows, grads, *update)


def _pairs_to_entries(path: str, weights: torch.Tensor, state: torch.Tensor, rows: torch.Tensor,
                      grads: torch.Tensor, grad_segments, grad_pairs, update) -> Optional[torch.Tensor]:
    """``adagrad_update``'s per-pair layout: applied in one fused pass (Numba, float32 on the host; returns None),
    else the per-entry gradients ``[m, D]`` summed in pair order (on the device for Triton and NPU)."""
    if grad_segments is None:
        raise ValueError("grad_pairs needs grad_segments (the entries of every row)")
    entry_offsets, pair_src = (x.to(torch.int64).cpu() for x in grad_pairs)
    D = weights.shape[1]
    m = entry_offsets.numel() - 1
    if (grads.dim() != 1 or m < 0 or int(entry_offsets[0]) != 0 or int(entry_offsets[-1]) != pair_src.numel()
            or bool((entry_offsets.diff() < 0).any())
            or (pair_src.numel() and (int(pair_src.min()) < 0 or int(pair_src.max()) + D > grads.numel()))):
        raise ValueError("grad_pairs must be (entry_offsets, pair_src) over a flat gradient source: "
                         "entry_offsets [m + 1] ascending from 0 to len(pair_src), pair_src + D within the source")
    order, offsets = (x.to(torch.int64).cpu() for x in grad_segments)
    if (offsets.numel() != rows.numel() + 1 or order.numel() != int(offsets[-1]) or int(offsets[0]) != 0
            or bool((offsets.diff() < 0).any()) or (order.numel() and (int(order.min()) < 0 or int(order.max()) >= m))):
        raise ValueError("grad_segments must be (order, offsets): offsets [n + 1] ascending from 0 to len(order), "
                         "order in [0, number of entries)")
    if path == "numba" and grads.dtype == torch.float32 and grads.device.type == "cpu":
        backend(path).adagrad_update_pairs(weights, state, rows, grads.contiguous(), order, offsets,
                                           entry_offsets, pair_src, *update)
        return None
    if path in ("triton", "npu"):  # ordered per entry on the device (no atomic accumulation)
        windows = grads.contiguous().as_strided((grads.numel() - D + 1, D), (1, 1))
        return backend(path).segment_sum_rows(windows, pair_src.to(grads.device), entry_offsets.to(grads.device))
    return entry_grads_from_pairs(grads.cpu(), entry_offsets, pair_src, D)


def _entries_to_rows(path: str, weights: torch.Tensor, state: torch.Tensor, rows: torch.Tensor,
                     grads: torch.Tensor, grad_segments, update) -> Optional[torch.Tensor]:
    """``adagrad_update``'s per-entry layout: applied with the sums inside the update loop (Numba; returns None),
    else the per-row gradients summed in segment order (on the device for Triton and NPU, else on the host)."""
    order, offsets = (x.to(torch.int64).cpu() for x in grad_segments)
    m = grads.shape[0] if grads.dim() == 2 else -1
    if (grads.dim() != 2 or grads.shape[1] != weights.shape[1] or offsets.numel() != rows.numel() + 1
            or order.numel() != int(offsets[-1]) or int(offsets[0]) != 0 or bool((offsets.diff() < 0).any())
            or (order.numel() and (int(order.min()) < 0 or int(order.max()) >= m))):
        raise ValueError("grad_segments must be (order, offsets) over the rows of a [m, D] gradient: "
                         "offsets [n + 1] ascending from 0 to len(order), order in [0, m)")
    if path == "numba":
        backend(path).adagrad_update(weights, state, rows.to(weights.device), grads.to(weights.device), *update,
                                     order=order, offsets=offsets)
        return None
    if path in ("triton", "npu"):  # ordered per row on the device, as the CPU paths add
        return backend(path).segment_sum_rows(grads, order.to(grads.device), offsets.to(grads.device))
    segment = torch.repeat_interleave(torch.arange(rows.numel()), offsets.diff())
    row_grads = torch.zeros(rows.numel(), grads.shape[1], dtype=grads.dtype)
    row_grads.index_add_(0, segment, grads.cpu().index_select(0, order))  # on the host: ordered
    return row_grads


def adagrad_bags(
    weights: torch.Tensor,
    state: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    grad_output: torch.Tensor,
    lr: float,
    eps: float = 1e-8,
    indices_checked: bool = False,
) -> None:
    """Row-wise AdaGrad (the formula of :func:`adagrad_update`, ``momentum_scale`` 1) in place, from bags.

    ``indices`` (int64) are local rows of ``weights`` [R, D] grouped into bags by ``offsets`` [n + 1] (int64, from
    0 to ``len(indices)``); ``grad_output`` [n, D] is each bag's gradient. Row ``r``'s gradient is the sum of the
    gradients of the bags it occurs in (with multiplicity); every touched row is updated once. A unique-based
    request is a bag of one row. The summation order is the path's own (fbgemm: rows grouped by a stable sort);
    every caller that must agree bitwise has to take the same path with the same bags in the same order.
    ``indices_checked``: the caller has bounded the indices already (the range check's two passes are skipped).
    """
    if weights.dtype != torch.float32 or state.dtype != torch.float32 or grad_output.dtype != torch.float32:
        raise ValueError("adagrad_bags: weights, state and grad_output must be float32")
    if not weights.is_contiguous() or weights.dim() != 2 or state.shape != (weights.shape[0],):
        raise ValueError(f"adagrad_bags: weights must be contiguous [R, D] and state [R]; got "
                         f"{tuple(weights.shape)} / {tuple(state.shape)}")
    if grad_output.shape != (len(offsets) - 1, weights.shape[1]):
        raise ValueError(f"adagrad_bags: grad_output {tuple(grad_output.shape)} != ({len(offsets) - 1}, "
                         f"{weights.shape[1]})")
    if not indices_checked and len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= weights.shape[0]):
        raise IndexError(f"adagrad_bags: an index is outside [0, {weights.shape[0]})")
    if len(indices) == 0:  # no row touched (fbgemm refuses a table of zero rows)
        return
    path = note("adagrad_bags", select_path("adagrad_bags", weights.device))
    if path == "numba" and weights.device.type == "cpu":
        backend(path).adagrad_bags(weights, state, indices, offsets, grad_output, lr, eps)
        return
    if path == "fbgemm":
        from . import tbe  # optional: fbgemm_gpu

        tbe.adagrad_bags(weights, state, indices.to(torch.int64).contiguous(), offsets.to(torch.int64).contiguous(),
                         grad_output.contiguous(), lr, eps)
        return
    reference.adagrad_bags(weights, state, indices.to(torch.int64), offsets.to(torch.int64), grad_output, lr, eps)


def entry_grads_from_pairs(src: torch.Tensor, entry_offsets: torch.Tensor, pair_src: torch.Tensor, dim: int
                           ) -> torch.Tensor:
    """``[m, dim]`` per-entry gradients: entry ``e`` sums ``src[pair_src[p]:pair_src[p] + dim]`` over its pairs in
    ascending ``p`` from zero (``index_add_`` into zeros, a serial loop in index order on CPU)."""
    entry_offsets = entry_offsets.to(torch.int64).cpu()
    m = entry_offsets.numel() - 1
    out = torch.zeros(m, dim, dtype=src.dtype, device=src.device)
    if pair_src.numel() == 0:
        return out
    windows = src.contiguous().as_strided((src.numel() - dim + 1, dim), (1, 1))
    entry = torch.repeat_interleave(torch.arange(m), entry_offsets.diff()).to(src.device)
    return out.index_add_(0, entry, windows.index_select(0, pair_src.to(torch.int64).to(src.device)))


def pool_segments(src: torch.Tensor, index: torch.Tensor, offsets: Optional[torch.Tensor], out: torch.Tensor,
                  out_offsets: torch.Tensor) -> None:
    """Into the flat ``out``, at element offset ``out_offsets[s]``: with ``offsets`` (CSR, [S + 1]) the sum of
    ``src[index[j]]`` over ``offsets[s] <= j < offsets[s + 1]`` in ascending ``j`` from zero (an ordered segment
    sum, bitwise ``zeros.index_add_``); without, the row ``src[index[s]]`` (a copy). ``src`` [R, D]; index
    tensors int64 on the CPU. The CPU float32 segment sum is ATen's ``embedding_bag`` (mode sum, which on x86 runs
    fbgemm's EmbeddingSpMDM kernel: each bag's rows added in index order from zero, the same arithmetic; tested
    bitwise) written into ``out`` one run of consecutive segments at a time; the CPU float32 row copy is one Numba
    pass; others use ``index_add_`` / ``index_select``."""
    D = src.shape[1]
    path = select_path("lookup", src.device)
    if path in ("triton", "npu") and src.dtype == torch.float32 and out.dtype == torch.float32:
        # the device paths: every segment's rows added in ascending order (Triton: one program per segment; npu:
        # rounds of index_add_ whose targets are distinct), no atomic accumulation; a copy is a segment of one row
        note("pool_segments", path)
        if offsets is None:
            offsets = torch.arange(len(index) + 1, dtype=torch.int64)
        rows = backend(path).segment_sum_rows(src.detach(), index.to(src.device), offsets.to(src.device))
        if len(out_offsets):
            _write_runs(out, out_offsets, rows.to(out.device))
        return
    if (offsets is not None and src.device.type == "cpu" and out.device.type == "cpu" and src.dtype == torch.float32
            and out.dtype == torch.float32 and len(out_offsets) and path not in ("reference", "triton", "npu")):
        note("pool_segments", "aten")  # ATen's embedding_bag (fbgemm's EmbeddingSpMDM on x86)
        _embedding_bag_into(out, out_offsets, src.detach(), index, offsets)
        return
    if (src.device.type == "cpu" and out.device.type == "cpu" and src.dtype == torch.float32
            and out.dtype == torch.float32 and path == "numba"):
        note("pool_segments", "numba")
        backend("numba").pool_segments(src.detach(), index, offsets, out, out_offsets)
        return
    note("pool_segments", "reference")
    index = index.to(src.device)
    if offsets is None:
        rows = src.index_select(0, index)
    else:
        seg = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets.diff()).to(src.device)
        rows = torch.zeros(offsets.numel() - 1, D, dtype=src.dtype, device=src.device)
        rows.index_add_(0, seg, src.index_select(0, index))
    at = (out_offsets.to(out.device)[:, None] + torch.arange(D, device=out.device)).reshape(-1)
    out.view(-1)[at] = rows.reshape(-1).to(out.dtype)


def micro_batch_values(offsets: np.ndarray, samples: np.ndarray, inverse: np.ndarray, keys: np.ndarray,
                       num_keys: int):
    """One table's values of one micro-batch, from a batch record's CSR layout.

    ``offsets`` [B + 1] delimit every sample's values in ``inverse`` (each value's position in the batch's
    ``num_keys`` unique keys); ``samples`` (ascending) are the micro-batch's samples; ``keys`` its unique key
    positions (a sorted set). Returns ``(lengths, value_key, value_sample, value_pos, value_index, status)``:
    per sample its value count; per value (sample after sample, in value order) its key position, its sample
    within the micro-batch, its position in ``keys`` and its index in ``inverse``. ``status``: 0 valid, 1 ``keys``
    not a sorted set within ``[0, num_keys)``, 2 a value outside ``[0, num_keys)``, 3 a value not in ``keys``
    (checked in that order; ``value_pos`` is only meaningful at 0). Numba's single pass when Numba imports, else
    NumPy; the same arrays either way (tested)."""
    if note("micro_batch_values", select_path("micro_batch_values", "cpu")) == "numba":
        return backend("numba").micro_batch_values(offsets, samples, inverse, keys, num_keys)
    return reference.micro_batch_values(offsets, samples, inverse, keys, num_keys)


def pooled_owner_plan(got: np.ndarray, at: np.ndarray, size: np.ndarray, b: np.ndarray, b0: np.ndarray,
                      out_at: np.ndarray, grad_off: np.ndarray, dim: int, rows_all: np.ndarray):
    """The owner's plan of one pooled (reduction-based) store from the received routing payload ``got``.

    Block ``k`` (one (micro-batch, requester) pair) is ``got[at[k]:at[k] + size[k]]``: ``b[k]`` per-sample counts,
    then the entries of those samples, sample after sample (``ReductionBased.plan``), each relative to the
    requester's first entry ``b0[k]``; its segments go to element offsets ``out_at[k] + dim * j`` of the
    micro-batch's payload, which starts at ``grad_off[k]`` in the batch's gradient payload. Returns ``(offsets,
    entries, out, grad, rows, status)``: the CSR of every segment over the entries (all blocks in order), every
    pair's entry, every segment's payload and gradient offsets, every pair's store row ``rows_all[entry]``, and
    ``status`` 0 valid, 1 counts that are negative or do not add up to the entries, 2 an entry outside
    ``rows_all`` (``rows`` is meaningless then). Numba's single pass when Numba imports, else NumPy; the same
    arrays either way (tested)."""
    if note("pooled_owner_plan", select_path("pooled_owner_plan", "cpu")) == "numba":
        return backend("numba").pooled_owner_plan(got, at, size, b, b0, out_at, grad_off, dim, rows_all)
    return reference.pooled_owner_plan(got, at, size, b, b0, out_at, grad_off, dim, rows_all)


def dedup_rows(rows: np.ndarray, num_rows: int):
    """Stable dedup of int64 ``rows`` in ``[0, num_rows)``: ``(order, uniq, starts, inv_sorted, inv)`` (see
    :func:`nestpipe.kernels.reference.dedup_rows`). CPU rule: Numba's counting sort when Numba imports and the rows
    are few against the entries (``num_rows <= 8 len(rows)``: linear), else numpy's stable argsort; the same
    arrays either way (tested)."""
    if select_path("dedup_rows", "cpu") == "numba" and num_rows <= 8 * len(rows):
        note("dedup_rows", "numba")
        return backend("numba").dedup_rows(rows, num_rows)
    note("dedup_rows", "reference")
    return reference.dedup_rows(rows)


def csr_by_segment(segment_of: torch.Tensor, num_segments: int):
    """``(order, offsets)`` int64 tensors: positions grouped by segment, ascending inside one (a stable counting
    sort with Numba on CPU, else a stable sort)."""
    if segment_of.device.type == "cpu" and select_path("csr_by_segment", "cpu") == "numba":
        note("csr_by_segment", "numba")
        return backend("numba").csr_by_segment(segment_of, num_segments)
    note("csr_by_segment", "reference")
    return reference.csr_by_segment(segment_of, num_segments)


def _embedding_bag_into(out: torch.Tensor, out_offsets: torch.Tensor, src: torch.Tensor, index: torch.Tensor,
                        offsets: torch.Tensor) -> None:
    """Sum-mode ``embedding_bag`` of every segment into ``out`` at ``out_offsets`` (``_embedding_bag_forward_only.out``:
    the functional op's kernel and arithmetic, each segment summed on its own). Where every offset is a multiple of
    the row width, one call pools all segments and one ``index_copy_`` places the rows; otherwise one call per run
    of segments laid out back to back writes straight into a view of ``out``."""
    D = src.shape[1]
    offs = out_offsets.numpy()
    op = torch.ops.aten._embedding_bag_forward_only.out
    if out.numel() % D == 0 and not (offs % D).any() and int(offsets[0]) == 0:
        # every segment starts on a row of ``out`` viewed as [-1, D]: one call for all of them, then one scatter of
        # whole rows (a payload of many (micro-batch, requester) blocks would take one call per run)
        rows = torch.empty(len(offs), D, dtype=out.dtype)
        scratch = [torch.empty(0, dtype=torch.int64) for _ in range(3)]  # offset2bag, bag_size, max_indices
        op(src, index, offsets, False, 0, False, None, True, -1, out0=rows, out1=scratch[0], out2=scratch[1],
           out3=scratch[2])
        out.view(-1, D).index_copy_(0, torch.from_numpy(offs // D), rows)
        return
    for a, b in row_runs(offs, D):
        o = int(offs[a])
        lo, hi = int(offsets[a]), int(offsets[b])
        scratch = [torch.empty(0, dtype=torch.int64) for _ in range(3)]  # offset2bag, bag_size, max_indices
        op(src, index[lo:hi], offsets[a:b + 1] - lo, False, 0, False, None, True, -1,
           out0=out[o:o + (b - a) * D].view(b - a, D), out1=scratch[0], out2=scratch[1], out3=scratch[2])


def _write_runs(out: torch.Tensor, out_offsets: torch.Tensor, rows: torch.Tensor) -> None:
    """``out[out_offsets[s]:out_offsets[s] + D] = rows[s]``, one copy per run of segments laid out back to back."""
    D = rows.shape[1]
    offs = out_offsets.numpy()
    for a, b in row_runs(offs, D):
        o = int(offs[a])
        out[o:o + (b - a) * D].view(b - a, D).copy_(rows[a:b])


def dual_buffer_sync(
    active_keys: torch.Tensor, active_rows: torch.Tensor, prefetch_keys: torch.Tensor, prefetch_rows: torch.Tensor
) -> None:
    """For every key in both strictly ascending key lists, copy its row from ``active_rows`` (aligned with
    ``active_keys``) into ``prefetch_rows`` (aligned with ``prefetch_keys``), in place. Keys are the served
    (global) keys of batches t and t+1; both buffers are on one device."""
    if active_rows.shape[0] != active_keys.numel() or prefetch_rows.shape[0] != prefetch_keys.numel():
        raise ValueError("each buffer must have one row per key")
    if active_rows.shape[1:] != prefetch_rows.shape[1:]:
        raise ValueError("active and prefetch rows must have the same dim")
    path = note("dual_buffer_sync", select_path("dual_buffer_sync", prefetch_rows.device))
    if path == "reference":
        reference.dual_buffer_sync(active_keys, active_rows, prefetch_keys, prefetch_rows)
    else:
        backend(path).dual_buffer_sync(active_keys, active_rows, prefetch_keys, prefetch_rows)


def dual_buffer_sync_rows(
    active_keys: torch.Tensor, prefetch_keys: torch.Tensor, src_weight: torch.Tensor,
    src_state: Optional[torch.Tensor], dst_weight: torch.Tensor, dst_state: Optional[torch.Tensor],
    from_store: bool = False,
) -> int:
    """The trainer's dual-buffer sync: weights and AdaGrad state of keys(t) ∩ keys(t+1) in one merge. Keys are the
    owner's local rows of batches t and t+1 (strictly ascending). Source: the active buffer (row ``i`` belongs to
    ``active_keys[i]``) or, ``from_store``, the store itself (row ``active_keys[i]``). ``dst_state=None``: weights
    only (``src_state`` is ignored). Returns the rows copied."""
    if dst_weight.shape[0] != prefetch_keys.numel() or (dst_state is not None and
                                                        dst_state.shape[0] != prefetch_keys.numel()):
        raise ValueError("the prefetch buffer must have one row per prefetch key")
    if not from_store and src_weight.shape[0] != active_keys.numel():
        raise ValueError("the active buffer must have one row per active key")
    path = select_path("dual_buffer_sync", dst_weight.device)
    path = note("dual_buffer_sync_rows", path if path in ("numba", "triton") else "reference")
    impl = reference if path == "reference" else backend(path)
    return impl.dual_buffer_sync_rows(active_keys.to(dst_weight.device), prefetch_keys.to(dst_weight.device),
                                      src_weight, src_state, dst_weight, dst_state, from_store)


class _SequenceLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, inverse, path):
        ctx.save_for_backward(inverse)
        ctx.num_rows, ctx.path = rows.shape[0], path
        # index_select on every path: a memory-bound copy that a loop of ours does not beat, and a single
        # well-tuned op on CUDA and NPU too.
        return reference.sequence_lookup(rows.detach(), inverse)

    @staticmethod
    def backward(ctx, grad_out):
        (inverse,) = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        if ctx.path in ("reference", "numba"):
            # On CPU index_add_ is a serial loop in ascending token order (bitwise equal to the ordered segment
            # sum, tested) and needs no counting sort first, so the CPU path uses it too.
            return reference.sequence_lookup_backward(grad_out, inverse, ctx.num_rows), None, None
        kernels = backend(ctx.path)
        order, offsets = kernels.csr_by_segment(inverse, ctx.num_rows)
        return kernels.segment_sum_rows(grad_out, order.to(grad_out.device), offsets.to(grad_out.device)), None, None


class _PooledLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, inverse, offsets, path):
        ctx.save_for_backward(inverse, offsets)
        ctx.num_rows, ctx.path = rows.shape[0], path
        if path == "reference":
            return reference.pooled_lookup(rows, inverse, offsets)
        return backend(path).segment_sum_rows(rows.detach(), inverse, offsets)

    @staticmethod
    def backward(ctx, grad_out):
        inverse, offsets = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        if ctx.path == "reference":
            return reference.pooled_lookup_backward(grad_out, inverse, offsets, ctx.num_rows), None, None, None
        kernels = backend(ctx.path)
        order, row_offsets = kernels.csr_by_segment(inverse, ctx.num_rows)
        bag = reference.bag_of_token(offsets)
        src_index = kernels.take(bag, order.to(bag.device))
        grad_rows = kernels.segment_sum_rows(grad_out, src_index, row_offsets.to(grad_out.device))
        return grad_rows, None, None, None


def _check_lookup(rows: torch.Tensor, inverse: torch.Tensor) -> None:
    if rows.dim() != 2:
        raise ValueError(f"rows must be [num_rows, dim], got shape {tuple(rows.shape)}")
    if inverse.dim() != 1 or inverse.dtype not in (torch.int64, torch.int32):
        raise ValueError("inverse must be a 1-D int32/int64 tensor")


def sequence_lookup(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Jagged lookup: ``out[i] = rows[inverse[i]]`` ([n, D]). Backward: ``grad_rows[u]`` = sum of ``grad_out[i]``
    over tokens with ``inverse[i] == u``, added in ascending ``i`` (bitwise reproducible)."""
    _check_lookup(rows, inverse)
    path = select_path("lookup", rows.device)
    note("lookup", "reference" if path == "numba" else path)  # the CPU runs index_select / index_add_ (see above)
    return _SequenceLookup.apply(rows, inverse.to(torch.int64), path)


def pooled_lookup(rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Pooled lookup (sum per bag): ``out[b] = sum(rows[inverse[i]] for offsets[b] <= i < offsets[b+1])`` ([B, D]),
    in ascending ``i``. Backward: ``grad_rows[u]`` = sum of ``grad_out[bag(i)]`` over ``inverse[i] == u``, ascending
    ``i``."""
    _check_lookup(rows, inverse)
    if offsets.dim() != 1 or offsets.numel() < 1 or int(offsets[-1]) != inverse.numel():
        raise ValueError("offsets must be [B + 1] with offsets[-1] == len(inverse)")
    return _PooledLookup.apply(
        rows, inverse.to(torch.int64), offsets.to(torch.int64), note("lookup", select_path("lookup", rows.device))
    )
