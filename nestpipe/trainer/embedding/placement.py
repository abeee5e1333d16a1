"""Row placement: which rank owns which embedding row, and how a row is initialised.

The rule (``nestpipe.kernels.row_placement``: :func:`~nestpipe.kernels.row_placement.affine_params` and the hash of
:mod:`nestpipe.utils.hashing`, here in NumPy with owner subsets), for table ``t`` (its index in the sorted table names) with vocabulary
``V`` and world size ``W``:

1. **Into the vocabulary.** An id in ``[0, V)`` is kept. Any other id (negative or ``>= V``) is mapped to
   ``splitmix64(id) mod V`` (SplitMix64 of the id's 64-bit two's-complement pattern). Two raw ids may so share one row; the trainer treats that row like any other.
2. **Permute.** ``p = (a_t * id + b_t) mod V``, a bijection of ``[0, V)`` because ``gcd(a_t, V) == 1``;
   ``a_t`` and ``b_t`` are derived from ``splitmix64`` of the table id (and a salt, 0 by default).
3. **Own.** The table is cut into ``k`` row shards held by the ranks ``owners = (o_0, ..., o_{k-1})`` (distinct;
   by default every rank, ``o_j = j``; the sharding plan of :mod:`nestpipe.trainer.sharding_plan` may give a
   table one owner, *table-wise*, or a subset, *row-wise over k ranks*). With ``R = ceil(V / k)`` rows per shard,
   rank ``o_(p // R)`` owns the row at local index ``p % R`` (fbgemm ``block_bucketize_sparse_features``
   semantics with uniform block sizes ``R``, followed by the shard -> rank map).

Invariants: every in-vocabulary id has exactly one owner and one local row; shards ``0..k-2`` hold ``R`` rows, the
last may hold fewer; a rank outside ``owners`` holds no row of the table. A row's initial value depends only on ``(seed, table, id, column)`` (counter-based hash),
never on the world size, so a run at any world size starts from the same full tables and rows can be
materialised lazily on first touch.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple

import numpy as np

from nestpipe import kernels
from nestpipe.kernels.row_placement import affine_params
from nestpipe.utils.hashing import GAMMA, splitmix64, to_vocab  # noqa: F401  (to_vocab: the trainer's name)

_GOLDEN = np.uint64(GAMMA)
MAX_VOCAB = 1 << 31  # a_t * id must fit in int64


@dataclasses.dataclass(frozen=True)
class TablePlacement:
    """Placement of one table over ``world`` ranks (see the module docstring). ``owners``: the ranks holding the
    table's row shards in shard order; empty means every rank (``owners == range(world)``)."""

    table_id: int
    vocab: int
    world: int
    a: int
    b: int
    owners: Tuple[int, ...] = ()

    def __post_init__(self):
        own = self.owner_ranks
        if len(set(own)) != len(own) or any(not 0 <= o < self.world for o in own):
            raise ValueError(f"table {self.table_id}: owners {list(own)} must be distinct ranks in [0, {self.world})")

    @property
    def owner_ranks(self) -> Tuple[int, ...]:
        return tuple(self.owners) if self.owners else tuple(range(self.world))

    @property
    def shards(self) -> int:
        return len(self.owner_ranks)

    @property
    def rows_per_rank(self) -> int:
        """Rows per shard ``R`` (the last shard may hold fewer)."""
        return -(-self.vocab // self.shards)

    def shard_of(self, rank: int) -> int:
        """Shard index held by ``rank``, or -1 when it holds none of this table."""
        own = self.owner_ranks
        return own.index(rank) if rank in own else -1

    def local_rows(self, rank: int) -> int:
        """Number of rows rank ``rank`` owns."""
        j = self.shard_of(rank)
        if j < 0:
            return 0
        r = self.rows_per_rank
        return max(0, min(self.vocab, (j + 1) * r) - j * r)

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
        """In-vocabulary ids -> (owner rank int64, local row int64), through the kernels' dispatch
        (:func:`nestpipe.kernels.place_keys`)."""
        return kernels.place_keys(ids, self.a, self.b, self.vocab, self.rows_per_rank, self.owners)

    def ids_of_rows(self, rank: int, rows: np.ndarray) -> np.ndarray:
        """Local rows of ``rank`` -> the in-vocabulary ids they hold."""
        j = self.shard_of(rank)
        if j < 0:
            raise ValueError(f"table {self.table_id}: rank {rank} holds no shard (owners {list(self.owner_ranks)})")
        p = np.int64(j) * np.int64(self.rows_per_rank) + np.asarray(rows, dtype=np.int64)
        return self.unpermute(p)


def make_placement(table_id: int, vocab: int, world: int, salt: int = 0,
                   owners: Sequence[int] = ()) -> TablePlacement:
    """The placement of table ``table_id``; ``salt`` != 0 gives a different (still valid) permutation; ``owners``
    the ranks holding its row shards (default: all)."""
    if vocab < 1:
        raise ValueError(f"table {table_id}: vocabulary must be >= 1, got {vocab}")
    if vocab > MAX_VOCAB:
        raise ValueError(f"table {table_id}: vocabulary {vocab} exceeds the supported {MAX_VOCAB}")
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    a, b = affine_params(table_id, vocab, salt)
    return TablePlacement(table_id, vocab, world, a, b, _owners(owners, world))


def _owners(owners: Sequence[int], world: int) -> Tuple[int, ...]:
    own = tuple(int(o) for o in owners)
    return () if own == tuple(range(world)) else own


def init_rows(seed: int, table_id: int, ids: np.ndarray, dim: int, scale: float, first_col: int = 0) -> np.ndarray:
    """float32 [n, dim] initial rows, uniform in ``[-scale, scale)``, a pure function of (seed, table, id, column):
    columns ``first_col .. first_col + dim - 1`` of the full rows (a column shard starts where its columns start, so
    a table split by columns starts from the same values as the whole table)."""
    ids = np.asarray(ids, dtype=np.int64).view(np.uint64)
    base = splitmix64(splitmix64(np.array([seed & ((1 << 64) - 1)], dtype=np.uint64)) ^ np.uint64(table_id))
    h = splitmix64(base ^ ids)  # [n]
    with np.errstate(over="ignore"):
        cols = np.arange(first_col, first_col + dim, dtype=np.uint64) * _GOLDEN
        z = splitmix64(h[:, None] + cols[None, :])
    u = (z >> np.uint64(40)).astype(np.float64) * (1.0 / (1 << 24))  # exact in float32
    return ((2.0 * u - 1.0) * scale).astype(np.float32)
