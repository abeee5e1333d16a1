"""Unit tests of the planning package (key arithmetic, network, timeline mechanics, planner, CLI) and of the
measured-run model of :mod:`nestpipe.measure.measured` built on it."""

import dataclasses
import json
import os

import numpy as np
import pytest

from nestpipe.cli import main
from nestpipe.measure import measured
from nestpipe.planning import keys, load_hardware, load_workload, network
from nestpipe.planning.cost_model import StepCosts, Scenario
from nestpipe.planning.planner import PlannerConfig, TableInfo, make_plan
from nestpipe.planning.timeline import simulate_steps


def test_expected_unique_matches_sampling():
    rng = np.random.default_rng(0)
    V, s, n = 50_000, 1.1, 20_000
    p = np.arange(1, V + 1, dtype=float) ** -s
    p /= p.sum()
    draws = [len(np.unique(rng.choice(V, size=n, p=p))) for _ in range(3)]
    assert keys.expected_unique(V, s, n) == pytest.approx(np.mean(draws), rel=0.02)
    x = rng.choice(V, size=n, p=p)
    r = 4 * np.mean([len(np.unique(c)) for c in np.split(x, 4)]) / len(np.unique(x))
    assert keys.redundancy_random(V, s, n, 4) == pytest.approx(r, rel=0.03)
    assert 1 <= keys.redundancy_random(V, s, n, 8) <= 8
    assert keys.owner_dedup_factor(V, s, n, 64) < keys.owner_dedup_factor(V, s, n, 2) <= 1


def test_all2all_grows_with_peers_and_hierarchical_saves_latency():
    hw = load_hardware("ascend-910b")
    t = [network.all2all_seconds(hw, p, 1e6) for p in (8, 64, 512, 2048)]
    assert t == sorted(t)
    hier = load_hardware("ascend-910b", {"all2all": "hierarchical"})
    assert network.all2all_seconds(hier, 2048, 1e3) < network.all2all_seconds(hw, 2048, 1e3)
    assert network.all2all_seconds(hw, 1, 1e9) == 0.0


def _costs(n, gather=1.0, a2a=0.1, comp=1.0):
    return StepCosts(data=0.0, h2d=0.0, route=0.0, gather=gather, copy=0.0, fwd=[a2a / n] * n,
                     compute=[comp / n] * n, bwd=[a2a / n] * n, replica=0.0, update=0.0, writeback=0.0, sync=0.0)


def test_off_mode_is_the_sum_of_its_tasks():
    s = simulate_steps(_costs(1), Scenario(8, "off"))
    assert s.step_time == pytest.approx(1.0 + 0.2 + 1.0)
    assert s.exposed["lookup"] == pytest.approx(1.0) and s.exposed["comm"] == pytest.approx(0.2)


def test_dbp_hides_lookup_until_it_is_the_bottleneck():
    hidden = simulate_steps(_costs(1, gather=0.5), Scenario(8, "dbp"))
    assert hidden.step_time == pytest.approx(1.2) and hidden.exposed["lookup"] == pytest.approx(0.0)
    bound = simulate_steps(_costs(1, gather=3.0), Scenario(8, "dbp"))
    assert bound.step_time == pytest.approx(3.0)


def test_fwp_exposes_two_of_2n_all2alls_and_negative_control():
    n = 8
    s = simulate_steps(_costs(n, gather=0.5, a2a=0.4), Scenario(8, "nested", micro_batches=n))
    assert s.exposed["comm"] == pytest.approx(2 * 0.4 / n)
    no = simulate_steps(_costs(n, gather=0.5, a2a=0.4), Scenario(8, "nested", micro_batches=n, fwp_overlap=False))
    assert no.exposed["comm"] == pytest.approx(0.8)


def test_presets_and_bad_inputs_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("nope")
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        load_hardware("ascend-910b", {"bogus": 1})
    with pytest.raises(ValueError, match="all2all"):
        load_hardware("ascend-910b", {"all2all": "ring"})
    f = tmp_path / "hw.json"
    f.write_text(json.dumps({"preset": "h100", "net_bw": 1e10}))
    assert load_hardware(str(f)).net_bw == 1e10
    with pytest.raises(ValueError, match="group_size"):
        Scenario(12, "2dsp", group_size=5)


def test_planner_splits_hot_tables_and_respects_memory():
    hw = load_hardware("ascend-910b")
    tables = [TableInfo("hist", 50_000_000, 128, "pooled", 50, 0.5), TableInfo("item", 50_000_000, 64, "sequence", 200, 0.3),
              TableInfo("tiny", 10, 16, "single", 1, 1.0)]
    plan = make_plan(tables, PlannerConfig(workers=16, batch_per_worker=512, group_size=16), hw)
    t = plan["tables"]
    assert t["hist"]["col_shards"] > 1 and t["hist"]["exchange"] == "reduction"  # pooled: column split
    assert t["item"]["row_shards"] > 1 and t["item"]["exchange"] == "unique"
    assert t["tiny"]["sharding"] in ("replicated", "table_wise")  # a 10-row table is never split
    for name, v in t.items():
        ranks = [s["rank"] for s in v["shards"]]
        assert len(ranks) == len(set(ranks)) == v["row_shards"] * v["col_shards"]
    assert plan["trainer_config"]["embedding"]["kinds"]["item"] == "unique"
    p8 = make_plan(tables, PlannerConfig(workers=16, batch_per_worker=512, group_size=8), hw)
    assert p8["trainer_config"]["sparse_groups"] == p8["group_size"] == 8 and p8["replica_groups"] == 2
    # memory cap forces row splits of a table that does not fit one worker
    big = [TableInfo("big", 100_000_000, 64, "sequence", 1, 0.1)]
    p = make_plan(big, PlannerConfig(workers=8, group_size=8, dram_cap=10e9), hw)
    assert p["tables"]["big"]["row_shards"] >= 4
    with pytest.raises(ValueError, match="do not fit"):
        make_plan(big, PlannerConfig(workers=2, group_size=2, dram_cap=1e9), hw)


def test_plan_cli_from_table_file(tmp_path, capsys):
    f = tmp_path / "tables.toml"
    f.write_text('[[tables]]\nname = "item"\nvocab = 1000000\ndim = 64\nkind = "sequence"\nhotness = 64\n'
                 'unique_ratio = 0.4\n[[tables]]\nname = "tag"\nvocab = 100\ndim = 32\nkind = "pooled"\nhotness = 3\n')
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", str(f), "--workers", "32", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["format"] == "nestpipe-plan" and set(plan["tables"]) == {"item", "tag"}
    assert 32 % plan["group_size"] == 0
    assert "busiest worker" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tables": [{"name": "x", "vocab": 10, "dim": 8, "kind": "weird"}]}))
    assert main(["plan", "--tables", str(bad), "--workers", "4"]) == 1


def test_simulate_cli_writes_figures(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", "--workers", "8", "1536", "--modes", "off", "nested", "--out", str(out)])
    assert rc == 0
    assert {"results.json", "scaling.png", "gantt-off.png", "gantt-nested.png"} <= set(os.listdir(out))
    res = json.loads((out / "results.json").read_text())
    nested = [p for p in res["predictions"] if p["mode"] == "nested" and p["workers"] == 1536][0]
    assert nested["qps"] == pytest.approx(512 * 1536 / nested["step_ms"] * 1e3)
    assert main(["simulate", "--modes", "bogus", "--workers", "8"]) == 1
    assert "unknown mode" in capsys.readouterr().err


def test_calibrate_run_errors_name_the_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(FileNotFoundError, match="metrics.json"):
        measured.calibrate_run(str(run))
    (run / "metrics.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot parse metrics.json"):
        measured.calibrate_run(str(run))
    assert main(["simulate", "--calibrate", str(run)]) == 1


def _local(world=2, n=4, cores=2):
    hw = measured.LocalHardware(key_s=2e-6, row_s=1e-6, coll_latency_s=1e-3, coll_s_per_byte=1e-9, dense_flops=1e10,
                                token_s=1e-7, step_overhead_s=2e-3, embed_bytes_per_row=260, grad_bytes_per_row=260,
                                route_bytes_per_key=9, allreduce_bytes=1.6e5, calib_world=2, cores=cores)
    wl = measured.LocalWorkload(world=world, batch=64, micro_batches=n, tokens=6400, batch_unique=3000,
                                mb_unique=3600, flops_per_sample=2e7, exchanged_tables=["item"], neg_unique=60)
    return hw, wl


def test_local_model_mechanisms():
    hw, wl = _local()
    off, nested = measured.predict(hw, wl, "off"), measured.predict(hw, wl, "nested")
    # off: every task in sequence = CPU work + every collective
    assert off.step_s == pytest.approx(off.cpu_s + off.comm_s, rel=1e-6)
    # nested hides collectives but cannot beat the CPU floor (2 ranks on 2 cores: one core each)
    assert off.cpu_s <= nested.step_s < off.step_s
    # 3 ranks on 2 cores: CPU work runs at 2/3 of a core
    w3 = measured.predict(hw, dataclasses.replace(wl, world=3), "off")
    assert w3.cpu_stretch == pytest.approx(1.5) and w3.step_s > 1.4 * off.cpu_s
    # a cap every rank's bytes cross: each embedding All2All needs W x bytes x wire overhead / rate
    rate = 1e7
    capped = measured.predict(hw, wl, "off", link_bit_per_s=rate)
    mb_bytes = 260 * wl.exchanged_rows * wl.remote / wl.micro_batches
    assert capped.comm_s > 2 * wl.micro_batches * 2 * mb_bytes * 8 / rate
    assert capped.step_s > off.step_s
    with pytest.raises(ValueError, match="pipeline must be one of"):
        measured.predict(hw, wl, "2dsp")


def test_local_model_dense_probe_scales_the_dense_time():
    hw, wl = _local(n=4)
    # the probe: batch seconds at 2, 4 and 8 micro-batches (per-call cost grows past 4)
    probed = dataclasses.replace(hw, dense_probe_s={"2": 0.040, "4": 0.041, "8": 0.050}, calib_micro_batches=4)
    assert measured.dense_scale(probed, 4) == pytest.approx(1.0)
    assert measured.dense_scale(probed, 8) == pytest.approx(0.050 / 0.041)
    assert measured.dense_scale(probed, 6) == pytest.approx(0.0455 / 0.041)  # piecewise linear between points
    assert measured.dense_scale(probed, 16) == pytest.approx((0.050 + 8 * 0.009 / 4) / 0.041)  # last slope on
    w8 = dataclasses.replace(wl, micro_batches=8)
    with_probe, without = measured.predict(probed, w8, "off"), measured.predict(hw, w8, "off")
    dense4 = wl.flops_per_sample * wl.batch / hw.dense_flops
    # negative control: without the probe the dense time is FLOPs only, the same at every micro-batch count
    assert measured.dense_scale(hw, 8) == 1.0
    assert with_probe.cpu_s - without.cpu_s == pytest.approx(dense4 * (0.050 / 0.041 - 1), rel=1e-6)


def test_local_model_collective_cpu_and_oversubscribed_cores():
    hw, wl = _local(n=8)
    # the collectives' CPU competes for the cores: the nested floor rises by it (2 ranks on 2 cores)
    with_cpu = dataclasses.replace(hw, coll_cpu_s=2e-4, coll_cpu_s_per_byte=2e-9)
    a, b = measured.predict(hw, wl, "nested"), measured.predict(with_cpu, wl, "nested")
    calls = measured.ROUTE_CALLS + 2 * wl.micro_batches + 1
    assert b.cpu_s - a.cpu_s > calls * 2e-4
    # ... but not the off step, whose collectives' time already holds their CPU
    assert measured.predict(with_cpu, wl, "off").step_s == pytest.approx(measured.predict(hw, wl, "off").step_s,
                                                                       rel=0.02)
    # more ranks than cores: each collective waits one scheduler slice more (kernel default 0.75 ms x (1 + log2 CPUs))
    slice_s = measured.scheduler_slice_s(2)
    assert 1e-4 < slice_s < 2e-2
    assert measured._collective(hw, 1e5, 3, None, 1500) - measured._collective(hw, 1e5, 2, None, 1500) == \
        pytest.approx(slice_s)
    assert measured._collective(hw, 1e5, 2, None, 1500) == pytest.approx(hw.coll_latency_s + 1e5 * hw.coll_s_per_byte)


def test_local_model_two_comm_streams_and_negative_control():
    hw, wl = _local(n=16)
    hw = dataclasses.replace(hw, coll_latency_s=3e-3, dense_flops=1e11)
    two = measured.predict(hw, wl, "nested")
    one = measured.predict(hw, wl, "nested", split_comm=False)
    # 32 latency-bound collectives on one stream outlast the compute; on the trainer's two comm threads they do not
    assert one.step_s > two.step_s * 1.05
    capped = [measured.predict(hw, wl, "nested", link_bit_per_s=1e7, split_comm=s).step_s for s in (True, False)]
    assert capped[0] == capped[1]  # across a cap both streams share the link's bytes


def test_tables_larger_than_dram_go_to_the_memory_mapped_tier_only_when_nothing_else_fits():
    from nestpipe.planning import planner
    from nestpipe.planning.hardware import load_hardware

    hw = load_hardware("cpu-gloo")
    item = planner.TableInfo("item", 32_038_725, 64, "sequence", hotness=200, unique_ratio=0.3)
    user = planner.TableInfo("user", 27_285, 64, "single")
    tier = dict(disk_cap=20e9, dram_cache=1e9, disk_read_bw=50e6, disk_write_bw=200e6)
    # 2 workers x 3 GB of DRAM cannot hold 8.3 GB of rows: without a disk the plan fails naming the option
    with pytest.raises(ValueError, match="give --disk-cap"):
        planner.make_plan([item, user], planner.PlannerConfig(workers=2, batch_per_worker=128, dram_cap=3e9), hw)
    plan = planner.make_plan([item, user], planner.PlannerConfig(workers=2, batch_per_worker=128, dram_cap=3e9,
                                                                 **tier), hw)
    assert plan["tier"]["tables"] == ["item"] and plan["tables"]["item"]["tier"] == "mmap"
    assert {s["tier"] for s in plan["tables"]["item"]["shards"]} == {"mmap"}
    assert plan["trainer_config"]["embedding"]["tier"] == "mmap"
    assert all(r["disk_bytes"] > 4e9 and r["dram_bytes"] <= 3e9 for r in plan["ranks"])
    assert "embedding.tier=\"mmap\"" in planner.format_plan(plan)
    # the tier costs its owner the missed rows: a slower disk, a costlier worker
    slow = planner.make_plan([item, user], planner.PlannerConfig(workers=2, batch_per_worker=128, dram_cap=3e9,
                                                                 **dict(tier, disk_read_bw=5e6)), hw)
    assert slow["estimate"]["max_rank_cost_ms"] > plan["estimate"]["max_rank_cost_ms"]
    # DRAM first: with 6 GB per worker the row-wise layout fits, and the disk is left alone
    roomy = planner.make_plan([item, user], planner.PlannerConfig(workers=2, batch_per_worker=128, dram_cap=6e9,
                                                                  **tier), hw)
    assert roomy["tier"]["tables"] == [] and "tier" not in roomy["trainer_config"]["embedding"]


def test_disk_probe_measures_positive_bandwidths(tmp_path):
    from nestpipe.planning import disk

    read_bw, write_bw = disk.measure(str(tmp_path), size_mb=8, reads=200)
    assert read_bw > 0 and write_bw > 0 and not list(tmp_path.iterdir())
