"""Per-host kernel choice (nestpipe.kernels.tuning): only bitwise-equal paths are timed and swapped, the choice is
cached per host fingerprint, a forced path wins, rank 0's choice is every rank's, and a run trains bitwise alike
whatever equal paths it takes."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from nestpipe import kernels
from nestpipe.kernels import select, tuning
from nestpipe.measure.launcher import run_plan, write_run
from nestpipe.trainer.export import assemble
from shard_sets import make_shards

SMALL = tuning.TuneShape(rows=4096, dim=16, bags=64, pooling=8)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(select.FORCE_ENV, raising=False)
    return tmp_path / "cache"


def test_only_equal_paths_are_candidates_and_they_agree_on_the_calibration_data(cache):
    assert "hstu_attention" not in tuning.EQUAL_PATHS and "adagrad_update" not in tuning.EQUAL_PATHS
    assert tuning.candidates("adagrad_bags", "cuda") == []  # accelerator paths are never timed
    measured = tuning.calibrate(SMALL)
    assert set(measured) == {op for op in tuning.EQUAL_PATHS if tuning.candidates(op)}
    assert "lookup" in measured and "dual_buffer_sync" in measured  # numba and the reference exist here
    for op, c in measured.items():
        assert c["equal"], op  # the calibration compared the candidates' results bitwise
        assert c["path"] in tuning.candidates(op) and set(c["timings_ms"]) == set(tuning.candidates(op))


def test_the_calibrations_calls_are_not_in_the_runs_record(cache):
    select.reset_taken()
    tuning.calibrate(SMALL)
    assert select.taken_paths() == {}  # metrics.json's kernel_paths lists what training executed
    # negative control: the same kind of call outside the calibration is recorded
    w, s = torch.zeros(8, 4), torch.zeros(8)
    kernels.adagrad_bags(w, s, torch.tensor([1, 2]), torch.tensor([0, 1, 2]), torch.ones(2, 4), 0.1)
    assert "adagrad_bags" in select.taken_paths()


def test_fbgemm_bag_update_is_a_candidate_only_for_row_widths_of_whole_lanes(cache):
    """fbgemm's TBE backward sums a row's last width % 8 columns in another order than the Numba kernel: for such
    widths it is not offered, and the calibration's own check sees the difference (the control)."""
    if "fbgemm" not in tuning.candidates("adagrad_bags"):
        pytest.skip("fbgemm's CPU TBE backward is not installed")
    wide = tuning.TuneShape(rows=2048, dim=132, bags=64, pooling=4)
    assert tuning.candidates("adagrad_bags", "cpu", wide) == []  # numba only: nothing to choose
    assert tuning.calibrate(wide, ops=["adagrad_bags"]) == {}
    _, equal = tuning.time_op("adagrad_bags", wide, ["numba", "fbgemm"], reps=2, rounds=1)
    assert not equal  # negative control: timed anyway, the two paths differ at this width
    whole = dataclasses.replace(wide, dim=128)
    assert "fbgemm" in tuning.candidates("adagrad_bags", "cpu", whole)
    assert tuning.time_op("adagrad_bags", whole, ["numba", "fbgemm"], reps=2, rounds=1)[1]


def test_a_faster_path_whose_results_differ_is_never_chosen(cache, monkeypatch):
    rule = select.rule_path("lookup", "cpu")
    other = next(p for p in tuning.candidates("lookup") if p != rule)
    fast_other = {rule: 10.0, other: 1.0}
    monkeypatch.setattr(tuning, "time_op", lambda op, shape, paths: (fast_other, False))
    assert tuning.calibrate(SMALL, ops=["lookup"])["lookup"]["path"] == rule
    # negative control: the same timings with equal results pick the faster path
    monkeypatch.setattr(tuning, "time_op", lambda op, shape, paths: (fast_other, True))
    assert tuning.calibrate(SMALL, ops=["lookup"])["lookup"]["path"] == other
    # a tie (within 3%) keeps the rule's path
    monkeypatch.setattr(tuning, "time_op", lambda op, shape, paths: ({rule: 1.0, other: 0.98}, True))
    assert tuning.calibrate(SMALL, ops=["lookup"])["lookup"]["path"] == rule


def test_calibration_then_cache_and_another_hosts_cache_is_ignored(cache):
    first = tuning.choose(SMALL)
    assert {c["source"] for op, c in first.items() if tuning.candidates(op)} == {"calibration"}
    again = tuning.choose(SMALL)
    assert {c["source"] for op, c in again.items() if tuning.candidates(op)} == {"cache"}
    assert {op: c["path"] for op, c in again.items()} == {op: c["path"] for op, c in first.items()}
    # the same file under this host's name but written on another host (another fingerprint): ignored
    fp = tuning.host_fingerprint()
    doc = json.loads(open(tuning.cache_path(fp)).read())
    doc["fingerprint"] = dict(fp, cpu_model="another CPU")
    with open(tuning.cache_path(fp), "w") as f:
        json.dump(doc, f)
    assert tuning.load_cache(fp) == {}
    assert {c["source"] for op, c in tuning.choose(SMALL).items() if tuning.candidates(op)} == {"calibration"}
    # and a cache of another fingerprint lives in another file
    assert tuning.cache_path(dict(fp, isa=["avx512f"])) != tuning.cache_path(fp)


def test_a_forced_path_wins_over_the_cache(cache, monkeypatch):
    tuning.choose(SMALL)  # cached
    monkeypatch.setenv(select.FORCE_ENV, "lookup:reference")
    choice = tuning.choose(SMALL)
    assert choice["lookup"] == {"path": "reference", "source": "forced"}
    with tuning.applied(choice):
        assert select.select_path("lookup", "cpu") == "reference"
    assert tuning.choose(SMALL, tune=False)["dual_buffer_sync"]["source"] == "rule"


def test_applied_choice_is_taken_on_cpu_only_and_restored(cache):
    choice = {"lookup": {"path": "reference", "source": "cache"}}
    before = select.select_path("lookup", "cpu")
    with tuning.applied(choice):
        assert select.select_path("lookup", "cpu") == "reference"
        assert select.select_path("lookup", torch.device("cpu")) == "reference"
        assert select.rule_path("lookup", "cpu") == before
        with select.forced({"lookup": "numba"}):
            assert select.select_path("lookup", "cpu") == "numba"  # forced wins
    assert select.select_path("lookup", "cpu") == before


@pytest.mark.slow
def test_runs_take_rank_0s_cached_choice_and_train_bitwise_like_the_rule(tmp_path, monkeypatch):
    """Two ranks take the paths rank 0's cache names (here the ones the rule does NOT take), and off and nested
    runs with them train bitwise like a run with the rule's paths."""
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv(tuning.CACHE_ENV, str(cache_dir))
    monkeypatch.delenv(select.FORCE_ENV, raising=False)
    shards = str(tmp_path / "ctr")
    make_shards(shards, "ctr", batch_size=16, micro_batches=4, shards=(6, 6), eval_shards=(1,), vocab=400, seed=2)
    sets = {"embedding": {"replicate_max_rows": 64}, "pipe": {"micro_batching": "clustered", "gantt_steps": 0},
            "dlrm": {"bottom_mlp": [16, 8], "top_mlp": [16], "cross_rank": 4}}

    def launch(names):
        plan = [{"run": str(tmp_path / n)} for n in names]
        p = run_plan(plan, 2, str(tmp_path / f"plan-{names[0]}.json"))
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
        return {n: json.load(open(tmp_path / n / "metrics.json")) for n in names}

    write_run(str(tmp_path / "calibrate"), shards, "dlrm", "nested", 4, sets)  # nested calls every tunable op
    write_run(str(tmp_path / "rule"), shards, "dlrm", "off", 6, dict(sets, tune_kernels=False))
    first = launch(["calibrate", "rule"])
    assert {c["source"] for c in first["calibrate"]["kernel_choice"].values()} >= {"calibration"}
    assert {c["source"] for c in first["rule"]["kernel_choice"].values()} == {"rule"}
    # rewrite this host's cache: every op takes a path the rule does not (all of them bitwise equal to it)
    fp = tuning.host_fingerprint()
    doc = json.loads(open(tuning.cache_path(fp)).read())
    swapped = {}
    for shape, ops in doc["shapes"].items():
        for op, c in ops.items():
            c["path"] = next(p for p in c["timings_ms"] if p != c["rule"])
            swapped[op] = c["path"]
    with open(tuning.cache_path(fp), "w") as f:
        json.dump(doc, f)
    assert swapped.get("lookup") and swapped.get("dual_buffer_sync")
    for name, pipeline in (("off", "off"), ("nested", "nested")):
        write_run(str(tmp_path / name), shards, "dlrm", pipeline, 6, sets)
    runs = launch(["off", "nested"])
    for name, m in runs.items():
        assert m["kernel_choice"] and all(c["source"] == "cache" and c["path"] == swapped[op]
                                          for op, c in m["kernel_choice"].items()), (name, m["kernel_choice"])
    assert "dual_buffer_sync" in runs["nested"]["kernel_choice"] and "dual_buffer_sync" not in runs["off"]["kernel_choice"]
    for name, m in runs.items():
        for r in m["per_rank"]:  # every rank executed the cached paths (noted at the call)
            taken = r["kernel_paths"]
            assert set(taken.get("dual_buffer_sync_rows", {})) <= {swapped["dual_buffer_sync"]}
            if "adagrad_bags" in swapped and "adagrad_bags" in taken:
                assert set(taken["adagrad_bags"]) == {swapped["adagrad_bags"]}, (name, taken)
            if swapped["lookup"] == "reference":
                assert "aten" not in taken.get("pool_segments", {}), (name, taken)
    rule, off, nested = (assemble(str(tmp_path / n)) for n in ("rule", "off", "nested"))
    for k in rule:
        assert torch.equal(rule[k], off[k]) and torch.equal(off[k], nested[k]), k
    assert os.path.exists(tuning.cache_path(fp))
