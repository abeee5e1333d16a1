"""Unique-based exchange (EMBark): the deduplicated rows of a micro-batch travel, for sequence features.

``UniqueBased`` is the requester side (the owner side is ``collection.py``'s). For micro-batch ``i`` of slot ``s``:

- input_dist (once per batch, inside the fused routing): the requester sends each owner, for every micro-batch, the
  positions (within the keys it routed to that owner) of the micro-batch's unique keys, in the shard's
  ``mb_unique`` order restricted to that owner.
- compute (owner): ``rows = buffer[entries]``, one row per requested key, from the batch's frozen buffer.
- output_dist (the per-micro-batch embedding All2All): rows go back; the requester reorders the per-owner pieces
  into ``mb_unique`` order with one gather, then expands to values (``sequence``) or pools per sample.
- backward: the rows' gradient travels the reverse way; the owner adds it into the per-entry gradient with
  ``index_add_`` (order-stable), so each entry accumulates its micro-batches in order.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import torch

from nestpipe.trainer.embedding.replicated import owner_bounds, owner_order


class UniqueBased:
    """Requester side."""

    @staticmethod
    def plan(dest: np.ndarray, pos_in_dest: np.ndarray, mb_keys: np.ndarray, world: int
             ) -> Tuple[List[np.ndarray], np.ndarray]:
        """Per-owner entry lists for one micro-batch and the gather that restores ``mb_keys`` order."""
        d = dest[mb_keys]
        order = owner_order(d, world)
        sorted_pos = pos_in_dest[mb_keys[order]]
        bounds = owner_bounds(d, world)
        lists = [sorted_pos[bounds[r]:bounds[r + 1]] for r in range(world)]
        unperm = np.empty_like(order)
        unperm[order] = np.arange(len(order))
        return lists, unperm

    @staticmethod
    def unpack(pieces: List[torch.Tensor], unperm: torch.Tensor, value_pos: torch.Tensor,
               value_sample: torch.Tensor, num_samples: int, pooled: bool) -> torch.Tensor:
        """Rows from every owner (rank order) -> per-value rows [nnz, D] or pooled sums [b, D]."""
        rows = torch.cat(pieces, 0).index_select(0, unperm)
        per_value = rows.index_select(0, value_pos)
        if not pooled:
            return per_value
        out = per_value.new_zeros(num_samples, per_value.shape[1])
        return out.index_add(0, value_sample, per_value)
