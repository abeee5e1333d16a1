"""Reduction-based exchange (EMBark): the owner pools its rows per sample and only partial sums travel.

For pooled multi-hot features (a bag of ~20 ids per sample, ``kind = pooled``): sending one ``[b, D]`` partial
sum per owner instead of the bag's rows is about ``ids per bag`` times fewer bytes.

- input_dist (once per batch, inside the fused routing): for every micro-batch the requester sends each owner the
  (sample within the micro-batch, entry) pairs of the values that owner holds, in value order, as one count per
  sample followed by the entries (the samples of the pairs are ``repeat(arange(b), counts)``: values come in
  sample order).
- compute (owner, in ``collection.py``): ``partial[sample] = sum of buffer[entry]`` over its pairs, in value order
  starting from zero: ``nestpipe.kernels.pool_segments``' ordered segment sum (bitwise equal to
  ``zeros.index_add_(0, samples, buffer[entries])``, tested).
- output_dist (the per-micro-batch embedding All2All): each rank holding rows of the table returns ``[b, D]`` (a
  rank holding none of it sends and receives nothing for it: a table-wise table's partial sum comes from its one
  owner); the requester adds the partial sums in rank order: ``((partial_0 + partial_1) + ...)``.
- backward: the pooled gradient ``[b, D]`` goes to every rank holding rows of the table; the owner's update treats every (requester, sample)
  as one bag of its entries (``nestpipe.kernels.adagrad_bags``) or, on the entry path, adds ``grad[sample]`` into
  each pair's entry in value order (``entry_grads_from_pairs``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from nestpipe.trainer.embedding.replicated import owner_bounds, owner_order


class ReductionBased:
    """Requester side."""

    @staticmethod
    def plan(dest: np.ndarray, pos_in_dest: np.ndarray, value_key: np.ndarray, value_sample: np.ndarray,
             world: int, owner: Optional[int] = None, num_samples: Optional[int] = None,
             owners: Optional[Sequence[int]] = None, lengths: Optional[np.ndarray] = None) -> List[np.ndarray]:
        """Per-rank flat int64 lists ``[counts..., entries...]`` for one micro-batch of ``num_samples`` samples
        (default: the largest sample index + 1): ``counts[s]`` is how many of sample s's values the owner holds,
        ``entries`` their rows in the owner's list, sample after sample in value order. The owner rebuilds each
        entry's sample as ``repeat(arange(b), counts)``: one number per sample on the wire instead of one per
        value (a bag of 20 values: about half the routing bytes). Requires ``value_sample`` non-decreasing (values
        in sample order, as the shards store them); the stable owner sort keeps that order within every list.
        ``owners``: the ranks holding rows of the table (default: all); every other rank gets an empty list (it
        serves none of the table, so no partial sum of it travels either way). ``owner``: the one rank every key
        of the table goes to (a table-wise layout, ``owners == (owner,)``), where the stable owner sort is the
        identity. ``lengths``: every sample's value count, where ``value_sample`` is ``repeat(arange(b), lengths)``
        (the data stage's layout): with one owner its counts are these, so neither a count nor a check of the order is
        computed."""
        if owner is not None and lengths is not None:
            if len(lengths) != num_samples or int(np.sum(lengths)) != len(value_key):
                raise ValueError(f"reduction plan: {len(lengths)} lengths adding up to {int(np.sum(lengths))} for "
                                 f"{num_samples} samples and {len(value_key)} values")
            empty = np.zeros(0, np.int64)
            return [np.concatenate([np.asarray(lengths, dtype=np.int64), value_key]) if r == owner else empty
                    for r in range(world)]
        if len(value_sample) > 1 and not bool((value_sample[1:] >= value_sample[:-1]).all()):
            raise ValueError("reduction plan: values must come in sample order")
        b = int(num_samples) if num_samples is not None else (int(value_sample[-1]) + 1 if len(value_sample) else 0)
        if owner is not None:
            counts = np.bincount(value_sample, minlength=b).astype(np.int64)
            # one owner: every key is in its list, in key order (``pos_in_dest`` is the identity)
            entries = value_key
            empty = np.zeros(0, np.int64)
            return [np.concatenate([counts, entries]) if r == owner else empty for r in range(world)]
        holds = set(range(world) if owners is None else owners)
        d = dest[value_key]
        order = owner_order(d, world)
        bounds = owner_bounds(d, world)
        samples = value_sample[order]
        entries = pos_in_dest[value_key[order]]
        return [np.concatenate([np.bincount(samples[bounds[r]:bounds[r + 1]], minlength=b).astype(np.int64),
                                entries[bounds[r]:bounds[r + 1]]]) if r in holds else np.zeros(0, np.int64)
                for r in range(world)]

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
        instead gives one payload-sized zero-filled gradient per block, summed by autograd: work that grows with
        blocks x payload and outweighs the dense backward once there are a few tables and ranks."""
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
