"""SplitMix64: the one 64-bit hash of the package (Steele, Lea and Flood, "Fast splittable pseudorandom number
generators", 2014).

``mix64`` is the generator's output finaliser (xor-shift 30 / multiply / xor-shift 27 / multiply / xor-shift 31, all
modulo 2**64), a bijection on 64-bit words; ``splitmix64(x, k)`` = ``mix64(x + k * GAMMA)`` with the golden gamma
``GAMMA = 0x9E3779B97F4A7C15`` (``k = 1``: the generator's step from state ``x``). Every user picks its own ``k`` and
keeps it, so the values it derives never change:

- embedding row placement and row initialisation (``nestpipe.kernels.row_placement``,
  ``nestpipe.trainer.embedding.placement``), the trainer's negatives stream: ``splitmix64(x)`` (k = 1);
- key combination and MinHash clustering (``nestpipe.clustering``): the bare finaliser ``mix64``;
- the synthetic data's per-id attributes (``nestpipe.datasets.synth``): ``splitmix64(x, salt + 1)``.

Three forms with identical values: NumPy ``uint64`` arrays (wrapping arithmetic), torch ``int64`` tensors (the
unsigned result's bit pattern; torch's int64 arithmetic wraps the same way) and Python ints (the reference).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the torch form only: the ingest and the synthetic data use the NumPy form without loading torch
    import torch

GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1

_U30, _U27, _U31 = np.uint64(30), np.uint64(27), np.uint64(31)
_UM1, _UM2 = np.uint64(MIX1), np.uint64(MIX2)


def mix64(x) -> np.ndarray:
    """The SplitMix64 finaliser of every element of a ``uint64`` array (a copy; wrapping arithmetic)."""
    z = np.array(x, dtype=np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> _U30
        z *= _UM1
        z ^= z >> _U27
        z *= _UM2
        z ^= z >> _U31
    return z


def splitmix64(x, k: int = 1) -> np.ndarray:
    """``mix64(x + k * GAMMA)`` of a ``uint64`` array (int64 input is taken by its two's-complement pattern)."""
    arr = np.asarray(x)
    words = arr.view(np.uint64) if arr.dtype == np.int64 else arr.astype(np.uint64)
    with np.errstate(over="ignore"):
        return mix64(words + np.uint64((k * GAMMA) & MASK64))


def mix64_int(value: int) -> int:
    """The finaliser of a Python int taken modulo 2**64 (an unsigned 64-bit int)."""
    z = value & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def splitmix64_int(value: int, k: int = 1) -> int:
    """``mix64_int(value + k * GAMMA)``: the reference of the array forms."""
    return mix64_int(value + k * GAMMA)


def signed64(value: int) -> int:
    """The int64 with the same two's-complement bit pattern as the unsigned 64-bit ``value``."""
    value &= MASK64
    return value - (1 << 64) if value >= (1 << 63) else value


def _logical_shift_right(x: torch.Tensor, shift: int) -> torch.Tensor:
    """``x >> shift`` on the unsigned 64-bit pattern of an int64 tensor (torch's ``>>`` is arithmetic)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def splitmix64_torch(ids: torch.Tensor, k: int = 1) -> torch.Tensor:
    """``splitmix64`` of every element of an integer tensor: int64 in, the unsigned result's int64 pattern out."""
    import torch

    z = ids.to(torch.int64) + signed64(k * GAMMA)
    z = (z ^ _logical_shift_right(z, 30)) * signed64(MIX1)
    z = (z ^ _logical_shift_right(z, 27)) * signed64(MIX2)
    return z ^ _logical_shift_right(z, 31)


def to_vocab(ids, vocab: int) -> np.ndarray:
    """Raw int64 ids into ``[0, vocab)`` as the trainer maps them: in-range ids unchanged, every other id
    ``splitmix64(id) mod vocab`` (step 1 of the row placement, ``nestpipe.kernels.row_placement``)."""
    ids = np.asarray(ids, dtype=np.int64)
    out = ids.copy()
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        out[bad] = (splitmix64(ids[bad]) % np.uint64(vocab)).astype(np.int64)
    return out
