"""Index arithmetic on concatenated ranges and on runs of back-to-back rows (NumPy; shared by the kernels, the data
stage and the owner plans)."""

from __future__ import annotations

from typing import List, Tuple

import numpy as np


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenated ranges ``[starts[j], starts[j] + lengths[j])`` as one int64 array."""
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(ends[-1] if len(ends) else 0, dtype=np.int64)


def row_runs(offsets: np.ndarray, dim: int) -> List[Tuple[int, int]]:
    """Element offsets of ``dim``-wide rows grouped into runs of rows laid out back to back: the ``(first, end)``
    index bounds of every run (row ``first`` starts at ``offsets[first]``, the run holds ``end - first`` rows)."""
    if len(offsets) == 0:
        return []
    breaks = (np.flatnonzero(np.diff(offsets) != dim) + 1).tolist()
    bounds = [0, *breaks, len(offsets)]
    return list(zip(bounds[:-1], bounds[1:]))
