"""Per-stage timing of one rank's threads.

:class:`StageTimer` sums seconds per stage name from every thread, and separately what the *compute thread* (the
thread that built the timer: it runs the dense model and the update) spent. *Exposed communication* is the compute
thread's time inside collectives (``*.comm``) plus its waits on communication threads (``wait.comm``); *exposed
lookup* is its time in retrieval and in the owner's gather/pool work plus its waits on the retrieval stage
(``wait.lookup``). In ``--pipeline off`` everything runs on the compute thread, so exposed equals total; in the
pipelined modes the same work runs on stage threads and only the waiting is exposed.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Dict, Optional

LOOKUP_STAGES = ("retrieve", "embed.owner")


class StageTimer:
    def __init__(self):
        self.total: Dict[str, float] = collections.defaultdict(float)
        self.count: Dict[str, int] = collections.defaultdict(int)
        self.exposed: Dict[str, float] = collections.defaultdict(float)
        self.bytes: Dict[str, int] = collections.defaultdict(int)  # payload bytes sent to other ranks, per stage
        # process CPU seconds (every thread) while a stage ran: the CPU a collective costs, where nothing else runs
        # beside it (``--pipeline off``); in the pipelined modes other threads' work is counted too
        self.cpu: Dict[str, float] = collections.defaultdict(float)
        self.compute_thread = threading.get_ident()
        self._lock = threading.Lock()
        # the run's trace (``nestpipe.trainer.pipeline.timeline.Timeline``: anything with ``record(stage, step, mb,
        # t0, t1)``), attached by the trainer; spans given a step are recorded there too
        self.trace = None

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.total[name] += seconds
            self.count[name] += 1
            if threading.get_ident() == self.compute_thread:
                self.exposed[name] += seconds

    def add_split(self, name: str, total_s: float, exposed_s: float) -> None:
        """Work that ran ``total_s`` in the background (e.g. an asynchronous collective) while the compute thread
        waited ``exposed_s`` of it. The total is at least the wait: a wait that returns later than the collective's
        completion callback (thread wake-up, the GIL) still held the compute thread that long."""
        total_s = max(total_s, exposed_s)
        with self._lock:
            self.total[name] += total_s
            self.count[name] += 1
            self.exposed[name] += exposed_s

    def add_cpu(self, name: str, seconds: float) -> None:
        with self._lock:
            self.cpu[name] += seconds

    def add_bytes(self, name: str, n: int) -> None:
        with self._lock:
            self.bytes[name] += int(n)

    def span(self, name: str, step: Optional[int] = None, mb: int = -1, traced_as: Optional[str] = None) -> "Span":
        """Time a block: its seconds count as stage ``name`` and, where ``step`` is given and a trace is attached
        (:attr:`trace`), it is also a span of the trace for ``step`` / micro-batch ``mb`` (named ``traced_as``
        there when given)."""
        return Span(self, name, step, mb, traced_as)

    def record(self, name: str, step: int, mb: int, t0: float, t1: float) -> None:
        """An interval measured by the caller, in the trace only (where one is attached)."""
        if self.trace is not None:
            self.trace.record(name, step, mb, t0, t1)

    def reset(self) -> None:
        with self._lock:
            self.total.clear()
            self.count.clear()
            self.exposed.clear()
            self.cpu.clear()

    def snapshot(self) -> "StageTimer":
        """A copy of the sums so far (steady-state figures are final minus a snapshot taken after warm-up)."""
        c = StageTimer()
        with self._lock:
            c.total.update(self.total)
            c.count.update(self.count)
            c.exposed.update(self.exposed)
            c.bytes.update(self.bytes)
            c.cpu.update(self.cpu)
        return c

    def minus(self, earlier: "StageTimer") -> "StageTimer":
        c = StageTimer()
        with self._lock:
            for k, v in self.total.items():
                c.total[k] = v - earlier.total.get(k, 0.0)
            for k, v in self.exposed.items():
                c.exposed[k] = v - earlier.exposed.get(k, 0.0)
            for k, v in self.bytes.items():
                c.bytes[k] = v - earlier.bytes.get(k, 0)
            for k, v in self.cpu.items():
                c.cpu[k] = v - earlier.cpu.get(k, 0.0)
        return c

    def summary(self) -> Dict[str, float]:
        return {k: round(v, 6) for k, v in sorted(self.total.items())}

    def exposed_communication(self) -> float:
        """Seconds the compute thread spent in, or waiting on, communication."""
        return sum(v for k, v in self.exposed.items() if k.endswith(".comm"))

    def exposed_lookup(self) -> float:
        """Seconds the compute thread spent in, or waiting on, embedding lookup (retrieval + owner gather)."""
        return sum(v for k, v in self.exposed.items() if k in LOOKUP_STAGES or k == "wait.lookup")

    def exposed_tier(self) -> float:
        """Seconds the compute thread spent reading or writing ``embedding.tier = mmap`` row files, plus its waits on
        the retrieval stage (which reads them one batch ahead: an upper bound of the tier's share of those waits)."""
        return sum(v for k, v in self.exposed.items() if k in ("tier.read", "tier.write", "wait.lookup"))

    def communication_total(self) -> float:
        """Seconds inside collectives on any thread (what ``--pipeline off`` would expose, measured here)."""
        return sum(v for k, v in self.total.items() if k.endswith(".comm") and not k.startswith("wait."))

    def lookup_total(self) -> float:
        return sum(v for k, v in self.total.items() if k in LOOKUP_STAGES)


class Span:
    """One timed block of :meth:`StageTimer.span` (a context manager)."""

    __slots__ = ("timer", "name", "step", "mb", "traced_as", "t0")

    def __init__(self, timer: StageTimer, name: str, step: Optional[int], mb: int, traced_as: Optional[str]):
        self.timer, self.name, self.step, self.mb, self.traced_as = timer, name, step, mb, traced_as

    def __enter__(self) -> "Span":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        t1 = time.perf_counter()
        self.timer.add(self.name, t1 - self.t0)
        if self.step is not None and self.timer.trace is not None:
            self.timer.trace.record(self.traced_as or self.name, self.step, self.mb, self.t0, t1)
        return False
