"""Input validation and the sample-key incidence of a batch, built with sorts only (no Python loops).

Why hand-written: ``np.unique(..., return_inverse=True)`` takes a general path with more passes than one
``np.argsort`` plus a boundary mask, which gives the same groups, and these helpers run on every batch of the ingest.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import numpy as np

INT32_MAX = np.iinfo(np.int32).max


def check_batch(values, offsets) -> Tuple[np.ndarray, np.ndarray]:
    """Validate jagged ``values``/``offsets``; return them as int64 arrays (no copy when already int64).

    ``values``: 1-D integer keys (uint64 is reinterpreted bit for bit as int64). ``offsets``: 1-D integers of
    length B+1, ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == len(values)``.
    """
    values = np.asarray(values)
    offsets = np.asarray(offsets)
    if values.ndim != 1:
        raise ValueError(f"values must be 1-D, got shape {values.shape}")
    if values.size and values.dtype.kind not in "iu":
        raise TypeError(f"values must be integer keys, got dtype {values.dtype}")
    values = values.view(np.int64) if values.dtype == np.uint64 else values.astype(np.int64, copy=False)
    if offsets.ndim != 1 or len(offsets) < 1:
        raise ValueError(f"offsets must be 1-D of length B+1 >= 1, got shape {offsets.shape}")
    if offsets.size and offsets.dtype.kind not in "iu":
        raise TypeError(f"offsets must be integers, got dtype {offsets.dtype}")
    offsets = offsets.astype(np.int64, copy=False)
    if offsets[0] != 0:
        raise ValueError(f"offsets[0] must be 0, got {offsets[0]}")
    if offsets[-1] != len(values):
        raise ValueError(f"offsets[-1] must equal len(values)={len(values)}, got {offsets[-1]}")
    if len(offsets) > 1 and np.any(offsets[1:] < offsets[:-1]):
        raise ValueError("offsets must be non-decreasing (a sample cannot have a negative length)")
    if len(values) > INT32_MAX:
        raise ValueError(f"a batch holds at most {INT32_MAX} keys (int32 inverse), got {len(values)}")
    return values, offsets


def check_assignment(assignment, num_samples: int, num_micro_batches: Optional[int] = None) -> Tuple[np.ndarray, int]:
    """Validate a micro-batch id per sample; return (int64 ids, N). N defaults to max id + 1."""
    a = np.asarray(assignment)
    if a.shape != (num_samples,):
        raise ValueError(f"assignment must have one micro-batch id per sample: shape ({num_samples},), got {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"assignment must hold integer micro-batch ids, got dtype {a.dtype}")
    a = a.astype(np.int64, copy=False)
    if a.size and a.min() < 0:
        raise ValueError(f"assignment holds a negative micro-batch id ({a.min()})")
    n = int(a.max()) + 1 if a.size else 0
    if num_micro_batches is not None:
        if a.size and n > num_micro_batches:
            raise ValueError(f"assignment holds micro-batch id {n - 1} >= num_micro_batches={num_micro_batches}")
        n = int(num_micro_batches)
    return a, n


def unique_inverse(values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(sorted unique values, int64 inverse) with ``unique[inverse] == values``; one argsort, no loops."""
    n = len(values)
    if n == 0:
        return values[:0].copy(), np.zeros(0, dtype=np.int64)
    order = np.argsort(values)
    sorted_values = values[order]
    starts = np.empty(n, dtype=bool)
    starts[0] = True
    np.not_equal(sorted_values[1:], sorted_values[:-1], out=starts[1:])
    inverse = np.empty(n, dtype=np.int64)
    inverse[order] = starts.astype(np.int64).cumsum() - 1  # a bool cumsum is several times slower
    return sorted_values[starts], inverse


def sample_of_occurrence(offsets: np.ndarray) -> np.ndarray:
    """int64 sample index of every key occurrence."""
    return np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets))


def distinct_codes(codes: np.ndarray) -> np.ndarray:
    """Sorted distinct values of an int64 array (sort + boundary mask)."""
    if len(codes) == 0:
        return codes[:0].copy()
    s = np.sort(codes)
    keep = np.empty(len(s), dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


@dataclasses.dataclass
class Incidence:
    """Which keys each sample holds, each (sample, key) pair once.

    Invariants: ``keys`` sorted unique; ``keys[inverse] == values``; ``pair_sample``/``pair_key`` list every
    distinct (sample, key-index) pair once, sorted by sample then key; ``doc_freq[k]`` = number of samples holding
    key k; ``key_weight[k]`` = cost of key k (1.0 unless per-occurrence weights were given).
    """

    num_samples: int
    keys: np.ndarray
    inverse: np.ndarray
    pair_sample: np.ndarray
    pair_key: np.ndarray
    doc_freq: np.ndarray
    key_weight: np.ndarray

    @property
    def num_keys(self) -> int:
        return len(self.keys)


def build_incidence(values: np.ndarray, offsets: np.ndarray, weights=None) -> Incidence:
    """Incidence of a validated batch; ``weights`` (optional) is a non-negative cost per key occurrence."""
    keys, inverse = unique_inverse(values)
    k = len(keys)
    b = len(offsets) - 1
    key_weight = np.ones(k, dtype=np.float64)
    if weights is not None:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != values.shape:
            raise ValueError(f"weights must give one cost per key occurrence: shape {values.shape}, got {w.shape}")
        if not np.all(np.isfinite(w)) or (w.size and w.min() < 0):
            raise ValueError("weights must be finite and >= 0")
        key_weight[inverse] = w
        if not np.array_equal(key_weight[inverse], w):
            raise ValueError("weights must be equal for every occurrence of the same key")
    if k == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Incidence(b, keys, inverse, empty, empty, empty, key_weight)
    pairs = distinct_codes(sample_of_occurrence(offsets) * k + inverse)
    pair_sample, pair_key = np.divmod(pairs, k)
    doc_freq = np.bincount(pair_key, minlength=k)
    return Incidence(b, keys, inverse, pair_sample, pair_key, doc_freq, key_weight)
