"""Reduction-based exchange (EMBark): the owner pools its rows per sample and only partial sums travel.

For pooled multi-hot features (a bag of ~20 ids per sample, ``kind = pooled``): sending one ``[b, D]`` partial
sum per owner instead of the bag's rows is about ``ids per bag`` times fewer bytes.

- input_dist (once per batch, inside the fused routing): for every micro-batch the requester sends each owner the
  (sample within the micro-batch, entry) pairs of the values that owner holds, in value order, as one count per
  sample followed by the entries (the samples of the pairs are ``repeat(arange(b), counts)``: values come in
  sample order).
- compute (owner): ``partial[sample] = sum of buffer[entry]`` over its pairs, in value order starting from zero.
  The pairs of one owner arrive sorted by sample (the requester's stable bucketing keeps value order, which is
  sample order), so on CPU float32 this is ``nestpipe.kernels.pooled_lookup``'s ordered segment sum (one pass,
  bitwise equal to ``zeros.index_add_(0, samples, buffer[entries])``, tested); other dtypes/devices, or pairs not
  sorted by sample, use that ``index_add_``.
- output_dist (the per-micro-batch embedding All2All): each owner returns ``[b, D]``; the requester adds the partial
  sums in rank order: ``((partial_0 + partial_1) + ...)``.
- backward: the pooled gradient ``[b, D]`` goes to every owner; the owner adds ``grad[sample]`` into each pair's
  entry (value order), so each entry accumulates its micro-batches in order.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch

from nestpipe.trainer.embedding.replicated import owner_bounds, owner_order
from nestpipe import kernels


class ReductionBased:
    """Requester side."""

    @staticmethod
    def plan(dest: np.ndarray, pos_in_dest: np.ndarray, value_key: np.ndarray, value_sample: np.ndarray,
             world: int, owner: Optional[int] = None, num_samples: Optional[int] = None) -> List[np.ndarray]:
        """Per-owner flat int64 lists ``[counts..., entries...]`` for one micro-batch of ``num_samples`` samples
        (default: the largest sample index + 1): ``counts[s]`` is how many of sample s's values the owner holds,
        ``entries`` their rows in the owner's list, sample after sample in value order. The owner rebuilds each
        entry's sample as ``repeat(arange(b), counts)``: one number per sample on the wire instead of one per
        value (a bag of 20 values: about half the routing bytes). Requires ``value_sample`` non-decreasing (values
        in sample order, as the shards store them); the stable owner sort keeps that order within every list.
        ``owner``: the one rank every key of the table goes to (a table-wise layout), where the stable owner sort
        is the identity."""
        if len(value_sample) > 1 and not bool((value_sample[1:] >= value_sample[:-1]).all()):
            raise ValueError("reduction plan: values must come in sample order")
        b = int(num_samples) if num_samples is not None else (int(value_sample[-1]) + 1 if len(value_sample) else 0)
        if owner is not None:
            counts = np.bincount(value_sample, minlength=b).astype(np.int64)
            entries = pos_in_dest[value_key]
            empty = np.zeros(b, np.int64)
            return [np.concatenate([counts, entries]) if r == owner else np.concatenate([empty, entries[:0]])
                    for r in range(world)]
        d = dest[value_key]
        order = owner_order(d, world)
        bounds = owner_bounds(d, world)
        samples = value_sample[order]
        entries = pos_in_dest[value_key[order]]
        return [np.concatenate([np.bincount(samples[bounds[r]:bounds[r + 1]], minlength=b).astype(np.int64),
                                entries[bounds[r]:bounds[r + 1]]])
                for r in range(world)]

    @staticmethod
    def segments(lst: np.ndarray, num_samples: int) -> Tuple[np.ndarray, np.ndarray]:
        """Owner side: (sample of every entry, entries) from a list of :meth:`plan`."""
        counts = lst[:num_samples].astype(np.int64)
        return np.repeat(np.arange(num_samples, dtype=np.int64), counts), lst[num_samples:].astype(np.int64)

    @staticmethod
    def unpack(pieces: List[torch.Tensor]) -> torch.Tensor:
        out = pieces[0]
        for p in pieces[1:]:
            out = out + p
        return out

    @staticmethod
    def unpack_flat(leaf: torch.Tensor, blocks: List[List[Tuple[int, int, int]]]) -> List[torch.Tensor]:
        """Every reduction-based slot's output from the flat received payload ``leaf`` in one autograd node.

        ``blocks[k]`` lists slot ``k``'s ``(element offset, samples, dim)`` per owner rank, in rank order; output
        ``k`` is the rank-order sum of those ``[samples, dim]`` blocks (the arithmetic of :meth:`unpack`). Its
        backward writes every block's gradient (the output's gradient, unchanged) straight into one
        payload-sized buffer; blocks of ``leaf`` no slot here covers get zeros. Slicing ``leaf`` into views
        instead gives one payload-sized zero-filled gradient per block, summed by autograd: measured 2.7x the
        whole dense backward (8 tables x 2 ranks at batch 1024)."""
        return list(_FlatUnpack.apply(leaf, blocks))


class _FlatUnpack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, leaf: torch.Tensor, blocks):
        ctx.blocks = blocks
        ctx.numel = leaf.numel()
        ctx.covered = sum(n * d for bl in blocks for _, n, d in bl)
        outs = []
        for bl in blocks:
            views = [leaf[o:o + n * d].view(n, d) for o, n, d in bl]
            out = views[0].clone() if len(views) == 1 else views[0] + views[1]
            for v in views[2:]:
                out = out + v
            outs.append(out)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        g = grads[0].new_empty(ctx.numel) if ctx.covered == ctx.numel else grads[0].new_zeros(ctx.numel)
        for bl, go in zip(ctx.blocks, grads):
            for o, n, d in bl:
                dst = g[o:o + n * d].view(n, d)
                if go is None:
                    dst.zero_()
                else:
                    dst.copy_(go)
        return g, None


class ShardedReductionBased:
    """Owner side."""

    @staticmethod
    def compute(buffer: torch.Tensor, samples: torch.Tensor, entry_rows: torch.Tensor, num_samples: int
                ) -> torch.Tensor:
        """``[num_samples, D]``: ``out[s] = sum of buffer[entry_rows[j]]`` over ``samples[j] == s``, ascending ``j``."""
        if (buffer.device.type == "cpu" and buffer.dtype == torch.float32 and len(samples)
                and bool((samples[1:] >= samples[:-1]).all()) and int(samples[-1]) < num_samples):
            return segment_pool(buffer, samples, entry_rows, num_samples)
        return ShardedReductionBased.compute_reference(buffer, samples, entry_rows, num_samples)

    @staticmethod
    def compute_reference(buffer: torch.Tensor, samples: torch.Tensor, entry_rows: torch.Tensor, num_samples: int
                          ) -> torch.Tensor:
        out = buffer.new_zeros(num_samples, buffer.shape[1])
        return out.index_add_(0, samples, buffer.index_select(0, entry_rows))

    @staticmethod
    def accumulate(grad_entries: torch.Tensor, samples: torch.Tensor, entries: torch.Tensor,
                   grad_pooled: torch.Tensor) -> None:
        """``grad_entries[entries[j]] += grad_pooled[samples[j]]`` for ascending ``j``: exactly
        ``grad_entries.index_add_(0, entries, grad_pooled.index_select(0, samples))`` (a serial loop in index order
        on CPU, tested bitwise), without materialising the gathered rows."""
        if not scatter_add_rows(grad_entries, entries, grad_pooled, samples):
            grad_entries.index_add_(0, entries, grad_pooled.index_select(0, samples))


def segment_pool(buffer: torch.Tensor, samples: torch.Tensor, entry_rows: torch.Tensor, num_samples: int
                 ) -> torch.Tensor:
    """Ordered segment sum for ``samples`` sorted ascending: bag ``s`` sums ``buffer[entry_rows[j]]`` for its ``j``
    in ascending order from zero (the arithmetic of ``nestpipe.kernels.pooled_lookup``'s forward; no autograd: the
    owner's buffer is frozen and its gradient arrives through the gradient All2All).

    With one intra-op thread (the trainer's default) a serial Numba loop runs it: calling Numba's parallel kernels
    from ranks that share the cores wakes its OpenMP pool (``NUMBA_NUM_THREADS`` threads, all cores by default),
    whose spinning workers measured 7x slower steps on 2 ranks x 1 thread (1183 vs 159 ms per step). With more
    threads: ``nestpipe.kernels.pooled_lookup``."""
    counts = torch.bincount(samples, minlength=num_samples)
    offsets = torch.zeros(num_samples + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    buffer = buffer.detach().contiguous()
    serial = _serial_kernel() if torch.get_num_threads() == 1 else None
    if serial is not None:
        out = torch.empty(num_samples, buffer.shape[1], dtype=buffer.dtype)
        serial(buffer.numpy(), entry_rows.contiguous().numpy(), offsets.numpy(), out.numpy())
        return out

    with torch.no_grad():
        return kernels.pooled_lookup(buffer, entry_rows, offsets)


_SERIAL = []


def _serial_kernel():
    """The serial segment sum (compiled once per process, cached on disk); None without Numba."""
    if not _SERIAL:
        try:
            import numba
        except ImportError:
            _SERIAL.append(None)
            return None

        @numba.njit(cache=True, nogil=True)
        def segment_sum_serial(src, index, offsets, out):
            dim = src.shape[1]
            for s in range(offsets.shape[0] - 1):
                for k in range(dim):
                    out[s, k] = 0.0
                for j in range(offsets[s], offsets[s + 1]):
                    r = index[j]
                    for k in range(dim):
                        out[s, k] += src[r, k]

        _SERIAL.append(segment_sum_serial)
    return _SERIAL[0]


def scatter_add_rows(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor,
                     src_index: Optional[torch.Tensor] = None) -> bool:
    """In place ``out[index[j]] += src[src_index[j]]`` (``src[j]`` when ``src_index`` is None) for ``j`` ascending,
    one row at a time: the arithmetic of CPU ``out.index_add_(0, index, src[src_index])``. Returns False (nothing
    done) where it does not apply (not CPU, other dtypes, no Numba); the caller then runs ``index_add_``."""
    if (out.device.type != "cpu" or src.device.type != "cpu" or out.dtype not in (torch.float32, torch.float64)
            or src.dtype != out.dtype or not out.is_contiguous() or out.dim() != 2 or len(index) == 0):
        return False
    compiled = _scatter_kernels()
    if compiled is None:
        return False
    gather_scatter, scatter = compiled
    src = src.detach().contiguous()
    # indices checked here once (vectorised) instead of per access inside the loop (bounds checks there kept it
    # from vectorising: about 1.6x slower)
    if int(index.min()) < 0 or int(index.max()) >= out.shape[0]:
        raise IndexError(f"scatter_add_rows: index outside [0, {out.shape[0]})")
    if src_index is None:
        if len(index) > src.shape[0]:
            raise IndexError(f"scatter_add_rows: {len(index)} indices for {src.shape[0]} source rows")
    elif len(src_index) != len(index) or int(src_index.min()) < 0 or int(src_index.max()) >= src.shape[0]:
        raise IndexError(f"scatter_add_rows: src_index outside [0, {src.shape[0]}) or of another length")
    if src_index is None:
        scatter(out.numpy(), index.contiguous().numpy(), src.numpy())
    else:
        gather_scatter(out.numpy(), index.contiguous().numpy(), src.numpy(), src_index.contiguous().numpy())
    return True


_SCATTER = []


def _scatter_kernels():
    if not _SCATTER:
        try:
            import numba
        except ImportError:
            _SCATTER.append(None)
            return None

        @numba.njit(cache=True, nogil=True)
        def gather_scatter_add(out, index, src, src_index):
            dim = out.shape[1]
            for j in range(index.shape[0]):
                o = index[j]
                s = src_index[j]
                for k in range(dim):
                    out[o, k] += src[s, k]

        @numba.njit(cache=True, nogil=True)
        def scatter_add(out, index, src):
            dim = out.shape[1]
            for j in range(index.shape[0]):
                o = index[j]
                for k in range(dim):
                    out[o, k] += src[j, k]

        _SCATTER.append((gather_scatter_add, scatter_add))
    return _SCATTER[0]
