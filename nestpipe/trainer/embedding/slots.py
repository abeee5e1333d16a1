"""The request streams of one rank's sharded tables: which store serves a slot, how it is exchanged, who holds it.

A sharded table is held by one store (whole rows) or, split by columns in a plan file, by one store per column shard
(``table@cJ``, in column order). A *slot* is one request stream into one store: one per store, plus ``item#neg``
(the GR negatives) served by the ``item`` store (``item@cJ#neg`` per column shard). The slots of one table are
consecutive and in column order, so the requester concatenates a table's column-shard outputs in slot order into
whole rows. Every rank builds the same :class:`SlotLayout` (same slots in the same order), which is what lets the
fused routing payload be parsed on the other side without headers.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

import numpy as np
import torch

from nestpipe.trainer.embedding.batch import NEG_SLOT, PreparedBatch
from nestpipe.trainer.embedding.placement import TablePlacement

NEG_SUFFIX = NEG_SLOT[len("item"):]  # "#neg": the negatives' slot of an item store (``item#neg``, ``item@c0#neg``)


@dataclasses.dataclass
class SlotLayout:
    """The slots of one rank's sharded stores and what routing needs to know about each (pure data)."""

    rank: int
    world: int
    device: torch.device
    slots: List[str]
    store_table: Dict[str, str]  # store -> its table
    store_dims: Dict[str, int]  # store -> row width
    store_rows: Dict[str, int]  # store -> rows this rank holds
    placements: Dict[str, TablePlacement]  # store -> the placement requesters route its keys with
    kinds: Dict[str, str]  # table -> exchange kind (unique / reduction / replicated)
    table_kind: Dict[str, str]  # table -> feature kind (pooled / sequence)
    batch_size: int  # the manifest's batch size: with the stores' vocabularies, bounds every routing value
    route_dtype: type = np.int64  # the routing payload's dtype: int32 where every value fits (the same on all ranks)

    @staticmethod
    def is_negatives(slot: str) -> bool:
        return slot.endswith(NEG_SUFFIX)

    def store_of(self, slot: str) -> str:
        return slot[:-len(NEG_SUFFIX)] if self.is_negatives(slot) else slot

    def table_of(self, slot: str) -> str:
        return self.store_table[self.store_of(slot)]

    def output_of(self, slot: str) -> str:
        """The model input a slot's output belongs to: its table, or ``item#neg`` for the negatives."""
        return NEG_SLOT if self.is_negatives(slot) else self.table_of(slot)

    def holds(self, slot: str, rank: int) -> bool:
        """Whether ``rank`` holds rows of the store behind ``slot`` (serves part of its requests)."""
        return rank in self.placements[self.store_of(slot)].owner_ranks

    def exchange(self, slot: str) -> str:
        """``unique`` or ``reduction``: how the slot's rows travel (the negatives always as unique rows)."""
        return "unique" if self.is_negatives(slot) else self.kinds[self.table_of(slot)]

    def slots_of_store(self, store: str) -> List[str]:
        return [s for s in self.slots if self.store_of(s) == store]

    def slot_keys(self, batch: PreparedBatch, slot: str) -> np.ndarray:
        """The batch's distinct keys requested through ``slot``."""
        if self.is_negatives(slot):
            return np.unique(batch.negatives)
        return batch.keys[self.table_of(slot)]
