"""nestpipe.kernels on CPU: placement, routing (fbgemm), and the Numba fast paths against the torch references."""

import math
import platform
import random

import numba
import numpy as np
import pytest
import torch

from nestpipe import kernels
from nestpipe.kernels import reference, routing, row_placement
from nestpipe.utils import hashing

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
EXTREMES = [I64_MIN, I64_MIN + 1, -1, 0, 1, 2**31 - 1, 2**31, 2**62, I64_MAX - 1, I64_MAX]


@pytest.fixture(autouse=True, scope="module")
def _fast_paths_active():
    # The tests below claim to test these paths: fail (not skip) when an extra is missing.
    assert kernels.select_path("route_keys", "cpu") == "fbgemm", "fbgemm-gpu-cpu is not installed"
    for op in ("lookup", "adagrad_update", "dual_buffer_sync"):
        assert kernels.select_path(op, "cpu") == "numba", "numba is not installed"


# ---------------------------------------------------------------- placement


def _placement_int(table_id, x, vocab, world):
    """Pure Python-int placement: the specification the tensor code must match."""
    x = x if 0 <= x < vocab else row_placement.splitmix64_int(x) % vocab
    a, b = row_placement.affine_params(table_id, vocab)
    p = (a * x + b) % vocab
    block = -(-vocab // world)
    return p // block, p % block


def test_splitmix64_matches_python_ints_at_extremes():
    ids = EXTREMES + [random.Random(0).randrange(I64_MIN, I64_MAX) for _ in range(200)]
    got = row_placement.splitmix64(torch.tensor(ids, dtype=torch.int64)).tolist()
    assert got == [hashing.signed64(hashing.splitmix64_int(x)) for x in ids]


@pytest.mark.parametrize("vocab", [1, 2, 7, 1000, 32_000_000, 2**40 + 15, 2**52])
@pytest.mark.parametrize("world", [1, 3, 8])
def test_placement_matches_python_ints(vocab, world):
    rng = random.Random(vocab + world)
    ids = EXTREMES + [vocab - 1, vocab, vocab + 1] + [rng.randrange(I64_MIN, I64_MAX) for _ in range(100)]
    ids += [rng.randrange(0, vocab) for _ in range(100)]
    owner, local = kernels.placement(5, torch.tensor(ids, dtype=torch.int64), vocab, world)
    expect = [_placement_int(5, x, vocab, world) for x in ids]
    assert list(zip(owner.tolist(), local.tolist())) == expect
    assert all(0 <= o < world and 0 <= r < kernels.owner_num_rows(vocab, world, o) for o, r in expect)


@pytest.mark.parametrize("vocab", [1, 2, 12, 97, 1024, 5000])
def test_placement_hash_is_a_bijection(vocab):
    for table in (0, 3):
        a, _ = kernels.affine_params(table, vocab)
        assert math.gcd(a, vocab) == 1
        p = kernels.placement_hash(table, torch.arange(vocab), vocab)
        assert torch.equal(torch.sort(p).values, torch.arange(vocab))
    # negative control: distinct tables permute differently (when there is room to)
    if vocab > 2:
        ids = torch.arange(vocab)
        assert not torch.equal(kernels.placement_hash(0, ids, vocab), kernels.placement_hash(3, ids, vocab))


def test_owner_rows_cover_the_vocabulary():
    for vocab, world in [(5, 4), (10, 3), (1, 8), (32, 32), (33, 32)]:
        assert sum(kernels.owner_num_rows(vocab, world, r) for r in range(world)) == vocab


def test_placement_rejects_bad_sizes():
    with pytest.raises(ValueError):
        kernels.placement(0, torch.tensor([1]), 0, 2)
    with pytest.raises(ValueError):
        kernels.placement(0, torch.tensor([1]), 2**53, 2)
    with pytest.raises(ValueError):
        kernels.placement(0, torch.tensor([1]), 10, 0)


# ---------------------------------------------------------------- routing


def _batch(seed, n, tables, vocabs, hot=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, n + 1, (tables,), generator=g).tolist()
    parts = []
    for t, length in enumerate(lengths):
        if hot:
            parts.append(torch.full((length,), 7, dtype=torch.int64))
        else:
            parts.append(torch.randint(-vocabs[t], 2 * vocabs[t], (length,), generator=g))
    return torch.cat(parts), lengths


ROUTING_CASES = [
    # (seed, n, vocabs, world, hot)
    (0, 300, [1000, 50, 7], 4, False),
    (1, 200, [100_000], 8, False),
    (2, 100, [10, 10], 1, False),  # single owner
    (3, 100, [5, 3], 8, False),  # more owners than rows
    (4, 100, [1000, 1000], 4, True),  # all keys duplicated
    (5, 0, [100, 100], 4, False),  # empty batch
]


@pytest.mark.parametrize("seed,n,vocabs,world,hot", ROUTING_CASES)
def test_routing_fbgemm_equals_reference_and_is_consistent(seed, n, vocabs, world, hot):
    ids, lengths = _batch(seed, n, len(vocabs), vocabs, hot)
    fast = kernels.route_keys(ids, vocabs, world, table_lengths=lengths)
    ref = routing.route(ids, lengths, vocabs, world, None, use_fbgemm=False)
    for name in ("unique_keys", "unique_offsets", "inverse", "send_rows", "send_lengths", "unbucketize_permute"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    assert fast.send_splits == ref.send_splits and sum(fast.send_splits) == fast.unique_keys.numel()
    # Semantics: owners answer in the order received; unpermuting gives each unique key its own (owner, row).
    start, expect = 0, []
    for t, length in enumerate(lengths):
        for x in ids[start : start + length].tolist():
            expect.append((t,) + _placement_int(t, x, vocabs[t], world))
        start += length
    owner_of_slot = torch.repeat_interleave(torch.arange(world), torch.tensor(fast.send_splits, dtype=torch.int64))
    table_of_slot = torch.repeat_interleave(
        torch.arange(len(vocabs)).repeat(world), fast.send_lengths.reshape(-1)
    )
    slot = fast.unbucketize_permute[fast.inverse]
    got = list(zip(table_of_slot[slot].tolist(), owner_of_slot[slot].tolist(), fast.send_rows[slot].tolist()))
    assert got == expect


def test_routing_permutation_is_not_trivial():
    # negative control for the test above: with several tables and owners the permutation really reorders keys
    ids, lengths = _batch(0, 300, 3, [1000, 50, 7])
    r = kernels.route_keys(ids, [1000, 50, 7], 4, table_lengths=lengths)
    assert not torch.equal(r.unbucketize_permute, torch.arange(r.unbucketize_permute.numel()))


def test_routing_int64_extremes_and_errors():
    ids = torch.tensor(EXTREMES * 3, dtype=torch.int64)
    r = kernels.route_keys(ids, 2**52, 16)
    assert r.unique_keys.numel() == len(set(kernels.placement_hash(0, ids, 2**52).tolist()))
    with pytest.raises(ValueError):
        kernels.route_keys(ids, [10, 10], 2, table_lengths=[1, 2])
    with pytest.raises(ValueError):
        kernels.route_keys(ids.float(), 10, 2)


# ---------------------------------------------------------------- gather, AdaGrad, sync


def _store(rows, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, dim, generator=g), torch.rand(rows, generator=g)


@pytest.mark.parametrize("dim", [1, 3, 64, 67])
def test_gather_rows_exact(dim):
    w, _ = _store(500, dim)
    for rows in (torch.randint(0, 500, (300,)), torch.zeros(50, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)):
        assert torch.equal(kernels.gather_rows(w, rows), reference.gather_rows(w, rows))
    out = torch.empty(10, dim)
    assert kernels.gather_rows(w, torch.arange(10), out).data_ptr() == out.data_ptr()
    assert torch.equal(out, w[:10])
    assert torch.equal(kernels.gather_to_device(w, torch.arange(4), "cpu"), w[:4])


@pytest.mark.parametrize("dim,n,momentum", [(64, 300, 1.0), (3, 100, 1.0), (67, 400, 4.0), (8, 1, 1.0), (8, 0, 1.0)])
def test_adagrad_matches_reference(dim, n, momentum):
    w, s = _store(1000, dim)
    rows = torch.randperm(1000)[:n]
    grads = torch.randn(n, dim) * 3
    w_ref, s_ref = w.clone(), s.clone()
    reference.adagrad_update(w_ref, s_ref, rows, grads, 0.05, 1e-8, momentum)
    kernels.adagrad_update(w, s, rows, grads, 0.05, 1e-8, momentum)
    torch.testing.assert_close(s, s_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-6)
    untouched = torch.ones(1000, dtype=torch.bool)
    untouched[rows] = False
    w0, s0 = _store(1000, dim)
    assert torch.equal(w[untouched], w0[untouched]) and torch.equal(s[untouched], s0[untouched])
    if n:
        assert not torch.equal(w[rows], w0[rows])


def _segments(n_rows, n_entries, seed):
    """(inv, order, offsets): entries assigned to rows (some rows with none), grouped by row in entry order."""
    g = torch.Generator().manual_seed(seed)
    inv = torch.randint(0, max(n_rows, 1), (n_entries,), generator=g) if n_rows else torch.zeros(0, dtype=torch.int64)
    order = torch.from_numpy(np.argsort(inv.numpy(), kind="stable"))
    offsets = torch.zeros(n_rows + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.bincount(inv, minlength=n_rows), 0)
    return inv, order, offsets


@pytest.mark.parametrize("dim,n,m,momentum", [(64, 300, 700, 1.0), (3, 50, 50, 4.0), (67, 10, 400, 1.0),
                                              (8, 1, 30, 1.0), (8, 0, 0, 1.0), (16, 40, 20, 1.0)])
def test_adagrad_grad_segments(dim, n, m, momentum, monkeypatch):
    # per-entry gradients summed per row inside the update == index_add_ into zeros, then the plain update
    w, s = _store(1000, dim)
    rows = torch.randperm(1000)[:n]
    inv, order, offsets = _segments(n, m, seed=dim + n)
    grads = torch.randn(m, dim) * 3
    row_grads = torch.zeros(n, dim).index_add_(0, inv, grads)
    w_plain, s_plain = w.clone(), s.clone()
    kernels.adagrad_update(w_plain, s_plain, rows, row_grads, 0.05, 1e-8, momentum)
    w_ref, s_ref = w.clone(), s.clone()
    reference.adagrad_update(w_ref, s_ref, rows, row_grads, 0.05, 1e-8, momentum)
    kernels.adagrad_update(w, s, rows, grads, 0.05, 1e-8, momentum, grad_segments=(order, offsets))
    # same sums in the same order, same update loop: bitwise equal to the numba path on summed gradients
    assert torch.equal(w, w_plain) and torch.equal(s, s_plain)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s, s_ref, atol=1e-6, rtol=1e-6)
    # the reference path of the segmented form agrees too
    monkeypatch.setenv("NESTPIPE_KERNELS", "reference")
    w2, s2 = _store(1000, dim)
    kernels.adagrad_update(w2, s2, rows, grads, 0.05, 1e-8, momentum, grad_segments=(order, offsets))
    torch.testing.assert_close(w2, w_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s2, s_ref, atol=1e-6, rtol=1e-6)


def test_adagrad_grad_segments_order_matters():
    # negative control: a different summation order of the same entries changes bits for some row
    dim, n, m = 64, 5, 400
    w, s = _store(100, dim)
    rows = torch.arange(n)
    inv, order, offsets = _segments(n, m, seed=1)
    grads = torch.randn(m, dim) * torch.logspace(-4, 4, m).unsqueeze(1)
    w2, s2 = w.clone(), s.clone()
    kernels.adagrad_update(w, s, rows, grads, 0.05, grad_segments=(order, offsets))
    rev = torch.cat([order[offsets[i]:offsets[i + 1]].flip(0) for i in range(n)])
    kernels.adagrad_update(w2, s2, rows, grads, 0.05, grad_segments=(rev, offsets))
    assert not torch.equal(w, w2)
    torch.testing.assert_close(w, w2, atol=1e-5, rtol=1e-5)


def test_adagrad_grad_segments_rejects_bad_input():
    w, s = _store(10, 4)
    grads = torch.randn(5, 4)
    for order, offsets in ((torch.arange(5), torch.tensor([0, 2, 4])),   # offsets end before len(order)
                           (torch.arange(5), torch.tensor([0, 3, 2, 5])),  # not ascending
                           (torch.tensor([0, 1, 2, 3, 9]), torch.tensor([0, 2, 3, 5]))):  # order out of range
        with pytest.raises(ValueError):
            kernels.adagrad_update(w, s, torch.arange(3), grads, 0.1, grad_segments=(order, offsets))


def test_adagrad_formula_is_discriminating():
    # negative control: eps inside the square root (the other common placement) must fail the comparison
    w, s = _store(100, 16)
    rows, grads, lr, eps = torch.arange(10), torch.randn(10, 16), 0.1, 0.5
    kernels.adagrad_update(w, s, rows, grads, lr, eps)
    w0, s0 = _store(100, 16)
    s_new = s0[rows] + grads.pow(2).mean(1)
    other = w0[rows] - (lr / torch.sqrt(s_new + eps)).unsqueeze(1) * grads
    assert (w[rows] - other).abs().max() > 1e-3
    expect = w0[rows] - (lr / (torch.sqrt(s_new) + eps)).unsqueeze(1) * grads
    torch.testing.assert_close(w[rows], expect, atol=1e-6, rtol=1e-6)


def test_adagrad_rejects_bad_input():
    w, s = _store(10, 4)
    with pytest.raises(ValueError):
        kernels.adagrad_update(w, s, torch.arange(3), torch.randn(3, 5), 0.1)
    with pytest.raises(ValueError):
        kernels.adagrad_update(w.double(), s, torch.arange(3), torch.randn(3, 4), 0.1)
    with pytest.raises(ValueError):
        reference.adagrad_update(w, s, torch.tensor([1, 1]), torch.randn(2, 4), 0.1, 1e-8)


def test_adagrad_prefetch_distance_changes_nothing(monkeypatch):
    # the public path runs the prefetching loop (distance > 0) ...
    from nestpipe.kernels import cpu

    seen = []
    original = cpu._adagrad
    monkeypatch.setattr(cpu, "_adagrad", lambda *a: (seen.append(a[-1]), original(*a))[1])
    w, s = _store(1000, 64)
    rows, grads = torch.randperm(1000)[:300], torch.randn(300, 64)
    kernels.adagrad_update(w, s, rows, grads, 0.05)
    assert seen == [cpu.PREFETCH_DISTANCE] and cpu.PREFETCH_DISTANCE > 0
    # ... and prefetching is only a hint: every distance (none, short, beyond the batch) gives the same bits
    for distance in (0, 1, 16, 10_000):
        w2, s2 = _store(1000, 64)
        original(w2.numpy(), s2.numpy(), rows.numpy(), grads.numpy(), np.float32(0.05), np.float32(1e-8),
                 np.float32(1.0), False, distance)
        assert torch.equal(w2, w) and torch.equal(s2, s)


@pytest.mark.parametrize("distance", [0, 3, 16, 10_000])
def test_numba_gather_loop_exact(distance):
    from nestpipe.kernels import cpu

    w, _ = _store(500, 67)
    for rows in (torch.randint(0, 500, (300,)), torch.tensor([499, 0, 499]), torch.zeros(0, dtype=torch.int64)):
        out = torch.empty(rows.numel(), 67)
        cpu._gather(w.numpy(), rows.numpy(), out.numpy(), distance)
        assert torch.equal(out, w.index_select(0, rows))


def test_prefetch_is_compiled_into_the_row_loops():
    # Cached code cannot be inspected: compile uncached copies and look for the x86 prefetch instruction.
    from nestpipe.kernels import cpu

    if not any(m in platform.machine().lower() for m in ("x86", "amd64")):
        pytest.skip("checks x86 assembly")
    w, s, rows = np.ones((50, 8), np.float32), np.ones(50, np.float32), np.arange(40)
    f32 = np.float32
    cases = [
        (cpu._adagrad, (w, s, rows, np.ones((40, 8), np.float32), f32(0.1), f32(1e-8), f32(1.0), False, 16), True),
        (cpu._gather, (w, rows, np.empty((40, 8), np.float32), 16), True),
        (cpu._take, (np.arange(5), np.array([1, 2]), np.empty(2, np.int64)), False),  # negative control
    ]
    for kernel, args, expect in cases:
        copy = numba.njit(parallel=True, nogil=True)(kernel.py_func)
        copy(*args)
        assert ("prefetcht0" in "".join(copy.inspect_asm().values())) is expect, kernel.__name__


def test_reference_adagrad_unchecked_equals_checked():
    w, s = _store(100, 8)
    rows, grads = torch.randperm(100)[:30], torch.randn(30, 8)
    w2, s2 = w.clone(), s.clone()
    reference.adagrad_update(w, s, rows, grads, 0.1, 1e-8)
    reference.adagrad_update(w2, s2, rows, grads, 0.1, 1e-8, check_distinct=False)
    assert torch.equal(w, w2) and torch.equal(s, s2)


def _sorted_keys(n, high, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.unique(torch.randint(0, high, (n,), generator=g))


SYNC_CASES = [
    lambda: (_sorted_keys(400, 1000, 1), _sorted_keys(400, 1000, 2)),  # partial overlap
    lambda: (_sorted_keys(300, 1000, 1),) * 2,  # full overlap
    lambda: (_sorted_keys(20000, 40000, 3), _sorted_keys(20000, 40000, 4)),  # several merge chunks
    lambda: (torch.arange(0, 100, 2), torch.arange(1, 100, 2)),  # none
    lambda: (torch.zeros(0, dtype=torch.int64), torch.arange(5)),  # empty
    lambda: (torch.tensor([I64_MIN, -1, 0, I64_MAX]), torch.tensor([I64_MIN, 5, I64_MAX])),  # extremes
]


@pytest.mark.parametrize("case", range(len(SYNC_CASES)))
@pytest.mark.parametrize("dim", [3, 64])
def test_dual_buffer_sync_exact(case, dim):
    a_keys, p_keys = SYNC_CASES[case]()
    active = torch.randn(a_keys.numel(), dim)
    prefetch = torch.randn(p_keys.numel(), dim)
    expect = prefetch.clone()
    n_ref = reference.dual_buffer_sync(a_keys, active, p_keys, expect)
    from nestpipe.kernels import cpu

    assert cpu.dual_buffer_sync(a_keys, active, p_keys, prefetch) == n_ref
    assert torch.equal(prefetch, expect)
    assert n_ref == len(set(a_keys.tolist()) & set(p_keys.tolist()))


@pytest.mark.parametrize("case", range(len(SYNC_CASES) - 1))  # local rows: no negative keys
@pytest.mark.parametrize("from_store", [False, True])
def test_dual_buffer_sync_rows_exact(case, from_store):
    a_keys, p_keys = SYNC_CASES[case]()
    g = torch.Generator().manual_seed(case)
    n_src = int(max(a_keys.max().item() if a_keys.numel() else 0, p_keys.max().item())) + 1 if from_store \
        else a_keys.numel()
    src_w, src_s = torch.randn(n_src, 5, generator=g), torch.rand(n_src, generator=g)
    dst_w, dst_s = torch.randn(p_keys.numel(), 5, generator=g), torch.rand(p_keys.numel(), generator=g)
    ew, es = dst_w.clone(), dst_s.clone()
    n_ref = reference.dual_buffer_sync_rows(a_keys, p_keys, src_w, src_s, ew, es, from_store)
    from nestpipe.kernels import cpu

    assert kernels.select_path("dual_buffer_sync", "cpu") == "numba"
    ww = dst_w.clone()  # weights only (the state stays where it is)
    assert cpu.dual_buffer_sync_rows(a_keys, p_keys, src_w, src_s, ww, None, from_store) == n_ref
    assert torch.equal(ww, ew)
    assert cpu.dual_buffer_sync_rows(a_keys, p_keys, src_w, src_s, dst_w, dst_s, from_store) == n_ref
    assert torch.equal(dst_w, ew) and torch.equal(dst_s, es)
    assert n_ref == len(set(a_keys.tolist()) & set(p_keys.tolist()))
    if from_store and n_ref and case == 0:
        # negative control: reading the active buffer's layout (row i) instead of the store's (row = key) differs
        bw, bs = dst_w.clone(), dst_s.clone()
        reference.dual_buffer_sync_rows(a_keys, p_keys, src_w, src_s, bw, bs, False)
        assert not torch.equal(bw, dst_w)


# ---------------------------------------------------------------- lookups


def _lookup_case(seed, num_rows, n, dim, bags):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_rows, dim, generator=g)
    inverse = torch.randint(0, max(1, num_rows), (n,), generator=g) if num_rows else torch.zeros(0, dtype=torch.int64)
    cuts = torch.sort(torch.randint(0, n + 1, (bags - 1,), generator=g)).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([n])])
    return rows, inverse, offsets


LOOKUP_CASES = [(0, 50, 400, 64, 20), (1, 7, 300, 3, 5), (2, 1, 200, 5, 3), (3, 10, 0, 8, 4), (4, 0, 0, 8, 1)]


def _run(fn, rows, *args):
    rows = rows.clone().requires_grad_(True)
    out = fn(rows, *args)
    g = torch.Generator().manual_seed(9)
    out.backward(torch.randn(out.shape, generator=g))
    return out.detach(), rows.grad


@pytest.mark.parametrize("case", LOOKUP_CASES)
def test_sequence_lookup_matches_reference(case):
    rows, inverse, _ = _lookup_case(*case)
    out, grad = _run(kernels.sequence_lookup, rows, inverse)
    out_ref, grad_ref = _run(lambda r, i: reference.sequence_lookup(r, i), rows, inverse)
    assert torch.equal(out, out_ref)
    torch.testing.assert_close(grad, grad_ref, atol=1e-6, rtol=1e-6)
    # against plain autograd of index_select, too
    _, grad_autograd = _run(lambda r, i: r.index_select(0, i), rows, inverse)
    torch.testing.assert_close(grad, grad_autograd, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", LOOKUP_CASES)
def test_pooled_lookup_matches_reference(case):
    rows, inverse, offsets = _lookup_case(*case)
    out, grad = _run(kernels.pooled_lookup, rows, inverse, offsets)
    out_ref, grad_ref = _run(lambda r, i, o: reference.pooled_lookup(r, i, o).requires_grad_(), rows, inverse, offsets)
    torch.testing.assert_close(out, out_ref, atol=1e-6, rtol=1e-6)
    bags = reference.bag_of_token(offsets)
    g = torch.Generator().manual_seed(9)
    grad_out = torch.randn(offsets.numel() - 1, rows.shape[1], generator=g)
    torch.testing.assert_close(grad, reference.pooled_lookup_backward(grad_out, inverse, offsets, rows.shape[0]),
                               atol=1e-6, rtol=1e-6)
    emb = torch.nn.functional.embedding_bag(inverse, rows, offsets[:-1], mode="sum") if inverse.numel() else None
    if emb is not None:
        torch.testing.assert_close(out, emb, atol=1e-5, rtol=1e-5)
    assert bags.numel() == inverse.numel()


def test_lookup_backward_is_bitwise_reproducible_across_threads():
    rows, inverse, offsets = _lookup_case(0, 20, 5000, 64, 100)  # heavy duplication
    results = []
    threads = numba.get_num_threads()
    try:
        for n_threads in (1, threads, 1):
            numba.set_num_threads(n_threads)
            results.append(_run(kernels.sequence_lookup, rows, inverse)[1])
            results.append(_run(kernels.pooled_lookup, rows, inverse, offsets)[1])
    finally:
        numba.set_num_threads(threads)
    for a, b in zip(results[::2], results[2::2]):
        assert torch.equal(a, b)
    # and equal to the serial reference bit for bit (both add in ascending token order)
    assert torch.equal(results[0], reference.sequence_lookup_backward(_run_grad_out(rows, inverse), inverse, 20))


def _run_grad_out(rows, inverse):
    g = torch.Generator().manual_seed(9)
    return torch.randn(inverse.numel(), rows.shape[1], generator=g)


def test_forced_reference_path(monkeypatch):
    monkeypatch.setenv("NESTPIPE_KERNELS", "reference")
    assert set(kernels.kernel_paths("cpu").values()) == {"reference"}
    monkeypatch.setenv("NESTPIPE_KERNELS", "fast")
    with pytest.raises(ValueError):
        kernels.select_path("lookup", "cpu")


def test_pooled_owner_update_rule_follows_the_instruction_set(monkeypatch):
    # fbgemm's TBE backward on AVX-512 hosts, the Numba kernel (bitwise the same arithmetic) below AVX-512
    from nestpipe.kernels import select

    monkeypatch.setattr(select, "cpu_has_avx512", lambda: True)
    assert kernels.select_path("adagrad_bags", "cpu") == "fbgemm"
    monkeypatch.setattr(select, "cpu_has_avx512", lambda: False)
    assert kernels.select_path("adagrad_bags", "cpu") == "numba"
    assert kernels.select_path("adagrad_bags", "cuda") == "reference"  # no device kernel: the entry update runs


def test_per_op_overrides_environment_and_block(monkeypatch):
    rule = kernels.kernel_paths("cpu")
    assert rule["adagrad_update"] == "numba"
    monkeypatch.setenv("NESTPIPE_KERNELS", "adagrad_update:reference,dual_buffer_sync:triton")
    got = kernels.kernel_paths("cpu")
    assert got["adagrad_update"] == "reference" and got["dual_buffer_sync"] == "triton"
    assert {op: p for op, p in got.items() if op not in ("adagrad_update", "dual_buffer_sync")} == \
        {op: p for op, p in rule.items() if op not in ("adagrad_update", "dual_buffer_sync")}
    with kernels.forced({"adagrad_update": "numba"}):  # the block wins over the environment, then is undone
        assert kernels.select_path("adagrad_update", "cpu") == "numba"
    assert kernels.select_path("adagrad_update", "cpu") == "reference"
    # the forced path is the one that runs (noted at the call); the two paths agree to float32 rounding (the
    # reference's vectorised sum of squares adds in another order than the Numba row loop)
    w, st = torch.randn(30, 8), torch.rand(30)
    rows, g = torch.tensor([1, 5, 7]), torch.randn(3, 8)
    outs = []
    for path in ("reference", "numba"):
        kernels.reset_taken()
        a, b = w.clone(), st.clone()
        with kernels.forced(f"adagrad_update:{path}"):
            kernels.adagrad_update(a, b, rows, g, 0.1)
        assert kernels.taken_paths() == {"adagrad_update": {path: 1}}
        outs.append(a)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-7)
    assert not torch.equal(outs[0], w)
    for bad in ("adagrad_update", "nope:numba", "lookup:fast"):
        monkeypatch.setenv("NESTPIPE_KERNELS", bad)
        with pytest.raises(ValueError, match="NESTPIPE_KERNELS"):
            kernels.select_path("lookup", "cpu")
    kernels.reset_taken()


def test_paths_are_noted_at_the_call(monkeypatch):
    """``taken_paths`` lists what ran, noted inside each op: not the rule's table of what could run."""
    src = torch.randn(10, 4)
    out = torch.zeros(12)
    idx, off = torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3])
    kernels.reset_taken()
    kernels.pool_segments(src, idx, off, out, torch.tensor([0, 4]))
    assert kernels.taken_paths() == {"pool_segments": {"aten": 1}}
    monkeypatch.setenv("NESTPIPE_KERNELS", "reference")
    kernels.pool_segments(src, idx, off, out, torch.tensor([0, 4]))
    kernels.dedup_rows(np.array([3, 1, 3]), 5)
    assert kernels.taken_paths() == {"dedup_rows": {"reference": 1}, "pool_segments": {"aten": 1, "reference": 1}}
    # negative control: the rule's table names ops nothing here called
    assert set(kernels.kernel_paths("cpu")) - set(kernels.taken_paths())
    kernels.reset_taken()
    assert kernels.taken_paths() == {}


def test_kernels_info_cli(capsys):
    import json

    from nestpipe.cli import main

    assert main(["kernels-info", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["paths"] == kernels.kernel_paths("cpu") and record["paths"]["adagrad_update"] == "numba"


def test_serial_and_parallel_segment_adagrad_are_bitwise_equal():
    """The serial twin (used at one intra-op thread, inside the pipeline's stage threads) computes exactly what
    the parallel loop computes."""
    from nestpipe.kernels import cpu

    g = torch.Generator().manual_seed(5)
    rows_n, dim, entries = 500, 12, 3000
    inv = torch.randint(0, rows_n, (entries,), generator=g)
    order = torch.argsort(inv, stable=True)
    touched, counts = torch.unique(inv, return_counts=True)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    grads = torch.randn(entries, dim, generator=g)
    outs = []
    for fn in (cpu._adagrad_segments, cpu._adagrad_segments_serial):
        w = torch.randn(rows_n, dim, generator=torch.Generator().manual_seed(1))
        s = torch.rand(rows_n, generator=torch.Generator().manual_seed(2))
        fn(w.numpy(), s.numpy(), touched.numpy(), grads.numpy(), order.numpy(), offsets.numpy(),
           np.float32(0.05), np.float32(1e-8), np.float32(2.0), True, 16)
        outs.append((w, s))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][0], torch.randn(rows_n, dim, generator=torch.Generator().manual_seed(1)))


def _pairs_case(seed, n_rows=40, n_entries=120, n_pairs=400, dim=64, src_rows=50):
    """A flat gradient source, per-entry pairs (entries with 0, 1 and many pairs) and entries grouped by row."""
    g = torch.Generator().manual_seed(seed)
    src = (torch.randn(src_rows * dim, generator=g) * torch.logspace(-3, 3, src_rows * dim)[torch.randperm(
        src_rows * dim, generator=g)]).float()
    pair_entry = torch.randint(0, n_entries, (n_pairs,), generator=g)
    pair_src = torch.randint(0, src_rows, (n_pairs,), generator=g) * dim
    inv, order, offsets = _segments(n_rows, n_entries, seed)
    return src, pair_entry, pair_src, inv, order, offsets


@pytest.mark.parametrize("seed,momentum", [(0, 1.0), (1, 4.0)])
def test_adagrad_grad_pairs_bitwise_equals_two_level_index_add(seed, momentum):
    """grad_pairs: per-entry sums (pairs in order) then per-row sums (entries in order), both from zero, inside
    the update == index_add_ into zeroed per-entry gradients, then the grad_segments update (bitwise); the serial
    and parallel twins agree; another pair order gives other bits (negative control)."""
    from nestpipe.kernels import cpu

    dim = 64
    src, pair_entry, pair_src, inv, order, offsets = _pairs_case(seed, dim=dim)
    n_rows, n_entries = offsets.numel() - 1, inv.numel()
    p_order, entry_offsets = cpu.csr_by_segment(pair_entry, n_entries)
    ps = pair_src[p_order]
    windows = src.as_strided((src.numel() - dim + 1, dim), (1, 1))
    grad_entries = torch.zeros(n_entries, dim).index_add_(0, pair_entry, windows[pair_src])
    rows = torch.randperm(1000)[:n_rows]
    w0, s0 = _store(1000, dim)
    w_ref, s_ref = w0.clone(), s0.clone()
    kernels.adagrad_update(w_ref, s_ref, rows, grad_entries, 0.05, 1e-8, momentum, grad_segments=(order, offsets))
    w, s = w0.clone(), s0.clone()
    kernels.adagrad_update(w, s, rows, src, 0.05, 1e-8, momentum, grad_segments=(order, offsets),
                     grad_pairs=(entry_offsets, ps))
    assert torch.equal(w, w_ref) and torch.equal(s, s_ref) and not torch.equal(w, w0)
    old = torch.get_num_threads()
    for threads in (1, 2):  # the serial twin at 1 thread, the parallel loop at 2
        torch.set_num_threads(threads)
        try:
            w2, s2 = w0.clone(), s0.clone()
            kernels.adagrad_update(w2, s2, rows, src, 0.05, 1e-8, momentum, grad_segments=(order, offsets),
                             grad_pairs=(entry_offsets, ps))
        finally:
            torch.set_num_threads(old)
        assert torch.equal(w2, w_ref) and torch.equal(s2, s_ref)
    # negative control: every entry's pairs reversed -> other bits for some row
    rev = torch.cat([ps[entry_offsets[e]:entry_offsets[e + 1]].flip(0) for e in range(n_entries)])
    w3, s3 = w0.clone(), s0.clone()
    kernels.adagrad_update(w3, s3, rows, src, 0.05, 1e-8, momentum, grad_segments=(order, offsets),
                     grad_pairs=(entry_offsets, rev))
    assert not torch.equal(w3, w_ref)


def test_adagrad_grad_pairs_rejects_bad_input():
    w, s = _store(10, 4)
    order, offsets = torch.arange(3), torch.tensor([0, 1, 3])
    for eo, ps in ((torch.tensor([0, 1, 2, 4]), torch.tensor([0, 4, 8])),       # offsets end past len(pair_src)
                   (torch.tensor([0, 1, 2, 3]), torch.tensor([0, 4, 18]))):     # a pair row past the source
        with pytest.raises(ValueError):
            kernels.adagrad_update(w, s, torch.arange(2), torch.randn(20), 0.1, grad_segments=(order, offsets),
                             grad_pairs=(eo, ps))


@pytest.mark.parametrize("layout", ["scattered", "runs", "runs-unaligned"])
@pytest.mark.parametrize("threads", [1, 2])
def test_pool_segments_bitwise_equals_index_add(threads, layout, monkeypatch):
    """pool_segments: ordered segment sums into a flat payload at given offsets (scattered, or in runs of segments
    laid out back to back as a payload's blocks are; on rows of the payload or, as after a block of another row
    width, off them) == zeros.index_add_ per segment (bitwise), copies == index_select; the reference path agrees;
    reversed pair order differs (negative control)."""
    g = torch.Generator().manual_seed(7)
    dim, n_seg, n_pairs = 64, 30, 600
    src = torch.randn(200, dim, generator=g) * torch.logspace(-3, 4, 200).unsqueeze(1)
    seg = torch.sort(torch.randint(0, n_seg, (n_pairs,), generator=g)).values
    index = torch.randint(0, 200, (n_pairs,), generator=g)
    offsets = torch.zeros(n_seg + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.bincount(seg, minlength=n_seg), 0)
    out_offsets = torch.randperm(n_seg + 5, generator=g)[:n_seg] * dim
    if layout.startswith("runs"):  # three blocks of consecutive segments with gaps between them
        out_offsets = torch.cat([torch.arange(0, 10), torch.arange(12, 22), torch.arange(25, 35)]) * dim
        out_offsets += 5 if layout == "runs-unaligned" else 0
    expect = torch.zeros(n_seg, dim).index_add_(0, seg, src[index])
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full(((n_seg + 6) * dim,), float("nan"))
        kernels.pool_segments(src, index, offsets, out, out_offsets)
        copy = torch.full(((n_seg + 6) * dim,), float("nan"))
        kernels.pool_segments(src, index[:n_seg], None, copy, out_offsets)
    finally:
        torch.set_num_threads(old)
    at = out_offsets[:, None] + torch.arange(dim)
    assert torch.equal(out[at], expect)
    assert torch.equal(copy[at], src[index[:n_seg]])
    monkeypatch.setenv("NESTPIPE_KERNELS", "reference")
    ref = torch.zeros((n_seg + 6) * dim)
    kernels.pool_segments(src, index, offsets, ref, out_offsets)
    assert torch.equal(ref[at], expect)
    monkeypatch.delenv("NESTPIPE_KERNELS")
    flipped = torch.cat([index[offsets[s]:offsets[s + 1]].flip(0) for s in range(n_seg)])
    other = torch.zeros((n_seg + 6) * dim)
    kernels.pool_segments(src, flipped, offsets, other, out_offsets)
    assert not torch.equal(other[at], expect)


@pytest.mark.parametrize("n,num_rows", [(0, 5), (1, 5), (10, 10), (500, 100), (3000, 100_000)])
def test_dedup_rows_equals_stable_argsort(n, num_rows):
    """The owner's fused dedup gives, array for array, the stable-argsort formulation's order, distinct rows, run
    starts and inverses (the update sums each row's entries in that order)."""
    from nestpipe.kernels import cpu

    rows = np.random.default_rng(n).integers(0, num_rows, n).astype(np.int64)
    got = cpu.dedup_rows(rows, num_rows)
    for a, b in zip(reference.dedup_rows(rows), got):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    # negative control: a valid but unstable sort (each row's positions descending) is caught by the same check
    if n >= 500:
        bad = np.lexsort((-np.arange(n), rows))
        assert np.array_equal(rows[bad], rows[got[0]]) and not np.array_equal(bad, got[0])


@pytest.mark.parametrize("case", ["valid", "int32", "empty_micro_batch", "unsorted_keys", "key_out_of_range",
                                  "value_out_of_range", "uncovered"])
def test_micro_batch_values_equals_numpy(case):
    """The data stage's one-pass kernel gives the NumPy formulation's arrays and status, valid input or not (each
    invalid case has its own status, which prepare_batch turns into its error message)."""
    from nestpipe.kernels import cpu

    rng = np.random.default_rng(7)
    B, U = 40, 50
    lens = rng.integers(0, 6, B)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    inverse = rng.integers(0, U, int(offsets[-1])).astype(np.int32 if case == "int32" else np.int64)
    samples = np.sort(rng.choice(B, 0 if case == "empty_micro_batch" else 17, replace=False)).astype(np.int64)
    keys = reference.micro_batch_values(offsets, samples, inverse, np.arange(U), U)[1]
    keys = np.unique(keys).astype(np.int64)
    expect_status = {"unsorted_keys": 1, "key_out_of_range": 1, "value_out_of_range": 2, "uncovered": 3}.get(case, 0)
    if case == "unsorted_keys":
        keys = keys[::-1].copy()
    elif case == "key_out_of_range":
        keys = np.append(keys, U)
    elif case == "value_out_of_range":
        inverse[offsets[samples[0]]:offsets[samples[0] + 1]] = U
        inverse[offsets[samples[0]]] = U
    elif case == "uncovered":
        keys = keys[1:]
    a = reference.micro_batch_values(offsets, samples, inverse, keys, U)
    b = cpu.micro_batch_values(offsets, samples, inverse, keys, U)
    assert a[5] == b[5] == expect_status
    n = 5 if expect_status == 0 else 3  # value_pos is only meaningful for valid input
    for x, y in zip(a[:n] + (a[4],), b[:n] + (b[4],)):
        assert x.dtype == y.dtype == np.int64 and np.array_equal(x, y)
    if case == "valid":
        assert np.array_equal(keys[a[3]], a[1]) and len(a[1]) == lens[samples].sum() > 0
        assert np.array_equal(inverse[a[4]], a[1]) and np.array_equal(np.bincount(a[2], minlength=17), lens[samples])


def _bags(seed, rows=300, dim=16, n_bags=60, max_len=12):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len, (n_bags,), generator=g)
    offsets = torch.zeros(n_bags + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lens, 0)
    indices = torch.randint(0, rows, (int(offsets[-1]),), generator=g)
    weight = torch.randn(rows, dim, generator=g) * torch.logspace(-3, 2, rows).unsqueeze(1)
    state = torch.rand(rows, generator=g)
    grad = torch.randn(n_bags, dim, generator=g)
    return weight, state, indices, offsets, grad


def _bag_paths():
    paths = ["numba"] if kernels.select.has_numba() else []
    return paths + (["fbgemm"] if kernels.select.has_fbgemm_tbe_cpu() else [])


@pytest.mark.parametrize("path", _bag_paths())
@pytest.mark.parametrize("seed", [0, 1])
def test_adagrad_bags_matches_float64_formula(seed, path, monkeypatch):
    """adagrad_bags (the numba kernel and fbgemm's TBE backward): each row's gradient is the sum of its bags'
    gradients (multiplicity counted) and it is updated once; close to the float64 formula, deterministic, and
    invariant bitwise under a monotone renumbering of the rows (store rows -> buffer positions). The reference path
    agrees within float32 rounding. Negative controls: dropping one occurrence of a row, or the plain formula with a
    row updated once per occurrence, is far from the result."""
    monkeypatch.setenv("NESTPIPE_KERNELS", f"adagrad_bags:{path}")
    weight, state, indices, offsets, grad = _bags(seed)
    w, s = weight.clone(), state.clone()
    kernels.adagrad_bags(w, s, indices, offsets, grad, 0.05, 1e-8)
    bag_of = torch.repeat_interleave(torch.arange(len(offsets) - 1), offsets.diff())
    g64 = torch.zeros(weight.shape, dtype=torch.float64).index_add_(0, indices, grad.double()[bag_of])
    touched = torch.unique(indices)
    s64 = state.double().clone()
    s64[touched] += g64[touched].square().mean(1)
    w64 = weight.double().clone()
    w64[touched] -= (0.05 / (s64[touched].sqrt() + 1e-8)).unsqueeze(1) * g64[touched]
    torch.testing.assert_close(w.double(), w64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.double(), s64, rtol=1e-5, atol=1e-6)
    untouched = torch.ones(len(weight), dtype=torch.bool)
    untouched[touched] = False
    assert torch.equal(w[untouched], weight[untouched]) and torch.equal(s[untouched], state[untouched])
    w2, s2 = weight.clone(), state.clone()
    kernels.adagrad_bags(w2, s2, indices, offsets, grad, 0.05, 1e-8)
    assert torch.equal(w2, w) and torch.equal(s2, s)
    uniq, inv = torch.unique(indices, return_inverse=True)
    wb, sb = weight[uniq].clone(), state[uniq].clone()
    kernels.adagrad_bags(wb, sb, inv, offsets, grad, 0.05, 1e-8)
    assert torch.equal(wb, w[uniq]) and torch.equal(sb, s[uniq])
    monkeypatch.setenv("NESTPIPE_KERNELS", "reference")
    wr, sr = weight.clone(), state.clone()
    kernels.adagrad_bags(wr, sr, indices, offsets, grad, 0.05, 1e-8)
    torch.testing.assert_close(wr, w, rtol=1e-5, atol=1e-6)
    monkeypatch.delenv("NESTPIPE_KERNELS")
    # negative controls
    short = torch.cat([indices[:3], indices[4:]])
    short_off = offsets.clone()
    short_off[short_off > 3] -= 1
    wn, sn = weight.clone(), state.clone()
    kernels.adagrad_bags(wn, sn, short, short_off, grad, 0.05, 1e-8)
    assert not torch.allclose(wn.double(), w64, rtol=1e-5, atol=1e-6)
    wo, so = weight.clone(), state.clone()
    singles = torch.arange(len(indices) + 1)
    kernels.adagrad_bags(wo, so, indices, singles, grad[bag_of], 0.05, 1e-8)  # same row sums, one bag per use
    torch.testing.assert_close(wo.double(), w64, rtol=1e-5, atol=1e-6)
    per_use = weight.double().clone()
    st = state.double().clone()
    for j, r in enumerate(indices.tolist()):
        st[r] += grad.double()[bag_of[j]].square().mean()
        per_use[r] -= 0.05 / (st[r].sqrt() + 1e-8) * grad.double()[bag_of[j]]
    assert not torch.allclose(per_use, w64, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not (kernels.select.has_numba() and kernels.select.has_fbgemm_tbe_cpu()),
                    reason="needs numba and fbgemm_gpu's CPU TBE op")
@pytest.mark.parametrize("rows", [300, 200_000])  # the counting-sort and the merge-sort grouping
def test_adagrad_bags_numba_equals_fbgemm_bitwise(rows):
    """The numba kernel reproduces fbgemm's TBE backward arithmetic bitwise (same grouping order, same 8-lane sum
    of squares), on bags with repeated rows, repeats inside one bag, empty bags and both of its grouping paths.
    Negative control: the same bags summed in the opposite order (bags reversed) is not bitwise equal, so the
    comparison sees a summation-order change."""
    g = torch.Generator().manual_seed(rows)
    n_bags, dim = 600, 24
    lens = torch.randint(0, 12, (n_bags,), generator=g)
    lens[::7] = 0
    offsets = torch.zeros(n_bags + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lens, 0)
    hot = torch.randint(0, rows, (40,), generator=g)  # a few rows repeated across (and within) bags
    indices = hot[torch.randint(0, 40, (int(offsets[-1]),), generator=g)]
    indices[::3] = torch.randint(0, rows, (len(indices[::3]),), generator=g)
    weight = torch.randn(rows, dim, generator=g)
    state = torch.rand(rows, generator=g)
    grad = torch.randn(n_bags, dim, generator=g)

    def run(path, idx, off, gr):
        w, s = weight.clone(), state.clone()
        with kernels.forced({"adagrad_bags": path}):
            kernels.adagrad_bags(w, s, idx, off, gr, 0.05, 1e-8)
        return w, s

    wn, sn = run("numba", indices, offsets, grad)
    wf, sf = run("fbgemm", indices, offsets, grad)
    assert torch.equal(wn, wf) and torch.equal(sn, sf)
    assert not torch.equal(wn, weight)
    # negative control: reversed bag order (the same sums, added in the opposite order)
    bags = [indices[offsets[b]:offsets[b + 1]] for b in range(n_bags)][::-1]
    rev_off = torch.zeros(n_bags + 1, dtype=torch.int64)
    rev_off[1:] = torch.cumsum(torch.tensor([len(b) for b in bags]), 0)
    wr, sr = run("numba", torch.cat(bags), rev_off, grad.flip(0))
    torch.testing.assert_close(wr, wn, rtol=1e-5, atol=1e-5)
    assert not torch.equal(wr, wn)


@pytest.mark.skipif(not kernels.select.has_numba(), reason="numba not installed")
def test_bag_grouping_counting_and_merge_sort_agree():
    """The bag update's grouping of occurrences by row: the counting sort (stores within a multiple of the
    occurrences) and the merge sort (larger stores) give the same rows, starts and bags, each row's occurrences in
    ascending position. Control: a grouping that is not stable (occurrences of a row reversed) differs."""
    from nestpipe.kernels import cpu

    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 6, 300)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    indices = rng.integers(0, 700, offsets[-1]).astype(np.int64)  # repeats across and within bags
    counting = cpu._bag_rows_sorted(indices, offsets, 700)
    merge = cpu._bag_rows_sorted(indices, offsets, 8 * len(indices) + 65537 + 700)  # the merge-sort branch
    bag_of = np.repeat(np.arange(len(lengths)), lengths)
    order = np.argsort(indices, kind="stable")
    uniq, first = np.unique(indices[order], return_index=True)
    expected = (uniq, np.append(first, len(indices)), bag_of[order])
    for got in (counting, merge):
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(g, e)
    unstable = np.concatenate([bag_of[order][a:b][::-1] for a, b in zip(expected[1][:-1], expected[1][1:])])
    assert not np.array_equal(counting[2], unstable)


def test_adagrad_bags_rejects_bad_input():
    weight, state, indices, offsets, grad = _bags(3)
    with pytest.raises(IndexError):
        kernels.adagrad_bags(weight, state, indices + len(weight), offsets, grad, 0.1)
    with pytest.raises(ValueError):
        kernels.adagrad_bags(weight, state, indices, offsets, grad[:-1], 0.1)
    with pytest.raises(ValueError):
        kernels.adagrad_bags(weight.double(), state.double(), indices, offsets, grad.double(), 0.1)
    empty_w = torch.zeros(0, weight.shape[1])
    kernels.adagrad_bags(empty_w, torch.zeros(0), indices[:0], torch.zeros(4, dtype=torch.int64),
                         torch.zeros(3, weight.shape[1]), 0.1)  # no row touched: nothing to do


@pytest.mark.parametrize("case", ["valid", "int32", "empty_blocks", "counts_short", "negative_count", "entry_out"])
def test_pooled_owner_plan_equals_numpy(case):
    """The owner's one-pass plan of a pooled store gives the NumPy formulation's arrays and status: valid blocks
    (counts then entries, several requesters and micro-batches, some blocks empty) and each corruption of the
    received payload with its own status, which the owner turns into its error message."""
    from nestpipe.kernels import cpu

    rng = np.random.default_rng(11)
    n_rows, dim = 50, 8
    rows_all = rng.integers(0, 1000, n_rows).astype(np.int64)
    parts, at, size, b, b0, out_at, grad_off = [], [], [], [], [], [], []
    cursor = 0
    for k in range(6):  # (micro-batch, requester) blocks
        nb = 0 if (case == "empty_blocks" and k % 2) else int(rng.integers(1, 6))
        counts = rng.integers(0, 4, nb)
        entries = rng.integers(0, 20, int(counts.sum()))
        parts += [counts, entries]
        at.append(cursor), size.append(nb + len(entries)), b.append(nb)
        b0.append(20 * (k % 2)), out_at.append(dim * 7 * k), grad_off.append(1000 * (k // 2))
        cursor += nb + len(entries)
    got = np.concatenate(parts).astype(np.int32 if case == "int32" else np.int64)
    if case == "counts_short":
        got[at[0]] += 1  # one more pair claimed than sent
    if case == "negative_count":
        got[at[1]] = -1
    if case == "entry_out":
        got[at[2] + b[2]] = n_rows  # an entry past the rows requested
    args = (got, np.array(at), np.array(size), np.array(b), np.array(b0), np.array(out_at), np.array(grad_off), dim,
            rows_all)
    ref = reference.pooled_owner_plan(*args)
    fast = cpu.pooled_owner_plan(*args)
    assert ref[-1] == fast[-1] == {"valid": 0, "int32": 0, "empty_blocks": 0, "counts_short": 1,
                                   "negative_count": 1, "entry_out": 2}[case]
    for a, c in zip(ref[:4], fast[:4]):
        assert a.dtype == c.dtype == np.int64 and np.array_equal(a, c)
    if ref[-1] == 0:
        assert np.array_equal(ref[4], fast[4]) and np.array_equal(fast[4], rows_all[fast[1]])
