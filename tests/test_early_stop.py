"""Early stopping on the valid split: the decision rule, the checkpoints it keeps, and a run that stops by itself,
keeps its best epoch and says which."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nestpipe.trainer import checkpoint, early_stop
from nestpipe.trainer.config import TrainConfig


def _es(scores, patience=2, max_epochs=10):
    es = early_stop.EarlyStop("NDCG@10", patience, max_epochs, batches_per_epoch=5)
    es.history = [{"epoch": k + 1, "step": 5 * (k + 1), "score": s} for k, s in enumerate(scores)]
    return es


def test_the_decision_keeps_the_best_epoch_and_waits_patience_epochs():
    assert not _es([]).done()
    assert not _es([0.1, 0.2, 0.15]).done()                    # one epoch since the best (patience 2)
    assert _es([0.1, 0.2, 0.15, 0.19]).done()                  # two
    assert _es([0.1, 0.2, 0.15, 0.19]).best["epoch"] == 2
    assert _es([0.3, 0.3, 0.1], patience=2).best["epoch"] == 1  # a tie keeps the earlier epoch
    assert _es([0.3, 0.3, 0.1], patience=2).done()
    assert _es([0.1, 0.2, 0.3], max_epochs=3).done()           # the last epoch trained
    assert _es([float("nan"), 0.1]).best["epoch"] == 2          # a NaN score is never the best
    d = _es([0.1, 0.2, 0.15, 0.19]).to_dict()
    assert (d["kept_epoch"], d["kept_step"], d["kept_score"], d["stopped_after_epoch"]) == (2, 10, 0.2, 4)


def test_pruning_keeps_the_best_and_the_latest_then_only_the_best(tmp_path):
    run = str(tmp_path)
    root = checkpoint.ckpt_root(run)
    for step in (5, 10, 15, 20):
        os.makedirs(os.path.join(root, f"step-{step:08d}"))
        with open(os.path.join(root, f"step-{step:08d}", "meta.json"), "w") as f:
            json.dump({"format": checkpoint.FORMAT, "step": step, "files": {}}, f)  # complete, nothing to check
    es = _es([0.1, 0.2, 0.15, 0.19])
    early_stop.prune(es, run, final=False)
    assert sorted(os.listdir(root)) == ["step-00000010", "step-00000020"]
    assert checkpoint.latest(run).endswith("step-00000020")  # a killed run resumes from the latest
    early_stop.prune(es, run, final=True)
    assert sorted(os.listdir(root)) == ["step-00000010"]
    assert checkpoint.latest(run).endswith("step-00000010")  # eval, export and serve read the kept epoch


def test_mode_auto_needs_a_valid_split_and_no_epoch_count(tmp_path):
    class Manifest:
        def __init__(self, splits):
            self.sets = {s: [object()] for s in splits}

    cfg = TrainConfig()
    assert early_stop.wanted(cfg, Manifest(["train", "valid", "eval"]))
    assert not early_stop.wanted(cfg, Manifest(["train", "eval"]))
    cfg.epochs = 3
    assert not early_stop.wanted(cfg, Manifest(["train", "valid", "eval"]))  # the user named the epochs
    cfg.early_stop.mode = "on"
    assert early_stop.wanted(cfg, Manifest(["train", "valid", "eval"]))
    with pytest.raises(ValueError, match="ingest with --validation"):
        early_stop.wanted(cfg, Manifest(["train", "eval"]))
    cfg.early_stop.mode, cfg.epochs = "off", None
    assert not early_stop.wanted(cfg, Manifest(["train", "valid", "eval"]))


@pytest.fixture(scope="module")
def valid_shards(tmp_path_factory):
    from nestpipe.datasets.synth import generate
    from nestpipe.ingest import IngestConfig, ingest

    d = tmp_path_factory.mktemp("es")
    generate(str(d / "raw"), scale="tiny", seed=1, progress=False)
    ingest(IngestConfig(raw=str(d / "raw"), out=str(d / "gr"), task="gr", max_seq_len=32, validation=True,
                        progress=False))
    return str(d / "gr")


@pytest.mark.slow
def test_a_run_on_shards_with_a_valid_split_stops_by_itself_and_keeps_its_best_epoch(valid_shards, tmp_path):
    """No --epochs: the run trains epoch by epoch on 2 ranks, scores each on the valid split, stops after `patience`
    epochs without a better score (or at max_epochs) and keeps the best; `nestpipe eval --split valid` of the run
    gives exactly the kept score (the same model, the same arithmetic)."""
    run = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "nestpipe", "train", "--shards", valid_shards, "--out", run, "--model", "sasrec",
           "--nproc-per-node", "2", "--no-progress", "--set", "early_stop.max_epochs=3",
           "--set", "early_stop.patience=1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    metrics = json.load(open(os.path.join(run, "metrics.json")))
    es = metrics["early_stop"]
    history = es["history"]
    scores = [h["score"] for h in history]
    assert [h["epoch"] for h in history] == list(range(1, len(history) + 1)) and len(history) >= 2
    best = max(range(len(scores)), key=lambda k: (scores[k], -k))
    assert es["kept_epoch"] == best + 1 and es["kept_score"] == scores[best]
    assert es["stopped_after_epoch"] == 3 or es["stopped_after_epoch"] - es["kept_epoch"] == 1
    assert metrics["steps_run"] == es["stopped_after_epoch"] * es["batches_per_epoch"]
    assert checkpoint.latest(run).endswith(f"step-{es['kept_step']:08d}")
    assert len(os.listdir(checkpoint.ckpt_root(run))) == 1
    p = subprocess.run([sys.executable, "-m", "nestpipe", "eval", "--run", run, "--split", "valid"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    ev = json.load(open(os.path.join(run, "eval-valid.json")))
    assert ev["step"] == es["kept_step"] and ev["model"]["NDCG@10"] == pytest.approx(es["kept_score"], abs=1e-12)
    # a resumed finished run trains nothing more
    p = subprocess.run([sys.executable, "-m", "nestpipe", "train", "--resume", run, "--nproc-per-node", "2",
                        "--no-progress"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "already finished" in p.stdout + p.stderr, p.stderr[-2000:]


def test_early_stop_without_a_valid_split_is_refused_before_launch(tmp_path, capsys):
    sys.path.insert(0, os.path.dirname(__file__))
    from shard_sets import make_shards

    from nestpipe.cli import main

    shards = str(tmp_path / "s")
    make_shards(shards, "gr", batch_size=12, micro_batches=3, shards=(2,), eval_shards=(1,), vocab=300, seq_len=8)
    out = tmp_path / "run"
    assert main(["train", "--shards", shards, "--out", str(out), "--model", "hstu", "--early-stop"]) == 1
    err = capsys.readouterr().err
    assert "early stopping scores the valid split" in err and "--validation" in err and len(err.splitlines()) == 1
    assert not out.exists()
