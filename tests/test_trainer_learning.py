"""Learning works on the default synthetic data: trained models beat trivial baselines by stated margins.

Data: ``nestpipe.datasets.synth.generate(scale="tiny")`` (planted communities and item->item successors) ->
``nestpipe ingest`` for both tasks. ``hstu`` trains on 2 gloo ranks (``--pipeline off``) with the default config and must beat the
most-popular baseline on full-catalog HR@10 and NDCG@10; ``dlrm`` trains on 2 ranks and must beat the constant
(train positive rate) predictor on AUC and logloss. Negative control: the same runs with both learning rates 0
(the initial model) do not clear the margins, so the margins measure training, not the evaluation.
"""

from __future__ import annotations

import pytest

from nestpipe.datasets import synth
from nestpipe.ingest import IngestConfig, ingest
from nestpipe.datasets.shards import load_manifest
from nestpipe.measure.launcher import run_plan, write_run
from nestpipe.trainer.evaluate import evaluate_run

pytestmark = pytest.mark.slow  # module fixtures train for a minute or more

# margins over the baselines (measured on 2 ranks, the default data without the click model's taste term: HR@10
# 0.30 vs 0.14, NDCG@10 0.20 vs 0.08; AUC 0.64, logloss 0.646 vs 0.676; with learning rate 0: HR@10 0.03, AUC 0.51,
# logloss 0.694)
HR_MARGIN = 0.05
NDCG_MARGIN = 0.03
AUC_MIN = 0.56
LOGLOSS_MARGIN = 0.01
HSTU_EPOCHS = 5
FROZEN = {"embedding": {"lr": 0}, "optim": {"lr": 0}}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("learn")
    raw = str(root / "raw")
    synth.generate(raw, scale="tiny", seed=0, progress=False)
    gr, ctr = str(root / "gr"), str(root / "ctr")
    ingest(IngestConfig(raw=raw, out=gr, task="gr", batch_size=32, micro_batches=4, max_seq_len=64,
                        batches_per_shard=2, workers=1, progress=False))
    ingest(IngestConfig(raw=raw, out=ctr, task="ctr", batch_size=128, micro_batches=4, batches_per_shard=25,
                        workers=1, progress=False))
    return {"gr": gr, "ctr": ctr, "root": root}


@pytest.fixture(scope="module")
def runs(data):
    """The four runs below (each model trained, and frozen for one step), by ``train_worker`` on 2 ranks (what
    ``nestpipe train --pipeline off`` runs in each rank) in one launch: {name: run directory}."""
    root = data["root"]
    todo = {"hstu": ("gr", "hstu", None, {"epochs": HSTU_EPOCHS}), "hstu-frozen": ("gr", "hstu", 1, FROZEN),
            "dlrm": ("ctr", "dlrm", None, {"epochs": 1}), "dlrm-frozen": ("ctr", "dlrm", 1, FROZEN)}
    out = {}
    for name, (task, model, steps, sets) in todo.items():
        out[name] = write_run(str(root / name), data[task], model, "off", steps, {**sets, "pipe": {"gantt_steps": 0}})
    p = run_plan([{"run": r} for r in out.values()], 2, str(root / "plan.json"), timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return out


def hstu_beats(ev) -> bool:
    m, b = ev["model"], ev["baseline_most_popular"]
    return m["HR@10"] >= b["HR@10"] + HR_MARGIN and m["NDCG@10"] >= b["NDCG@10"] + NDCG_MARGIN


def dlrm_beats(ev) -> bool:
    m, b = ev["model"], ev["baseline_constant"]
    return m["AUC"] >= AUC_MIN and m["logloss"] <= b["logloss"] - LOGLOSS_MARGIN


def _check_intervals(ev, metrics, baselines):
    """Every metric of the model and of each baseline has a 95% interval around its value; every model - baseline
    difference a paired interval around it and the verdict that interval gives."""
    assert ev["intervals"]["resamples"] == 1000 and ev["intervals"]["samples"] == ev["samples"]
    for name in ["model"] + [f"baseline_{b}" for b in baselines]:
        for m in metrics:
            lo, hi = ev["intervals"][name][m]
            assert lo <= ev[name][m] + 1e-12 and ev[name][m] <= hi + 1e-12, (name, m, lo, hi, ev[name][m])
            if name != "model":
                c = ev["comparisons"][name][m]
                assert c["interval"][0] <= c["difference"] + 1e-12 <= c["interval"][1] + 2e-12, (name, m, c)
                assert c["verdict"] == ("tie" if c["interval"][0] <= 0 <= c["interval"][1] else
                                        "better" if (c["interval"][0] > 0) != (m == "logloss") else "worse"), c
    assert set(ev["vs_strongest_baseline"]) == {"baseline", *metrics}


def test_hstu_beats_most_popular(data, runs):
    ev = evaluate_run(runs["hstu"])
    assert ev["protocol"].startswith("full catalog") and ev["samples"] >= 100
    # every eval user is scored (the ingest keeps the incomplete last eval batch), and the report says how many
    m = load_manifest(data["gr"])
    assert ev["split_samples"] == m.stats["samples"]["eval"] == ev["samples"] + ev["too_short"]
    assert ev["split_samples"] % m.batch_size, "the fixture should leave an incomplete last eval batch"
    assert hstu_beats(ev), ev
    _check_intervals(ev, ("HR@10", "NDCG@10", "HR@50", "NDCG@50"), ["most_popular", "successor_counts"])
    assert ev["comparisons"]["baseline_most_popular"]["HR@10"]["verdict"] == "better", ev["comparisons"]
    # negative control: the untrained model (learning rates 0) does not beat the baseline
    frozen = evaluate_run(runs["hstu-frozen"])
    assert not hstu_beats(frozen), frozen
    assert frozen["model"]["HR@10"] < frozen["baseline_most_popular"]["HR@10"], frozen


def test_dlrm_beats_constant(data, runs):
    ev = evaluate_run(runs["dlrm"])
    assert ev["samples"] >= 1000
    assert ev["samples"] == load_manifest(data["ctr"]).stats["samples"]["eval"]  # every eval interaction
    assert dlrm_beats(ev), ev
    names = ["constant", "logistic_regression", "factorization_machine"]  # the pairwise baseline of every eval
    _check_intervals(ev, ("AUC", "logloss"), names)
    assert ev["strongest_baseline"] == max(names, key=lambda n: ev[f"baseline_{n}"]["AUC"]), ev
    assert ev["baseline_factorization_machine"]["fit"]["train_samples"] > 20_000
    assert ev["comparisons"]["baseline_constant"]["AUC"]["verdict"] == "better", ev["comparisons"]
    assert "baseline_logistic_regression_crosses" not in ev  # asked for only (its cost: docs/trainer.md)
    # asked for (here on 3,000 training samples, to keep the test short), the crosses baseline joins the report
    from nestpipe.trainer import baselines
    from nestpipe.trainer.config import load_run_config
    from nestpipe.trainer.evaluate import evaluate_ctr, load_trained
    from nestpipe.trainer.run_files import run_manifest

    cfg = load_run_config(runs["dlrm"])
    man, cfg.shards = run_manifest(runs["dlrm"], cfg, None, need_data=True)
    full, model = load_trained(runs["dlrm"], cfg, man)
    ev = evaluate_ctr(cfg, man, full, model, None,
                      cross=baselines.CrossConfig(max_train_samples=3000, buckets=2 ** 16, grid=(0.01,)))
    names.append("logistic_regression_crosses")
    _check_intervals(ev, ("AUC", "logloss"), names)
    assert ev["strongest_baseline"] == max(names, key=lambda n: ev[f"baseline_{n}"]["AUC"]), ev
    fit = ev["baseline_logistic_regression_crosses"]["fit"]
    singles = [t for t, s in load_manifest(data["ctr"]).tables.items() if s.kind == "single"]
    pairs = {frozenset(p.split("*")) for p in fit["pairs"]}
    assert len(pairs) == len(fit["pairs"]) == len(singles) * (len(singles) - 1) // 2, fit  # every single-id pair
    assert {"user_id", "author_id"} in pairs, fit  # the DLRM's dot_pairs default
    # synthetic data: the generator's own probabilities bound what any model can reach (within sampling noise)
    ceiling = ev["bayes_ceiling"]
    assert ceiling["rows"] >= ev["samples"] and ceiling["AUC"] > ev["model"]["AUC"] - 0.01, ev
    frozen = evaluate_run(runs["dlrm-frozen"])
    assert not dlrm_beats(frozen), frozen
