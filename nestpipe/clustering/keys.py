"""Combine the keys of several tables into one 64-bit id space.

``combine_keys(table_id, keys)`` = ``mix64(keys XOR salt(table_id))`` where ``salt(t) = mix64(t + GOLDEN)`` and
``mix64`` is the SplitMix64 finaliser of :mod:`nestpipe.utils.hashing` (xor-shift / multiply by odd constants, all
modulo 2**64). Every step is an
invertible map of 64-bit words, so for a fixed table id the map key -> combined id is a bijection: two different
keys of one table never collide. All arithmetic runs on ``uint64`` arrays, which wrap modulo 2**64 by definition,
so no input (int64 extremes included) overflows or warns; the result is reinterpreted as int64.

Across tables collisions are possible but unlikely: (t1, k1) and (t2, k2) collide exactly when
``k2 == k1 ^ salt(t1) ^ salt(t2)``. The salts are pseudo-random 64-bit words, so for n1 and n2 distinct keys of two
tables the expected number of colliding pairs is about ``n1 * n2 / 2**64`` (about 1e-9 for two tables of 1e5 keys
in one batch; 0.05 for two tables of 1e9 keys each). Clustering tolerates a collision (it only merges two keys'
costs); nothing that needs exact per-table ids (the trainer's lookups) uses combined ids.
"""

from __future__ import annotations

import numpy as np

from nestpipe.utils.hashing import GAMMA, mix64

_GOLDEN = np.uint64(GAMMA)


def table_salt(table_id: int) -> np.uint64:
    """The 64-bit salt of a table id: ``mix64(table_id + GOLDEN)`` modulo 2**64."""
    return mix64(np.array([(int(table_id) + int(_GOLDEN)) % (1 << 64)], dtype=np.uint64))[0]


def combine_keys(table_id: int, keys) -> np.ndarray:
    """int64 ids of ``keys`` of table ``table_id`` in a space shared by all tables (see the module docstring).

    ``keys`` is any integer array (int64 extremes allowed); ``table_id`` a non-negative int. Deterministic across
    runs, platforms and NumPy versions.
    """
    if isinstance(table_id, (bool, np.bool_)) or not isinstance(table_id, (int, np.integer)):
        raise TypeError(f"table_id must be an int, got {type(table_id).__name__}")
    if int(table_id) < 0:
        raise ValueError(f"table_id must be >= 0, got {table_id}")
    arr = np.asarray(keys)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"keys must be an integer array, got dtype {arr.dtype}")
    if arr.dtype == np.uint64:
        words = arr.astype(np.uint64, copy=False)
    else:
        words = arr.astype(np.int64, copy=False).view(np.uint64)
    return mix64(words ^ table_salt(int(table_id))).view(np.int64)
