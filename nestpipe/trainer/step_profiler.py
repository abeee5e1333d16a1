"""``pipe.profile_steps``: rank 0's steps recorded by ``torch.profiler`` into ``RUN/profile-rank0.json``.

The profile starts before the third step a rank trains (the first two carry one-off costs: JIT loads, allocator
growth) and stops after ``profile_steps`` steps or at the end of the run, whichever comes first. It records the host
(every thread: the pipeline's stage and communication threads included) and, where torch has an accelerator, the
device (kernels, copies, collectives' kernels), in Chrome trace format. ``benchmarks/gpu_check.py`` reads it to
measure how much of the copy and exchange time overlaps compute (:func:`overlap_share`).
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Optional, Tuple

import torch

WARM_STEPS = 2


class StepProfiler:
    """Starts and stops a ``torch.profiler.profile`` around a window of steps (no-op unless ``steps`` > 0 and this
    is rank 0)."""

    def __init__(self, steps: int, rank: int, out: str, first_step: int):
        self.steps = steps if rank == 0 else 0
        self.path = os.path.join(out, "profile-rank0.json")
        self.start_at = first_step + WARM_STEPS
        self.prof = None
        self.recorded = 0

    def before(self, step: int) -> None:
        if self.steps and self.prof is None and self.recorded == 0 and step >= self.start_at:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()

    def after(self, step: int) -> None:
        if self.prof is not None:
            self.recorded += 1
            if self.recorded >= self.steps:
                self.close()

    def close(self) -> None:
        """Stop and write the trace (atomic rename); idempotent."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        tmp = self.path + ".tmp"
        prof.export_chrome_trace(tmp)
        os.replace(tmp, self.path)


# -- reading a trace -------------------------------------------------------------------------------------------------
def _merge(intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: List[Tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(x: List[Tuple[float, float]], y: List[Tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            total += b - a
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def classify(event: Dict) -> Optional[str]:
    """``"copy"`` (a host-to-device copy), ``"exchange"`` (a collective: NCCL kernels on the device, the gloo or
    c10d calls on the host) or ``"compute"`` (any other device kernel) for a complete (``ph`` X) trace event; None
    for everything else."""
    if event.get("ph") != "X":
        return None
    cat, name = str(event.get("cat", "")).lower(), str(event.get("name", ""))
    low = name.lower()
    if cat == "gpu_memcpy":
        return "copy" if "htod" in low.replace(" ", "").replace("_", "") else None
    if "nccl" in low and cat == "kernel":
        return "exchange"
    if cat == "kernel":
        return "compute"
    if cat in ("cpu_op", "user_annotation") and (low.startswith("gloo:") or low.startswith("c10d::all")
                                                or low.startswith("nccl:")):
        return "exchange"
    return None


def overlap_share(trace: Dict) -> Dict[str, float]:
    """Of the trace's copy and exchange time (their union), the share that overlaps device compute: 1.0 where every
    copy and collective ran while a kernel computed, 0.0 where they ran alone. Returns the times (microseconds) and
    the share (NaN where nothing was copied or exchanged)."""
    spans: Dict[str, List[Tuple[float, float]]] = {"copy": [], "exchange": [], "compute": []}
    for e in trace.get("traceEvents", []):
        kind = classify(e)
        if kind is not None:
            t0 = float(e["ts"])
            spans[kind].append((t0, t0 + float(e.get("dur", 0.0))))
    moved = _merge(spans["copy"] + spans["exchange"])
    compute = _merge(spans["compute"])
    total = _length(moved)
    hidden = _intersection(moved, compute)
    return {"copy_us": _length(_merge(spans["copy"])), "exchange_us": _length(_merge(spans["exchange"])),
            "compute_us": _length(compute), "moved_us": total, "overlapped_us": hidden,
            "share": hidden / total if total else float("nan")}


def read_overlap(path: str) -> Dict[str, float]:
    with open(path) as f:
        return overlap_share(json.load(f))
