"""Partition a batch's samples into micro-batches and extract unique keys.

Invariant: ``assign`` returns a balanced partition (micro-batch sizes differ by at most one) and is deterministic
for a seed. Only the partition changes; the samples and so the batch's summed gradient do not.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np


def _check(values: np.ndarray, offsets: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    values = np.asarray(values, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(values):
        raise ValueError("offsets must be int64 of length B+1 with offsets[0] == 0 and offsets[-1] == len(values)")
    if np.any(np.diff(offsets) < 0):
        raise ValueError("offsets must be non-decreasing")
    return values, offsets


def assign(values, offsets, num_micro_batches: int, *, method: str = "default", seed: int = 0, weights=None) -> np.ndarray:
    """Micro-batch id (0..N-1) of each sample; balanced and deterministic for ``seed``."""
    values, offsets = _check(values, offsets)
    b = len(offsets) - 1
    n = int(num_micro_batches)
    if n < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {n}")
    if n > b:
        raise ValueError(f"num_micro_batches={n} exceeds the batch size {b}: some micro-batches would be empty")
    if method not in ("default", "random"):
        raise ValueError(f"unknown clustering method {method!r}")
    rng = np.random.default_rng(seed)
    perm = rng.permutation(b)
    out = np.empty(b, dtype=np.int32)
    out[perm] = np.arange(b) % n
    return out


def redundancy(values, offsets, assignment) -> float:
    """Sum over micro-batches of unique-key counts / the batch's unique-key count (1.0 is the lower bound)."""
    values, offsets = _check(values, offsets)
    total = len(np.unique(values))
    if total == 0:
        return 1.0
    sample_of = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    mb = np.asarray(assignment)[sample_of].astype(np.int64)
    pairs = np.unique(np.stack([mb, values]), axis=1)
    return pairs.shape[1] / total


def unique_keys(values, offsets, assignment) -> Tuple[np.ndarray, np.ndarray, List[np.ndarray]]:
    """(sorted unique keys, int32 inverse of every occurrence, per-micro-batch int32 positions into unique)."""
    values, offsets = _check(values, offsets)
    assignment = np.asarray(assignment)
    uniq, inverse = np.unique(values, return_inverse=True)
    inverse = inverse.astype(np.int32)
    n = int(assignment.max()) + 1 if len(assignment) else 0
    sample_of = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    mb_of_value = assignment[sample_of]
    per_mb = [np.unique(inverse[mb_of_value == i]).astype(np.int32) for i in range(n)]
    return uniq, inverse, per_mb
