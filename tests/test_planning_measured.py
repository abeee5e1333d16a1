"""``nestpipe simulate --calibrate RUN``: calibrate on one measured run, predict held-out measured runs.

Tiny GR configurations trained for real (8 steps each, 3 interleaved repeats, the fastest counts): calibration
input ``--pipeline off``, world 2, 4 micro-batches, plain loopback; held out: nested at world 2, off at 2
micro-batches, off and nested at world 3, and (as root, in a network namespace with a ``tc tbf`` cap, as in
``benchmarks/pipeline_bench.py``) off and nested across the cap. The capped steps (bandwidth-bound) are asserted
within the 15% target (negative control: a link per rank instead of one shared link misses them by more than a
quarter). The loopback steps of this tiny size (a few milliseconds, dispatch-bound, moved by the host's dispatch
cost) are only checked against a gross error, a factor of 2 either way, and the table is printed with a warning (a
configuration outside its bound, capped or not, is measured again with the calibration, and the fastest repeats over
both measurements are judged, since load that changes between launches moves it); the 15% target is measured by the full-size version,
``benchmarks/simulator_validation.py`` (docs/planning.md). The calibration also records the collectives' CPU and
probes the dense model at other micro-batch counts (checked below, with the probe switched off as negative control).

Deterministic checks beside it: the volumes the model derives from the shards (per-micro-batch distinct keys,
remote share ``(W - 1) / W``, the negatives sent with every micro-batch) reproduce the bytes the trainer counted at
world 3 and at another micro-batch count (negative control: with the world-2 remote share the world-3 bytes are off
by a quarter).
"""

from __future__ import annotations

import os
import warnings

import pytest

from nestpipe.cli import main
from nestpipe.measure import measured
from nestpipe.measure import validate_local as v

# module fixtures train for a minute or more; measured step times are compared, so nothing else runs meanwhile
pytestmark = [pytest.mark.slow, pytest.mark.serial]

C = v.Config
STEPS, BATCH, SEQ, VOCAB = 8, 16, 40, 20_000
CAP_BIT = 40e6
REPEATS = 3  # interleaved; each configuration's fastest repeat counts


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("simcal")
    shards = {n: v.make_gr_shards(str(base / f"gr-n{n}"), BATCH, SEQ, n, VOCAB, STEPS + 1) for n in (2, 4)}
    cfgs = [C(2, "off", 4), C(2, "nested", 4), C(2, "off", 2), C(3, "off", 4), C(3, "nested", 4)]
    ok, why = v.can_cap()
    if ok:
        cfgs += [C(2, "off", 4, CAP_BIT), C(2, "nested", 4, CAP_BIT)]
    else:
        print(f"bandwidth-capped configurations SKIPPED: {why} (need root, ip netns and tc)")
    load0 = os.getloadavg()[0]
    runs = v.train_configs(str(base / "runs"), shards, cfgs, STEPS, SEQ, repeats=REPEATS, timeout=300)
    runs = {c: v.fastest(rs) for c, rs in runs.items()}
    return {"runs": runs, "calib": runs[cfgs[0]], "capped": ok, "load": max(load0, os.getloadavg()[0]),
            "base": base, "shards": shards}


def test_held_out_steps_predicted(trained):
    rows, hw = v.validate(trained["calib"], trained["runs"])
    table = v.format_rows(rows)
    print(f"load average {trained['load']:.1f} on {os.cpu_count()} cores\n{table}")
    held = [r for r in rows if r.role == "held-out"]
    assert len(held) == len(rows) - 1 >= 4
    cal = [r for r in rows if r.role == "calibration"][0]
    assert abs(cal.error) < 1e-6
    assert bool([r for r in held if r.config.cap_bit_per_s]) == trained["capped"]

    # bandwidth-bound (capped) rows: the 15% target (the cap's bytes x ranks / rate). Latency- and dispatch-bound
    # loopback rows of this tiny size: the 15% target is not checked here (the full-size benchmark,
    # benchmarks/simulator_validation.py, is where it is measured; docs/planning.md). A step of a few milliseconds
    # moves with the host's dispatch cost, which one calibration run cannot pin for other micro-batch counts and world
    # sizes, so only a gross error is caught: a prediction off by more than a factor of 2 either way (a wrong volume
    # or a missing stage, not a host's dispatch speed).
    def outside(rows):
        return [r.config for r in rows if r.role == "held-out" and (
            abs(r.error) > 0.15 if r.config.cap_bit_per_s else not 0.5 <= 1 + r.error <= 2.0)]

    runs = trained["runs"]
    bad = outside(rows)
    if bad:
        # The calibration and the other configurations are separate launches, so load that changes between them
        # moves the errors. Measure the calibration and the outliers again, interleaved, and judge the fastest repeat
        # of each over both measurements: a transient goes, a wrong model stays.
        again = v.train_configs(str(trained["base"] / "again"), trained["shards"], [cal.config] + bad, STEPS, SEQ,
                                repeats=REPEATS, timeout=300)
        runs = dict(runs)
        for c, rs in again.items():
            runs[c] = v.fastest([runs[c]] + rs)
        first = table
        rows, hw = v.validate(runs[cal.config], runs)
        table = v.format_rows(rows)
        print(f"measured again ({', '.join(c.tag for c in bad)} outside their bound):\n{table}")
        bad = outside(rows)
        table = f"{first}\nmeasured again:\n{table}"
    assert not bad, f"outside their bound (capped 15%, loopback 2x): {[c.tag for c in bad]}\n{table}"
    for r in rows:  # negative control: every rank on a link of its own (W x the rate) misses the capped steps
        if r.role != "held-out" or not r.config.cap_bit_per_s:
            continue
        meas = measured.read_run(runs[r.config])
        wl = measured.workload_from_shards(meas.shards, meas.cfg, r.config.world)
        own = measured.predict(hw, wl, r.config.pipeline, r.config.cap_bit_per_s * r.config.world)
        assert abs(own.step_s / r.measured_s - 1) > 0.25, (r.config.tag, own.step_s, r.measured_s)
    warnings.warn(f"loopback configurations: 15% target not checked (known miss, docs/planning.md); measured:\n"
                  f"{table}")


def test_volumes_from_the_shards_match_the_trainer_counters(trained):
    runs = trained["runs"]
    hw, wl2, _ = measured.calibrate_run(trained["calib"])
    for cfg in (C(3, "off", 4), C(2, "off", 2)):
        meas = measured.read_run(runs[cfg])
        wl = measured.workload_from_shards(meas.shards, meas.cfg, cfg.world)
        predicted = hw.embed_bytes_per_row * wl.exchanged_rows * wl.remote
        assert predicted == pytest.approx(meas.bytes["embed"], rel=0.03), cfg
        route = hw.route_bytes_per_key * (wl.batch_unique + wl.exchanged_rows) * wl.remote
        assert route == pytest.approx(meas.bytes["route"], rel=0.05), cfg
        if cfg.world == 3:  # negative control: the world-2 remote share
            assert abs(hw.embed_bytes_per_row * wl.exchanged_rows * wl2.remote / meas.bytes["embed"] - 1) > 0.2
    assert wl2.redundancy >= 1.0


def test_cli_calibrate_prints_predictions(trained, capsys):
    assert main(["simulate", "--calibrate", trained["calib"], "--workers", "2", "3", "--modes", "off", "nested"]) == 0
    out = capsys.readouterr().out
    assert "calibrated on" in out and "GFLOP/s" in out
    assert len([ln for ln in out.splitlines() if ln.startswith(("off ", "nested "))]) == 4


def test_calibration_refuses_a_pipelined_run(trained):
    nested = trained["runs"][C(2, "nested", 4)]
    with pytest.raises(measured.RunError, match="needs a --pipeline off run"):
        measured.calibrate_run(nested)


def test_calibration_refuses_an_off_run_routed_ahead(trained, tmp_path):
    """The model's off routes every batch in its own step; an off run with pipe.route_ahead (the trainer's default)
    overlaps its routing collectives with the step, so its collective times cannot be fitted."""
    import json
    import shutil

    run = str(tmp_path / "ahead")
    shutil.copytree(trained["calib"], run)
    cfg = json.load(open(os.path.join(run, "config.json")))
    assert cfg["pipe"]["route_ahead"] is False  # what validate_local trains with
    measured.calibrate_run(run)
    cfg["pipe"]["route_ahead"] = True
    json.dump(cfg, open(os.path.join(run, "config.json"), "w"))
    with pytest.raises(measured.RunError, match="route_ahead=false"):
        measured.calibrate_run(run)


def test_calibration_measures_collective_cpu_and_probes_the_dense_model(trained):
    meas = measured.read_run(trained["calib"])
    # the trainer records process CPU per step and inside each collective (what competes for the cores)
    assert 0 < meas.cpu_s < 2 * meas.step_s * (os.cpu_count() or 1)
    assert {"embed.comm", "grad.comm"} <= set(meas.stages_cpu)
    assert all(0 <= meas.stages_cpu[k] <= meas.stages[k] * (os.cpu_count() or 1) + 1e-3 for k in meas.stages_cpu)
    hw, wl, _ = measured.calibrate_run(trained["calib"])
    n = wl.micro_batches
    assert sorted(int(k) for k in hw.dense_probe_s) == sorted({max(1, n // 2), n, 2 * n})
    assert all(v > 0 for v in hw.dense_probe_s.values()) and hw.coll_cpu_s >= 0 and hw.coll_cpu_s_per_byte >= 0
    # without the probe (negative control) the dense time does not depend on the micro-batch count
    bare, _, _ = measured.calibrate_run(trained["calib"], probe=False)
    assert bare.dense_probe_s == {} and measured.dense_scale(bare, 2 * n) == 1.0
