"""The exact partition objective on the informative keys, and local search that improves it.

Objective: ``cost(a) = sum over keys k of w_k * (number of micro-batches holding k)``; redundancy is
``cost / sum(w)``. A key held by one sample, or by so many samples that it lands in every micro-batch whatever the
partition, adds the same amount to every balanced partition; :class:`Problem` drops those keys, so costs here
differ from the full one by a constant and every comparison stays exact.

Move gains for the current partition (C[g, k] = number of samples of micro-batch g holding key k):
``gain(s -> g) = sum_{k in s} w_k [C[a_s, k] == 1] - sum_{k in s} w_k [C[g, k] == 0]``
(keys s alone brings to its micro-batch are saved; keys new to g are paid). A swap of s (in a) with t (in b)
gains ``gain(s -> b) + gain(t -> a)`` minus the weight of shared keys that are single in a or b, so the pairwise
sum is an optimistic estimate: every batch of swaps is checked against the exact cost and kept only if it helps.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from nestpipe.clustering.balance import balanced_argmax
from nestpipe.clustering.incidence import Incidence


class Problem:
    """A batch's informative (sample, key) pairs with re-indexed keys, ready for cost and gain evaluation.

    Invariants: ``pair_sample`` sorted; ``pair_key`` in 0..num_keys-1; ``weight[k] > 0`` is key k's cost;
    ``matrix`` is the binary [B, num_keys] CSR incidence of the same pairs.
    """

    def __init__(self, inc: Incidence, caps: np.ndarray):
        self.num_samples = inc.num_samples
        self.caps = caps
        self.num_groups = len(caps)
        df = inc.doc_freq
        # A key held by d samples lies in at least ceil(d / max cap) and at most min(d, N) micro-batches.
        lo = -(-df // int(caps.max()))
        hi = np.minimum(df, self.num_groups)
        informative = (lo < hi) & (inc.key_weight > 0)
        new_index = informative.astype(np.int64).cumsum() - 1
        keep = informative[inc.pair_key]
        self.pair_sample = inc.pair_sample[keep]
        self.pair_key = new_index[inc.pair_key[keep]]
        self.weight = inc.key_weight[informative]
        self.doc_freq = df[informative]
        self.num_keys = int(informative.sum())
        indptr = np.zeros(self.num_samples + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.pair_sample, minlength=self.num_samples), out=indptr[1:])
        self.indptr = indptr
        self.matrix = sp.csr_matrix(
            (np.ones(len(self.pair_key), dtype=np.float64), self.pair_key, indptr),
            shape=(self.num_samples, self.num_keys),
        )

    def counts(self, a: np.ndarray) -> np.ndarray:
        """C [N, K]: how many samples of each micro-batch hold each key."""
        k = self.num_keys
        flat = np.bincount(a[self.pair_sample] * k + self.pair_key, minlength=self.num_groups * k)
        return flat.reshape(self.num_groups, k)

    def cost(self, a: np.ndarray) -> float:
        return float(((self.counts(a) > 0) * self.weight).sum())

    def gains(self, a: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """G [B, N]: exact cost decrease of moving one sample alone to each micro-batch (0 for its own)."""
        single = counts[a[self.pair_sample], self.pair_key] == 1
        saved = np.bincount(self.pair_sample, weights=self.weight[self.pair_key] * single, minlength=self.num_samples)
        paid = np.asarray(self.matrix @ ((counts == 0) * self.weight).T)
        g = saved[:, None] - paid
        g[np.arange(self.num_samples), a] = 0.0
        return g


def _pair_swaps(a: np.ndarray, g: np.ndarray, n: int) -> np.ndarray:
    """Candidate swaps [S, 2] (s, t) with s's best target = t's group and vice versa, by estimated gain."""
    b = len(a)
    masked = g.copy()
    masked[np.arange(b), a] = -np.inf
    target = np.argmax(masked, axis=1)
    gain = masked[np.arange(b), target]
    lane = a * n + target
    order = np.lexsort((np.arange(b), -gain, lane))
    lane_sorted = lane[order]
    rank = np.empty(b, dtype=np.int64)
    rank[order] = np.arange(b) - np.searchsorted(lane_sorted, lane_sorted, side="left")
    own_code = lane * b + rank
    partner_code = (target * n + a) * b + rank
    code_order = np.argsort(own_code)
    sorted_codes = own_code[code_order]
    pos = np.minimum(np.searchsorted(sorted_codes, partner_code), b - 1)
    found = sorted_codes[pos] == partner_code
    partner = code_order[pos]
    first = found & (a < target)
    s = np.nonzero(first)[0]
    t = partner[s]
    total = gain[s] + gain[t]
    good = total > 0
    s, t, total = s[good], t[good], total[good]
    best = np.argsort(-total, kind="stable")
    return np.stack([s[best], t[best]], axis=1)


def swap_refine(problem: Problem, a: np.ndarray, max_passes: int) -> np.ndarray:
    """Improve a balanced partition by batches of pairwise swaps; never returns a costlier one.

    Each pass proposes the mutually-best swaps, applies them all, and keeps the result only if the exact cost
    drops; otherwise it retries with the better half of the swaps, down to one. Sizes never change.
    """
    a = a.copy()
    n = problem.num_groups
    if problem.num_keys == 0 or n == 1:
        return a
    counts = problem.counts(a)
    cost = float(((counts > 0) * problem.weight).sum())
    for _ in range(max_passes):
        swaps = _pair_swaps(a, problem.gains(a, counts), n)
        improved = False
        while len(swaps):
            trial = a.copy()
            trial[swaps[:, 0]], trial[swaps[:, 1]] = a[swaps[:, 1]], a[swaps[:, 0]]
            trial_counts = problem.counts(trial)
            trial_cost = float(((trial_counts > 0) * problem.weight).sum())
            if trial_cost < cost:
                a, counts, cost, improved = trial, trial_counts, trial_cost, True
                break
            swaps = swaps[: len(swaps) // 2]
        if not improved:
            break
    return a


def reassign_refine(problem: Problem, a: np.ndarray, max_passes: int) -> np.ndarray:
    """Improve a balanced partition by capacity-constrained reassignment of all samples at once by move gain.

    Moves interact (two samples leaving together), so each pass is kept only if the exact cost drops.
    """
    a = a.copy()
    if problem.num_keys == 0 or problem.num_groups == 1:
        return a
    counts = problem.counts(a)
    cost = float(((counts > 0) * problem.weight).sum())
    for _ in range(max_passes):
        trial = balanced_argmax(problem.gains(a, counts), problem.caps)
        trial_counts = problem.counts(trial)
        trial_cost = float(((trial_counts > 0) * problem.weight).sum())
        if trial_cost >= cost:
            break
        a, counts, cost = trial, trial_counts, trial_cost
    return a


def swap_saving(problem: Problem, counts: np.ndarray, a: np.ndarray, s: int, t: int) -> float:
    """The exact cost decrease of swapping samples ``s`` and ``t`` (in different micro-batches) under ``counts``
    (:meth:`Problem.counts` of ``a``): each one's move gain from the counts as they are, less what the keys both
    hold were counted for (such a key stays in both micro-batches)."""
    gs, gt = a[s], a[t]
    ks = problem.pair_key[problem.indptr[s]:problem.indptr[s + 1]]
    kt = problem.pair_key[problem.indptr[t]:problem.indptr[t + 1]]
    w = problem.weight
    gain_s = w[ks] @ ((counts[gs, ks] == 1).astype(np.float64) - (counts[gt, ks] == 0))
    gain_t = w[kt] @ ((counts[gt, kt] == 1).astype(np.float64) - (counts[gs, kt] == 0))
    both = np.intersect1d(ks, kt, assume_unique=True)
    return float(gain_s + gain_t - w[both] @ ((counts[gs, both] == 1).astype(np.float64) + (counts[gt, both] == 1)))


def _apply_swap(problem: Problem, counts: np.ndarray, a: np.ndarray, s: int, t: int) -> None:
    """Swap samples ``s`` and ``t`` in ``a`` and update ``counts`` (a sample's keys are distinct)."""
    gs, gt = a[s], a[t]
    ks = problem.pair_key[problem.indptr[s]:problem.indptr[s + 1]]
    kt = problem.pair_key[problem.indptr[t]:problem.indptr[t + 1]]
    counts[gs, ks] -= 1
    counts[gt, ks] += 1
    counts[gt, kt] -= 1
    counts[gs, kt] += 1
    a[s], a[t] = gt, gs


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """The indices of the ``k`` largest ``values``, ascending; among equal values the lowest indices. A
    function of the values alone: ``np.argpartition``'s choice among ties depends on the SIMD path NumPy dispatches
    to, which would make the shards depend on the machine that writes them."""
    if k >= len(values):
        return np.arange(len(values))
    kth = np.partition(values, len(values) - k)[len(values) - k]  # the k-th largest value (a value, not an index)
    above = np.flatnonzero(values > kth)
    return np.sort(np.concatenate([above, np.flatnonzero(values == kth)[:k - len(above)]]))


def greedy_swap_refine(problem: Problem, a: np.ndarray, max_rounds: int, top_k: int = 256, movers: int = 64,
                       costs: np.ndarray = None, max_load: float = None) -> np.ndarray:
    """Improve a balanced partition by single swaps checked exactly; never returns a costlier one, sizes never
    change.

    Each round scores the pairs of the ``movers`` samples with the largest single-move gain and every sample in
    another micro-batch by the estimated gain ``gain(s -> a_t) + gain(t -> a_s)`` (:meth:`Problem.gains`) and
    walks the ``top_k`` best-scored pairs in order (equal scores by index), making each swap whose exact saving
    under the counts as they are by then (:func:`swap_saving`) is positive and whose samples have not moved yet
    this round; rounds stop when one makes no swap. Where :func:`swap_refine` makes only
    mutually-best swaps, this also finds the swaps of a sample whose best micro-batch is full.

    ``costs`` and ``max_load`` (a per-sample cost and a cap): a swap is made only if afterwards both micro-batches'
    loads (a load: the sum of a micro-batch's samples' costs) are at most ``max_load``, so a partition whose
    costliest micro-batch is within the cap stays so; ``max_load`` is raised to the partition's own costliest load
    if that is larger. A cap, not a bound on max - min: a synchronous step waits for the costliest micro-batch, and
    a cheap one costs nothing, so cheap micro-batches are left free to take the samples that share their keys."""
    a = np.asarray(a, dtype=np.int64).copy()
    n, b = problem.num_groups, problem.num_samples
    if problem.num_keys == 0 or n == 1 or b < 2:
        return a
    counts = problem.counts(a)
    load = None
    if costs is not None:
        costs = np.asarray(costs, dtype=np.float64)
        load = np.bincount(a, weights=costs, minlength=n)
        max_load = max(float(max_load), float(load.max()))
    m = min(b, movers)
    for _ in range(max_rounds):
        g = problem.gains(a, counts)  # g[s, h]: gain of moving s alone into micro-batch h
        # the m samples that gain most by moving anywhere, against every partner: pair[i, t] = g[s_i, a_t] +
        # g[t, a_s_i] (an m x B matrix instead of B x B: the round's cost grows with B, not B^2)
        sel = _top(g.max(axis=1), m)
        pair = g[sel][:, a] + g[:, a[sel]].T
        pair[a[sel][:, None] == a[None, :]] = -np.inf
        flat = pair.reshape(-1)
        cand = _top(flat, min(top_k, flat.size))
        cand = cand[np.argsort(-flat[cand], kind="stable")]  # best first, equal scores in index order
        moved = np.zeros(b, dtype=bool)
        made = 0
        for c in cand:
            i, t = divmod(int(c), b)
            s = int(sel[i])
            if not pair[i, t] > 0:
                break
            if moved[s] or moved[t]:
                continue
            gs, gt = a[s], a[t]
            if load is not None:
                shift = costs[s] - costs[t]
                after = load.copy()
                after[gs] -= shift
                after[gt] += shift
                if after[gs] > max_load or after[gt] > max_load:
                    continue
            if swap_saving(problem, counts, a, s, t) > 0:
                _apply_swap(problem, counts, a, s, t)
                moved[s] = moved[t] = True
                if load is not None:
                    load = after
                made += 1
        if not made:
            break
    return a
