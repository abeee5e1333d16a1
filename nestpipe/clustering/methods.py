"""The clustering methods. Each maps a :class:`Problem` and a seed to a balanced partition (micro-batch g gets
exactly ``caps[g]`` samples) and is deterministic for the seed.

``random``   a uniformly random balanced partition: the baseline (O(B)).
``minhash``  (the default) rarity-weighted MinHash signatures order the samples, runs of that order seed a
             balanced spherical k-means on IDF-weighted key vectors (8 rounds, each one sparse product
             [B, K] x [K, N] plus a vectorised capacity-constrained assignment), then 3 passes of exact-gain swaps.
             O(m * nnz + rounds * nnz * N): cheap enough for every batch of the ingest
             (``benchmarks/clustering_bench.py`` times it).
``kmeans``   the stronger, slower one: scikit-learn KMeans (several restarts) on a TruncatedSVD embedding of the
             IDF-weighted key vectors, an optimal balanced assignment to its centroids (scipy
             ``linear_sum_assignment`` on a B x B cost), the same k-means rounds, then exact-gain reassignment and up
             to 20 swap passes; the ``minhash`` result competes and the cheaper exact cost wins, so it is never
             worse than the default. Tens of milliseconds per batch: for offline ingest where quality matters.

Key weighting: a key's IDF ``log(B / df)`` scales its coordinate, so a hot key present in most samples carries
almost no weight in the similarity, and keys that cannot change the cost (see :class:`Problem`) are dropped.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from nestpipe.clustering.balance import balanced_argmax, chunk_order
from nestpipe.clustering.keys import mix64
from nestpipe.clustering.refine import Problem, reassign_refine, swap_refine


def random_partition(problem: Problem, seed: int) -> np.ndarray:
    order = np.random.default_rng(seed).permutation(problem.num_samples)
    return chunk_order(order, problem.caps)


def _idf(problem: Problem) -> np.ndarray:
    return np.log(problem.num_samples / problem.doc_freq) * problem.weight


def minhash_signatures(problem: Problem, num_hashes: int, seed: int) -> np.ndarray:
    """[B, m] rarity-weighted MinHash: per hash j, the minimum over a sample's keys of ``-log(u_jk) / idf_k``.

    ``u_jk`` in (0, 1) comes from a 64-bit mix of (seed, j, key), so a key is the minimum with probability
    proportional to its IDF (exponential-race weighted sampling): rare shared keys decide the buckets, hot keys
    rarely do. Two samples share a signature entry with probability equal to their weighted Jaccard similarity
    (in the exponential-race approximation). Samples without informative keys get +inf.
    """
    b, k = problem.num_samples, problem.num_keys
    out = np.full((b, num_hashes), np.inf)
    present = np.diff(problem.indptr) > 0
    if k == 0 or not present.any():
        return out
    starts = problem.indptr[:-1][present]
    rate = np.maximum(_idf(problem), 1e-12)
    key_words = np.arange(k, dtype=np.uint64)
    base = mix64(np.array([seed % (1 << 64)], dtype=np.uint64))[0]
    for j in range(num_hashes):  # m is small (4); each round is vectorised over all pairs
        h = mix64(key_words ^ mix64(np.array([base + np.uint64(j + 1)], dtype=np.uint64))[0])
        u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
        race = -np.log(u) / rate
        out[present, j] = np.minimum.reduceat(race[problem.pair_key], starts)
    return out


def minhash_order(problem: Problem, seed: int, num_hashes: int = 4) -> np.ndarray:
    """Sample order that puts equal MinHash signatures next to each other (lexicographic sort)."""
    sig = minhash_signatures(problem, num_hashes, seed)
    return np.lexsort(tuple(sig[:, j] for j in range(num_hashes - 1, -1, -1)) + ())


def _tfidf(problem: Problem):
    """Row-normalised IDF-weighted values of the pairs and the CSR matrix built from them."""
    b = problem.num_samples
    val = _idf(problem)[problem.pair_key]
    norm = np.sqrt(np.bincount(problem.pair_sample, weights=val * val, minlength=b))
    norm[norm == 0] = 1.0
    val = val / norm[problem.pair_sample]
    x = sp.csr_matrix((val, problem.pair_key, problem.indptr), shape=(b, problem.num_keys))
    return val, x


def spherical_kmeans(problem: Problem, a: np.ndarray, rounds: int) -> np.ndarray:
    """Balanced spherical k-means from partition ``a``: score = cosine to each micro-batch's summed vector.

    A sample's own contribution is left out of its current centroid (leave-one-out), otherwise on data without
    structure every sample prefers where it already is and nothing moves.
    """
    b, k, n = problem.num_samples, problem.num_keys, problem.num_groups
    if k == 0 or n == 1:
        return a
    val, x = _tfidf(problem)
    self_sim = np.bincount(problem.pair_sample, weights=val * val, minlength=b)
    rows = np.arange(b)
    for _ in range(rounds):
        sums = np.bincount(a[problem.pair_sample] * k + problem.pair_key, weights=val, minlength=n * k).reshape(n, k)
        score = np.asarray(x @ sums.T)
        score[rows, a] -= self_sim
        score /= np.maximum(np.linalg.norm(sums, axis=1), 1e-12)[None, :]
        nxt = balanced_argmax(score, problem.caps)
        if np.array_equal(nxt, a):
            break
        a = nxt
    return a


def minhash_partition(problem: Problem, seed: int) -> np.ndarray:
    a = chunk_order(minhash_order(problem, seed), problem.caps)
    a = spherical_kmeans(problem, a, rounds=8)
    return swap_refine(problem, a, max_passes=3)


def _sklearn_seed_partition(problem: Problem, seed: int, restarts: int) -> np.ndarray:
    """KMeans on a TruncatedSVD embedding, then the optimal balanced assignment to the centroids."""
    # start-up time: scikit-learn and scipy.optimize load only when this method runs (the default method uses neither)
    from scipy.optimize import linear_sum_assignment
    from sklearn.cluster import KMeans
    from sklearn.decomposition import TruncatedSVD
    from threadpoolctl import threadpool_limits

    b, n = problem.num_samples, problem.num_groups
    _, x = _tfidf(problem)
    dims = int(min(32, problem.num_keys - 1, b - 1))
    # One BLAS thread: the data stage shares its cores with the trainer, and oversubscribed BLAS runs slower.
    with threadpool_limits(limits=1):
        if dims >= 2:
            emb = TruncatedSVD(n_components=dims, n_iter=3, random_state=seed).fit_transform(x)
        else:
            emb = x.toarray()
        km = KMeans(n_clusters=n, n_init=restarts, random_state=seed).fit(emb)
    dist = ((emb[:, None, :] - km.cluster_centers_[None, :, :]) ** 2).sum(axis=2)  # [B, N]
    slots = np.repeat(np.arange(n), problem.caps)  # one column per seat: an optimal balanced assignment
    rows, cols = linear_sum_assignment(dist[:, slots])
    a = np.empty(b, dtype=np.int64)
    a[rows] = slots[cols]
    return a


def kmeans_partition(problem: Problem, seed: int) -> np.ndarray:
    if problem.num_keys == 0 or problem.num_groups == 1:
        return random_partition(problem, seed)
    candidates = [minhash_partition(problem, seed)]
    a = _sklearn_seed_partition(problem, seed, restarts=4)
    a = spherical_kmeans(problem, a, rounds=15)
    a = reassign_refine(problem, a, max_passes=5)
    candidates.append(swap_refine(problem, a, max_passes=20))
    costs = [problem.cost(c) for c in candidates]
    return candidates[int(np.argmin(costs))]


METHODS = {
    "random": random_partition,
    "minhash": minhash_partition,
    "kmeans": kmeans_partition,
}
DEFAULT_METHOD = "minhash"
