"""Partition a batch's samples into micro-batches and extract unique keys (the public entry points).

Invariant: ``assign`` returns a balanced partition (micro-batch sizes differ by at most one; micro-batch g has
``ceil(B/N)`` samples for g < B % N and ``floor(B/N)`` otherwise) and is deterministic for a seed. Only the
partition changes; the samples, and so the batch's summed gradient, do not.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from nestpipe.clustering.balance import capacities, chunk_order
from nestpipe.clustering.incidence import build_incidence, check_batch
from nestpipe.clustering.methods import DEFAULT_METHOD, METHODS
from nestpipe.clustering.objective import redundancy, unique_keys, unique_keys_packed
from nestpipe.clustering.refine import Problem, greedy_swap_refine

__all__ = ["assign", "refine", "redundancy", "unique_keys", "method_names", "table_fields", "tables_fields"]


def method_names():
    """Accepted values of ``assign(method=...)``: ``default`` plus every registered method."""
    return ["default", *METHODS]


def assign(values, offsets, num_micro_batches: int, *, method: str = "default", seed: int = 0, weights=None) -> np.ndarray:
    """Micro-batch id (0..N-1, int32) of each of the B samples, chosen to minimise redundancy.

    ``values``: int64 keys of all samples concatenated (combine several tables with ``combine_keys``);
    ``offsets``: int64 [B+1]; ``weights``: optional cost per key occurrence (equal for equal keys, e.g. the row's
    bytes) so costlier rows weigh more. ``method``: ``default`` (= ``minhash``), ``minhash``, ``kmeans`` or
    ``random`` (see ``nestpipe.clustering.methods``). Requires 1 <= N <= B.
    """
    values, offsets = check_batch(values, offsets)
    b = len(offsets) - 1
    if isinstance(num_micro_batches, (bool, np.bool_)) or not isinstance(num_micro_batches, (int, np.integer)):
        raise TypeError(f"num_micro_batches must be an int, got {type(num_micro_batches).__name__}")
    n = int(num_micro_batches)
    if n < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {n}")
    if n > b:
        raise ValueError(f"num_micro_batches={n} exceeds the batch size B={b}: some micro-batches would be empty")
    name = DEFAULT_METHOD if method == "default" else method
    if name not in METHODS:
        raise ValueError(f"unknown clustering method {method!r}; choose one of {method_names()}")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    caps = capacities(b, n)
    if n == 1:
        return np.zeros(b, dtype=np.int32)
    if name == "random":  # needs no keys: skip building the incidence
        if weights is not None:
            build_incidence(values, offsets, weights)  # still validate the weights
        return chunk_order(np.random.default_rng(int(seed)).permutation(b), caps).astype(np.int32)
    problem = Problem(build_incidence(values, offsets, weights), caps)
    return METHODS[name](problem, int(seed)).astype(np.int32)


def refine(values, offsets, mb, num_micro_batches: int, *, costs=None, max_load: Optional[float] = None,
           max_rounds: int = 32) -> np.ndarray:
    """``mb`` (a partition of the batch's samples, e.g. from :func:`assign`) improved by single exact-gain swaps
    (:func:`~nestpipe.clustering.refine.greedy_swap_refine`): never more rows, the same micro-batch sizes. With
    ``costs`` (one per sample) and ``max_load``: every swap keeps every micro-batch's summed cost at most ``max_load``
    (or at most the input's own costliest micro-batch, if that is larger). ``max_rounds``: at most this many
    rounds of swaps (each scores the samples that gain most by moving against every partner once)."""
    values, offsets = check_batch(values, offsets)
    mb = np.asarray(mb)
    b, n = len(offsets) - 1, int(num_micro_batches)
    if mb.dtype.kind not in "iu":
        raise TypeError(f"mb must hold integer micro-batch ids, got dtype {mb.dtype}")
    mb = mb.astype(np.int64)
    if mb.shape != (b,) or (b and (mb.min() < 0 or mb.max() >= n)):
        raise ValueError(f"mb must give each of the {b} samples a micro-batch in 0..{n - 1}")
    if (costs is None) != (max_load is None):
        raise ValueError("costs and max_load go together")
    if costs is not None and np.shape(costs) != (b,):
        raise ValueError(f"costs must give one cost per sample ({b}), got shape {np.shape(costs)}")
    if costs is not None and not (np.all(np.isfinite(costs)) and np.isfinite(max_load) and max_load >= 0):
        raise ValueError(f"costs and max_load must be finite and max_load >= 0, got max_load {max_load!r}")
    if n == 1 or b < 2:
        return mb.astype(np.int32)
    problem = Problem(build_incidence(values, offsets), np.bincount(mb, minlength=n))
    return greedy_swap_refine(problem, mb, int(max_rounds), costs=costs, max_load=max_load).astype(np.int32)


def tables_fields(tables: Mapping[str, Tuple[np.ndarray, np.ndarray]], mb,
                  num_micro_batches: Optional[int] = None) -> Dict[str, Dict[str, np.ndarray]]:
    """Every table's six shard fields of one batch (``nestpipe.datasets.shards``: ``values``, ``lengths``,
    ``unique``, ``inverse``, ``mb_unique``, ``mb_offsets``), in the shard format's dtypes, from each table's keys
    and per-sample lengths (``tables[name] = (values, lengths)``) and the batch's micro-batch partition ``mb``.
    ``unique`` is sorted; ``inverse`` maps every value to its position in ``unique``; micro-batch i's keys are
    ``mb_unique[mb_offsets[i]:mb_offsets[i + 1]]``. All tables' unique keys come from one pass
    (:func:`~nestpipe.clustering.objective.unique_keys_packed`)."""
    names = list(tables)
    packed = []
    for name in names:
        values, lengths = tables[name]
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(np.asarray(lengths), out=offsets[1:])
        packed.append((values, offsets))
    results = unique_keys_packed(packed, mb, num_micro_batches=num_micro_batches)
    out = {}
    for name, (uniq, inverse, mb_unique, mb_offsets) in zip(names, results):
        values, lengths = tables[name]
        out[name] = {
            "values": np.asarray(values).astype(np.int64, copy=False),
            "lengths": np.asarray(lengths).astype(np.int32, copy=False),
            "unique": uniq.astype(np.int64, copy=False), "inverse": inverse.astype(np.int32, copy=False),
            "mb_unique": mb_unique.astype(np.int32, copy=False), "mb_offsets": mb_offsets.astype(np.int64, copy=False),
        }
    return out


def table_fields(values, lengths, mb, num_micro_batches: Optional[int] = None) -> Dict[str, np.ndarray]:
    """One table's six shard fields of one batch: :func:`tables_fields` for a single table."""
    return tables_fields({"table": (values, lengths)}, mb, num_micro_batches)["table"]
