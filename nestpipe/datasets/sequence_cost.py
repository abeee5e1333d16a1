"""The per-sequence cost model of GR batches, ``c(n) = a n^2 + b n`` seconds for a sequence of ``n`` tokens.

The ingest balances batches with it (:mod:`nestpipe.ingest.balance`) and records it in the manifest
(``options.balance``); the trainer reads it back to report how evenly the ranks' batches cost (``token_imbalance``).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SequenceCost:
    """Seconds of forward + backward for one sequence of ``n`` tokens: ``a n^2 + b n``."""

    a: float
    b: float

    def __call__(self, n: np.ndarray) -> np.ndarray:
        n = np.asarray(n, dtype=np.float64)
        return self.a * n * n + self.b * n

    def units(self, n: np.ndarray) -> np.ndarray:
        """The cost in whole units of ``a`` (int64): ``n^2 + round(b / a) n`` (``n`` when ``a`` is 0). Balancing
        compares these: integer sums are exact, so the batches do not depend on rounding, the platform or the unit
        the cost is given in, only on ``b / a``."""
        n = np.asarray(n, dtype=np.int64)
        if self.a == 0:
            return n.copy()
        return n * n + np.int64(round(self.b / self.a)) * n

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b}

    @classmethod
    def parse(cls, text: str) -> "SequenceCost":
        """``"A,B"`` (seconds per token squared, seconds per token), both >= 0 and not both 0."""
        try:
            a, b = (float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"--sequence-cost must be 'A,B' (seconds per token^2, seconds per token), got {text!r}")
        if a < 0 or b < 0 or a + b == 0 or not np.isfinite([a, b]).all():
            raise ValueError(f"--sequence-cost {text!r}: A and B must be finite, >= 0 and not both 0")
        return cls(a, b)


# The default HSTU (2 layers, 2 heads x 16, dim 64), jagged attention, one thread, forward + backward of the layer
# stack per sequence, as `nestpipe measure sequence-cost` fits it. Only the ratio b / a (here about 208 tokens: below
# that length the per-token work dominates) changes which samples share a batch.
DEFAULT_COST = SequenceCost(a=2.4e-8, b=5.0e-6)
