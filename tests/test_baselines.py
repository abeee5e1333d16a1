"""The baselines ``nestpipe eval`` reports beside every model (:mod:`nestpipe.trainer.baselines`).

- The successor-counting and most-popular ranks equal a brute-force scoring of every catalog item (and of the same
  sampled negatives); negative control: the brute force without the own-history tier gives other ranks.
- On real shards (tiny synthetic data -> ``nestpipe ingest --task gr``), :func:`next_item_baselines` equals an
  independent computation from the shard files on the model's protocol (train windows counted, eval windows'
  last token held out). Negative controls: counting the eval windows too, or taking the targets from the
  training prefix (the token before the last), changes the figures.
- The logistic regression picks its regularisation on a validation tail of the training samples, records it, and
  learns a planted signal (negative control: shuffled labels give AUC near 0.5).
- The hashed-cross regression learns a pure pairwise (XOR-like) signal that the plain regression cannot (its AUC
  stays near 0.5: the negative control); its crosses of bags equal a brute-force enumeration of every id pair; the
  pairs cover every single-id table pair and the DLRM's ``dot_pairs``; the strongest CTR baseline is the one of
  highest AUC.
- The factorization machine learns the same pairwise signal with its default settings (negative control: without
  factors, ``dim`` 0, it stays at AUC 0.5); its logits and gradient equal a pair-by-pair sum and finite differences
  (negative control: the gradient without the self-interaction term differs); two fits give identical predictions,
  it keeps the epoch of least tail logloss; a CTR eval reports it with intervals and paired verdicts, and compares
  the model with the strongest of all baselines.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from nestpipe.datasets import synth
from nestpipe.datasets.shards import load_manifest, table_offsets
from nestpipe.ingest import IngestConfig, ingest
from nestpipe.trainer import baselines
from nestpipe.trainer.data import iter_shard
from nestpipe.trainer.embedding.placement import to_vocab
from nestpipe.trainer.evaluate import _auc, _rank_metrics, next_item_baselines
from nestpipe.utils.hashing import splitmix64


def _brute_rank(trans, pop_rank, history, target, items, own_tier=True):
    """Rank of ``target`` among ``items`` by (successor count of the last input, own count, popularity)."""
    last = history[-1]
    succ = np.array([trans.get((last, int(i)), 0) for i in items])
    own = np.array([int((history == i).sum()) for i in items]) if own_tier else np.zeros(len(items), int)
    st = trans.get((last, int(target)), 0)
    ot = int((history == target).sum()) if own_tier else 0
    pr, prt = pop_rank[items], pop_rank[target]
    better = (succ > st) | ((succ == st) & (own > ot)) | ((succ == st) & (own == ot) & (pr < prt))
    return int(better.sum())


def _fit_brute(windows, vocab):
    trans, counts = {}, np.zeros(vocab, np.int64)
    for w in windows:
        np.add.at(counts, w, 1)
        for a, b in zip(w[:-1], w[1:]):
            trans[(int(a), int(b))] = trans.get((int(a), int(b)), 0) + 1
    order = np.lexsort((np.arange(vocab), -counts))
    pop_rank = np.empty(vocab, np.int64)
    pop_rank[order] = np.arange(vocab)
    return trans, pop_rank


def test_successor_counts_rank_is_the_brute_force_rank():
    rng = np.random.default_rng(0)
    vocab = 60
    succ_of = rng.integers(0, vocab, vocab)
    windows = []
    for _ in range(300):
        w = [int(rng.integers(vocab))]
        for _ in range(int(rng.integers(1, 12))):
            w.append(int(succ_of[w[-1]]) if rng.random() < 0.5 else int(rng.zipf(1.5) % vocab))
        windows.append(np.array(w, np.int64))
    pop, succ = baselines.fit_next_item([{"item.values": np.concatenate(windows),
                                          "item.lengths": np.array([len(w) for w in windows])}], vocab)
    trans, pop_rank = _fit_brute(windows, vocab)
    assert np.array_equal(pop.pop_rank, pop_rank)
    everything = np.arange(vocab)
    differs = 0
    for _ in range(200):
        h = rng.integers(0, vocab, int(rng.integers(1, 10)))
        t = int(succ_of[h[-1]]) if rng.random() < 0.5 else int(rng.integers(vocab))
        negs = rng.integers(0, vocab, 25)
        assert succ.rank(h, t) == _brute_rank(trans, pop_rank, h, t, everything)
        assert succ.rank(h, t, negs) == _brute_rank(trans, pop_rank, h, t, negs)
        assert pop.rank(h, t) == pop_rank[t]
        assert pop.rank(h, t, negs) == int((pop_rank[negs] < pop_rank[t]).sum())
        differs += succ.rank(h, t) != _brute_rank(trans, pop_rank, h, t, everything, own_tier=False)
    assert differs > 10  # negative control: the own-history tier matters to the ranks checked above


@pytest.fixture(scope="module")
def gr_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("baselines")
    synth.generate(str(root / "raw"), scale="tiny", seed=0, progress=False)
    out = str(root / "gr")
    ingest(IngestConfig(raw=str(root / "raw"), out=out, task="gr", batch_size=32, micro_batches=4, max_seq_len=32,
                        batches_per_shard=4, workers=1, progress=False))
    return out


def _split_windows(shards, split, vocab):
    out = []
    for e in load_manifest(shards).sets[split]:
        for rec in iter_shard(os.path.join(shards, e.path)):
            off = table_offsets(rec, "item")
            vals = to_vocab(rec["item.values"], vocab)
            out += [vals[off[s]:off[s + 1]] for s in range(len(off) - 1)]
    return out


def _independent(train, evals, vocab, prefix_targets=False):
    trans, pop_rank = _fit_brute(train, vocab)
    items = np.arange(vocab)
    ranks = []
    for w in evals:
        if prefix_targets:
            w = w[:-1]  # the training prefix's last token as the target
        if len(w) >= 2:
            ranks.append(_brute_rank(trans, pop_rank, w[:-1], int(w[-1]), items))
    return _rank_metrics(np.array(ranks))


def test_next_item_baselines_use_the_model_protocol(gr_shards):
    vocab = load_manifest(gr_shards).tables["item"].vocab
    got = next_item_baselines(gr_shards, vocab)
    train, evals = _split_windows(gr_shards, "train", vocab), _split_windows(gr_shards, "eval", vocab)
    want = _independent(train, evals, vocab)
    assert got["successor_counts"] == pytest.approx(want, abs=1e-12)
    assert got["successor_counts"]["HR@10"] > 1.5 * got["most_popular"]["HR@10"], got
    # negative controls: the eval targets leaking into the counts, or targets from the training prefix
    leak = _independent(train + evals, evals, vocab)
    prefix = _independent(train, evals, vocab, prefix_targets=True)
    assert leak["HR@10"] > want["HR@10"] + 0.02, (leak, want)
    assert abs(prefix["HR@10"] - want["HR@10"]) > 0.02, (prefix, want)


def _ctr_records(rng, n_rec, b, flip):
    recs = []
    for _ in range(n_rec):
        a = rng.integers(0, 50, b)
        dense = rng.normal(size=(b, 3))
        logit = np.where(a < 25, 1.0, -1.0) + 0.8 * dense[:, 0]
        y = (rng.random(b) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        if flip:
            y = rng.permutation(y)
        recs.append({"a.values": a, "a.lengths": np.ones(b, np.int64), "dense": dense, "labels": y[:, None]})
    return recs


@pytest.mark.parametrize("shuffled", [False, True])
def test_logistic_baseline_learns_a_planted_signal(shuffled):
    rng = np.random.default_rng(1)
    train, ev = _ctr_records(rng, 20, 256, shuffled), _ctr_records(rng, 4, 256, False)
    lr = baselines.LogisticBaseline(["a"], {"a": 50}, 0).fit(train)
    info = lr.fit_info
    assert info["C"] in info["grid"] and set(info["validation_logloss"]) == {str(c) for c in info["grid"]}
    assert info["train_samples"] == 20 * 256 and info["features"] == 50 + 3
    auc = _auc(np.concatenate([r["labels"][:, 0] for r in ev]), np.concatenate([lr.predict(r) for r in ev]))
    if shuffled:  # negative control: nothing to learn
        assert abs(auc - 0.5) < 0.05, auc
    else:
        assert auc > 0.7, auc


def _xor_records(rng, n_rec, b, noise=0.1):
    """Two single-id tables of 20 ids; the label is the parity of (a + b) flipped with probability ``noise``: every
    id alone has a positive rate of 1/2, so only the pair carries the signal."""
    recs = []
    for _ in range(n_rec):
        a, c = rng.integers(0, 20, b), rng.integers(0, 20, b)
        y = ((a + c) % 2).astype(np.float32)
        y = np.where(rng.random(b) < noise, 1 - y, y)
        recs.append({"a.values": a, "a.lengths": np.ones(b, np.int64), "c.values": c,
                     "c.lengths": np.ones(b, np.int64), "dense": rng.normal(size=(b, 2)), "labels": y[:, None]})
    return recs


def test_cross_baseline_learns_a_pairwise_signal_the_plain_regression_cannot():
    rng = np.random.default_rng(2)
    train, ev = _xor_records(rng, 16, 256), _xor_records(rng, 4, 256)
    vocabs = {"a": 20, "c": 20}
    y = np.concatenate([r["labels"][:, 0] for r in ev])
    plain = baselines.LogisticBaseline(["a", "c"], vocabs, 0).fit(train)
    cfg = baselines.CrossConfig(buckets=2 ** 12)
    cross = baselines.CrossLogisticBaseline(["a", "c"], vocabs, 0, [("a", "c")], cfg).fit(train)
    auc_plain = _auc(y, np.concatenate([plain.predict(r) for r in ev]))
    auc_cross = _auc(y, np.concatenate([cross.predict(r) for r in ev]))
    assert cross.fit_info["features"] == 40 + 2 ** 12 + 2 and cross.fit_info["pairs"] == ["a*c"]
    assert abs(auc_plain - 0.5) < 0.05, auc_plain  # negative control: no single id carries the signal
    assert auc_cross > 0.7 and auc_cross > auc_plain + 0.2, (auc_cross, auc_plain)  # Bayes AUC: 0.9
    # without the pair the cross regression is the plain one: same columns, same fit
    none = baselines.CrossLogisticBaseline(["a", "c"], vocabs, 0, [], cfg).fit(train)
    assert abs(_auc(y, np.concatenate([none.predict(r) for r in ev])) - auc_plain) < 0.02


def test_cross_columns_of_bags_are_every_id_pair():
    rng = np.random.default_rng(3)
    b = 40
    la, lc = rng.integers(0, 4, b), np.ones(b, np.int64)
    lt = rng.integers(0, 3, b)
    rec = {"a.values": rng.integers(0, 9, la.sum()), "a.lengths": la, "c.values": rng.integers(0, 7, b),
           "c.lengths": lc, "t.values": rng.integers(0, 5, lt.sum()), "t.lengths": lt,
           "d.values": rng.integers(0, 7, b), "d.lengths": lc,
           "dense": np.zeros((b, 1)), "labels": np.zeros((b, 1), np.float32)}
    vocabs = {"a": 9, "c": 7, "t": 5, "d": 7}
    pairs = [("a", "c"), ("c", "d"), ("a", "t"), ("c", "t"), ("d", "c")]  # c, d: single ids (the vectorised path)
    m = baselines.CrossLogisticBaseline(["a", "c", "d", "t"], vocabs, 0, pairs,
                                        baselines.CrossConfig(buckets=1 << 40))
    rows, cols = m.cross_columns(rec)
    got = sorted(zip(rows.tolist(), cols.tolist()))
    want, triples = [], set()
    for p, (x, z) in enumerate(pairs):
        ox, oz = table_offsets(rec, x), table_offsets(rec, z)
        for s in range(b):
            for i in rec[f"{x}.values"][ox[s]:ox[s + 1]]:
                for j in rec[f"{z}.values"][oz[s]:oz[s + 1]]:
                    h = int(splitmix64(np.array([int(i) * vocabs[z] + int(j)], np.uint64), p + 1)[0]) % (1 << 40)
                    want.append((s, h))
                    triples.add((p, int(i), int(j)))
    assert got == sorted(want) and len(got) == int((la * lc).sum() + 2 * b + (la * lt).sum() + (lc * lt).sum())
    # distinct (pair, id, id) crosses get distinct buckets here, also across pairs with equal ids (the pair index
    # is hashed too); a hash of the ids alone would merge (0, i, j) with (1, i, j)
    assert len(set(cols.tolist())) == len(triples)


def test_cross_pairs_cover_single_tables_and_dot_pairs():
    got = baselines.cross_pairs(["c", "a", "b"], [("b", "a"), ("a", "history"), ("history", "history")])
    assert got == [("a", "b"), ("a", "c"), ("b", "c"), ("a", "history")]


def test_strongest_ctr_baseline_is_the_highest_auc():
    from nestpipe.trainer.evaluate import strongest_ctr_baseline

    res = {"baseline_constant": {"AUC": 0.5, "logloss": 0.6}, "baseline_lr": {"AUC": 0.64, "logloss": 0.62},
           "baseline_lrx": {"AUC": 0.66, "logloss": 0.63}}
    assert strongest_ctr_baseline(res, ["constant", "lr", "lrx"]) == "lrx"
    res["baseline_lrx"]["AUC"] = float("nan")
    assert strongest_ctr_baseline(res, ["constant", "lr", "lrx"]) == "lr"


@pytest.mark.parametrize("dim", [4, 0])
def test_factorization_machine_learns_a_pairwise_signal_the_plain_regression_cannot(dim):
    """The parity of two ids is a rank-one interaction (``v_a = (-1)^a``): the factorization machine with its
    default settings learns it; negative control: without factors (``dim`` 0: the regression's form) it cannot."""
    rng = np.random.default_rng(2)
    train, ev = _xor_records(rng, 32, 256), _xor_records(rng, 4, 256)
    y = np.concatenate([r["labels"][:, 0] for r in ev])
    plain = baselines.LogisticBaseline(["a", "c"], {"a": 20, "c": 20}, 0).fit(train)
    fm = baselines.FactorizationMachineBaseline(["a", "c"], {"a": 20, "c": 20}, 0,
                                                baselines.FMConfig(dim=dim)).fit(train)
    auc_plain = _auc(y, np.concatenate([plain.predict(r) for r in ev]))
    auc_fm = _auc(y, np.concatenate([fm.predict(r) for r in ev]))
    assert abs(auc_plain - 0.5) < 0.05, auc_plain
    assert fm.fit_info["features"] == 40 + 2 and fm.fit_info["train_samples"] == 32 * 256
    if dim:
        assert auc_fm > 0.8 and auc_fm > auc_plain + 0.25, (auc_fm, auc_plain)  # Bayes AUC: 0.9
    else:
        assert abs(auc_fm - 0.5) < 0.05, auc_fm


def test_factorization_machine_logits_and_gradient_are_the_brute_force_ones():
    """:func:`fm_logits` equals ``b + sum_i w_i x_i + sum_{i<j} <v_i, v_j> x_i x_j`` summed pair by pair, and
    :func:`fm_gradient` the central finite differences of the batch's mean logloss (float64)."""
    from scipy.sparse import csr_matrix

    rng = np.random.default_rng(5)
    b, rows, dim = 6, 9, 3
    dense = np.where(rng.random((b, rows)) < 0.4, rng.normal(size=(b, rows)), 0.0)
    x = csr_matrix(dense)
    theta = rng.normal(size=(rows + 1, dim + 1)) * 0.7
    y = (rng.random(b) < 0.5).astype(np.float64)
    want = np.full(b, theta[rows, dim]) + dense @ theta[:rows, dim]
    for s in range(b):
        for i in range(rows):
            for j in range(i + 1, rows):
                want[s] += theta[i, :dim] @ theta[j, :dim] * dense[s, i] * dense[s, j]
    assert np.allclose(baselines.fm_logits(theta, x, dim), want, rtol=1e-12, atol=1e-12)

    def loss(th, bias):
        full = np.vstack([th, np.r_[np.zeros(dim), bias][None]])
        return baselines.logloss(y, 1 / (1 + np.exp(-baselines.fm_logits(full, x, dim))))

    th, bias = theta[:rows].copy(), theta[rows, dim]
    grad, g_bias = baselines.fm_gradient(th.copy(), bias, x, x.multiply(x).tocsr(), y)
    eps = 1e-6
    numeric = np.zeros_like(th)
    for idx in np.ndindex(*th.shape):
        up, down = th.copy(), th.copy()
        up[idx] += eps
        down[idx] -= eps
        numeric[idx] = (loss(up, bias) - loss(down, bias)) / (2 * eps)
    assert np.allclose(grad, numeric, atol=1e-7), np.abs(grad - numeric).max()
    assert abs(g_bias - (loss(th, bias + eps) - loss(th, bias - eps)) / (2 * eps)) < 1e-7
    # negative control: without the self-interaction correction the gradient is not the loss's
    wrong = grad.copy()
    wrong[:, :dim] += (x.multiply(x).T @ (np.ones(b) / b))[:, None] * th[:, :dim]
    assert not np.allclose(wrong, numeric, atol=1e-4)


def test_factorization_machine_is_deterministic_and_keeps_the_epoch_of_least_tail_logloss():
    rng = np.random.default_rng(7)
    train, ev = _xor_records(rng, 12, 256), _xor_records(rng, 2, 256)
    make = lambda **kw: baselines.FactorizationMachineBaseline(  # noqa: E731
        ["a", "c"], {"a": 20, "c": 20}, 0, baselines.FMConfig(lr=0.01, batch_size=128, **kw)).fit(train)
    one, two, other = make(), make(), make(seed=1)
    p1, p2 = np.concatenate([one.predict(r) for r in ev]), np.concatenate([two.predict(r) for r in ev])
    assert np.array_equal(p1, p2) and np.array_equal(one.theta, two.theta)
    drop = lambda info: {k: v for k, v in info.items() if k != "fit_s"}  # noqa: E731
    assert drop(one.fit_info) == drop(two.fit_info)
    assert not np.array_equal(p1, np.concatenate([other.predict(r) for r in ev]))  # the seed is what is fixed
    info = one.fit_info
    history = info["validation_logloss"]
    # early stopping: the kept epoch has the least tail logloss, and training stopped `patience` epochs after it
    assert info["epochs"] == 1 + int(np.argmin(history)) and info["epochs"] < info["max_epochs"], info
    assert len(history) == info["epochs"] + info["patience"], info
    # refitted on every training sample for that many epochs: not the model that was scored on the tail
    tail_model = make(refit=False)
    assert not np.array_equal(tail_model.theta, one.theta)
    assert tail_model.fit_info["epochs"] == info["epochs"]


def test_ctr_eval_reports_the_factorization_machine_beside_the_strongest_baseline(tmp_path):
    """``evaluate_ctr`` (what eval.json holds for a CTR run) fits the factorization machine by default and reports
    it like every baseline: its figures and fit, a 95% interval per metric, the paired comparison and verdict
    against the model; the strongest baseline is the one of highest AUC among all of them."""
    import json

    import torch

    from shard_sets import make_shards

    from nestpipe.measure.launcher import write_run
    from nestpipe.trainer.config import load_run_config
    from nestpipe.trainer.evaluate import evaluate_ctr
    from nestpipe.trainer.models import build_model, model_table_dims

    shards = str(tmp_path / "ctr")
    man = make_shards(shards, "ctr", batch_size=64, micro_batches=2, shards=(12,), eval_shards=(4,), vocab=300,
                      seed=3)
    cfg = load_run_config(write_run(str(tmp_path / "run"), shards, "dlrm", "auto", 1))
    torch.manual_seed(0)
    model = build_model(cfg, man, model_table_dims(cfg, man)).eval()
    full = {f"embedding.{t}.weight": 0.1 * torch.randn(man.tables[t].vocab, model_table_dims(cfg, man)[t])
            for t in model.tables}
    ev = evaluate_ctr(cfg, man, full, model, None, fm=baselines.FMConfig(lr=0.01))
    json.dumps(ev)  # eval.json's content
    names = ["constant", "logistic_regression", "factorization_machine"]
    assert "baseline_logistic_regression_crosses" not in ev  # asked for only
    fm = ev["baseline_factorization_machine"]
    assert set(fm) == {"AUC", "logloss", "fit"} and fm["fit"]["train_samples"] == 12 * 64
    assert fm["fit"]["epochs"] >= 1 and fm["fit"]["validation_logloss"]
    assert fm["AUC"] > 0.6, fm  # the planted signal of the test shards (clicks by video id and a dense feature)
    for name in ["model"] + [f"baseline_{n}" for n in names]:
        for m in ("AUC", "logloss"):
            lo, hi = ev["intervals"][name][m]
            assert lo <= ev[name][m] + 1e-12 <= hi + 2e-12, (name, m)
    for m in ("AUC", "logloss"):
        c = ev["comparisons"]["baseline_factorization_machine"][m]
        assert c["interval"][0] <= c["difference"] + 1e-12 <= c["interval"][1] + 2e-12, c
        assert c["verdict"] in ("tie", "better", "worse")
    assert ev["strongest_baseline"] == max(names, key=lambda n: ev[f"baseline_{n}"]["AUC"]), ev
    best = f"baseline_{ev['strongest_baseline']}"
    assert ev["vs_strongest_baseline"] == {"baseline": ev["strongest_baseline"],
                                           **{m: ev["comparisons"][best][m]["verdict"] for m in ("AUC", "logloss")}}


def _leaks(w, validation):
    """Users whose held-out interaction (valid: e - 2, eval: e - 1) is a training target (a window's token > 0)."""
    held = 2 if validation else 1
    bad = 0
    for s, e in zip(USER_STARTS.tolist(), USER_ENDS.tolist()):
        for a, b in zip(w["train_start"], w["train_end"]):
            if s <= a < e and (e - held) in range(a + 1, b):
                bad += 1
    return bad


USER_STARTS, USER_ENDS = np.array([0, 2, 5, 15, 16]), np.array([2, 5, 15, 16, 60])


@pytest.mark.parametrize("validation", [False, True])
def test_gr_windows_hold_out_the_valid_interaction(validation):
    from nestpipe.ingest.gr import windows

    w = windows(USER_STARTS, USER_ENDS, 8, validation)
    assert list(w["eval_end"]) == [2, 5, 15, 60]  # every user with 2+ interactions; the last one is the target
    if validation:
        assert list(w["valid_end"]) == [4, 14, 59] and list(w["valid_start"]) == [2, 6, 51]
        assert max(w["train_end"][w["train_start"] >= 16]) == 58 and _leaks(w, True) == 0
        # negative control: the windows of the plain split train on the valid target of every user with 3+
        assert _leaks(windows(USER_STARTS, USER_ENDS, 8, False), True) == 3
    else:
        assert "valid_start" not in w and _leaks(w, False) == 0


def test_validation_split_is_written_and_evaluable(tmp_path, gr_shards):
    raw = os.path.join(os.path.dirname(gr_shards), "raw")
    out = str(tmp_path / "gr-valid")
    ingest(IngestConfig(raw=raw, out=out, task="gr", batch_size=32, micro_batches=4, max_seq_len=32,
                        batches_per_shard=4, workers=1, progress=False, validation=True))
    man = load_manifest(out)
    assert set(man.sets) == {"train", "valid", "eval"}
    vocab = man.tables["item"].vocab
    valid = _split_windows(out, "valid", vocab)
    evals = _split_windows(out, "eval", vocab)
    assert len(valid) > 0.8 * len(evals)
    got = next_item_baselines(out, vocab, split="valid")
    assert got["successor_counts"] == pytest.approx(_independent(_split_windows(out, "train", vocab), valid, vocab))
    # the default ingest keeps its fingerprint (no valid split, same manifest as before the option existed)
    assert "valid" not in load_manifest(gr_shards).sets


def test_click_truth_streams_the_exact_auc_and_logloss():
    from sklearn.metrics import roc_auc_score

    from nestpipe.datasets.synth import ClickTruth

    rng = np.random.default_rng(4)
    dates = rng.choice([20220505, 20220506, 20220507, 20220508], 20_000)
    p = 1 / (1 + np.exp(-rng.normal(0, 1, len(dates))))
    y = rng.random(len(dates)) < p
    truth = ClickTruth()
    for part in np.array_split(np.arange(len(dates)), 7):  # streamed in chunks
        truth.add(dates[part], p[part], y[part])
    r = truth.result(2)
    sel = dates >= 20220507
    assert r["rows"] == sel.sum() and r["first_date"] == 20220507
    assert abs(r["AUC"] - roc_auc_score(y[sel], p[sel])) < 1e-4
    want_ll = -np.mean(np.where(y[sel], np.log(p[sel]), np.log1p(-p[sel])))
    assert abs(r["logloss"] - want_ll) < 1e-9
    v = truth.result(2, "valid")  # the valid split of --validation: the one date before the eval dates
    sel = dates == 20220506
    assert v["rows"] == sel.sum() and v["first_date"] == 20220506
    assert abs(v["AUC"] - roc_auc_score(y[sel], p[sel])) < 1e-4
    # negative control: probabilities that do not belong to the rows give chance
    shuffled = ClickTruth()
    shuffled.add(dates, rng.permutation(p), y)
    assert abs(shuffled.result(2)["AUC"] - 0.5) < 0.03 and r["AUC"] > 0.65


def test_synth_truth_travels_with_the_shards(gr_shards):
    from nestpipe.datasets.synth import TRUTH_FILE
    from nestpipe.utils.jsonio import read_json

    raw = os.path.join(os.path.dirname(gr_shards), "raw")
    assert read_json(os.path.join(gr_shards, TRUTH_FILE)) == read_json(os.path.join(raw, TRUTH_FILE))
    ceiling = read_json(os.path.join(raw, TRUTH_FILE))["bayes_ceiling_by_eval_days"]
    assert set(ceiling) == {str(d) for d in range(1, 8)}
    assert ceiling["3"]["rows"] > ceiling["1"]["rows"] > 0 and 0.6 < ceiling["3"]["AUC"] < 0.8
    valid = read_json(os.path.join(raw, TRUTH_FILE))["bayes_ceiling_valid_by_eval_days"]
    assert valid["3"]["first_date"] < ceiling["3"]["first_date"] and 0 < valid["3"]["rows"] < ceiling["3"]["rows"]


# -- the ceiling on synthetic data: the generator's own next-item ranking ------------------------------------------
def _oracle(seed=0, **overrides):
    import dataclasses

    cfg = synth.SynthConfig.for_scale("tiny", seed=seed, **overrides)
    return synth.next_item_oracle({"config": dataclasses.asdict(cfg)}), cfg


@pytest.mark.parametrize("overrides", [dict(communities=True), dict(communities=False),
                                       dict(session_topics=8, topic_prob=0.8)])
def test_oracle_rank_is_the_brute_force_rank_and_its_probabilities_sum_to_one(overrides):
    oracle, cfg = _oracle(**overrides)
    rng = np.random.default_rng(1)
    everything = np.arange(cfg.num_videos)
    head = synth.head_catalogue(cfg)
    for k in range(60):
        c = int(rng.integers(cfg.num_communities))
        h = synth.community_catalogue(cfg, c)[rng.integers(0, 50, int(rng.integers(1, 12)))]
        if k % 7 == 0:
            h = head[rng.integers(0, 50, 3)]  # no community in the input: the uniform mixture
        p = oracle.probabilities(h, everything)
        assert p.sum() == pytest.approx(1.0, abs=1e-9)  # every item of the catalogue, the successor included
        t = int(rng.integers(cfg.num_videos)) if k % 3 else int(np.argmax(p))
        negs = rng.integers(0, cfg.num_videos, 40)
        assert oracle.rank(h, t) == int((p > p[t]).sum())
        assert oracle.rank(h, t, negs) == int((p[negs] > p[t]).sum())


def test_oracle_successor_matches_the_generated_logs(tmp_path):
    """The oracle's successor is the one the generator wrote: consecutive items of a user's session equal
    succ(previous) far more often than chance (P_follow ~ 0.26 inside a session); negative control: the oracle of
    another seed's layout predicts them at chance."""
    import polars as pl

    synth.generate(str(tmp_path / "raw"), scale="tiny", seed=0, progress=False)
    log = pl.concat([pl.read_csv(str(tmp_path / "raw" / f)) for f in synth.LOG_FILES if "standard" in f])
    s = log.sort(["user_id", "time_ms"])
    u, v = s["user_id"].to_numpy(), s["video_id"].to_numpy()
    pairs = np.flatnonzero(u[1:] == u[:-1])

    def follow_share(oracle):
        hit = [oracle.probabilities(v[i:i + 1], v[i + 1:i + 2])[0] >= oracle.p_follow for i in pairs[:3000]]
        return float(np.mean(hit))

    right, _ = _oracle()
    wrong, _ = _oracle(seed=1)
    assert 0.18 < follow_share(right) < 0.35, follow_share(right)
    assert follow_share(wrong) < 0.02


def test_the_shards_oracle_ranks_above_the_counting_baseline(gr_shards):
    """The oracle eval builds from the shards' truth file (the generator's config) beats the counting baseline on
    the model's protocol; negative control: the oracle of another seed's generator falls far below it."""
    from nestpipe.trainer.evaluate import _next_item_oracle, next_item_examples

    vocab = load_manifest(gr_shards).tables["item"].vocab
    oracle, other = _next_item_oracle(gr_shards), _oracle(seed=1)[0]
    assert oracle is not None and oracle.cfg == _oracle()[1]
    ranks, wrong = [], []
    for _, _, inputs, targets, _ in next_item_examples(gr_shards, vocab, None, 0, 0):
        for h, t in zip(inputs, targets):
            ranks.append(oracle.rank(h, int(t)))
            wrong.append(other.rank(h, int(t)))
    got, bad = _rank_metrics(np.array(ranks)), _rank_metrics(np.array(wrong))
    counting = next_item_baselines(gr_shards, vocab)["successor_counts"]
    assert got["HR@10"] > counting["HR@10"] and got["NDCG@10"] > counting["NDCG@10"], (got, counting)
    assert bad["HR@10"] < 0.5 * counting["HR@10"], (bad, counting)


def test_logistic_float32_matrix_fits_the_float64_model():
    """The default float32 model matrix (the cheaper fit) picks the same C and predicts what the float64 fit does."""
    rng = np.random.default_rng(2)
    train, ev = _ctr_records(rng, 20, 256, False), _ctr_records(rng, 4, 256, False)
    f32 = baselines.LogisticBaseline(["a"], {"a": 50}, 0).fit(train)
    f64 = baselines.LogisticBaseline(["a"], {"a": 50}, 0, baselines.LogisticConfig(dtype="float64")).fit(train)
    assert f32._matrix(*f32.features(ev[0])).dtype == np.float32 and f32.fit_info["dtype"] == "float32"
    assert f32.fit_info["C"] == f64.fit_info["C"]
    p32, p64 = (np.concatenate([m.predict(r) for r in ev]) for m in (f32, f64))
    assert np.abs(p32 - p64).max() < 1e-3


def test_session_topics_are_planted_and_the_oracle_reads_them(tmp_path):
    """``session_topics = K``: a session's fresh in-community draws share its topic (rank mod K) far more often
    than two Zipf draws do by chance, and the oracle, which takes the topic's posterior from the history, ranks the logs'
    next items higher than the same oracle told there are no topics. Negative controls: with ``topic_prob = 0``
    consecutive items share a topic at chance, and the topic-aware oracle gains nothing there."""
    import dataclasses

    import polars as pl

    def logs(**overrides):
        cfg = synth.SynthConfig.for_scale("tiny", seed=0, **overrides)
        out = tmp_path / f"raw-{overrides.get('topic_prob', 0)}"
        synth.generate(str(out), config=cfg, progress=False)
        log = pl.concat([pl.read_csv(str(out / f)) for f in synth.LOG_FILES if "standard" in f])
        s = log.sort(["user_id", "time_ms"])
        return cfg, s["user_id"].to_numpy(), s["video_id"].to_numpy()

    def same_topic_share(cfg, u, v):
        slots = synth._Layout.build(cfg).video_to_slot(v)
        comm = synth._slot_community(cfg, slots)
        topic = (slots - cfg.head_size) % cfg.catalogue_size % 8
        follows = np.r_[False, slots[1:] == synth._successor(cfg, slots[:-1])]
        pair = (u[1:] == u[:-1]) & (comm[1:] >= 0) & (comm[1:] == comm[:-1]) & ~follows[1:] & ~follows[:-1]
        marginal = np.bincount(topic[comm >= 0], minlength=8) / (comm >= 0).sum()
        return float((topic[1:] == topic[:-1])[pair].mean()), float((marginal ** 2).sum())  # (share, chance)

    def hit_rate(oracle, u, v):
        ends = np.flatnonzero(u[1:] == u[:-1])[::7][:600] + 1
        return float(np.mean([oracle.rank(v[max(0, e - 64):e][u[max(0, e - 64):e] == u[e]], int(v[e])) < 10
                              for e in ends]))

    cfg, u, v = logs(session_topics=8, topic_prob=0.8)
    plain = synth.NextItemOracle(dataclasses.replace(cfg, session_topics=0, topic_prob=0.0))
    share, chance = same_topic_share(cfg, u, v)
    assert share > chance + 0.25, (share, chance)  # chance: two draws of the ranks' Zipf share a topic
    assert hit_rate(synth.NextItemOracle(cfg), u, v) > hit_rate(plain, u, v) + 0.03
    cfg0, u0, v0 = logs(session_topics=8, topic_prob=0.0)
    share, chance = same_topic_share(cfg0, u0, v0)
    assert abs(share - chance) < 0.03, (share, chance)
    assert abs(hit_rate(synth.NextItemOracle(cfg0), u0, v0) - hit_rate(plain, u0, v0)) < 0.01


def test_oracle_names_each_items_topic_and_the_sessions_topic():
    """``item_topics``: a catalogue item's topic is its in-catalogue rank mod K, head items have none;
    ``session_topic``: a history of one topic's items puts that topic's posterior above 0.9. Negative controls:
    another topic's items move the posterior there; without session topics no item has a topic and there is no
    posterior; a history of head items only has no community."""
    oracle, cfg = _oracle(session_topics=8, topic_prob=0.8)
    cat, head = synth.community_catalogue(cfg, 3), synth.head_catalogue(cfg)
    comm, topic = oracle.item_topics(np.r_[cat[:40], head[:5]])
    assert (comm[:40] == 3).all() and (topic[:40] == np.arange(40) % 8).all()
    assert (comm[40:] == -1).all() and (topic[40:] == -1).all()
    assert (oracle.item_ranks(np.r_[cat[:40], head[:5]]) == np.r_[np.arange(40), np.full(5, -1)]).all()
    for z in (5, 2):
        community, post = oracle.session_topic(cat[[z + 8, z, z + 24, z + 8, z + 16]])
        assert community == 3 and post.sum() == pytest.approx(1.0) and int(post.argmax()) == z and post.max() > 0.9
    plain, _ = _oracle()
    assert (plain.item_topics(cat[:40])[1] == -1).all()
    assert plain.session_topic(cat[[5, 13, 29]]) == (3, None)
    assert oracle.session_topic(head[:4]) == (None, None)


def test_topic_authors_give_each_author_one_topic_of_every_popularity():
    """``topic_authors = A``: every author of a catalogue's topic videos holds videos of one (community, topic) only,
    at places j, j + A, ... of the topic (so popular and rare ones alike), and the topic has A authors; head videos
    keep the default grouping (four neighbouring slots) under other ids. Negative control: without it, authors (four neighbouring ranks) mix topics."""
    cfg = synth.SynthConfig.for_scale("tiny", session_topics=8, topic_prob=0.8, topic_authors=4)
    plain = synth.SynthConfig.for_scale("tiny", session_topics=8, topic_prob=0.8)
    oracle = synth.NextItemOracle(cfg)
    cat = np.concatenate([synth.community_catalogue(cfg, c)[:8 * 40] for c in range(cfg.num_communities)])
    comm, topic = oracle.item_topics(cat)
    authors = synth.video_authors(cfg, cat)
    groups = {}
    for a, c, z, r in zip(authors, comm, topic, np.tile(np.arange(8 * 40), cfg.num_communities)):
        groups.setdefault(int(a), set()).add((int(c), int(z), r // 8 % 4))
    assert all(len(g) == 1 for g in groups.values()) and len(groups) == cfg.num_communities * 8 * 4
    head = synth.head_catalogue(cfg)[:50]
    ours, theirs = synth.video_authors(cfg, head), synth.video_authors(plain, head)
    assert ((ours[:, None] == ours[None, :]) == (theirs[:, None] == theirs[None, :])).all()  # the same grouping
    mixed = {}
    for a, c, z in zip(synth.video_authors(plain, cat), comm, topic):
        mixed.setdefault(int(a), set()).add((int(c), int(z)))
    assert np.mean([len(g) > 1 for g in mixed.values()]) > 0.9
    assert not set(synth.video_authors(cfg, head)) & set(groups)  # the topic authors hold topic videos only
    with pytest.raises(ValueError, match="topic_authors"):
        synth.SynthConfig.for_scale("tiny", topic_authors=4)  # no session topics
    with pytest.raises(ValueError, match="topic_authors"):
        synth.SynthConfig.for_scale("tiny", session_topics=8, topic_prob=0.8, topic_authors=10)  # 640 >= 625


def test_oracle_target_kind_names_how_the_generator_drew_the_target():
    oracle, cfg = _oracle()
    layout = synth._Layout.build(cfg)
    history = synth.community_catalogue(cfg, 3)[[5, 9, 40]]
    succ = int(layout.slot_to_video(synth._successor(cfg, layout.video_to_slot(history[-1:])))[0])
    assert oracle.target_kind(history, succ) == "successor"
    assert oracle.target_kind(history, int(synth.head_catalogue(cfg)[0])) == "head"
    assert oracle.target_kind(history, int(synth.community_catalogue(cfg, 3)[100])) == "community"
    assert oracle.target_kind(history, int(synth.community_catalogue(cfg, 4)[0])) == "elsewhere"
    # the successor of an earlier item is a fresh draw as far as the last step goes
    earlier = int(layout.slot_to_video(synth._successor(cfg, layout.video_to_slot(history[:1])))[0])
    assert earlier != succ and oracle.target_kind(history, earlier) == "community"


def test_cooccurrence_counts_rank_on_the_models_protocol(gr_shards, tmp_path):
    """``research/cooccurrence_counts.py`` scores the split's samples on ``nestpipe eval``'s protocol: with the
    training pairs of the history's last items it ranks far above the most-popular baseline; negative control: with
    no history item read (``--last 0``) it is the training popularity ranking, that baseline's figures exactly."""
    import json
    import subprocess
    import sys

    def run(*extra):
        out = tmp_path / f"cooc{len(extra)}.json"
        subprocess.run([sys.executable, "research/cooccurrence_counts.py", gr_shards, "--split", "eval",
                        "--json", str(out), *extra], check=True, capture_output=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return json.loads(out.read_text())

    popular = next_item_baselines(gr_shards, load_manifest(gr_shards).tables["item"].vocab)["most_popular"]
    pairs, none = run(), run("--last", "0")
    assert pairs["samples"] == none["samples"] > 0
    assert pairs["HR@10"] > popular["HR@10"] + 0.1, (pairs, popular)
    assert (none["HR@10"], none["NDCG@10"]) == pytest.approx((popular["HR@10"], popular["NDCG@10"])), (none, popular)
