"""Key routing: placement hash + dedup + bucketize by owner, shared by every path.

Only the bucketize step differs between paths (fbgemm ``block_bucketize_sparse_features`` or a plain-torch stable
sort by owner); both produce the same integers, which the tests check exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .row_placement import block_size, placement_hash


@dataclass
class RoutedKeys:
    """The routing of one batch's keys (T tables, W owners).

    Invariants:
      * ``unique_keys``: the placement-hashed rows ``p`` of the batch's distinct keys, table-major and strictly
        ascending within a table; ``unique_offsets[t]:unique_offsets[t + 1]`` is table ``t``'s slice.
      * ``inverse[i]``: position in ``unique_keys`` of token ``i`` (``unique_keys[inverse[i]]`` is its row).
      * ``send_rows``: local row ids (``p % block_t``) grouped owner-major, then table, then ascending ``p``;
        ``send_lengths[r, t]`` keys of table ``t`` go to owner ``r``; ``send_splits[r] = send_lengths[r].sum()``
        are the All2All input splits (in keys).
      * ``unbucketize_permute[u]``: position in ``send_rows`` of unique key ``u``. Owners answer in the order they
        received, so ``rows_by_unique = received_rows[unbucketize_permute]``.
    """

    unique_keys: torch.Tensor
    unique_offsets: torch.Tensor
    inverse: torch.Tensor
    send_rows: torch.Tensor
    send_lengths: torch.Tensor
    send_splits: List[int]
    unbucketize_permute: torch.Tensor


def _as_tables(
    ids: torch.Tensor, table_lengths: Optional[Sequence[int]], vocabs: Union[int, Sequence[int]]
) -> Tuple[List[int], List[int]]:
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ids must be int32/int64, got {ids.dtype}")
    if table_lengths is None:
        table_lengths = [ids.numel()]
    lengths = [int(x) for x in table_lengths]
    vocab_list = [int(vocabs)] * len(lengths) if isinstance(vocabs, int) else [int(v) for v in vocabs]
    if len(vocab_list) != len(lengths):
        raise ValueError(f"{len(lengths)} table lengths but {len(vocab_list)} vocabularies")
    if any(x < 0 for x in lengths) or sum(lengths) != ids.numel():
        raise ValueError(f"table lengths {lengths} do not add up to {ids.numel()} ids")
    if sum(vocab_list) >= 1 << 62:
        raise ValueError("the vocabularies of one routing call must add up to less than 2**62 rows")
    return lengths, vocab_list


def hash_and_dedup(
    ids: torch.Tensor,
    table_lengths: Optional[Sequence[int]],
    vocabs: Union[int, Sequence[int]],
    table_ids: Optional[Sequence[int]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int]]:
    """``(unique_keys, unique_offsets, inverse, vocab_list)``: the part of routing common to every path."""
    lengths, vocab_list = _as_tables(ids, table_lengths, vocabs)
    tables = list(range(len(lengths))) if table_ids is None else [int(t) for t in table_ids]
    if len(tables) != len(lengths):
        raise ValueError(f"{len(lengths)} tables but {len(tables)} table ids")
    # One global key space: table t's rows live at [base_t, base_t + V_t), so a single sorted unique dedups all
    # tables at once and comes out table-major.
    bases = [0]
    for v in vocab_list[:-1]:
        bases.append(bases[-1] + v)
    pieces = []
    start = 0
    for t, (n, v) in enumerate(zip(lengths, vocab_list)):
        pieces.append(placement_hash(tables[t], ids[start : start + n], v) + bases[t])
        start += n
    global_keys = torch.cat(pieces) if pieces else ids.new_zeros(0, dtype=torch.int64)
    uniq, inverse = torch.unique(global_keys, sorted=True, return_inverse=True)
    base_t = torch.tensor(bases, dtype=torch.int64, device=ids.device)
    offsets = torch.searchsorted(uniq, torch.cat([base_t, base_t.new_tensor([bases[-1] + vocab_list[-1]])]))
    table_of_unique = torch.repeat_interleave(torch.arange(len(bases), device=ids.device), offsets.diff())
    return uniq - base_t[table_of_unique], offsets, inverse.reshape(-1), vocab_list


def bucketize_reference(
    unique_keys: torch.Tensor, unique_offsets: torch.Tensor, vocabs: List[int], world: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch: ``(send_rows, send_lengths [W, T], unbucketize_permute)`` by a stable sort on the owner."""
    counts = unique_offsets.diff()
    blocks = torch.tensor([block_size(v, world) for v in vocabs], dtype=torch.int64, device=unique_keys.device)
    block_of_key = torch.repeat_interleave(blocks, counts)
    owner = unique_keys // block_of_key
    local = unique_keys % block_of_key
    order = torch.sort(owner, stable=True).indices
    permute = torch.empty_like(order)
    permute[order] = torch.arange(order.numel(), device=order.device)
    table = torch.repeat_interleave(torch.arange(len(vocabs), device=unique_keys.device), counts)
    lengths = torch.zeros(world * len(vocabs), dtype=torch.int64, device=unique_keys.device)
    lengths.index_add_(0, owner * len(vocabs) + table, torch.ones_like(owner))
    return local[order], lengths.view(world, len(vocabs)), permute


def bucketize_fbgemm(
    unique_keys: torch.Tensor, unique_offsets: torch.Tensor, vocabs: List[int], world: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fbgemm ``block_bucketize_sparse_features`` (one bag per table, ``sequence=True`` for the permutation)."""
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    blocks = torch.tensor([block_size(v, world) for v in vocabs], dtype=torch.int64, device=unique_keys.device)
    lengths, rows, _, _, permute = torch.ops.fbgemm.block_bucketize_sparse_features(
        unique_offsets.diff(), unique_keys, False, True, blocks, world
    )
    return rows, lengths.view(world, len(vocabs)), permute


def route(
    ids: torch.Tensor,
    table_lengths: Optional[Sequence[int]],
    vocabs: Union[int, Sequence[int]],
    world: int,
    table_ids: Optional[Sequence[int]],
    use_fbgemm: bool,
) -> RoutedKeys:
    uniq, offsets, inverse, vocab_list = hash_and_dedup(ids, table_lengths, vocabs, table_ids)
    bucketize = bucketize_fbgemm if use_fbgemm else bucketize_reference
    send_rows, send_lengths, permute = bucketize(uniq, offsets, vocab_list, world)
    return RoutedKeys(
        unique_keys=uniq,
        unique_offsets=offsets,
        inverse=inverse,
        send_rows=send_rows,
        send_lengths=send_lengths,
        send_splits=[int(x) for x in send_lengths.sum(1).tolist()],
        unbucketize_permute=permute,
    )
