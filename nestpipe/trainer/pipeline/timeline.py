"""The per-stage timeline: spans (thread, stage, step, micro-batch, start, end), Chrome trace JSON, a PNG Gantt chart,
and the overlap queries the tests assert on.

Spans come from :meth:`nestpipe.utils.timing.StageTimer.span` (the stage timer's trace is this rank's
:class:`Timeline`) or, for intervals measured by hand, :meth:`Timeline.record`. Each rank records its own spans
(thread-safe) for steps ``[first_step, first_step + max_steps)``; times are seconds
since the rank's origin, and the origin's wall-clock time aligns ranks in the merged trace (``RUN/trace.json``,
one Chrome-trace process per rank, one track per thread; opens in Perfetto or chrome://tracing).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from nestpipe.utils import gantt
from nestpipe.utils.jsonio import read_json, write_json_atomic

Span = Dict[str, object]  # {"rank", "thread", "stage", "step", "mb", "t0", "t1"}

# display order of threads in traces and charts, and of stages (the five DBP stages, then the exchanges around the
# dense compute) in the chart's lanes
THREAD_ORDER = ["data", "h2d", "route", "retrieve", "compute", "comm", "embed-comm", "grad-comm"]
STAGE_ORDER = ["prefetch", "h2d", "route", "retrieve", "tier.gather", "prime", "embed.a2a", "fwd_bwd", "dense",
               "grad.a2a", "dense.allreduce.comm", "update", "tier.write_back", "update.dense"]


class Timeline:
    def __init__(self, rank: int, first_step: int = 0, max_steps: int = 64):
        self.rank = rank
        self.first_step = first_step
        self.max_steps = max_steps
        self.origin = time.perf_counter()
        self.origin_wall = time.time()
        self.spans: List[Span] = []
        self._lock = threading.Lock()

    def wants(self, step: int) -> bool:
        return self.first_step <= step < self.first_step + self.max_steps

    def record(self, stage: str, step: int, mb: int, t0: float, t1: float) -> None:
        if not self.wants(step):
            return
        name = threading.current_thread().name
        thread = "compute" if threading.current_thread() is threading.main_thread() else name
        with self._lock:
            self.spans.append({"rank": self.rank, "thread": thread, "stage": stage, "step": int(step),
                               "mb": int(mb), "t0": t0 - self.origin, "t1": t1 - self.origin})

    def export(self) -> Dict:
        with self._lock:
            return {"rank": self.rank, "origin_wall": self.origin_wall, "spans": list(self.spans)}


# -- merged (all ranks) -------------------------------------------------------------------------------------------
def merge(per_rank: Iterable[Dict]) -> List[Span]:
    """All ranks' spans on one clock (rank origins aligned by wall-clock time)."""
    per_rank = list(per_rank)
    base = min(r["origin_wall"] for r in per_rank)
    out = []
    for r in per_rank:
        shift = r["origin_wall"] - base
        for s in r["spans"]:
            out.append(dict(s, t0=s["t0"] + shift, t1=s["t1"] + shift))
    return out


def chrome_trace(spans: List[Span]) -> Dict:
    events = []
    threads = sorted({(s["rank"], s["thread"]) for s in spans},
                     key=lambda rt: (rt[0], THREAD_ORDER.index(rt[1]) if rt[1] in THREAD_ORDER else 99, rt[1]))
    tid = {rt: i for i, rt in enumerate(threads)}
    for rank in sorted({s["rank"] for s in spans}):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
    for (rank, thread), i in tid.items():
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": i, "args": {"name": thread}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": i, "args": {"sort_index": i}})
    for s in spans:
        name = s["stage"] if s["mb"] < 0 else f"{s['stage']} mb{s['mb']}"
        events.append({"name": name, "cat": s["stage"], "ph": "X", "pid": s["rank"], "tid": tid[(s["rank"], s["thread"])],
                       "ts": round(s["t0"] * 1e6, 1), "dur": round(max(s["t1"] - s["t0"], 0) * 1e6, 1),
                       "args": {"step": s["step"], "micro_batch": s["mb"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, spans: List[Span]) -> None:
    write_json_atomic(path, chrome_trace(spans), indent=None, sort_keys=False)


def load_chrome_trace(path: str) -> List[Span]:
    """Spans back from a trace written by :func:`write_chrome_trace`."""
    ev = read_json(path, "Chrome trace", expect=dict)["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("name") == "thread_name"}
    out = []
    for e in ev:
        if e.get("ph") != "X":
            continue
        out.append({"rank": e["pid"], "thread": names[(e["pid"], e["tid"])], "stage": e["cat"],
                    "step": e["args"]["step"], "mb": e["args"]["micro_batch"], "t0": e["ts"] / 1e6,
                    "t1": (e["ts"] + e["dur"]) / 1e6})
    return out


def gantt_steps(spans: List[Span], warmup: int, count: int) -> List[int]:
    """The steps a chart draws: ``count`` recorded steps after the first ``warmup`` (the pipeline fill and the first
    calls' one-off costs), or the last ``count`` recorded when too few were recorded to skip them."""
    recorded = sorted({int(s["step"]) for s in spans})
    steady = recorded[warmup:] if len(recorded) > warmup else []
    return (steady or recorded[-count:])[:count]


def _stage_rank(stage: str) -> int:
    return STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER)


def gantt_lanes(spans: List[Span]) -> Tuple[Dict[int, str], List[str]]:
    """One lane per rank and stage (``dense``, ``embed.a2a``, ...), in :data:`STAGE_ORDER`; a stage whose spans
    overlap in time (two micro-batches at once) gets as many numbered lanes as it needs. Returns ({span id: lane
    name}, the lane names top to bottom)."""
    by_stage: Dict[tuple, List[Span]] = {}
    for s in spans:
        by_stage.setdefault((s["rank"], _stage_rank(s["stage"]), s["stage"]), []).append(s)
    lane_of: Dict[int, str] = {}
    lanes: List[str] = []
    for (rank, _, stage), group in sorted(by_stage.items(), key=lambda kv: kv[0]):
        ends: List[float] = []  # greedy interval partitioning: the first sub-lane free at the span's start
        for s in sorted(group, key=lambda s: (s["t0"], s["t1"])):
            k = next((i for i, e in enumerate(ends) if e <= s["t0"] + 1e-6), len(ends))  # 1 us: clock rounding
            lane = f"rank {rank} {stage}" + (f" #{k + 1}" if k else "")
            if k == len(ends):
                ends.append(s["t1"])
                lanes.append(lane)
            ends[k] = s["t1"]
            lane_of[id(s)] = lane
    return lane_of, lanes


def write_gantt(path: str, spans: List[Span], steps: Iterable[int], title: str = "") -> Dict[str, object]:
    """A PNG Gantt chart of ``steps``: one lane per rank and stage, one colour per step, the x axis spanning only
    those steps, each bar labelled with its micro-batch (or stage) where the label fits inside the bar. Drawn by
    :func:`nestpipe.utils.gantt.draw`, as the simulator's predicted schedule is. Returns what was drawn (steps,
    lanes, bars, labelled bars, x span in ms) for tests and callers; nothing is written when no span is selected."""
    steps = sorted(set(steps))
    sel = [s for s in spans if s["step"] in steps and not s["stage"].startswith("wait.")]
    if not sel:
        return {"steps": [], "lanes": [], "bars": [], "labelled": [], "x_span": 0.0}
    lane_of, lanes = gantt_lanes(sel)
    t_base = min(s["t0"] for s in sel)
    t_end = max(s["t1"] for s in sel)
    bars = [gantt.Bar(lane_of[id(s)], (s["t0"] - t_base) * 1e3, (s["t1"] - t_base) * 1e3,
                      f"mb {s['mb']}" if s["mb"] >= 0 else s["stage"], f"step {s['step']}")
            for s in sel]
    legend = {f"step {step}": gantt.PALETTE[i % len(gantt.PALETTE)] for i, step in enumerate(steps)}
    name = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    labelled = gantt.draw(path, bars, lanes, legend, title=f"{title or 'pipeline timeline'}: {name}",
                          xlim=(0.0, (t_end - t_base) * 1e3), xlabel=f"ms (0 = the start of step {steps[0]})")
    return {"steps": steps, "lanes": lanes, "bars": bars, "labelled": labelled, "x_span": (t_end - t_base) * 1e3}


# -- overlap queries ------------------------------------------------------------------------------------------------
def overlap_s(a: Span, b: Span) -> float:
    return max(0.0, min(a["t1"], b["t1"]) - max(a["t0"], b["t0"]))


def _select(spans: List[Span], rank: int, pred: Callable[[Span], bool]) -> List[Span]:
    return [s for s in spans if s["rank"] == rank and pred(s)]


def retrieval_overlaps(spans: List[Span], rank: int) -> List[int]:
    """Steps ``t`` whose forward/backward (stage 5: all micro-batches, ``fwd_bwd`` on the compute thread)
    overlapped the retrieval of batch ``t + 1``."""
    ret = {s["step"]: s for s in _select(spans, rank, lambda s: s["stage"] == "retrieve")}
    dense = _select(spans, rank, lambda s: s["stage"] == "fwd_bwd")
    out = set()
    for d in dense:
        r = ret.get(d["step"] + 1)
        if r is not None and overlap_s(r, d) > 0:
            out.add(d["step"])
    return sorted(out)


def a2a_overlaps(spans: List[Span], rank: int) -> List[tuple]:
    """(step, i) where the embedding All2All of micro-batch ``i + 1`` overlapped micro-batch ``i``'s dense compute."""
    emb = {(s["step"], s["mb"]): s for s in _select(spans, rank, lambda s: s["stage"] == "embed.a2a")}
    out = []
    for d in _select(spans, rank, lambda s: s["stage"] == "dense"):
        e = emb.get((d["step"], d["mb"] + 1))
        if e is not None and overlap_s(e, d) > 0:
            out.append((d["step"], d["mb"]))
    return sorted(out)


def grad_overlaps(spans: List[Span], rank: int) -> List[tuple]:
    """(step, i) where the gradient All2All of micro-batch ``i - 1`` overlapped micro-batch ``i``'s dense compute."""
    grad = {(s["step"], s["mb"]): s for s in _select(spans, rank, lambda s: s["stage"] == "grad.a2a")}
    out = []
    for d in _select(spans, rank, lambda s: s["stage"] == "dense"):
        g = grad.get((d["step"], d["mb"] - 1))
        if g is not None and overlap_s(g, d) > 0:
            out.append((d["step"], d["mb"]))
    return sorted(out)
