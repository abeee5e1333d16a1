"""Key-centric clustering: partitions, redundancy, unique keys, combined keys, edge cases, planted optimum."""

import os
import warnings

import numpy as np
import pytest

from nestpipe.clustering import assign, combine_keys, method_names, redundancy, unique_keys
from nestpipe.clustering.balance import balanced_argmax, capacities

CLUSTER_METHODS = ["minhash", "kmeans"]
ALL_METHODS = ["default", "random", *CLUSTER_METHODS]
I64 = np.iinfo(np.int64)


def jagged(samples):
    lengths = [len(s) for s in samples]
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    values = np.concatenate([np.asarray(s, dtype=np.int64) for s in samples]) if samples else np.zeros(0, np.int64)
    return values.astype(np.int64), offsets


def planted(num_sets, per_set, keys_per_set=120, keys_per_sample=16, seed=0, hot_key=None):
    """Samples drawn from ``num_sets`` disjoint key sets, shuffled; returns (values, offsets, true set of each)."""
    rng = np.random.default_rng(seed)
    truth = rng.permutation(np.repeat(np.arange(num_sets), per_set))
    samples = []
    for g in truth:
        keys = g * 10_000 + rng.choice(keys_per_set, keys_per_sample, replace=False)
        samples.append(list(keys) + ([hot_key] if hot_key is not None else []))
    values, offsets = jagged(samples)
    return values, offsets, truth


def check_partition(a, b, n):
    """The contract of assign: int32, one id in 0..n-1 per sample, sizes differ by at most one."""
    assert a.dtype == np.int32 and a.shape == (b,)
    assert a.min() >= 0 and a.max() < n
    sizes = np.bincount(a, minlength=n)
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == b


def brute_redundancy(values, offsets, a):
    total = len(set(values.tolist()))
    if total == 0:
        return 1.0
    per = sum(len({int(v) for s in np.nonzero(a == g)[0] for v in values[offsets[s]:offsets[s + 1]]})
              for g in np.unique(a))
    return per / total


def check_unique_keys(values, offsets, a, result):
    """unique_keys' contract, checked against a Python-set reference."""
    uniq, inverse, per_mb = result
    assert uniq.dtype == np.int64 and inverse.dtype == np.int32
    assert np.all(np.diff(uniq) > 0)
    assert np.array_equal(uniq[inverse], values)
    assert len(per_mb) == int(a.max()) + 1
    for g, pos in enumerate(per_mb):
        assert pos.dtype == np.int32 and np.all(np.diff(pos) > 0)
        members = np.nonzero(a == g)[0]
        expected = {int(v) for s in members for v in values[offsets[s]:offsets[s + 1]]}
        assert set(uniq[pos].tolist()) == expected


# ---------------------------------------------------------------- partitions

@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("n", [1, 3, 8, 50])
def test_every_sample_once_and_balanced(method, n):
    values, offsets, _ = planted(4, 25, seed=n)
    a = assign(values, offsets, n, method=method, seed=3)
    check_partition(a, 100, n)


def test_partition_check_catches_unbalanced_and_out_of_range():
    with pytest.raises(AssertionError):
        check_partition(np.array([0, 0, 0, 1], dtype=np.int32), 4, 2)
    with pytest.raises(AssertionError):
        check_partition(np.array([0, 1, 2, 1], dtype=np.int32), 4, 2)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_deterministic_for_a_seed(method):
    values, offsets, _ = planted(4, 32, seed=1)
    a1 = assign(values, offsets, 4, method=method, seed=7)
    a2 = assign(values.copy(), offsets.copy(), 4, method=method, seed=7)
    assert np.array_equal(a1, a2)


def test_random_depends_on_seed():
    values, offsets, _ = planted(4, 32, seed=1)
    assert not np.array_equal(assign(values, offsets, 4, method="random", seed=1),
                              assign(values, offsets, 4, method="random", seed=2))


@pytest.mark.parametrize("method", ALL_METHODS)
def test_n_equals_b_and_n_not_dividing_b(method):
    values, offsets, _ = planted(3, 7, seed=2)  # B = 21
    a = assign(values, offsets, 21, method=method)
    assert sorted(a.tolist()) == list(range(21))
    a = assign(values, offsets, 4, method=method)
    assert sorted(np.bincount(a).tolist()) == [5, 5, 5, 6]


def test_clear_errors():
    values, offsets = jagged([[1, 2], [3]])
    with pytest.raises(ValueError, match="exceeds the batch size B=2"):
        assign(values, offsets, 3)
    with pytest.raises(ValueError, match="num_micro_batches must be >= 1"):
        assign(values, offsets, 0)
    with pytest.raises(ValueError, match="unknown clustering method 'nope'"):
        assign(values, offsets, 2, method="nope")
    with pytest.raises(ValueError, match=r"offsets\[-1\] must equal len\(values\)=3"):
        assign(values, np.array([0, 1, 2]), 2)
    with pytest.raises(ValueError, match="non-decreasing"):
        assign(values, np.array([0, 2, 1, 3]), 2)
    with pytest.raises(ValueError, match=r"offsets\[0\] must be 0"):
        assign(values, np.array([1, 3]), 1)
    with pytest.raises(TypeError, match="values must be integer keys"):
        assign(values.astype(float), offsets, 2)
    with pytest.raises(ValueError, match="one micro-batch id per sample"):
        redundancy(values, offsets, np.array([0, 1, 0]))
    with pytest.raises(ValueError, match="negative micro-batch id"):
        unique_keys(values, offsets, np.array([0, -1]))
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        assign(values, offsets, 2, seed=-1)
    assert method_names() == ["default", "random", "minhash", "kmeans"]


# ---------------------------------------------------------------- edge cases

@pytest.mark.parametrize("method", ALL_METHODS)
def test_empty_key_lists_and_samples_without_keys(method):
    values, offsets = jagged([[] for _ in range(10)])
    a = assign(values, offsets, 3, method=method)
    check_partition(a, 10, 3)
    assert redundancy(values, offsets, a) == 1.0
    uniq, inverse, per_mb = unique_keys(values, offsets, a)
    assert len(uniq) == 0 and len(inverse) == 0 and [len(p) for p in per_mb] == [0, 0, 0]
    values, offsets = jagged([[], [5, 6], [], [6, 7], [], [9]])
    a = assign(values, offsets, 2, method=method)
    check_partition(a, 6, 2)
    check_unique_keys(values, offsets, a, unique_keys(values, offsets, a))


@pytest.mark.parametrize("method", ALL_METHODS)
def test_single_hot_key_in_every_sample(method):
    values, offsets = jagged([[42]] * 40)
    a = assign(values, offsets, 8, method=method)
    check_partition(a, 40, 8)
    assert redundancy(values, offsets, a) == 8.0  # every micro-batch must fetch it: R = N whatever the partition


@pytest.mark.parametrize("method", ALL_METHODS)
def test_int64_extremes_never_overflow(method):
    ext = [I64.min, I64.min + 1, -1, 0, 1, I64.max - 1, I64.max]
    rng = np.random.default_rng(0)
    samples = [list(rng.choice(ext, 3)) for _ in range(30)]
    values, offsets = jagged(samples)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="raise"):
            a = assign(values, offsets, 4, method=method)
            result = unique_keys(values, offsets, a)
            r = redundancy(values, offsets, a)
            combined = combine_keys(3, values)
    check_partition(a, 30, 4)
    check_unique_keys(values, offsets, a, result)
    assert r == pytest.approx(brute_redundancy(values, offsets, a))
    assert len(np.unique(combined)) == len(np.unique(values))


# ---------------------------------------------------------------- redundancy

def test_redundancy_hand_made():
    values, offsets = jagged([[1, 2], [2, 3], [4], [4, 1]])
    # mb0 = {1, 2, 3}, mb1 = {4, 1}: 5 rows for 4 unique keys
    assert redundancy(values, offsets, np.array([0, 0, 1, 1])) == 5 / 4
    # mb0 = samples 0, 3 -> {1, 2, 4}; mb1 = samples 1, 2 -> {2, 3, 4}: 6 rows
    assert redundancy(values, offsets, np.array([0, 1, 1, 0])) == 6 / 4
    assert redundancy(values, offsets, np.array([0, 0, 0, 0])) == 1.0
    # duplicated keys inside one sample count once
    values, offsets = jagged([[7, 7, 7], [7]])
    assert redundancy(values, offsets, np.array([0, 1])) == 2.0
    # weighted: key 1 costs 3, key 2 costs 1; mb0 {1, 2}, mb1 {1} -> (3 + 1 + 3) / (3 + 1)
    values, offsets = jagged([[1, 2], [1]])
    assert redundancy(values, offsets, np.array([0, 1]), weights=[3.0, 1.0, 3.0]) == 7 / 4
    with pytest.raises(ValueError, match="equal for every occurrence"):
        redundancy(values, offsets, np.array([0, 1]), weights=[3.0, 1.0, 2.0])


def test_redundancy_matches_brute_force_and_a_broken_variant_does_not():
    rng = np.random.default_rng(5)
    samples = [list(rng.integers(0, 30, rng.integers(0, 8))) for _ in range(40)]
    values, offsets = jagged(samples)
    a = assign(values, offsets, 5, method="random", seed=1)
    expected = brute_redundancy(values, offsets, a)
    assert redundancy(values, offsets, a) == pytest.approx(expected)
    # Negative control: counting occurrences per micro-batch instead of distinct keys gives a different figure.
    broken = len(values) / len(np.unique(values))
    assert broken != pytest.approx(expected)


# ---------------------------------------------------------------- unique keys

def test_unique_keys_reconstruct_and_per_micro_batch_lists():
    rng = np.random.default_rng(2)
    samples = [list(rng.integers(-50, 50, rng.integers(0, 10))) for _ in range(64)]
    values, offsets = jagged(samples)
    a = assign(values, offsets, 6, seed=4).astype(np.int64)
    check_unique_keys(values, offsets, a, unique_keys(values, offsets, a))


def test_unique_keys_check_catches_corruption():
    values, offsets = jagged([[1, 2], [2, 3], [4], [4, 1]])
    a = np.array([0, 0, 1, 1])
    uniq, inverse, per_mb = unique_keys(values, offsets, a)
    bad_inverse = inverse.copy()
    bad_inverse[0] = (bad_inverse[0] + 1) % len(uniq)
    with pytest.raises(AssertionError):
        check_unique_keys(values, offsets, a, (uniq, bad_inverse, per_mb))
    bad_lists = [per_mb[0][:-1], per_mb[1]]
    with pytest.raises(AssertionError):
        check_unique_keys(values, offsets, a, (uniq, inverse, bad_lists))


def test_unique_keys_explicit_micro_batch_count_keeps_empty_trailing_lists():
    values, offsets = jagged([[1], [2]])
    _, _, per_mb = unique_keys(values, offsets, np.array([0, 0]), num_micro_batches=3)
    assert [p.tolist() for p in per_mb] == [[0, 1], [], []]


# ---------------------------------------------------------------- combined keys

def _splitmix_reference(x):
    """SplitMix64 finaliser in plain Python integers (independent of the NumPy implementation)."""
    m = (1 << 64) - 1
    x &= m
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    x ^= x >> 31
    return x


def test_combine_keys_matches_reference_and_is_bijective_per_table():
    keys = np.array([I64.min, -1, 0, 1, 12345, I64.max], dtype=np.int64)
    for table in (0, 1, 77):
        salt = _splitmix_reference(table + 0x9E3779B97F4A7C15)
        expected = [_splitmix_reference((int(k) & ((1 << 64) - 1)) ^ salt) for k in keys]
        got = combine_keys(table, keys).view(np.uint64).tolist()
        assert got == expected
    many = np.random.default_rng(0).integers(I64.min, I64.max, 200_000, dtype=np.int64, endpoint=True)
    many = np.unique(many)
    assert len(np.unique(combine_keys(5, many))) == len(many)
    # tables get different ids for the same key
    small = np.arange(100_000, dtype=np.int64)
    assert len(np.intersect1d(combine_keys(0, small), combine_keys(1, small))) == 0
    with pytest.raises(ValueError, match="table_id must be >= 0"):
        combine_keys(-1, small)
    with pytest.raises(TypeError, match="keys must be an integer array"):
        combine_keys(0, np.array([1.5]))


def test_bijection_check_catches_a_lossy_mix():
    many = np.unique(np.random.default_rng(0).integers(0, 1 << 40, 100_000, dtype=np.int64))
    lossy = (combine_keys(5, many).view(np.uint64) >> np.uint64(48)).astype(np.int64)  # keeps 16 bits only
    assert len(np.unique(lossy)) < len(many)


# ---------------------------------------------------------------- balanced assignment

def test_balanced_argmax_respects_capacities_and_prefers_high_scores():
    rng = np.random.default_rng(0)
    score = rng.random((37, 5))
    caps = capacities(37, 5)
    a = balanced_argmax(score, caps)
    assert np.array_equal(np.bincount(a, minlength=5), caps)
    # with room for everyone, every row gets its argmax
    easy = np.eye(5)[np.arange(37) % 5] + 0.01 * score
    assert np.array_equal(balanced_argmax(easy, capacities(37, 5)), np.argmax(easy, axis=1))
    # negative control: with every row preferring column 0, capacities still hold (the greedy must spill over)
    crowded = np.zeros((37, 5))
    crowded[:, 0] = 1.0
    assert np.array_equal(np.bincount(balanced_argmax(crowded, caps), minlength=5), caps)


def test_balanced_argmax_compiled_equals_the_numpy_reference():
    from nestpipe.clustering import balance

    balance.load_kernel()  # load the compiled path (it runs wherever Numba is loaded)
    rng = np.random.default_rng(5)
    cases = [rng.random((512, 8)), rng.integers(0, 3, (200, 7)).astype(float),  # many exact ties
             np.zeros((33, 4)), np.where(rng.random((64, 8)) < 0.3, -np.inf, rng.random((64, 8))),
             rng.random((9, 9)).astype(np.float32), np.full((10, 3), -0.0)]
    for score in cases:
        caps = capacities(score.shape[0], score.shape[1])
        ref = balance.balanced_argmax_numpy(score, caps)
        assert np.array_equal(balance.balanced_argmax(score, caps), ref)
    # negative control: breaking ties by the last row instead of the first changes the result
    tied = rng.integers(0, 2, (100, 4)).astype(float)
    caps = capacities(100, 4)
    flipped = balance.balanced_argmax(tied[::-1].copy(), caps)[::-1]
    assert not np.array_equal(flipped, balance.balanced_argmax_numpy(tied, caps))


# ---------------------------------------------------------------- planted optimum

@pytest.mark.parametrize("method", CLUSTER_METHODS)
@pytest.mark.parametrize("num_sets", [4, 8])
def test_planted_disjoint_sets_reach_the_optimum(method, num_sets):
    values, offsets, truth = planted(num_sets, 24, seed=num_sets)
    a = assign(values, offsets, num_sets, method=method, seed=0)
    r = redundancy(values, offsets, a)
    r_random = redundancy(values, offsets, assign(values, offsets, num_sets, method="random", seed=0))
    assert r == 1.0
    assert r < r_random
    # the found partition is the planted one up to relabelling
    assert len(set(zip(a.tolist(), truth.tolist()))) == num_sets


@pytest.mark.parametrize("method", CLUSTER_METHODS)
def test_planted_with_a_hot_key_in_every_sample(method):
    values, offsets, _ = planted(4, 32, seed=9, hot_key=-7)
    a = assign(values, offsets, 4, method=method)
    unique = len(np.unique(values))
    optimum = (unique - 1 + 4) / unique  # every set once, the hot key in all 4 micro-batches
    assert redundancy(values, offsets, a) == pytest.approx(optimum)


def test_planted_check_catches_a_random_partition():
    values, offsets, _ = planted(8, 24, seed=8)
    assert redundancy(values, offsets, assign(values, offsets, 8, method="random")) > 1.5


@pytest.mark.parametrize("method", CLUSTER_METHODS)
def test_weights_steer_the_partition(method):
    # Key A pairs samples (0,1),(2,3),(4,5),(6,7); key B pairs (0,7),(1,6),(2,5),(3,4): the weights decide.
    samples = [[100 + i // 2, 200 + (i if i < 4 else 7 - i)] for i in range(8)]
    values, offsets = jagged(samples)
    a_keys, b_keys = values[0::2], values[1::2]
    one_each = np.arange(0, 9)
    b_costly = np.where(values >= 200, 10.0, 1.0)
    a = assign(values, offsets, 4, method=method, weights=b_costly)
    check_partition(a, 8, 4)
    assert redundancy(b_keys, one_each, a) == 1.0 and redundancy(a_keys, one_each, a) == 2.0
    a = assign(values, offsets, 4, method=method, weights=np.where(values >= 200, 1.0, 10.0))
    assert redundancy(a_keys, one_each, a) == 1.0 and redundancy(b_keys, one_each, a) == 2.0
    with pytest.raises(ValueError, match="weights must give one cost per key occurrence"):
        assign(values, offsets, 4, method=method, weights=[1.0])


@pytest.mark.parametrize("vocabs", [
    ((5, 1), (1000, 3), (2**62, 6), (3, 0)),  # ranges overflow one shared id space: (table, key) lexsort
    ((5, 1), (1000, 3), (10**9, 6), (3, 0)),  # one shared id space, too wide for a presence map: argsort
    ((5, 1), (300, 3), (20, 6), (3, 0)),  # small ranges: presence map, no sort
])
def test_unique_keys_multi_equals_per_table_unique_keys(vocabs):
    from nestpipe.clustering import unique_keys, unique_keys_multi

    rng = np.random.default_rng(7)
    b, n = 64, 4
    assignment = rng.permutation(np.arange(b) % n)
    tables = []
    for vocab, max_len in vocabs:
        lengths = rng.integers(0, max_len + 1, b)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        values = rng.integers(-vocab, vocab, offsets[-1], dtype=np.int64)
        tables.append((values, offsets))
    multi = unique_keys_multi(tables, assignment, num_micro_batches=n)
    for (values, offsets), (u, inv, per_mb) in zip(tables, multi):
        ru, rinv, rper = unique_keys(values, offsets, assignment, num_micro_batches=n)
        assert np.array_equal(u, ru) and np.array_equal(inv, rinv) and inv.dtype == np.int32
        assert len(per_mb) == n and all(np.array_equal(x, y) for x, y in zip(per_mb, rper))
    # negative control: a table's keys must not leak into another table's unique list
    shifted = [(tables[0][0] + 1, tables[0][1])] + tables[1:]
    assert not np.array_equal(unique_keys_multi(shifted, assignment, num_micro_batches=n)[0][0], multi[0][0])


def test_presence_map_scratch_is_clean_between_calls_and_threads():
    """The presence-map unique reuses per-thread buffers: a call must not see values of an earlier call (larger or
    smaller span), of a call that failed, or of another thread. Reference: np.unique."""
    import threading

    from nestpipe.clustering import objective

    rng = np.random.default_rng(3)

    def check(g, span):
        d, rank = objective._dense_or_sorted_unique(g, span)
        ref, inv = np.unique(g, return_inverse=True)
        assert np.array_equal(d, ref) and np.array_equal(rank, inv.reshape(-1))

    for span in (5000, 70000, 300, 70000, 5000):
        check(rng.integers(0, span, 4000).astype(np.int64), span)
    # a failing call (a value past the span) leaves the buffer clean
    with pytest.raises(IndexError):
        objective._dense_or_sorted_unique(np.array([3, 10, 5000], np.int64), 4000)
    check(np.array([1, 2], np.int64), 4000)
    # negative control: without the clear, the next call sees the previous call's keys
    buf = objective._scratch("present", 4000, np.bool_)
    buf[[7, 9]] = True
    d, _ = objective._dense_or_sorted_unique(np.array([1], np.int64), 4000)
    assert d.tolist() == [1, 7, 9]
    buf[:] = False
    errors = []

    def worker(seed):
        try:
            r = np.random.default_rng(seed)
            for _ in range(50):
                span = int(r.integers(100, 20000))
                check(r.integers(0, span, 3000).astype(np.int64), span)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# ---------------------------------------------------------------- refine (single exact-gain swaps)

def test_refine_takes_a_random_partition_to_the_planted_one_and_never_costs_more():
    from nestpipe.clustering import refine

    values, offsets, truth = planted(4, 16, seed=3)
    rng = np.random.default_rng(3)
    start = truth.copy()
    for _ in range(6):  # the planted partition with six samples swapped across sets
        s, t = rng.choice(np.flatnonzero(start == 0)), rng.choice(np.flatnonzero(start != 0))
        start[s], start[t] = start[t], start[s]
    out = refine(values, offsets, start, 4)
    check_partition(out, len(truth), 4)
    assert np.array_equal(np.bincount(out, minlength=4), np.bincount(start, minlength=4))
    assert redundancy(values, offsets, out) == 1.0 < redundancy(values, offsets, start)
    assert np.array_equal(out, truth)
    # a partition no single swap improves comes back unchanged
    assert np.array_equal(refine(values, offsets, out, 4), out)
    start = assign(values, offsets, 4, method="random", seed=1)  # from a random one: fewer rows, the same sizes
    out = refine(values, offsets, start, 4)
    assert redundancy(values, offsets, out) < 0.7 * redundancy(values, offsets, start)
    # more samples than a round's 64 movers: fewer rows, the same sizes
    values, offsets, truth = planted(4, 40, seed=3)
    start = assign(values, offsets, 4, method="random", seed=1)
    out = refine(values, offsets, start, 4)
    assert redundancy(values, offsets, out) < 0.7 * redundancy(values, offsets, start)
    assert np.array_equal(np.bincount(out, minlength=4), np.bincount(start, minlength=4))
    rng = np.random.default_rng(0)
    for seed in range(5):  # random keys, random starts: never more rows
        samples = [list(rng.integers(0, 60, rng.integers(1, 12))) for _ in range(90)]
        v, o = jagged(samples)
        a = assign(v, o, 5, method="random", seed=seed)
        assert redundancy(v, o, refine(v, o, a, 5)) <= redundancy(v, o, a)


def test_refine_with_costs_keeps_every_micro_batch_under_the_cap():
    """Swaps that would take a micro-batch's summed cost above ``max_load`` are not made. Control: the same start
    refined without the costs saves more rows and breaks the cap."""
    from nestpipe.clustering import refine

    values, offsets, truth = planted(4, 16, seed=5)
    rng = np.random.default_rng(5)
    costs = np.where(truth == 0, 50.0, 1.0) * rng.uniform(0.99, 1.01, len(truth))  # set 0's samples are costly
    start = np.empty(len(truth), dtype=np.int64)
    for g in range(4):  # each micro-batch takes 4 samples of every set: equal costs, every key 4 times over
        start[truth == g] = np.repeat(np.arange(4), 4)
    load = lambda a: np.bincount(a, costs, 4)  # noqa: E731
    cap = 1.05 * costs.sum() / 4
    assert load(start).max() <= cap
    bounded = refine(values, offsets, start, 4, costs=costs, max_load=cap)
    free = refine(values, offsets, start, 4)
    assert load(bounded).max() <= cap + 1e-9
    assert redundancy(values, offsets, bounded) < redundancy(values, offsets, start)  # it still saves rows
    assert load(free).max() > cap and redundancy(values, offsets, free) < redundancy(values, offsets, bounded)
    # a start above the cap: the cap becomes its costliest micro-batch, which no swap makes costlier
    over = refine(values, offsets, start, 4, costs=costs, max_load=0.5 * cap)
    assert load(over).max() <= load(start).max() + 1e-9
    with pytest.raises(ValueError, match="together"):
        refine(values, offsets, start, 4, costs=costs)
    with pytest.raises(ValueError, match="one cost per sample"):
        refine(values, offsets, start, 4, costs=costs[:-1], max_load=cap)
    with pytest.raises(ValueError, match="micro-batch in 0..3"):
        refine(values, offsets, np.full(len(truth), 4), 4)
    with pytest.raises(TypeError, match="integer"):
        refine(values, offsets, start.astype(float) + 0.5, 4)
    with pytest.raises(ValueError, match="finite"):
        refine(values, offsets, start, 4, costs=costs, max_load=float("nan"))


def test_swap_saving_is_the_exact_cost_change():
    """The refinement's exact check equals the full cost before minus after for random swaps (shared keys, keys
    single in a micro-batch, weights). Control: counting only the moved sample's own keys gives other figures."""
    from nestpipe.clustering.incidence import build_incidence
    from nestpipe.clustering.refine import Problem, _apply_swap, swap_saving

    rng = np.random.default_rng(11)
    wrong = 0
    for trial in range(40):
        samples = [list(rng.integers(0, 25, rng.integers(1, 9))) for _ in range(30)]
        values, offsets = jagged(samples)
        weights = rng.uniform(0.5, 2.0, 25)[values]
        a = assign(values, offsets, 5, method="random", seed=trial).astype(np.int64)
        p = Problem(build_incidence(values, offsets, weights), np.bincount(a, minlength=5))
        counts = p.counts(a)
        s, t = rng.choice(np.flatnonzero(a == 0)), rng.choice(np.flatnonzero(a == 1))
        swapped = a.copy()
        swapped[s], swapped[t] = a[t], a[s]
        assert swap_saving(p, counts, a, s, t) == pytest.approx(p.cost(a) - p.cost(swapped))
        after, moved = counts.copy(), a.copy()
        _apply_swap(p, after, moved, s, t)
        assert np.array_equal(moved, swapped) and np.array_equal(after, p.counts(swapped))
        only_s = p.pair_key[p.indptr[s]:p.indptr[s + 1]]  # the control: s's move gain alone
        one_sided = (((counts[a[s], only_s] == 1) * p.weight[only_s]).sum()
                     - ((counts[a[t], only_s] == 0) * p.weight[only_s]).sum())
        wrong += not np.isclose(one_sided, p.cost(a) - p.cost(swapped))
    assert wrong > 20


def test_refine_is_the_same_whatever_simd_path_numpy_dispatches_to():
    """The shards must be the same bytes on any machine: ``refine`` (many equal scores on unit-weight keys) gives
    the same partitions with NumPy's dispatched CPU features turned off as with them (a partial sort's choice among
    equal values differs between those paths; control: selecting with ``np.argpartition`` fails this)."""
    import subprocess
    import sys
    import textwrap

    from numpy._core import _multiarray_umath as umath

    dispatched = [f for f in umath.__cpu_dispatch__ if umath.__cpu_features__.get(f)]
    if not dispatched:
        pytest.skip("this CPU runs NumPy's baseline code only: there is no other SIMD path to compare with")
    code = textwrap.dedent("""
        import hashlib
        import numpy as np
        from nestpipe.clustering import refine
        rng = np.random.default_rng(7)
        out = []
        for trial in range(6):
            lens = rng.integers(1, 30, 200)
            offsets = np.concatenate([[0], np.cumsum(lens)])
            values = rng.integers(0, 400, offsets[-1])
            mb = rng.permutation(np.repeat(np.arange(8), 25))
            costs = (lens ** 2).astype(float)
            out.append(refine(values, offsets, mb, 8))
            out.append(refine(values, offsets, mb, 8, costs=costs, max_load=1.2 * costs.sum() / 8))
        print(hashlib.sha256(np.concatenate(out).tobytes()).hexdigest())
    """)
    env = {k: v for k, v in os.environ.items() if k != "NPY_DISABLE_CPU_FEATURES"}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=e).stdout
            for e in (env, dict(env, NPY_DISABLE_CPU_FEATURES=",".join(dispatched)))]
    assert runs[0].strip() and runs[0] == runs[1], runs
