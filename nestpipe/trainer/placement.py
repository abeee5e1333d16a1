"""Row placement: which rank owns which embedding row, and how a row is initialised.

The rule (shared with ``nestpipe.kernels``), for table ``t`` (its index in the sorted table names) with vocabulary
``V`` and world size ``W``:

1. **Into the vocabulary.** An id in ``[0, V)`` is kept. Any other id (negative or ``>= V``) is mapped to
   ``mix64(id) mod V`` where ``mix64`` is the SplitMix64 finaliser applied to the id's 64-bit two's-complement
   pattern. Two raw ids may so share one row; the trainer treats that row like any other.
2. **Permute.** ``p = (a_t * id + b_t) mod V``, a bijection of ``[0, V)`` because ``gcd(a_t, V) == 1``;
   ``a_t`` and ``b_t`` are derived from ``mix64`` of the table id (and a salt, 0 by default).
3. **Own.** With ``R = ceil(V / W)`` rows per rank, rank ``p // R`` owns the row at local index ``p % R``
   (fbgemm ``block_bucketize_sparse_features`` semantics with uniform block sizes ``R``).

Invariants: every in-vocabulary id has exactly one owner and one local row; ranks ``0..W-2`` own ``R`` rows, the
last rank may own fewer. A row's initial value depends only on ``(seed, table, id, column)`` (counter-based hash),
never on the world size, so a run at any world size starts from the same full tables and rows can be
materialised lazily on first touch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Tuple

import numpy as np

_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
MAX_VOCAB = 1 << 31  # a_t * id must fit in int64


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser, elementwise on uint64 (wrapping arithmetic)."""
    z = np.asarray(x).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _C1
        z = (z ^ (z >> np.uint64(27))) * _C2
        z = z ^ (z >> np.uint64(31))
    return z


def _mix_int(x: int) -> int:
    return int(mix64(np.array([x & _M64], dtype=np.uint64))[0])


def to_vocab(ids: np.ndarray, vocab: int) -> np.ndarray:
    """Map raw int64 ids into ``[0, vocab)``: in-range ids unchanged, others ``mix64(id) mod vocab``."""
    ids = np.asarray(ids, dtype=np.int64)
    out = ids.copy()
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        out[bad] = (mix64(ids[bad].view(np.uint64)) % np.uint64(vocab)).astype(np.int64)
    return out


@dataclasses.dataclass(frozen=True)
class TablePlacement:
    """Placement of one table over ``world`` ranks (see the module docstring)."""

    table_id: int
    vocab: int
    world: int
    a: int
    b: int

    @property
    def rows_per_rank(self) -> int:
        return -(-self.vocab // self.world)

    def local_rows(self, rank: int) -> int:
        """Number of rows rank ``rank`` owns."""
        r = self.rows_per_rank
        return max(0, min(self.vocab, (rank + 1) * r) - rank * r)

    def permute(self, ids: np.ndarray) -> np.ndarray:
        """In-vocabulary ids -> permuted position p in ``[0, V)``."""
        ids = np.asarray(ids, dtype=np.int64)
        return (ids * np.int64(self.a) + np.int64(self.b)) % np.int64(self.vocab)

    def unpermute(self, p: np.ndarray) -> np.ndarray:
        """Permuted positions -> in-vocabulary ids (the inverse bijection)."""
        a_inv = pow(self.a, -1, self.vocab) if self.vocab > 1 else 0
        p = np.asarray(p, dtype=np.int64)
        return ((p - np.int64(self.b)) % np.int64(self.vocab)) * np.int64(a_inv) % np.int64(self.vocab)

    def owner_and_row(self, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """In-vocabulary ids -> (owner rank int64, local row int64)."""
        p = self.permute(ids)
        r = np.int64(self.rows_per_rank)
        return p // r, p % r

    def ids_of_rows(self, rank: int, rows: np.ndarray) -> np.ndarray:
        """Local rows of ``rank`` -> the in-vocabulary ids they hold."""
        p = np.int64(rank) * np.int64(self.rows_per_rank) + np.asarray(rows, dtype=np.int64)
        return self.unpermute(p)


def make_placement(table_id: int, vocab: int, world: int, salt: int = 0) -> TablePlacement:
    """The placement of table ``table_id``; ``salt`` != 0 gives a different (still valid) permutation."""
    if vocab < 1:
        raise ValueError(f"table {table_id}: vocabulary must be >= 1, got {vocab}")
    if vocab > MAX_VOCAB:
        raise ValueError(f"table {table_id}: vocabulary {vocab} exceeds the supported {MAX_VOCAB}")
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    h = _mix_int(table_id * 2 + 1 + (salt << 20))
    if vocab == 1:
        return TablePlacement(table_id, vocab, world, 1, 0)
    a = 1 + h % (vocab - 1)
    while math.gcd(a, vocab) != 1:
        a = a + 1 if a + 1 < vocab else 1
    b = _mix_int(h ^ 0x5DEECE66D) % vocab
    return TablePlacement(table_id, vocab, world, a, b)


def init_rows(seed: int, table_id: int, ids: np.ndarray, dim: int, scale: float) -> np.ndarray:
    """float32 [n, dim] initial rows, uniform in ``[-scale, scale)``, a pure function of (seed, table, id, column)."""
    ids = np.asarray(ids, dtype=np.int64).view(np.uint64)
    base = mix64(mix64(np.array([seed & _M64], dtype=np.uint64)) ^ np.uint64(table_id))
    h = mix64(base ^ ids)  # [n]
    cols = np.arange(dim, dtype=np.uint64) * _GOLDEN
    with np.errstate(over="ignore"):
        z = mix64(h[:, None] + cols[None, :])
    u = (z >> np.uint64(40)).astype(np.float64) * (1.0 / (1 << 24))  # exact in float32
    return ((2.0 * u - 1.0) * scale).astype(np.float32)
