"""``embedding.tier = mmap``: rows and AdaGrad state in files with a small DRAM cache train bitwise like the DRAM
store (both models, world 2, ``off`` and ``nested``); negative control: evicted dirty rows not written back."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from nestpipe.trainer.embedding.placement import make_placement
from nestpipe.trainer.embedding.store import RowStore
from nestpipe.trainer.embedding.tiered_store import TierError, TieredRowStore
from nestpipe.trainer.export import assemble
from nestpipe.measure.launcher import run_plan, write_run
from shard_sets import make_shards

SETS = {
    "hstu": {"embedding": {"replicate_max_rows": 100, "lr": 0.05}, "optim": {"lr": 0.01},
             "hstu": {"num_layers": 1, "num_random_negatives": 8, "num_popular_negatives": 8, "in_batch_negatives": 0}},
    "dlrm": {"embedding": {"replicate_max_rows": 100, "lr": 0.05}, "optim": {"lr": 0.01},
             "dlrm": {"bottom_mlp": [16, 8], "top_mlp": [16], "cross_rank": 4}},
}
MMAP = {"tier": "mmap", "dram_cache_mb": 0.05}  # a few hundred rows per rank: far below the tables


def _pair(tmp_path, cache_rows, n=500, dim=8):
    pl = make_placement(3, n, 1)
    dram = RowStore("t", pl, 0, dim, seed=5, init_scale=0.1)
    tier = TieredRowStore("t", pl, 0, dim, 5, 0.1, str(tmp_path / "store"), cache_rows, "run", 1)
    return dram, tier


def _random_batches(store_rows, steps=60, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield torch.from_numpy(np.unique(rng.integers(0, store_rows, 40)))


@pytest.mark.parametrize("skip", [False, True])
def test_tiered_store_keeps_the_dram_stores_values_through_evictions(tmp_path, skip):
    dram, tier = _pair(tmp_path, cache_rows=64)
    tier.skip_dirty_write_back = skip
    for step, rows in enumerate(_random_batches(500)):
        (w0, s0), (w1, s1) = dram.gather(rows), tier.gather(rows)
        assert skip or (torch.equal(w0, w1) and torch.equal(s0, s1)), step
        w0, s0 = w0 * 0.9 + 0.01 * step, s0 + 1.0
        dram.write_back(rows, w0, s0)
        tier.write_back(rows, w0.clone(), s0.clone())
    assert tier.stats["evicted_dirty"] > 0 and tier.stats["misses"] > tier.stats["hits"] > 0
    a, b = dram.full_rows(0, 500), tier.full_rows(0, 500)
    same = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert same != skip  # the control: evicted updates lost


def test_a_dram_checkpoint_loads_into_the_tier_and_a_store_of_another_run_is_refused(tmp_path):
    dram, tier = _pair(tmp_path, cache_rows=32)
    for rows in _random_batches(500, steps=10):
        w, s = tier.gather(rows)
        tier.write_back(rows, w + 1, s + 2)
        w, s = dram.gather(rows)
        dram.write_back(rows, w + 1, s + 2)
    assert tier.stats["passed_through"] > 0  # batches of ~38 rows through a 32-row cache
    assert torch.equal(tier.materialized, dram.materialized)
    # a DRAM run's checkpoint entry (its touched rows) resumed on the tier: a fresh store takes the rows
    fresh = TieredRowStore("t", tier.placement, 0, 8, 5, 0.1, str(tmp_path / "store"), 32, "run", 1)
    fresh.load_state_dict(dram.state_dict())
    assert torch.equal(fresh.materialized, dram.materialized)
    assert all(torch.equal(x, y) for x, y in zip(tier.full_rows(0, 500), dram.full_rows(0, 500)))
    assert all(torch.equal(x, y) for x, y in zip(fresh.full_rows(0, 500), dram.full_rows(0, 500)))
    with pytest.raises(TierError, match="another run or layout"):
        TieredRowStore("t", tier.placement, 0, 8, 5, 0.1, str(tmp_path / "store"), 32, "other-run", 1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tier")
    shards = {"hstu": str(base / "gr"), "dlrm": str(base / "ctr")}
    make_shards(shards["hstu"], "gr", batch_size=12, micro_batches=4, shards=(8, 8), eval_shards=(1,),
                vocab=2000, seq_len=10, seed=1)
    make_shards(shards["dlrm"], "ctr", batch_size=16, micro_batches=4, shards=(8, 8), eval_shards=(1,),
                vocab=2000, seed=2)
    out, plan = {}, []
    for model in ("hstu", "dlrm"):
        for name, mode, emb, hooks in (("dram-off", "off", {}, {}), ("mmap-off", "off", MMAP, {}),
                                       ("mmap-nested", "nested", MMAP, {}),
                                       ("mmap-nowb", "nested", MMAP, {"skip_tier_write_back": True})):
            run = str(base / f"{model}-{name}")
            sets = json.loads(json.dumps(SETS[model]))
            sets["embedding"].update(emb)
            sets["pipe"] = {"gantt_steps": 0, "micro_batching": "clustered"}
            write_run(run, shards[model], model, mode, 16, sets, 0)
            plan.append({"run": run, "resume": False, "testing_hooks": hooks})
            out[(model, name)] = run
    # resume: 8 steps with checkpoints every 4, then the same run continued to 16 from its step-8 checkpoint
    run = str(base / "hstu-mmap-resumed")
    sets = json.loads(json.dumps(SETS["hstu"]))
    sets["embedding"].update(MMAP)
    sets["pipe"] = {"gantt_steps": 0, "micro_batching": "clustered"}
    write_run(run, shards["hstu"], "hstu", "nested", 8, sets, 4)
    plan.append({"run": run, "resume": False, "testing_hooks": {}})
    out[("hstu", "mmap-resumed")] = run
    p = run_plan(plan, 2, str(base / "plan.json"), timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    cfg = json.load(open(os.path.join(run, "config.json")))
    cfg["steps"] = 16
    json.dump(cfg, open(os.path.join(run, "config.json"), "w"))
    p = run_plan([{"run": run, "resume": True}], 2, str(base / "plan-resume.json"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return out


def _diff(a, b):
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["hstu", "dlrm"])
def test_mmap_tier_with_a_small_cache_trains_bitwise_like_dram(runs, model):
    ref = assemble(runs[(model, "dram-off")])
    for name in ("mmap-off", "mmap-nested"):
        run = runs[(model, name)]
        assert _diff(ref, assemble(run)) == [], name
        m = json.load(open(os.path.join(run, "metrics.json")))
        stages = m["per_rank"][0]["stages_s"]
        assert stages.get("tier.read", 0) > 0 and stages.get("tier.write", 0) > 0, stages  # evictions happened
        assert os.listdir(os.path.join(run, "store"))
        assert m["exposed_tier_s_per_step"] > 0
        cats = {e["cat"] for e in json.load(open(os.path.join(run, "trace.json")))["traceEvents"] if e["ph"] == "X"}
        assert {"tier.gather", "tier.write_back"} <= cats, cats
    # negative control: evicted updates not written back
    assert _diff(ref, assemble(runs[(model, "mmap-nowb")]))


@pytest.mark.slow
def test_mmap_tier_resumes_bitwise_from_its_checkpoint(runs):
    run = runs[("hstu", "mmap-resumed")]
    starts = [json.loads(x) for x in open(os.path.join(run, "scalars.jsonl")) if '"start"' in x]
    assert [s["resumed_from_step"] for s in starts] == [0, 8], starts
    assert _diff(assemble(runs[("hstu", "dram-off")]), assemble(run)) == []


def test_a_disk_without_room_fails_before_training_naming_the_directory_or_file(tmp_path, monkeypatch):
    import errno

    from nestpipe.trainer.embedding import tiered_store

    pl = make_placement(3, 500, 1)
    monkeypatch.setattr(tiered_store, "_free_bytes", lambda path: 1000)
    with pytest.raises(TierError, match=r"store: table t needs 0\.00 GiB .* 0\.00 GiB free"):
        TieredRowStore("t", pl, 0, 8, 5, 0.1, str(tmp_path / "store"), 32, "run", 1)
    monkeypatch.undo()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(TierError, match=r"t\.rank0\.weight: cannot reserve .*No space left on device"):
        TieredRowStore("t", pl, 0, 8, 5, 0.1, str(tmp_path / "store2"), 32, "run", 1)


def test_snapshot_copies_the_row_files_and_restores_them(tmp_path):
    dram, tier = _pair(tmp_path, cache_rows=48)
    for rows in _random_batches(500, steps=8, seed=3):
        for st in (dram, tier):
            w, s = st.gather(rows)
            st.write_back(rows, w * 2, s + 1)
    snap_dir = tmp_path / "ckpt"
    snap_dir.mkdir()
    snap = tier.snapshot(str(snap_dir))
    assert sorted(os.listdir(snap_dir)) == ["t.rank0.state", "t.rank0.weight"] and "weight" not in snap
    for rows in _random_batches(500, steps=4, seed=4):  # train on past the snapshot
        w, s = tier.gather(rows)
        tier.write_back(rows, w + 5, s + 5)
    tier.load_state_dict(snap, where=str(snap_dir))
    assert torch.equal(tier.materialized, dram.materialized)
    with pytest.raises(ValueError, match="memory-mapped tier .* embedding.tier"):  # the DRAM store cannot take it
        dram.load_state_dict(snap, where=str(snap_dir))
    assert all(torch.equal(x, y) for x, y in zip(tier.full_rows(0, 500), dram.full_rows(0, 500)))


def test_a_write_error_names_the_row_file(tmp_path):
    import errno

    _, tier = _pair(tmp_path, cache_rows=64)
    rows = torch.arange(10)
    w, s = tier.gather(rows)
    tier.write_back(rows, w + 1, s + 1)

    class FailingFile:
        def __setitem__(self, key, value):
            raise OSError(errno.EIO, "Input/output error")

    tier.weight_file = FailingFile()
    with pytest.raises(TierError, match=r"t\.rank0\.weight: writing rows failed .*Input/output error"):
        tier.flush()


def _dual_buffer_run(store, batches):
    """The retrieval stage's gather of batch t+1 on a thread while batch t is written back, then the dual-buffer
    sync (rows of t and t+1 taken from t's updated buffer): the protocol the DBP schedules run on a store."""
    import threading

    rows = batches[0]
    w, s = store.gather(rows)
    for t in range(len(batches)):
        new_w, new_s = w * 0.5 + 0.25 * (t + 1), s + 1.0  # batch t's update, in its buffer
        nxt = {}
        if t + 1 < len(batches):
            th = threading.Thread(target=lambda: nxt.update(zip("ws", store.gather(batches[t + 1]))))
            th.start()
        store.write_back(rows, new_w, new_s)
        if t + 1 < len(batches):
            th.join()
            nrows = batches[t + 1]
            pos = {int(r): i for i, r in enumerate(rows)}
            w, s = nxt["w"].clone(), nxt["s"].clone()
            for j, r in enumerate(nrows.tolist()):
                if r in pos:
                    w[j], s[j] = new_w[pos[r]], new_s[pos[r]]
            rows = nrows


@pytest.mark.parametrize("cache_rows", [48, 24])
def test_concurrent_gather_and_write_back_keep_the_dram_stores_values(tmp_path, cache_rows):
    # 48: below two batches of about 36 rows (loads and evictions overlap the write-back); 24: below one (rows pass
    # through; the next batch's gather loads rows while the write-back runs)
    import time

    dram, tier = _pair(tmp_path, cache_rows=cache_rows)
    read = tier._read_rows

    def slow_read(rows):  # a disk read long enough for batch t's write-back to land while batch t+1's rows load
        out = read(rows)
        time.sleep(0.003)
        return out

    tier._read_rows = slow_read
    batches = list(_random_batches(200, steps=40, seed=7))
    for store in (dram, tier):
        _dual_buffer_run(store, batches)
    assert tier.stats["evicted_dirty"] > 0 and (cache_rows > 36 or tier.stats["passed_through"] > 0)
    assert all(torch.equal(x, y) for x, y in zip(dram.full_rows(0, 500), tier.full_rows(0, 500)))


def test_a_write_back_that_lands_while_its_row_loads_is_kept(tmp_path):
    # the interleaving the retrieval stage and the compute thread can produce, step by step: batch t+1 reserves a
    # slot for row r and reads r from the file outside the lock; batch t's write-back of r lands in that slot;
    # the read then must not overwrite it
    _, tier = _pair(tmp_path, cache_rows=8)
    rows = np.arange(5, dtype=np.int64)
    slots, miss_idx, take, _ = tier._reserve(rows)
    assert len(take) == 5
    new_w, new_s = torch.full((5, 8), 7.0), torch.full((5,), 3.0)
    tier.write_back(torch.from_numpy(rows), new_w, new_s)
    w_m, s_m, fresh = tier._read_rows(rows[miss_idx])
    tier._install(rows, miss_idx, take, w_m, s_m, fresh)
    w, s = tier.gather(torch.from_numpy(rows))
    assert torch.equal(w, new_w) and torch.equal(s, new_s)
