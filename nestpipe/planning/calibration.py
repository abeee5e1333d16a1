"""Calibration: fit the three category scales of the cost model to one measured step breakdown.

Inputs are exactly one configuration's measured step time, lookup time and All2All time (everything else is
compute), measured with the pipeline off (every cost exposed). The raw model of the same configuration gives
per-category totals; each category's scale is measured / raw. Nothing else is fitted: how costs grow with the
worker count, the micro-batch count, the group size, and what the pipelines hide, come from the mechanisms.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict

from nestpipe.utils.jsonio import read_json

from .cost_model import Scales, Scenario, step_costs
from .hardware import HardwareConfig
from .workload import WorkloadConfig


@dataclasses.dataclass
class Breakdown:
    """A measured ``--pipeline off`` step: total, lookup and All2All milliseconds at ``workers`` workers."""

    workers: int
    step_ms: float
    lookup_ms: float
    comm_ms: float
    source: str = ""

    @property
    def compute_ms(self) -> float:
        return self.step_ms - self.lookup_ms - self.comm_ms

    def validate(self) -> None:
        if self.workers < 1 or min(self.lookup_ms, self.comm_ms) < 0 or self.compute_ms <= 0:
            raise ValueError(f"{self.source or 'breakdown'}: need workers >= 1, lookup, comm >= 0 and "
                             f"lookup + comm < step (got {self})")


# The paper's TorchRec breakdown at 1,536 NPUs (docs/planning.md): the only numbers the validation feeds in.
PAPER_TORCHREC_1536 = Breakdown(workers=1536, step_ms=5793.83, lookup_ms=2870.99, comm_ms=1207.85,
                                source="NestPipe paper, TorchRec at 1,536 NPUs")


def _totals(wl, hw, bd, scales):
    return step_costs(wl, hw, Scenario(bd.workers, "off", micro_batches=1), scales).category_totals()


def _solve(f, target: float, what: str, where: str) -> float:
    """x > 0 with f(x) = target, f increasing (volume x rate + fixed latencies): bisection in log space."""
    lo, hi = 1e-9, 1e9
    if f(hi) < target:
        raise ValueError(f"{where}: the model cannot reach the measured {what} ({target * 1e3:.2f} ms)")
    if f(lo) > target:
        raise ValueError(f"{where}: measured {what} {target * 1e3:.2f} ms is below the model's fixed cost "
                         f"{f(lo) * 1e3:.2f} ms (latencies, per-peer overheads) at this worker count; the hardware "
                         f"preset's latencies are too high for this measurement")
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-12:
            break
    return (lo * hi) ** 0.5


def calibrate(wl: WorkloadConfig, hw: HardwareConfig, bd: Breakdown) -> Scales:
    """Volume factors that make the off-mode model reproduce ``bd`` exactly (lookup, then comm, then compute:
    the embedding update is compute but its rows are lookup volume)."""
    bd.validate()
    where = bd.source or "calibration"
    lk = _solve(lambda x: _totals(wl, hw, bd, Scales(1.0, x, 1.0))["lookup"], bd.lookup_ms * 1e-3, "lookup", where)
    cm = _solve(lambda x: _totals(wl, hw, bd, Scales(1.0, lk, x))["comm"], bd.comm_ms * 1e-3, "All2All", where)
    cp = _solve(lambda x: _totals(wl, hw, bd, Scales(x, lk, cm))["compute"], bd.compute_ms * 1e-3, "compute", where)
    return Scales(compute=cp, lookup=lk, comm=cm)


def load_breakdown(path: str) -> Breakdown:
    """A JSON file ``{"workers", "step_ms", "lookup_ms", "comm_ms"}``."""
    d = read_json(path, "breakdown", expect=dict)
    missing = [k for k in ("workers", "step_ms", "lookup_ms", "comm_ms") if k not in d]
    if missing:
        raise ValueError(f"{path}: breakdown lacks {missing}")
    bd = Breakdown(int(d["workers"]), float(d["step_ms"]), float(d["lookup_ms"]), float(d["comm_ms"]), source=path)
    bd.validate()
    return bd


RUN_KEYS = ("world", "batch_size_per_rank", "pipeline", "samples_per_s", "lookup_s_per_step",
            "communication_s_per_step")


def breakdown_from_run(run: str) -> Dict[str, Any]:
    """The headline figures of ``RUN/metrics.json`` as a breakdown (step from samples/s, lookup and communication
    per step): a quick look at a run; :func:`nestpipe.measure.measured.calibrate_run` is the calibration."""
    path = os.path.join(run, "metrics.json")
    m = read_json(path, "metrics", hint=f"is {run} the --out directory of `nestpipe train`?", expect=dict)
    missing = [k for k in RUN_KEYS if k not in m]
    if missing:
        raise ValueError(f"{path}: metrics lack {missing} (written by an older trainer?)")
    step_s = m["batch_size_per_rank"] * m["world"] / m["samples_per_s"]
    return {"workers": m["world"], "pipeline": m["pipeline"], "step_ms": step_s * 1e3,
            "lookup_ms": m["lookup_s_per_step"] * 1e3, "comm_ms": m["communication_s_per_step"] * 1e3}
