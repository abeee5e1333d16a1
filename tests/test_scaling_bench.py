"""The scaling benchmark (benchmarks/scaling_bench.py): its harness at world 2 on a tiny workload (not for timing:
the cap is made and removed, NestPipe and the simulator run, the record's fields are filled), the TorchRec runner's
collective byte counter, and the evaluation of the targets."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import scaling_bench  # noqa: E402
import torchrec_runner  # noqa: E402


class _Tensor:
    def __init__(self, n, size=4):
        self.n, self.size = n, size

    def numel(self):
        return self.n

    def element_size(self):
        return self.size


def _fake_dist(world, rank):
    calls = []
    d = types.SimpleNamespace(get_world_size=lambda group=None: world, get_rank=lambda group=None: rank)
    for name in ("all_to_all_single", "all_to_all", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
                 "all_gather_into_tensor", "all_reduce"):
        setattr(d, name, lambda *a, _n=name, **k: calls.append(_n))
    return d, calls


def test_torchrec_collective_counter_counts_bytes_to_other_ranks_only():
    d, calls = _fake_dist(world=4, rank=1)
    counting = torchrec_runner._count_collectives(d)
    d.all_to_all_single(None, _Tensor(100), None, [10, 20, 30, 40])  # not counting yet
    assert counting["all_to_all"] == 0 and calls == ["all_to_all_single"]
    counting["on"] = True
    d.all_to_all_single(None, _Tensor(100), None, [10, 20, 30, 40])  # all but the rank's own 20 rows of 4 B
    assert counting["all_to_all"] == 80 * 4
    d.all_to_all_single(None, _Tensor(100))  # even split: 3/4 leaves
    assert counting["all_to_all"] == 80 * 4 + 75 * 4
    d.reduce_scatter(None, [_Tensor(5), _Tensor(6), _Tensor(7), _Tensor(8)])
    assert counting["reduce_scatter"] == (5 + 7 + 8) * 4
    d.all_gather([], _Tensor(10))
    assert counting["all_gather"] == 3 * 10 * 4
    d.all_reduce(_Tensor(8))
    assert counting["all_reduce"] == 2 * 3 * 8 * 4 / 4
    assert len(calls) == 6  # every call still reached the collective
    # control: counting the rank's own split as sent would have given the whole input
    assert counting["all_to_all"] != 100 * 4 + 75 * 4


def test_targets_read_the_ratios():
    rat = {"gr": {"2": {"auto_over_torchrec": 1.2, "wire_bytes_nestpipe_over_torchrec": 0.4, "nested_over_off": 1.1},
                  "4": {"auto_over_torchrec": 1.4, "wire_bytes_nestpipe_over_torchrec": 0.45, "nested_over_off": 1.2,
                        "prediction_error": 0.1},
                  "8": {"auto_over_torchrec": 1.6, "wire_bytes_nestpipe_over_torchrec": 0.5, "nested_over_off": 1.3,
                        "prediction_error": -0.19}},
           "pooled": {"2": {"auto_over_torchrec": 1.1}, "4": {"auto_over_torchrec": 1.0},
                      "8": {"auto_over_torchrec": 0.9}}}
    t = scaling_bench.targets(rat)
    assert t == {"gr_ratio_does_not_fall": True, "pooled_ratio_does_not_fall": False,
                 "gr_ratio_at_largest_world": 1.6, "gr_wire_bytes_at_most_half": True,
                 "prediction_within_20pct": True}
    rat["gr"]["8"]["prediction_error"] = 0.25
    rat["gr"]["4"]["wire_bytes_nestpipe_over_torchrec"] = 0.6
    t = scaling_bench.targets(rat)
    assert t["prediction_within_20pct"] is False and t["gr_wire_bytes_at_most_half"] is False
    assert scaling_bench.targets({"gr": {"2": {"nested_over_off": 1.0}}})["gr_ratio_does_not_fall"] is None
    assert scaling_bench.targets({"gr": {"2": {"auto_over_torchrec": 1.0}}})["gr_ratio_does_not_fall"] is None


@pytest.mark.slow
def test_harness_runs_at_world_2_tiny(tmp_path, capsys):
    from nestpipe.measure.validate_local import can_cap

    ok, why = can_cap()
    if not ok:
        pytest.skip(f"the scaling benchmark needs a capped network namespace: {why}")
    torchrec = os.path.join(ROOT, ".venv-torchrec", "bin", "python")
    extra = ["--torchrec-python", torchrec] if os.path.exists(torchrec) else []
    if not extra:
        print("TorchRec side SKIPPED: no .venv-torchrec (make torchrec-env builds it)")
    res = scaling_bench.main(["--tiny", "--worlds", "2", "--rate", "200e6", "--no-pooled", "--out", str(tmp_path),
                              *extra])
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert scaling_bench.pb.NS not in ns  # the capped namespace is gone
    assert res["cap_bit_per_s"] == 200e6 and "rate 200000000bit" in res["cap_tc"]
    gr = res["worlds"]["2"]["gr"]
    for mode in scaling_bench.MODES:
        n = gr["nestpipe"][mode]
        assert n["samples_per_s"] > 0 and n["wire_bytes_per_sample"] > 0 and n["cpu_s_per_step"] > 0
    assert gr["nestpipe"]["auto"]["pipeline"] in ("off", "dbp", "fwp", "nested")
    p = res["predictions"]["worlds"]["2"]
    assert p["off_step_ms"] > 0 and p["nested_step_ms"] > 0
    assert os.path.exists(tmp_path / "predictions.json") and os.path.exists(tmp_path / "scaling.png")
    assert "nested_over_off" in res["ratios"]["gr"]["2"]
    if extra:
        t = gr["torchrec"]
        assert "error" not in t, t.get("error")
        assert t["samples_per_s"] > 0 and t["wire_bytes_per_sample"] > 0
        assert {r["plan"] for r in t["plans_run"]} == set(scaling_bench.TORCHREC_PLANS)
        # the loopback's own count is the wire's (headers included): at least the payload the counter saw
        assert t["link_bytes_per_sample"] >= 0.5 * t["wire_bytes_per_sample"]
