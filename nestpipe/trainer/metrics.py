"""The scalar log (``RUN/scalars.jsonl``); the stage timers are :mod:`nestpipe.utils.timing`."""

from __future__ import annotations

import json
from typing import Optional



class ScalarLog:
    """Append-only JSONL of per-step scalars (``RUN/scalars.jsonl``), written by rank 0."""

    def __init__(self, path: Optional[str]):
        self.f = open(path, "a") if path else None

    def write(self, step: int, **scalars) -> None:
        if self.f:
            self.f.write(json.dumps({"step": step, **scalars}, sort_keys=True) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f:
            self.f.close()
