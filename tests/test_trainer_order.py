"""Order-stable reductions the synchronous step and the pipelined modes rely on for bitwise reproducibility.

- CPU ``index_add_`` adds source rows into their targets in index order (a serial loop), for any thread count.
- The reduction-based plan keeps value order per owner (the owner's ordered segment sum, ``kernels.pool_segments``,
  is tested bitwise against ``zeros.index_add_`` in tests/test_kernels.py).
Negative controls: the values are chosen so that another summation order gives other bits, and the test checks
that it does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nestpipe.trainer.embedding.reduction_based import ReductionBased


def cancelling_rows(n: int, dim: int, seed: int) -> torch.Tensor:
    """float32 rows of mixed magnitudes (1e7 .. 1e-3, both signs): sums depend on the order of addition."""
    rng = np.random.default_rng(seed)
    mag = 10.0 ** rng.integers(-3, 8, size=(n, dim))
    return torch.from_numpy((rng.standard_normal((n, dim)) * mag).astype(np.float32))


def serial(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor, order) -> torch.Tensor:
    out = out.clone()
    for j in order:
        out[index[j]] += src[j]
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_index_add_accumulates_in_index_order(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n, targets, dim = 3000, 7, 16
        src = cancelling_rows(n, dim, 0)
        index = torch.from_numpy(np.random.default_rng(1).integers(0, targets, n))
        base = cancelling_rows(targets, dim, 2)
        got = base.clone().index_add_(0, index, src)
        assert torch.equal(got, serial(base, index, src, range(n)))
        # the same call again: bitwise identical
        assert torch.equal(got, base.clone().index_add_(0, index, src))
        # negative control: reversed order of addition changes the bits (so the check above can fail)
        assert not torch.equal(got, serial(base, index, src, range(n - 1, -1, -1)))
    finally:
        torch.set_num_threads(old)


def test_reduction_plan_keeps_value_order_per_owner():
    """The requester's per-owner lists are sorted by sample (what the owner's segment sum needs)."""
    rng = np.random.default_rng(5)
    keys, world = 300, 3
    dest = rng.integers(0, world, keys)
    pos = np.zeros(keys, dtype=np.int64)
    for r in range(world):
        pos[dest == r] = np.arange(int((dest == r).sum()))
    lens = rng.integers(0, 30, 64)
    value_sample = np.repeat(np.arange(64), lens)
    value_key = rng.integers(0, keys, len(value_sample))
    lists = ReductionBased.plan(dest, pos, value_key, value_sample, world, num_samples=64)
    total = 0
    for r, lst in enumerate(lists):
        assert len(lst) == 64 + int((dest[value_key] == r).sum())  # one count per sample, one entry per value
        s, e = np.repeat(np.arange(64), lst[:64]), lst[64:]  # each entry's sample, the entries
        assert np.all(np.diff(s) >= 0)
        sel = dest[value_key] == r
        assert np.array_equal(s, value_sample[sel]) and np.array_equal(e, pos[value_key[sel]])
        total += len(e)
    assert total == len(value_key)
    # values out of sample order cannot be sent as counts: refused, not silently regrouped
    with pytest.raises(ValueError, match="sample order"):
        ReductionBased.plan(dest, pos, value_key, value_sample[::-1].copy(), world)


def test_reduction_plan_single_owner_shortcut_equals_general():
    """A table-wise table (one owner): the shortcut's lists equal the general stable-sort plan's, element for element
    and dtype for dtype, on the owner and on every other rank (empty); so do the lists built from the samples'
    lengths."""
    rng = np.random.default_rng(6)
    keys, world = 200, 3
    lens = rng.integers(0, 30, 64)
    value_sample = np.repeat(np.arange(64), lens)
    value_key = rng.integers(0, keys, len(value_sample))
    pos = np.arange(keys, dtype=np.int64)
    for owner in range(world):
        dest = np.full(keys, owner, dtype=np.int64)
        general = ReductionBased.plan(dest, pos, value_key, value_sample, world, owners=(owner,), num_samples=64)
        short = ReductionBased.plan(dest, pos, value_key, value_sample, world, owner, num_samples=64)
        # the data stage's per-sample lengths as the counts (no bincount, no order check)
        given = ReductionBased.plan(dest, pos, value_key, value_sample, world, owner, num_samples=64, lengths=lens)
        assert len(short) == world
        for a, b, c in zip(general, short, given):
            assert a.dtype == b.dtype == c.dtype and np.array_equal(a, b) and np.array_equal(a, c)
        with pytest.raises(ValueError, match="lengths adding up to"):
            ReductionBased.plan(dest, pos, value_key, value_sample, world, owner, num_samples=64, lengths=lens[1:])
        assert len(short[owner]) == 64 + len(value_key)
        # the ranks holding none of the table get nothing (no counts: no partial sums travel to or from them)
        assert all(len(short[r]) == 0 for r in range(world) if r != owner)
        # negative control: the check catches lists handed to the wrong owner
        wrong = ReductionBased.plan(dest, pos, value_key, value_sample, world, (owner + 1) % world)
        assert not all(np.array_equal(a, b) for a, b in zip(general, wrong))


def _views_unpack(leaf, blocks):
    return [ReductionBased.unpack([leaf[o:o + n * d].view(n, d) for o, n, d in bl]) for bl in blocks]


@pytest.mark.parametrize("uncovered", [False, True])
def test_flat_unpack_bitwise_equals_views(uncovered):
    """``unpack_flat`` (one autograd node) gives bitwise the outputs and the payload gradient of slicing the payload
    into views and summing them in rank order, including zeros where a block is not covered (a unique-based slot's
    part of the payload)."""
    g = torch.Generator().manual_seed(3)
    W, b, dims = 3, 5, [4, 2, 4]
    blocks, off = [[] for _ in dims], 0
    for _r in range(W):
        for k, d in enumerate(dims):
            blocks[k].append((off, b, d))
            off += b * d
        if uncovered:
            off += 7  # a block no slot covers
    payload = cancelling_rows(off, 1, 0).reshape(-1)
    weights = [torch.randn(b, d, generator=g) for d in dims]
    grads = []
    for fn in (_views_unpack, ReductionBased.unpack_flat):
        leaf = payload.clone().requires_grad_(True)
        outs = fn(leaf, blocks)
        sum((o * w).sum() for o, w in zip(outs, weights)).backward()
        grads.append(([o.detach() for o in outs], leaf.grad))
    (o_ref, g_ref), (o_new, g_new) = grads
    for a, c in zip(o_ref, o_new):
        assert torch.equal(a, c)
    assert torch.equal(g_ref, g_new)
    # negative controls: the same checks catch a gradient sent to another slot's blocks (slots 0 and 2 share a
    # dim) and partial sums added in another rank order
    from nestpipe.trainer.embedding.reduction_based import _FlatUnpack

    class SwappedBackward(_FlatUnpack):
        @staticmethod
        def backward(ctx, *grads):
            ctx.blocks = [ctx.blocks[2], ctx.blocks[1], ctx.blocks[0]]
            return _FlatUnpack.backward(ctx, *grads)

    leaf = payload.clone().requires_grad_(True)
    outs = SwappedBackward.apply(leaf, blocks)
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()
    assert not torch.equal(leaf.grad, g_ref)
    outs = ReductionBased.unpack_flat(payload, [bl[::-1] for bl in blocks])
    assert not all(torch.equal(a, c) for a, c in zip(o_ref, outs))
