"""The scalar log (``RUN/scalars.jsonl``); the stage timers are :mod:`nestpipe.utils.timing`."""

from __future__ import annotations

import json
import math
from typing import Optional



class ScalarLog:
    """Append-only JSONL of per-step scalars (``RUN/scalars.jsonl``), written by rank 0; with ``tensorboard_dir``
    the numeric scalars also go to TensorBoard event files there (tag ``train/<name>``, the step as global step)."""

    def __init__(self, path: Optional[str], tensorboard_dir: Optional[str] = None):
        self.f = open(path, "a") if path else None
        self.tb = None
        if path and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (checked at launch)

            self.tb = SummaryWriter(tensorboard_dir)

    def write(self, step: int, **scalars) -> None:
        if self.f:
            self.f.write(json.dumps({"step": step, **scalars}, sort_keys=True) + "\n")
            self.f.flush()
        if self.tb is not None:
            for k, v in scalars.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(f"train/{k}", v, step)

    def close(self) -> None:
        if self.f:
            self.f.close()
        if self.tb is not None:
            self.tb.close()
