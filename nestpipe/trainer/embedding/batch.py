"""The host-side batch the embedding exchanges consume (built by :func:`nestpipe.trainer.data.prepare_batch`).

A :class:`PreparedBatch` holds, per table (slot), the in-vocabulary ids of the batch's unique keys in shard order,
and per micro-batch the positions of its unique keys and of every value. ``NEG_SLOT`` is the GR negatives' slot: a
per-batch key list served by the ``item`` store.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import numpy as np

NEG_SLOT = "item#neg"  # the GR negatives: a per-batch key list served by the ``item`` store


@dataclasses.dataclass
class MicroBatchData:
    """One micro-batch's host arrays. Per table: value positions into the batch keys and each value's sample."""

    index: int
    samples: np.ndarray  # int64 sample indices in the batch (ascending)
    lengths: Dict[str, np.ndarray]  # table -> int64 [b]
    value_key: Dict[str, np.ndarray]  # table -> int64 [nnz_i], position of each value in the table's batch keys
    value_sample: Dict[str, np.ndarray]  # table -> int64 [nnz_i], sample index within the micro-batch
    mb_keys: Dict[str, np.ndarray]  # table -> int64 [U_i] sorted positions into the batch keys (shard's mb_unique)
    value_pos: Dict[str, np.ndarray]  # table -> int64 [nnz_i], position of each value in mb_keys
    fields: Dict[str, np.ndarray]  # dense, labels, play, duration, user ... restricted to the micro-batch


@dataclasses.dataclass
class PreparedBatch:
    step: int
    batch_size: int
    keys: Dict[str, np.ndarray]  # slot -> in-vocabulary ids of the batch's unique keys (shard order)
    micro: List[MicroBatchData]
    negatives: Optional[np.ndarray] = None  # GR: in-vocabulary item ids [K] shared by all micro-batches
