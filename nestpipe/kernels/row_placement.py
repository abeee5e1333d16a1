"""Row placement shared by the trainer and the kernels: the one rule (``nestpipe.trainer.embedding.placement`` builds
its per-table placements from :func:`affine_params` and hashes with the same :mod:`nestpipe.utils.hashing`).

For table ``t`` with vocabulary ``V`` on ``W`` ranks an id goes through three steps:

1. **into the vocabulary**: ids in ``[0, V)`` are kept; any other int64 id (negative, or ``>= V``) becomes
   ``splitmix64(id) mod V``, where ``splitmix64`` is the finaliser of Steele et al.'s SplitMix64 applied to the
   id's 64-bit two's-complement pattern after adding the golden gamma ``0x9E3779B97F4A7C15`` (all mod 2**64), and
   ``mod`` is taken on the unsigned 64-bit value.
2. **bijective affine permutation**: ``p = (a_t * x + b_t) mod V`` with ``a_t`` coprime with ``V`` (see
   :func:`affine_params`), so hot ids that are numerically close spread over all ranks.
3. **block placement**: with ``block = ceil(V / W)``, owner ``p // block`` at local row ``p % block``. This is
   exactly what fbgemm ``block_bucketize_sparse_features`` computes with block size ``block``.

Every step is exact int64 arithmetic, safe for ids at the int64 extremes: the product ``a_t * x`` is formed in
chunks so it never overflows (vocabularies up to ``2**52`` rows are supported).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from nestpipe.utils.hashing import signed64 as _signed64  # noqa: F401  (re-exported for tests)
from nestpipe.utils.hashing import splitmix64_int
from nestpipe.utils.hashing import splitmix64_torch as splitmix64

MAX_VOCAB = 1 << 52


def _unsigned_mod(z: torch.Tensor, modulus: int) -> torch.Tensor:
    """``u mod modulus`` where ``u`` is the unsigned 64-bit value whose bit pattern ``z`` holds."""
    rem = torch.remainder(z, modulus)  # in [0, modulus); equals u mod modulus for z >= 0
    wrap = (1 << 64) % modulus  # u = z + 2**64 when z < 0
    return torch.where(z < 0, torch.remainder(rem + wrap, modulus), rem)


def _check_vocab(vocab: int) -> None:
    if not isinstance(vocab, int) or vocab < 1 or vocab > MAX_VOCAB:
        raise ValueError(f"vocabulary size must be an int in [1, 2**52], got {vocab!r}")


def map_into_vocab(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Step 1: ids in ``[0, vocab)`` unchanged, every other id to ``splitmix64(id) mod vocab``."""
    _check_vocab(vocab)
    ids = ids.to(torch.int64)
    inside = (ids >= 0) & (ids < vocab)
    return torch.where(inside, ids, _unsigned_mod(splitmix64(ids), vocab))


def affine_params(table_id: int, vocab: int, salt: int = 0) -> Tuple[int, int]:
    """``(a_t, b_t)`` of table ``table_id``: with ``h = splitmix64(2 t + 1 + salt * 2**20)``, ``a_t = 1 + h mod
    (vocab - 1)`` moved up to the next value coprime with ``vocab`` (1 when vocab = 1), ``b_t =
    splitmix64(h xor 0x5DEECE66D) mod vocab`` (0 when vocab = 1). Pure functions of ``(table_id, vocab, salt)``:
    identical on every rank, and the trainer's placement (``nestpipe.trainer.embedding.placement``) is built from
    them (``salt`` != 0 gives another valid permutation, for tests)."""
    _check_vocab(vocab)
    if vocab == 1:
        return 1, 0
    h = splitmix64_int(table_id * 2 + 1 + (salt << 20))
    a = 1 + h % (vocab - 1)
    while math.gcd(a, vocab) != 1:
        a = a + 1 if a + 1 < vocab else 1
    return a, splitmix64_int(h ^ 0x5DEECE66D) % vocab


def mulmod(x: torch.Tensor, a: int, modulus: int) -> torch.Tensor:
    """``(a * x) mod modulus`` for ``x`` in ``[0, modulus)`` and ``a`` in ``[0, modulus)``, without int64 overflow.

    ``x`` is consumed in chunks of ``s = 62 - bits(modulus)`` bits from the top (Horner's rule), so every
    intermediate stays below ``2**63``. For ``modulus < 2**31`` this is a single multiply.
    """
    bits = max(1, (modulus - 1).bit_length())
    step = 62 - bits
    if step >= bits:
        return torch.remainder(x * a, modulus)
    result = torch.zeros_like(x)
    top = ((bits + step - 1) // step) * step
    for shift in range(top - step, -1, -step):
        chunk = (x >> shift) & ((1 << step) - 1)
        result = torch.remainder(result * (1 << step) + chunk * a, modulus)
    return result


def placement_hash(table_id: int, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Steps 1 and 2: the permuted row ``p`` in ``[0, vocab)`` of every id (a bijection on ``[0, vocab)``)."""
    a, b = affine_params(table_id, vocab)
    x = map_into_vocab(ids, vocab)
    return torch.remainder(mulmod(x, a, vocab) + b, vocab)


def block_size(vocab: int, world: int) -> int:
    """Rows per owner block: ``ceil(vocab / world)``."""
    _check_vocab(vocab)
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world size must be a positive int, got {world!r}")
    return -(-vocab // world)


def owner_num_rows(vocab: int, world: int, rank: int) -> int:
    """Rows stored by ``rank`` (the last ranks may hold fewer, or none when ``world`` does not divide well)."""
    block = block_size(vocab, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside [0, {world})")
    return max(0, min(block, vocab - rank * block))


def placement(table_id: int, ids: torch.Tensor, vocab: int, world: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(owner rank, local row)`` of every id of table ``table_id`` (both int64, same shape as ``ids``)."""
    block = block_size(vocab, world)
    p = placement_hash(table_id, ids, vocab)
    return p // block, p % block
