"""Event-based schedule of training steps on the worker's resources.

Every resource is a *stream*: tasks on it run one at a time in issue order (CUDA/ACL stream semantics), and a
task starts when its stream is free and all its dependencies have ended. Streams: ``cpu`` (data), ``pcie.h2d``
(batch and row copies), ``net.keys`` (key routing), ``dram`` (owner gather), ``net`` (embedding All2Alls, 2D-SP
replica sync), ``device`` (dense compute, update, dual-buffer sync), ``pcie.d2h`` (write-back).

Dependencies by mode:

- without DBP the batch's lookup starts after the previous step's write-back (everything serial, TorchRec-like);
- with DBP the lookup of batch t runs while batch t-1 trains. Retrieval of t waits for the write-back of t-2 (rows
  updated by t-2 are in DRAM; those updated by t-1 are fixed by the ``sync`` copy) and the buffer that t-2 used;
  ``sync`` of t runs after the update of t-1 and before t's first All2All;
- with FWP the ``net`` stream is issued ``fwd0, fwd1, bwd0, fwd2, bwd1, ..., bwd(N-1)``: the All2All of micro-batch
  i+1 runs while i computes, and only ``fwd0`` and the last ``bwd`` cannot hide. Without overlap (``fwp_overlap``
  off, or N > 1 outside FWP) micro-batch i+1's All2All waits for i's gradient All2All.

Step time is measured in the steady state (update end to update end); the critical path of that window, walked
back through the task that bound each start, gives the exposed time per category.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from nestpipe.utils import gantt

from .cost_model import CATEGORY, Scenario, StepCosts

STREAMS = ("cpu", "pcie.h2d", "net.keys", "dram", "net", "device", "pcie.d2h")
STREAM_OF = {"data": "cpu", "h2d": "pcie.h2d", "route": "net.keys", "gather": "dram", "copy": "pcie.h2d",
             "fwd": "net", "bwd": "net", "replica": "net", "compute": "device", "update": "device",
             "sync": "device", "writeback": "pcie.d2h"}
CATEGORY_COLORS = {"compute": "#4c72b0", "lookup": "#dd8452", "comm": "#55a868"}  # Gantt chart colours, legend order


@dataclasses.dataclass
class Task:
    name: str  # e.g. "fwd"
    step: int
    micro: int  # -1 when not per micro-batch
    stream: str
    duration: float
    deps: List["Task"]
    start: float = 0.0
    end: float = 0.0
    binder: Optional["Task"] = None

    @property
    def category(self) -> str:
        return CATEGORY[self.name]

    @property
    def label(self) -> str:
        return f"{self.name}{'' if self.micro < 0 else f'[{self.micro}]'}@{self.step}"


@dataclasses.dataclass
class Schedule:
    tasks: List[Task]
    step_time: float
    exposed: Dict[str, float]  # category -> seconds per step on the critical path
    window: tuple  # (start, end) of the measured steps

    def as_dict(self) -> Dict[str, float]:
        return {"step_s": self.step_time, **{f"exposed_{k}_s": v for k, v in self.exposed.items()}}


def _issue(stream_tail: Dict[str, Task], tasks: List[Task], t: Task) -> Task:
    prev = stream_tail.get(t.stream)
    cands = ([prev] if prev else []) + [d for d in t.deps if d is not None]
    t.binder = max(cands, key=lambda x: x.end) if cands else None
    t.start = t.binder.end if t.binder else 0.0
    t.end = t.start + t.duration
    stream_tail[t.stream] = t
    tasks.append(t)
    return t


def simulate_steps(costs: StepCosts, sc: Scenario, steps: int = 10, measure: int = 4,
                   stream_of: Optional[Dict[str, str]] = None) -> Schedule:
    """Schedule ``steps`` identical steps and measure the last ``measure`` of them. ``stream_of`` overrides the
    stream of some tasks (e.g. the embedding and gradient All2Alls on two streams, as the trainer's two FWP
    communication threads on two process groups)."""
    streams = dict(STREAM_OF, **(stream_of or {}))
    if steps < measure + 3:
        raise ValueError(f"steps ({steps}) must exceed measure ({measure}) by at least 3 (pipeline fill)")
    n = len(costs.compute)
    tasks: List[Task] = []
    tail: Dict[str, Task] = {}
    by = {}  # (name, step, micro) -> Task

    def mk(name, step, deps, micro=-1, duration=None):
        dur = duration if duration is not None else getattr(costs, name)
        t = _issue(tail, tasks, Task(name, step, micro, streams[name], dur, deps))
        by[(name, step, micro)] = t
        return t

    def get(name, step, micro=-1):
        return by.get((name, step, micro))

    overlap = sc.fwp and sc.fwp_overlap
    for t in range(steps):
        prev_done = get("writeback", t - 1)
        d = mk("data", t, [] if sc.dbp else [prev_done])
        h = mk("h2d", t, [d])
        r = mk("route", t, [h])
        if sc.dbp:
            g = mk("gather", t, [r, get("writeback", t - 2)])
            c = mk("copy", t, [g, get("writeback", t - 2)])
            s = mk("sync", t, [c, get("update", t - 1)])
            ready = [c, s]
        else:
            g = mk("gather", t, [r])
            c = mk("copy", t, [g])
            ready = [c]
        fwd, comp, bwd = {}, {}, {}

        def do_fwd(i):
            deps = list(ready)
            if not overlap and i > 0:
                deps.append(bwd[i - 1])
            fwd[i] = mk("fwd", t, deps, i, costs.fwd[i])

        def do_bwd(i):
            bwd[i] = mk("bwd", t, [comp[i]], i, costs.bwd[i])

        if overlap:
            do_fwd(0)
            for i in range(n):
                comp_deps = [fwd[i]]
                if i + 1 < n:
                    do_fwd(i + 1)  # issued before compute i runs: overlaps it
                comp[i] = mk("compute", t, comp_deps, i, costs.compute[i])
                if i >= 1:
                    do_bwd(i - 1)
            do_bwd(n - 1)
        else:
            for i in range(n):
                do_fwd(i)
                comp[i] = mk("compute", t, [fwd[i]], i, costs.compute[i])
                do_bwd(i)
        last = bwd[n - 1]
        if costs.replica > 0:
            last = mk("replica", t, [last])
        u = mk("update", t, [last] + list(bwd.values()))
        mk("writeback", t, [u])

    ends = [get("update", t).end for t in range(steps)]
    lo, hi = steps - measure - 1, steps - 1
    step_time = (ends[hi] - ends[lo]) / measure
    exposed = {"compute": 0.0, "lookup": 0.0, "comm": 0.0}
    w0, w1 = ends[lo], ends[hi]
    node = get("update", hi)
    while node is not None and node.end > w0:
        exposed[node.category] += max(0.0, min(node.end, w1) - max(node.start, w0))
        node = node.binder
    exposed = {k: v / measure for k, v in exposed.items()}
    return Schedule(tasks, step_time, exposed, (w0, w1))


def write_gantt(path: str, schedule: Schedule, steps: int = 2, title: str = "") -> None:
    """PNG Gantt chart of the last ``steps`` measured steps (and half a step before them), one row per stream,
    colour by category; drawn by :func:`nestpipe.utils.gantt.draw`, as the trainer's measured timeline is."""
    w1 = schedule.window[1]
    span = schedule.step_time * steps
    w0 = w1 - span
    bars = [gantt.Bar(t.stream, (t.start - w0) * 1e3, (t.end - w0) * 1e3, t.label, t.category)
            for t in schedule.tasks if t.end > w0 - 0.5 * span and t.start < w1]
    gantt.draw(path, bars, STREAMS, CATEGORY_COLORS, title=title, xlabel="ms (0 = start of the measured window)",
               xlim=(-0.5 * span * 1e3, span * 1e3), min_label_width=0.04 * span * 1e3)
