"""Cluster a Criteo-style multi-table CTR batch (not KuaiRand) into micro-batches.

A CTR batch has 26 categorical tables (one id per sample) plus a multi-hot history of recent ad ids. Ads belong
to advertisers' campaigns, and users mostly see ads of a few campaigns, so samples of the same campaign share
keys. The keys of all tables are merged into one id space with ``combine_keys`` and weighted by their row bytes
(dim x 4), so a 128-dim row counts 8 times a 16-dim one. Run: ``python examples/criteo_style_clustering.py``.
"""

import numpy as np

from nestpipe.clustering import assign, combine_keys, redundancy, unique_keys

B, N, CAMPAIGNS = 512, 8, 16
rng = np.random.default_rng(0)
campaign = rng.integers(0, CAMPAIGNS, B)

# table id -> (keys of every sample, dim). Tables 0..9 depend on the campaign, 10..25 are campaign-free.
tables = {}
for t in range(26):
    vocab = int(10 ** (1 + 5 * t / 25))
    noise = rng.zipf(1.3, B) % vocab
    tables[t] = ((campaign * 50 + rng.integers(0, 50, B)) % vocab if t < 10 else noise, 16 if t >= 10 else 64)
history_len = rng.integers(5, 30, B)
history = np.concatenate([c * 400 + rng.integers(0, 400, n) for c, n in zip(campaign, history_len)])

# One jagged batch: per sample, its 26 single ids then its history, all keys combined across tables.
values, weights, lengths = [], [], np.full(B, 26) + history_len
hist_off = np.r_[0, np.cumsum(history_len)]
for s in range(B):  # readable example code; the ingest does this with array operations
    for t, (keys, dim) in tables.items():
        values.append(combine_keys(t, keys[s:s + 1])[0])
        weights.append(4.0 * dim)
    values.extend(combine_keys(26, history[hist_off[s]:hist_off[s + 1]]))
    weights.extend([4.0 * 128] * history_len[s])
values = np.asarray(values, dtype=np.int64)
weights = np.asarray(weights)
offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)

for method in ("random", "default", "kmeans"):
    a = assign(values, offsets, N, method=method, seed=0, weights=weights)
    print(f"{method:>8}: redundancy {redundancy(values, offsets, a):.3f} (rows), "
          f"{redundancy(values, offsets, a, weights=weights):.3f} (bytes); micro-batch sizes {np.bincount(a).tolist()}")

# What the trainer receives for the history table (unique-based exchange): unique ids, inverse, per-micro-batch lists.
a = assign(values, offsets, N, weights=weights)
uniq, inverse, per_mb = unique_keys(history, hist_off.astype(np.int64), a)
assert np.array_equal(uniq[inverse], history)
print(f"history table: {len(uniq)} unique ids, rows sent per micro-batch {[len(p) for p in per_mb]} "
      f"(sum {sum(len(p) for p in per_mb)} vs {len(uniq)} ideal)")
