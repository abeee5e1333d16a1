"""Stage timers, the scalar log (JSONL) and ``RUN/metrics.json``.

In the synchronous step every collective is waited on by the compute thread, so *exposed communication* is the
time spent inside collectives (``*.comm``) and *exposed lookup* the time spent in retrieval and in the owner's
gather/pool work; the pipelined modes report the same keys measured as waiting time.
"""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Dict, Optional


class StageTimer:
    def __init__(self):
        self.total: Dict[str, float] = collections.defaultdict(float)
        self.count: Dict[str, int] = collections.defaultdict(int)

    def add(self, name: str, seconds: float) -> None:
        self.total[name] += seconds
        self.count[name] += 1

    def span(self, name: str):
        timer = self

        class _Span:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.add(name, time.perf_counter() - self.t0)

        return _Span()

    def reset(self) -> None:
        self.total.clear()
        self.count.clear()

    def summary(self) -> Dict[str, float]:
        return {k: round(v, 6) for k, v in sorted(self.total.items())}

    def exposed_communication(self) -> float:
        return sum(v for k, v in self.total.items() if k.endswith(".comm"))

    def exposed_lookup(self) -> float:
        return sum(v for k, v in self.total.items() if k in ("retrieve", "embed.owner"))


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


def write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
