"""``RUN/timeline.png``: steady-state steps only, one lane per rank and stage, labels that fit inside their bars."""

from __future__ import annotations

import os

from nestpipe.trainer.pipeline import timeline as tl
from nestpipe.utils import gantt


def _spans():
    """Two ranks, steps 0-5; step 0 and 1 are warm-up (step 0 starts after 5 s of start-up idle); in every step
    two embedding All2Alls overlap (two micro-batches in flight) and the dense stage runs 4 micro-batches inside
    the fwd_bwd span."""
    out = []
    for rank in (0, 1):
        t = 5.0
        for step in range(6):
            def add(stage, t0, t1, mb=-1, thread="compute"):
                out.append({"rank": rank, "thread": thread, "stage": stage, "step": step, "mb": mb,
                            "t0": t0, "t1": t1})
            add("prefetch", t, t + 0.001, thread="data")
            add("route", t + 0.001, t + 0.003, thread="route")
            add("embed.a2a", t + 0.003, t + 0.010, 0, "comm")
            add("embed.a2a", t + 0.005, t + 0.012, 1, "comm")
            add("fwd_bwd", t + 0.012, t + 0.052)
            for mb in range(4):
                add("dense", t + 0.012 + 0.01 * mb, t + 0.022 + 0.01 * mb, mb)
            add("wait.comm", t + 0.052, t + 0.053)
            add("update", t + 0.053, t + 0.0532)  # too narrow for its label
            t += 0.06 if step > 1 else 0.3  # warm-up steps are slow
    return out


def test_chart_draws_steady_steps_in_stage_lanes_with_fitting_labels(tmp_path):
    spans = _spans()
    steps = tl.gantt_steps(spans, warmup=2, count=3)
    assert steps == [2, 3, 4]
    got = tl.write_gantt(str(tmp_path / "t.png"), spans, steps, title="hstu")
    assert open(tmp_path / "t.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # one lane per rank and stage in pipeline order; the overlapping All2Alls get a second lane
    assert got["lanes"][:6] == ["rank 0 prefetch", "rank 0 route", "rank 0 embed.a2a", "rank 0 embed.a2a #2",
                                "rank 0 fwd_bwd", "rank 0 dense"]
    assert len(got["lanes"]) == 2 * 7 and "rank 0 dense #2" not in got["lanes"] and not any("wait" in lane for lane in got["lanes"])
    # the x axis spans the drawn steps only: no start-up idle, no warm-up step
    assert 3 * 0.06 * 1e3 - 10 < got["x_span"] < 3 * 0.06 * 1e3
    assert {b.legend for b in got["bars"]} == {"step 2", "step 3", "step 4"}
    # no two bars of one lane overlap, and every written label fits inside its bar: labels never overlap
    by_lane = {}
    for b in got["bars"]:
        by_lane.setdefault(b.lane, []).append(b)
    for bars in by_lane.values():
        bars.sort(key=lambda b: b.start)
        assert all(a.end <= b.start + 1e-3 for a, b in zip(bars, bars[1:]))
    assert got["labelled"] and all(gantt.label_fits(b.label, b.end - b.start, got["x_span"])
                                   for b in got["labelled"])
    assert not any(b.lane.endswith("update") for b in got["labelled"])  # 0.2 ms: no room for its label
    assert {b.label for b in got["labelled"] if b.lane.endswith("dense")} == {"mb 0", "mb 1", "mb 2", "mb 3"}


def test_negative_controls_for_the_chart_rules():
    spans = _spans()
    # without skipping the warm-up, the chart would start at the 5 s of idle and the slow steps
    assert tl.gantt_steps(spans, warmup=0, count=3) == [0, 1, 2]
    # one lane per thread (the earlier chart) puts the overlapping All2Alls and the nested dense/fwd_bwd spans on
    # top of each other: the per-stage lanes are what separates them
    thread_lanes = {}
    for s in spans:
        if s["step"] == 2 and s["rank"] == 0 and not s["stage"].startswith("wait."):
            thread_lanes.setdefault(s["thread"], []).append((s["t0"], s["t1"]))
    overlapping = [t for t, iv in thread_lanes.items()
                   if any(a[1] > b[0] for a, b in zip(sorted(iv), sorted(iv)[1:]))]
    assert sorted(overlapping) == ["comm", "compute"]
    assert not gantt.label_fits("mb 0", 0.2, 180.0) and gantt.label_fits("mb 0", 10.0, 180.0)


def test_too_few_steps_to_skip_the_warm_up_draws_the_last_ones():
    spans = [s for s in _spans() if s["step"] < 2]
    assert tl.gantt_steps(spans, warmup=2, count=3) == [0, 1]
    assert os.path.basename(__file__)  # module runs without a trained run: no fixtures needed
