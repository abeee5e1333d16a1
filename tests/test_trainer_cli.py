"""Trainer CLI end to end: train/eval/export, SIGKILL + resume bitwise, a failing rank, clear errors, placement."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import re
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from nestpipe.trainer import testing_hooks
from nestpipe.trainer.export import assemble
from nestpipe.trainer.embedding.placement import init_rows, make_placement, to_vocab
from shard_sets import make_shards

SETS = ["--set", "embedding.replicate_max_rows=200", "--set", "hstu.num_layers=1",
        "--set", "hstu.num_random_negatives=8", "--set", "hstu.num_popular_negatives=8"]
NO_CHART = ["--set", "pipe.gantt_steps=0"]  # no timeline.png (about 2 s a launch); the first test below draws one


def cmd(*args):
    if args[:1] == ("train",) and "--shards" in args:  # a new run: NO_CHART first, so a later --set overrides it
        args = ("train", *NO_CHART, *args[1:])
    return [sys.executable, "-m", "nestpipe", *args]


def env(**hooks):
    """The ranks' environment, with test-only hooks (nestpipe.trainer.testing_hooks) when given."""
    return dict(os.environ, OMP_NUM_THREADS="1", **(testing_hooks.as_env(**hooks) if hooks else {}))


IN_PROCESS = ("eval", "export", "plan")  # single-process commands: run here, without a process start-up each


def run(*args, timeout=180, hooks=None):
    if args[0] in IN_PROCESS and not hooks:
        return run_here(*args)
    return subprocess.run(cmd(*args), capture_output=True, text=True, timeout=timeout, env=env(**(hooks or {})))


def run_here(*args):
    """``nestpipe ARGS`` through the CLI's own entry point in this process: its exit code, stdout and stderr as a
    finished process would give them (an uncaught exception fails the test, as a traceback would)."""
    from nestpipe.cli import main

    out, err, threads = io.StringIO(), io.StringIO(), torch.get_num_threads()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            rc = e.code if isinstance(e.code, int) else 1
        finally:
            torch.set_num_threads(threads)  # eval sets the run's intra-op threads
    return subprocess.CompletedProcess(list(args), rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def gr(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("cli") / "gr")
    make_shards(d, "gr", batch_size=12, micro_batches=3, shards=(5, 5), eval_shards=(1,), vocab=300, seq_len=8,
                seed=3)
    return d


def test_placement_every_key_one_owner_and_init_independent_of_world():
    for vocab in (1, 7, 300, 1001):
        ids = np.arange(vocab)
        for world in (1, 2, 3, 4):
            pl = make_placement(5, vocab, world)
            owner, row = pl.owner_and_row(ids)
            assert owner.min() >= 0 and owner.max() < world
            assert np.all(row < np.array([pl.local_rows(r) for r in range(world)])[owner])
            # a bijection onto (owner, row) pairs: every key exactly one owner and one slot
            assert len(set(zip(owner.tolist(), row.tolist()))) == vocab
            for r in range(world):
                rows = np.arange(pl.local_rows(r))
                assert np.array_equal(pl.owner_and_row(pl.ids_of_rows(r, rows))[1], rows)
    oov = np.array([-5, 300, 10**12, 299])
    mapped = to_vocab(oov, 300)
    assert mapped[-1] == 299 and np.all((mapped >= 0) & (mapped < 300))
    assert np.array_equal(mapped, to_vocab(oov, 300))
    a = init_rows(0, 2, np.array([3, 4]), 8, 0.05)
    assert np.array_equal(a, init_rows(0, 2, np.array([4, 3]), 8, 0.05)[::-1])
    assert not np.array_equal(a, init_rows(1, 2, np.array([3, 4]), 8, 0.05))
    # negative control for the bijection check: a non-coprime multiplier collides
    bad = (ids_300 := np.arange(300)) * 6 % 300
    assert len(set(bad.tolist())) < len(ids_300)


@pytest.mark.slow
def test_train_eval_export_and_errors(gr, tmp_path):
    out = str(tmp_path / "run")
    p = run("train", "--shards", gr, "--out", out, "--model", "hstu", "--nproc-per-node", "2", "--epochs", "1",
            "--no-progress", "--tensorboard", *SETS, "--set", "pipe.gantt_steps=3")
    assert p.returncode == 0, p.stderr[-4000:]
    assert "samples/s" in p.stdout
    assert os.path.getsize(os.path.join(out, "timeline.png")) > 0
    _check_tensorboard_events(out)
    m = json.load(open(os.path.join(out, "metrics.json")))
    assert m["steps_run"] == 5 and m["world"] == 2 and all(x > 0 for x in m["samples_per_s_per_rank"])
    assert m["per_rank"][0]["exposed_communication_s"] > 0
    p = run("eval", "--run", out)
    assert p.returncode == 0, p.stderr[-3000:]
    ev = json.load(open(os.path.join(out, "eval.json")))
    assert set(ev["model"]) == {"HR@10", "HR@50", "NDCG@10", "NDCG@50"} and ev["samples"] > 0
    assert "HR@10" in ev["baseline_most_popular"] and "NDCG@10" in ev["baseline_successor_counts"]
    assert ev["strongest_baseline"] in ("most_popular", "successor_counts")
    p = run("export", "--run", out, "--out", str(tmp_path / "m.pt"))
    assert p.returncode == 0, p.stderr[-3000:]
    d = torch.load(str(tmp_path / "m.pt"), weights_only=True)
    # hstu defaults output_embedding=untied, transition=0.3 and item_bias=0.5: every item row is
    # [input | output | from | to | bias], four dims of 16 and the bias's four columns
    assert d["embedding.item.weight"].shape == (300, 68) and "optim.dense.pos.exp_avg" in d
    _check_safetensors_export(out, tmp_path, d)
    # the run stands on its own: with its shards gone (moved), export still works from the manifest the run
    # kept; eval asks for --shards and checks that they are the run's (before: "no manifest" for both)
    import shutil

    moved = str(tmp_path / "moved-run")
    shutil.copytree(out, moved)
    cfg = json.load(open(os.path.join(moved, "config.json")))
    cfg["shards"] = str(tmp_path / "gone")
    json.dump(cfg, open(os.path.join(moved, "config.json"), "w"))
    p = run("export", "--run", moved, "--out", str(tmp_path / "m2.pt"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert torch.equal(torch.load(str(tmp_path / "m2.pt"), weights_only=True)["embedding.item.weight"],
                       d["embedding.item.weight"])
    p = run("eval", "--run", moved)
    assert p.returncode != 0 and "pass --shards" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    p = run("eval", "--run", moved, "--shards", gr, "--max-batches", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    other = str(tmp_path / "other")
    make_shards(other, "gr", batch_size=12, micro_batches=3, shards=(2, 2), eval_shards=(1,), vocab=300, seq_len=8,
                seed=4)
    p = run("eval", "--run", moved, "--shards", other)
    assert p.returncode != 0 and "not the shards run" in p.stderr, p.stderr[-2000:]
    # wrong model for the task
    p = run("train", "--shards", gr, "--out", str(tmp_path / "x"), "--model", "dlrm", "--steps", "1")
    assert p.returncode != 0 and "'gr'" in p.stderr and "hstu" in p.stderr
    # a world size the shards cannot feed (10 train batches, 11 ranks; fewer shards than ranks are dealt:
    # test_fewer_shards_than_ranks_are_dealt_and_too_few_batches_refused)
    p = run("train", "--shards", gr, "--out", str(tmp_path / "y"), "--model", "hstu", "--nproc-per-node", "11",
            "--steps", "1", "--no-progress", *SETS)
    assert p.returncode != 0 and "10 train batch(es) cannot feed world size 11" in p.stderr, p.stderr[-2000:]


def test_corrupt_shard_is_named(gr, tmp_path):
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(gr, bad)
    path = os.path.join(bad, "train-000001.tar")
    with open(path, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0xFF]))
    p = run("train", "--shards", bad, "--out", str(tmp_path / "r"), "--model", "hstu", "--nproc-per-node", "2",
            "--steps", "2", "--no-progress", *SETS)
    assert p.returncode != 0 and "train-000001.tar" in p.stderr and "corrupt" in p.stderr
    # checked in the parent before launching: one line per problem, no rank's traceback, nothing written
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 3, p.stderr
    assert "nothing launched" in p.stderr and not (tmp_path / "r" / "config.json").exists()


def test_failing_rank_ends_all_ranks_quickly(gr, tmp_path):
    t0 = time.time()
    p = run("train", "--shards", gr, "--out", str(tmp_path / "f"), "--model", "hstu", "--nproc-per-node", "2",
            "--steps", "5", "--timeout", "20", "--no-progress", *SETS, timeout=120,
            hooks={"fail_step": 2, "fail_rank": 1})
    took = time.time() - t0
    assert p.returncode != 0
    assert "injected failure at step 2" in p.stderr and "rank 1" in p.stderr
    assert took < 60, took


def _kill_tree(proc):
    """SIGKILL the launcher and every worker it started (torchrun puts workers in their own sessions)."""
    import psutil

    try:
        procs = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    proc.kill()
    for c in procs:
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(procs, timeout=10)


def _wait_for(path, proc, limit=120):
    t0 = time.time()
    while not os.path.exists(path):
        assert proc.poll() is None, "training ended before the expected point"
        assert time.time() - t0 < limit, f"timed out waiting for {path}"
        time.sleep(0.05)


# with a learning-rate schedule: the resumed steps must take the rates of their own step numbers
SIGKILL_ARGS = ["--model", "hstu", "--nproc-per-node", "2", "--steps", "9", "--checkpoint-every", "3",
                "--no-progress", *SETS, "--set", 'optim.schedule="linear"', "--set", "optim.warmup_steps=2",
                "--set", "optim.embedding_follows=true"]


@pytest.fixture(scope="module")
def sigkill_ref(gr, tmp_path_factory):
    """The uninterrupted run both tiers' killed runs are compared with (the memory-mapped tier trains bitwise like
    DRAM: tests/test_tiered_store.py)."""
    ref = str(tmp_path_factory.mktemp("sigkill") / "ref")
    p = run("train", "--shards", gr, "--out", ref, *SIGKILL_ARGS)
    assert p.returncode == 0, p.stderr[-3000:]
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["dram", "mmap"])
def test_sigkill_mid_checkpoint_and_mid_step_then_resume_is_bitwise(gr, sigkill_ref, tmp_path, tier):
    args = list(SIGKILL_ARGS)
    if tier == "mmap":  # row files with a DRAM cache of 5 KiB (a few dozen rows): far below the item table
        args += ["--set", 'embedding.tier="mmap"', "--set", "embedding.dram_cache_mb=0.005"]
    hooks = {"checkpoint_sleep_s": 2.0, "step_sleep_s": 0.4}  # windows to kill the runs below in
    ref = sigkill_ref

    out = str(tmp_path / "killed")
    ck = os.path.join(out, "checkpoints")
    proc = subprocess.Popen(cmd("train", "--shards", gr, "--out", out, *args), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env(**hooks))
    try:
        _wait_for(os.path.join(ck, ".tmp-step-00000006", "rank-00000.pt.part"), proc)  # mid checkpoint write
    finally:
        _kill_tree(proc)
    assert os.path.exists(os.path.join(ck, "step-00000003", "meta.json"))
    assert not os.path.exists(os.path.join(ck, "step-00000006"))

    # resume, and kill again mid-step once step 6 is checkpointed
    proc = subprocess.Popen(cmd("train", "--resume", out, "--nproc-per-node", "2"), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env(**hooks))
    try:
        _wait_for(os.path.join(ck, "step-00000006", "meta.json"), proc)
        time.sleep(0.6)  # inside step 7 (each step pauses 0.4 s between retrieval and forward)
    finally:
        _kill_tree(proc)
    p = run("train", "--resume", out, "--nproc-per-node", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    starts = [json.loads(x) for x in open(os.path.join(out, "scalars.jsonl")) if '"start"' in x]
    assert [s["resumed_from_step"] for s in starts] == [0, 3, 6], starts
    a, b = assemble(ref), assemble(out)  # what `nestpipe export` writes (tested above), without a launch each
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    if tier == "mmap":
        return  # what follows does not depend on the tier
    # resuming the finished run says so and changes nothing (no NaN loss logged, metrics.json kept)
    metrics_before = open(os.path.join(out, "metrics.json")).read()
    scalars_before = open(os.path.join(out, "scalars.jsonl")).read()
    p = run("train", "--resume", out, "--nproc-per-node", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "already finished" in p.stdout, p.stdout[-2000:]
    assert open(os.path.join(out, "metrics.json")).read() == metrics_before
    assert "NaN" not in open(os.path.join(out, "scalars.jsonl")).read()[len(scalars_before):]
    # --resume alone takes the world size from the checkpoint and honours --steps and --set (before: "written with
    # world size 2, this run has 1", and --set was ignored)
    p = run("train", "--resume", out, "--steps", "10", "--set", "pipeline=\"off\"", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.load(open(os.path.join(out, "metrics.json")))
    assert m["world"] == 2 and m["resumed_from_step"] == 9 and m["pipeline"] == "off", m
    # and the comparison is sensitive: one step more differs (the linear schedule ends at rate final_lr_ratio = 0,
    # so that tenth and last step moves the optimizers' state, not the weights)
    c = assemble(out)
    assert int(c["meta.step"]) == 10
    moved = [k for k in a if k != "meta.step" and not torch.equal(a[k], c[k])]
    assert moved, "one more step changed nothing the comparison reads"


@pytest.mark.slow
def test_a_damaged_checkpoint_is_refused_by_name_and_the_previous_one_used(sigkill_ref, tmp_path):
    """Every file of a checkpoint is listed in its meta.json with its sha256 and size; a damaged newest checkpoint
    (a rank file truncated, or one byte changed at the same size) is reported by name and skipped, and --resume
    from the previous one trains to a bitwise-equal export. Control: the intact copy reports nothing, and loading
    the truncated file directly fails (so skipping it is what saved the run)."""
    import shutil

    from nestpipe.trainer import checkpoint

    out = str(tmp_path / "run")
    shutil.copytree(sigkill_ref, out)
    before = {n: open(os.path.join(sigkill_ref, n), "rb").read() for n in ("config.json", "scalars.jsonl")}
    newest = checkpoint.latest(out)
    assert newest.endswith("step-00000009") and checkpoint.damage(newest) == []
    meta = checkpoint.read_meta(newest)
    assert sorted(meta["files"]) == ["rank-00000.pt", "rank-00001.pt"]
    rank1 = os.path.join(newest, "rank-00001.pt")
    data = open(rank1, "rb").read()
    with open(rank1, "wb") as f:  # one byte changed, same size: only the checksum sees it
        f.write(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    assert checkpoint.damage(newest) == ["rank-00001.pt: sha256 differs from the recorded one"]
    with open(rank1, "wb") as f:
        f.write(data[:len(data) // 2])
    assert checkpoint.damage(newest) == [f"rank-00001.pt: {len(data) // 2} bytes, {len(data)} recorded"]
    with pytest.raises(Exception):
        checkpoint.load_rank_file(newest, 1)
    assert checkpoint.latest(out, quiet=True).endswith("step-00000006")
    p = run("train", "--resume", out, "--nproc-per-node", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step-00000009 is damaged, not used (rank-00001.pt:" in p.stderr, p.stderr[-2000:]
    starts = [json.loads(x) for x in open(os.path.join(out, "scalars.jsonl")) if '"start"' in x]
    assert starts[-1]["resumed_from_step"] == 6
    a, b = assemble(sigkill_ref), assemble(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert checkpoint.damage(checkpoint.latest(out)) == []  # step 9 written again, intact
    # the copy was resumed where it is: the run it was copied from is untouched (before, --resume continued in
    # the directory config.json named, the original)
    assert {n: open(os.path.join(sigkill_ref, n), "rb").read() for n in before} == before
    assert json.load(open(os.path.join(out, "config.json")))["out"] == os.path.abspath(out)


def test_config_validation_names_the_key_and_checks_types():
    from nestpipe.trainer.config import TrainConfig

    for bad, message in (({"pipe": {"depth": 0}}, "pipe.depth = 0: must be >= 1"),
                         ({"pipe": {"comm_threads": 3}}, "pipe.comm_threads = 3: expected one of 1, 2"),
                         ({"pipeline": "fast"}, "pipeline = 'fast': expected one of auto, off, dbp, fwp, nested"),
                         ({"embedding": {"lr": "0.1"}}, "embedding.lr = '0.1': expected float"),
                         ({"progress": 1}, "progress = 1: expected bool"),
                         ({"dlrm": {"top_mlp": [64, "x"]}}, "dlrm.top_mlp"),
                         ({"embedding": {"kinds": {"item": "hashed"}}}, "embedding.kinds.item = 'hashed'"),
                         ({"embedding": {"huge_pages": "sometimes"}}, "embedding.huge_pages"),
                         ({"steps": 0}, "steps = 0: must be >= 1"),  # a run of no steps "trained" to loss nan
                         ({"embedding": {"lr": "abc"}}, "embedding.lr = 'abc': expected float")):
        with pytest.raises(ValueError, match=re.escape(message)):
            TrainConfig.from_dict(bad, where="cfg")
    # integers are accepted for float keys, lists for tuples
    cfg = TrainConfig.from_dict({"embedding": {"lr": 1}, "dlrm": {"top_mlp": [8, 4]}})
    assert cfg.embedding.lr == 1 and cfg.dlrm.top_mlp == (8, 4)


def test_config_of_an_earlier_run_with_retired_test_keys_loads_with_a_warning(tmp_path, capsys):
    from nestpipe.trainer.config import TrainConfig, load_run_config

    doc = TrainConfig().to_dict()
    doc["debug_fail_step"] = -1
    doc["pipe"]["debug_skip_dual_buffer_sync"] = False
    (tmp_path / "config.json").write_text(json.dumps(doc))
    cfg = load_run_config(str(tmp_path))
    assert cfg == TrainConfig()
    err = capsys.readouterr().err
    assert "ignoring debug_fail_step, pipe.debug_skip_dual_buffer_sync" in err and "testing_hooks" in err


def test_config_of_a_run_from_before_the_item_options_loads_them_off(tmp_path):
    """A run written before ``output_embedding``, ``transition`` and ``item_bias`` existed trained tied rows with
    neither term: its config loads with those values (not today's defaults), so its tables keep their widths.
    Control: the same document read as a new config takes the defaults."""
    from nestpipe.trainer.config import TrainConfig, load_run_config

    doc = TrainConfig().to_dict()
    for section in ("hstu", "sasrec"):
        for key in ("output_embedding", "transition", "item_bias"):
            del doc[section][key]
    (tmp_path / "config.json").write_text(json.dumps(doc))
    cfg = load_run_config(str(tmp_path))
    for section in (cfg.hstu, cfg.sasrec):
        assert (section.output_embedding, section.transition, section.item_bias) == ("tied", 0.0, 0.0)
    fresh = TrainConfig.from_dict(doc).hstu
    assert (fresh.output_embedding, fresh.transition, fresh.item_bias) == ("untied", 0.3, 0.5)


def test_help_config_lists_every_key():
    p = run("train", "--help-config")
    assert p.returncode == 0, p.stderr
    for key in ("pipe.depth", "pipe.boundary_prime", "embedding.placement", "hstu.max_seq_len", "dlrm.target",
                "optim.lr", "flush_denormal", "sparse_groups"):
        assert f"  {key}  (" in p.stdout, key
    assert "debug_" not in p.stdout


def test_testing_hooks_refuse_unknown_names_and_wrong_types():
    with pytest.raises(ValueError, match="unknown testing hook 'skip_sync'"):
        testing_hooks.as_env(skip_sync=True)
    with pytest.raises(ValueError, match="fail_step = 'x': expected int"):
        testing_hooks.as_env(fail_step="x")
    with pytest.raises(ValueError, match="unknown testing hook 'skip_sync'"):
        testing_hooks.make(skip_sync=True)
    assert testing_hooks.make(fail_step=3).changed() == {"fail_step": 3}
    assert testing_hooks.from_env({}).changed() == {} == testing_hooks.PRODUCTION.changed()
    assert testing_hooks.from_env(testing_hooks.as_env(step_sleep_s=0.5)).changed() == {"step_sleep_s": 0.5}


def test_no_product_module_of_the_engine_reads_testing_hooks():
    """The negative controls reach the embedding engine and the pipeline as constructor parameters: no module under
    trainer/embedding or trainer/pipeline imports testing_hooks, and nothing reads a process-wide hook state."""
    import pathlib

    import nestpipe.trainer as trainer

    root = pathlib.Path(trainer.__file__).parent
    for sub in ("embedding", "pipeline"):
        for path in (root / sub).glob("*.py"):
            assert "testing_hooks" not in path.read_text(), path
    assert not hasattr(testing_hooks, "active") and not hasattr(testing_hooks, "override")


def test_fewer_shards_than_ranks_are_dealt_and_too_few_batches_refused(tmp_path, capsys):
    """One train shard of 4 batches and 2 ranks: the batches are dealt (rank 0 gets 0 and 2, rank 1 gets 1 and 3, in
    every epoch, and a stream started at a later step reads what the first one read there); 4 batches for 5 ranks
    are refused before any rank starts, in one line naming --batch-size. Negative control: with 2 shards the split
    rule is by shard as before (rank 0 reads the first shard's batches)."""
    from nestpipe.cli import main
    from nestpipe.datasets.shards import iter_shard, load_manifest
    from nestpipe.trainer.data import ShardStream, world_problem

    one = str(tmp_path / "one")
    make_shards(one, "gr", batch_size=12, micro_batches=3, shards=(4,), eval_shards=(1,), vocab=300, seq_len=8, seed=3)
    m = load_manifest(one)
    batches = [r["user"].tolist() for r in iter_shard(os.path.join(one, m.sets["train"][0].path))]
    assert world_problem(m, "train", 2, one) == ""
    for rank in (0, 1):
        st = ShardStream(one, "train", rank, 2, verify=True)
        assert st.batches_per_rank == 2 and st.dropped == 0
        got = [(step, rec["user"].tolist()) for step, rec, _ in itertools.islice(st.records(0), 5)]
        assert got == [(k, batches[rank + 2 * (k % 2)]) for k in range(5)]
        assert [rec["user"].tolist() for _, rec, _ in itertools.islice(st.records(3), 2)] == [g for _, g in got[3:5]]
    three = ShardStream(one, "train", 2, 3, verify=False)  # 4 batches over 3 ranks: one each, the fourth dropped
    assert (three.batches_per_rank, three.dropped) == (1, 1)
    assert next(three.records(0))[1]["user"].tolist() == batches[2]
    problem = world_problem(m, "train", 5, one)
    assert "4 train batch(es) cannot feed world size 5" in problem and "--batch-size" in problem
    out = tmp_path / "run"
    t0 = time.perf_counter()
    rc = main(["train", "--shards", one, "--out", str(out), "--model", "hstu", "--nproc-per-node", "5", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc != 0 and "cannot feed world size 5" in err and len(err.strip().splitlines()) == 1, err
    assert time.perf_counter() - t0 < 20 and not (out / "config.json").exists()
    two = str(tmp_path / "two")
    make_shards(two, "gr", batch_size=12, micro_batches=3, shards=(2, 2), eval_shards=(1,), vocab=300, seq_len=8,
                seed=3)
    m2 = load_manifest(two)
    first = [r["user"].tolist() for r in iter_shard(os.path.join(two, m2.sets["train"][0].path))]
    st = ShardStream(two, "train", 0, 2, verify=False)
    assert not st.dealt and [rec["user"].tolist() for _, rec, _ in itertools.islice(st.records(0), 2)] == first


def test_model_defaults_from_the_shards_task(tmp_path):
    """No --model: ctr shards train dlrm (before: the config's hstu default, refused as the wrong task); an explicit
    --model still wins, so a wrong one is still refused (negative control)."""
    ctr = str(tmp_path / "ctr")
    make_shards(ctr, "ctr", batch_size=12, micro_batches=3, shards=(2,), eval_shards=(1,), vocab=300, seed=3)
    out = str(tmp_path / "run")
    p = run("train", "--shards", ctr, "--out", out, "--steps", "1", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    conf = json.load(open(os.path.join(out, "config.json")))
    assert conf["model"] == "dlrm"
    # the dlrm's own defaults for shared keys apply (the other models keep the sections' defaults), and --set wins
    assert conf["optim"]["lr"] == 0.002 and conf["embedding"]["init_scale"] == 0.1
    assert conf["dlrm"]["dot_pairs"] == ["user_id*author_id"]
    from nestpipe.trainer.config import default_config

    assert default_config("hstu")["optim"]["lr"] == 0.004 and default_config("sasrec")["embedding"]["init_scale"] == 0.05
    assert (default_config("hstu")["embedding"]["table_lr"] == default_config("sasrec")["embedding"]["table_lr"]
            == {"item": 0.15})
    p = run("train", "--shards", ctr, "--out", str(tmp_path / "r3"), "--steps", "1", "--no-progress",
            "--set", "optim.lr=0.01")
    assert p.returncode == 0, p.stderr[-3000:]
    conf = json.load(open(str(tmp_path / "r3" / "config.json")))
    assert conf["optim"]["lr"] == 0.01 and conf["embedding"]["init_scale"] == 0.1
    p = run("train", "--shards", ctr, "--out", str(tmp_path / "r2"), "--model", "hstu", "--steps", "1")
    assert p.returncode != 0 and "use --model dlrm" in p.stderr


def _check_safetensors_export(out, tmp_path, d):
    """``export --out FILE.safetensors``: read back with the safetensors package, every tensor bitwise the
    torch.save export's, also when each table is streamed in blocks of 7 rows; the model config beside it."""
    from safetensors.torch import load_file

    from nestpipe.trainer.export import export_safetensors

    st = str(tmp_path / "m.safetensors")
    p = run("export", "--run", out, "--out", st)
    assert p.returncode == 0 and "model config in" in p.stdout, p.stderr[-3000:]
    got = load_file(st)
    assert sorted(got) == sorted(d)
    assert all(torch.equal(got[k], d[k]) and got[k].dtype == d[k].dtype for k in d)
    conf = json.load(open(str(tmp_path / "m.config.json")))
    assert conf["model"] == "hstu" and conf["tables"]["item"]["vocab"] == 300 and conf["step"] == int(d["meta.step"])
    blocks = str(tmp_path / "blocks.safetensors")
    export_safetensors(out, blocks, block_rows=7)  # 300 rows: 43 blocks per table
    assert open(blocks, "rb").read() == open(st, "rb").read()
    # negative control: one byte changed in the item table's bytes is seen by the comparison
    raw = bytearray(open(st, "rb").read())
    n = int.from_bytes(raw[:8], "little")
    lo = json.loads(raw[8:8 + n])["embedding.item.weight"]["data_offsets"][0]
    raw[8 + n + lo + 5] ^= 0x40
    bad = str(tmp_path / "bad.safetensors")
    open(bad, "wb").write(bytes(raw))
    assert not torch.equal(load_file(bad)["embedding.item.weight"], d["embedding.item.weight"])


def _check_tensorboard_events(out):
    """``--tensorboard``: the event files under RUN/tensorboard, read with TensorBoard's own reader, hold the loss of
    every step of scalars.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = [json.loads(x) for x in open(os.path.join(out, "scalars.jsonl"))]
    want = {r["step"]: r["loss"] for r in logged if "loss" in r}
    acc = EventAccumulator(os.path.join(out, "tensorboard"))
    acc.Reload()
    got = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert len(want) == 5 and set(got) == set(want)
    assert all(got[k] == pytest.approx(want[k], rel=1e-6) for k in want)  # events store float32
    assert "train/samples_per_s" in acc.Tags()["scalars"]


def test_no_tensorboard_unless_asked(gr, tmp_path):
    out = str(tmp_path / "plain")
    p = run("train", "--shards", gr, "--out", out, "--model", "hstu", "--nproc-per-node", "1", "--steps", "2",
            "--no-progress", *SETS)
    assert p.returncode == 0, p.stderr[-3000:]
    assert os.path.exists(os.path.join(out, "scalars.jsonl")) and not os.path.exists(os.path.join(out, "tensorboard"))


@pytest.fixture(scope="module")
def ctr_ingested(tmp_path_factory):
    from nestpipe.datasets import synth
    from nestpipe.ingest import IngestConfig, ingest

    root = tmp_path_factory.mktemp("plan-ctr")
    synth.generate(str(root / "raw"), scale="tiny", seed=0, progress=False)
    out = str(root / "ctr")
    ingest(IngestConfig(raw=str(root / "raw"), out=out, task="ctr", batch_size=128, micro_batches=4,
                        batches_per_shard=4, workers=1, progress=False))
    return out


@pytest.mark.slow
def test_a_plan_from_plan_runs_in_train_as_it_is(ctr_ingested, tmp_path):
    """`nestpipe plan --out p.json` then `train --set embedding.placement=p.json`: the plan's exchange kinds are
    applied (before: "table 'history' is replicated in the plan but exchanged as 'reduction'" inside the ranks)."""
    for name, extra in (("all-replicated", []), ("mixed", ["--hbm-cap", "2e6"])):
        plan = str(tmp_path / f"{name}.json")
        p = run("plan", "--shards", ctr_ingested, "--workers", "2", "--no-column-split", "--hardware", "cpu-gloo",
                "--out", plan, *extra)
        assert p.returncode == 0, p.stderr[-2000:]
        want = {t: v["exchange"] for t, v in json.load(open(plan))["tables"].items()}
        out = str(tmp_path / f"run-{name}")
        p = run("train", "--shards", ctr_ingested, "--out", out, "--nproc-per-node", "2", "--steps", "2",
                "--no-progress", "--set", f"embedding.placement={json.dumps(plan)}")
        assert p.returncode == 0, p.stderr[-3000:]
        assert json.load(open(os.path.join(out, "metrics.json")))["exchange_kinds"] == want
        # the trainer's own rule would exchange history by partial sums: the plan decided otherwise
        assert want["history"] == ("replicated" if name == "all-replicated" else "reduction")
    assert sorted(set(want.values())) == ["reduction", "replicated", "unique"]
    # an explicit embedding.kinds entry still wins, and a conflict with the plan is refused naming the table
    p = run("train", "--shards", ctr_ingested, "--out", str(tmp_path / "conflict"), "--nproc-per-node", "2",
            "--steps", "1", "--no-progress", "--set", f"embedding.placement={json.dumps(plan)}",
            "--set", 'embedding.kinds={"tag": "unique"}')
    assert p.returncode != 0 and "'tag' is replicated in the plan" in p.stderr, p.stderr[-2000:]


@pytest.mark.slow
def test_a_plan_with_column_splits_runs_in_train_eval_and_export(ctr_ingested, tmp_path):
    """`nestpipe plan` at 4 workers cuts the pooled history table into two column ranges (column_wise 1x2); `train`
    runs that plan as it is (one store per column shard), and `eval` and `export` read the run back with whole rows."""
    plan = str(tmp_path / "p4.json")
    p = run("plan", "--shards", ctr_ingested, "--workers", "4", "--hardware", "cpu-gloo", "--hbm-cap", "2e6",
            "--out", plan)
    assert p.returncode == 0, p.stderr[-2000:]
    spec = json.load(open(plan))["tables"]["history"]
    assert (spec["sharding"], spec["col_shards"]) == ("column_wise", 2), spec
    out = str(tmp_path / "run")
    p = run("train", "--shards", ctr_ingested, "--out", out, "--nproc-per-node", "4", "--steps", "2",
            "--no-progress", "--set", f"embedding.placement={json.dumps(plan)}")
    assert p.returncode == 0, p.stderr[-3000:]
    from nestpipe.trainer import checkpoint

    meta = checkpoint.read_meta(checkpoint.latest(out))
    cols = sorted((pm["first_col"], pm["dim"], tuple(pm["owners"])) for st, pm in meta["placement"].items()
                  if pm["table"] == "history")
    ranks = sorted(s["rank"] for s in spec["shards"])
    assert [c[:2] for c in cols] == [(0, 32), (32, 32)] and sorted(c[2][0] for c in cols) == ranks, cols
    p = run("eval", "--run", out)
    assert p.returncode == 0, p.stderr[-2000:]
    p = run("export", "--run", out, "--out", str(tmp_path / "m.pt"))
    assert p.returncode == 0, p.stderr[-2000:]
    m = torch.load(str(tmp_path / "m.pt"), weights_only=True)
    assert m["embedding.history.weight"].shape == (5000, 64) and m["embedding.history.adagrad_state"].shape == (5000, 2)


def test_plan_replicates_tiny_tables():
    """A replicated table's gradients ride in the dense AllReduce: a 3-row table costs its bytes, not a collective's
    latency, so the planner replicates it (before: 5,000-row tables replicated, 3-row ones sharded)."""
    from nestpipe.planning.hardware import load_hardware
    from nestpipe.planning.planner import PlannerConfig, TableInfo, make_plan

    tables = [TableInfo("big", 5000, 64, "pooled", 20, 1.0)] + [
        TableInfo(f"tiny{i}", 3, 64, "single", 1, 1.0) for i in range(4)]
    plan = make_plan(tables, PlannerConfig(workers=2, batch_per_worker=128, group_size=2),
                     load_hardware("ascend-910b"))
    assert all(plan["tables"][f"tiny{i}"]["sharding"] == "replicated" for i in range(4))
    # negative control: charged a collective's latency of its own, a tiny table is not worth replicating
    from nestpipe.planning import network

    hw = load_hardware("ascend-910b")
    assert network.allreduce_seconds(hw, 2, 3 * 64 * 4) > 100 * network.allreduce_seconds(hw, 2, 3 * 64 * 4,
                                                                                            latency=False)


def test_table_lr_sets_one_tables_learning_rate(tmp_path):
    """``embedding.table_lr``: a table at learning rate 0 keeps its initial rows while the others train (negative
    control: without the override the same table moves); an unknown table name is refused."""
    ctr = str(tmp_path / "ctr")
    make_shards(ctr, "ctr", batch_size=12, micro_batches=3, shards=(2,), eval_shards=(1,), vocab=300, seed=3)
    # both runs in one launch of the ranks (the trainer's own train_worker, as `nestpipe train` runs it)
    from nestpipe.measure.launcher import run_plan, write_run

    runs = {name: write_run(str(tmp_path / name), ctr, "dlrm", "auto", 2, {"pipe": {"gantt_steps": 0}, **sets})
            for name, sets in (("frozen", {"embedding": {"table_lr": {"video_id": 0.0}}}), ("plain", {}))}
    p = run_plan([{"run": r} for r in runs.values()], 1, str(tmp_path / "plan.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    tables = {name: assemble(r) for name, r in runs.items()}
    table_id = sorted(["user_id", "video_id", "author_id", "tag", "history"]).index  # the placement's table ids

    def initial(t, vocab):  # the dlrm's init_scale default is 0.1
        return torch.from_numpy(init_rows(0, table_id(t), np.arange(vocab), 8, 0.1))

    assert torch.equal(tables["frozen"]["embedding.video_id.weight"], initial("video_id", 300))
    assert not torch.equal(tables["plain"]["embedding.video_id.weight"], initial("video_id", 300))
    assert not torch.equal(tables["frozen"]["embedding.user_id.weight"], initial("user_id", 200))
    p = run("train", "--shards", ctr, "--out", str(tmp_path / "bad"), "--steps", "1", "--no-progress",
            "--set", 'embedding.table_lr={"nope": 0.1}')
    assert p.returncode != 0 and "no table named ['nope']" in p.stderr and "Traceback" not in p.stderr
