"""Cost-balanced GR batches (``nestpipe ingest --balance tokens``, the gr default) and the trainer's token_imbalance.

Unit level: the batch order is a permutation whose batches cost nearly the same within a window (control: the
unbalanced order's batches do not); the micro-batch swaps keep counts and reach the tolerance. Ingest level: the
written shards' training batches and micro-batches are balanced by the recorded cost model, and ``--balance off``
shards of the same data are not; eval micro-batches stay as the clustering made them. The cost model against
measured per-sequence times is in ``test_sequence_cost``.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from nestpipe.datasets import shards as S
from nestpipe.datasets.sequence_cost import DEFAULT_COST, SequenceCost
from nestpipe.ingest import balance
from nestpipe.ingest.config import IngestConfig


def _lengths(n, seed=0, top=1024):
    rng = np.random.default_rng(seed)
    return np.minimum(rng.geometric(1 / 150, n), top)


def _batch_costs(costs, order, B):
    k = len(order) // B
    return costs[order[:k * B]].reshape(k, B).sum(1)


def test_balanced_order_is_a_permutation_with_equal_cost_batches_per_window():
    B, W = 64, 16
    L = _lengths(B * W * 3 + 37)  # three windows and a tail of 37 samples
    order = balance.balanced_order(L, B, DEFAULT_COST, window=W)
    assert sorted(order.tolist()) == list(range(len(L)))
    assert order[-37:].tolist() == list(range(len(L) - 37, len(L)))  # the tail stays last, in order
    c = DEFAULT_COST(L)
    for w in range(3):
        got = _batch_costs(c, order, B)[w * W:(w + 1) * W]
        assert balance.imbalance(got) < 0.01, got
        # every batch draws from its own window only (a shard still reads one or two partitions)
        members = order[w * W * B:(w + 1) * W * B]
        assert members.min() >= w * W * B and members.max() < (w + 1) * W * B
        # the samples of a batch stay in their sample order
        for b in range(W):
            seg = members[b * B:(b + 1) * B]
            assert (np.diff(seg) > 0).all()
    # the control: the same samples in their own order are far from balanced
    plain = _batch_costs(c, np.arange(len(L)), B)[:W]
    assert balance.imbalance(plain) > 0.1


def test_balanced_order_depends_only_on_b_over_a():
    L = _lengths(64 * 20, seed=3)
    a = balance.balanced_order(L, 64, SequenceCost(2e-7, 1e-4))
    b = balance.balanced_order(L, 64, SequenceCost(2e-4, 1e-1))  # the same ratio, another unit
    assert np.array_equal(a, b)
    c = balance.balanced_order(L, 64, SequenceCost(0.0, 1.0))  # tokens only: another composition
    assert not np.array_equal(a, c)


def test_micro_batch_swaps_keep_counts_and_reach_the_tolerance():
    rng = np.random.default_rng(1)
    costs = DEFAULT_COST(_lengths(128, seed=4))
    mb = rng.permutation(np.repeat(np.arange(8), 16))
    before = balance.imbalance(np.bincount(mb, costs, 8))
    out, swaps = balance.balance_micro_batches(mb, costs, 8)
    load = np.bincount(out, costs, 8)
    assert np.array_equal(np.bincount(out, minlength=8), np.full(8, 16))
    assert swaps > 0 and before > 0.05
    assert balance.imbalance(load) <= balance.MICRO_TOLERANCE  # the costliest within 5% of the mean
    # a sample alone costlier than the others together: nothing to gain, no swap made, nothing breaks
    lone = np.array([1000.0] + [1.0] * 15)
    mb = np.repeat(np.arange(4), 4)
    out, _ = balance.balance_micro_batches(mb, lone, 4)
    assert np.array_equal(np.bincount(out, minlength=4), np.full(4, 4))
    assert np.bincount(out, lone, 4).max() == 1003.0


def test_keyed_micro_batch_swaps_add_fewer_rows_than_cost_only_swaps():
    """With the samples' keys, the balancing swaps pick among the gap-halving ones the swap that adds the fewest
    distinct keys: the result is as balanced and exchanges fewer rows than the cost-only choice (the control)."""
    from nestpipe.clustering.objective import redundancy

    rng = np.random.default_rng(2)
    n, per = 8, 16
    lengths = np.concatenate([rng.integers(200, 400, per) if g % 2 else rng.integers(10, 60, per) for g in range(n)])
    mb = np.repeat(np.arange(n), per)  # clustered: group g's samples share a vocabulary of their own
    values = np.concatenate([rng.integers(1000 * g, 1000 * g + 300, L) for g, L in zip(mb, lengths)])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    costs = DEFAULT_COST.units(lengths)
    keyed, _ = balance.balance_micro_batches(mb, costs, n, keys=(values, offsets))
    plain, _ = balance.balance_micro_batches(mb, costs, n)
    for out in (keyed, plain):
        assert np.array_equal(np.bincount(out, minlength=n), np.full(n, per))
        assert balance.imbalance(np.bincount(out, costs, n)) <= balance.MICRO_TOLERANCE + 1e-9
    assert redundancy(values, offsets, keyed) < redundancy(values, offsets, plain)


def test_sequence_cost_option_is_checked_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="'A,B'"):
        IngestConfig(raw=str(tmp_path), out=str(tmp_path / "o"), sequence_cost="fast").validate()
    with pytest.raises(ValueError, match="not both 0"):
        IngestConfig(raw=str(tmp_path), out=str(tmp_path / "o"), sequence_cost="0,0").validate()
    with pytest.raises(ValueError, match="ctr samples all cost the same"):
        IngestConfig(raw=str(tmp_path), out=str(tmp_path / "o"), task="ctr", balance="tokens").validate()
    assert IngestConfig(raw="r", out="o").balanced() and not IngestConfig(raw="r", out="o", task="ctr").balanced()
    assert balance.BALANCE_MODES == ("tokens", "batches", "off")


def _train_batches(out):
    import webdataset as wds

    m = S.load_manifest(out)
    for sample in wds.WebDataset(S.shard_paths(out, m, "train"), shardshuffle=False).decode():
        rec = S.decode_sample(sample)
        yield np.asarray(rec["item.lengths"], np.int64), np.asarray(rec["mb"], np.int64)


@pytest.fixture(scope="module")
def gr_pair(tmp_path_factory):
    from nestpipe.datasets import synth
    from nestpipe.ingest import ingest

    root = tmp_path_factory.mktemp("balance")
    synth.generate(str(root / "raw"), scale="tiny", seed=0, progress=False)
    out = {}
    for mode in ("tokens", "off"):
        out[mode] = str(root / mode)
        ingest(IngestConfig(raw=str(root / "raw"), out=out[mode], task="gr", batch_size=32, micro_batches=4,
                            max_seq_len=256, batches_per_shard=4, workers=1, progress=False, balance=mode))
    return out


def test_ingested_batches_and_micro_batches_are_balanced(gr_pair):
    opts = json.load(open(os.path.join(gr_pair["tokens"], "manifest.json")))["options"]
    assert opts["balance"]["method"] == "tokens" and opts["balance"]["a"] == DEFAULT_COST.a
    assert "balance" not in json.load(open(os.path.join(gr_pair["off"], "manifest.json")))["options"]
    spread = {}
    for mode, out in gr_pair.items():
        batches = list(_train_batches(out))
        costs = np.array([DEFAULT_COST(L).sum() for L, _ in batches])
        micro = [balance.imbalance(np.bincount(mb, DEFAULT_COST(L), 4)) for L, mb in batches]
        spread[mode] = (balance.imbalance(costs), float(np.mean(micro)))
    assert spread["tokens"][0] < 0.02, spread  # one window: every batch within 2% of the costliest
    assert spread["tokens"][1] < balance.MICRO_TOLERANCE + 0.01, spread
    assert spread["off"][0] > 3 * spread["tokens"][0] and spread["off"][1] > 3 * spread["tokens"][1], spread
    # the same samples, only regrouped
    lens = {m: np.sort(np.concatenate([L for L, _ in _train_batches(o)])) for m, o in gr_pair.items()}
    assert np.array_equal(lens["tokens"], lens["off"])


def test_only_training_micro_batches_are_balanced_and_refined(gr_pair):
    """Valid and eval batches are scored whole: their micro-batches stay as the clustering made them (the stored
    ``mb`` equals ``clustering.assign`` of the batch's items with the batch's seed); training batches' do not (the
    control: the same comparison on train finds batches the balancing changed)."""
    import webdataset as wds

    from nestpipe import clustering
    from nestpipe.ingest.common import batch_seed

    out = gr_pair["tokens"]
    m = S.load_manifest(out)
    opts = m.options
    same = {}
    for split in ("train", "eval"):
        same[split] = []
        for sample in wds.WebDataset(S.shard_paths(out, m, split), shardshuffle=False).decode():
            rec = S.decode_sample(sample)
            values = np.asarray(rec["item.values"], np.int64)
            clustered = clustering.assign(values, S.table_offsets(rec, "item"), 4, method=opts["clustering"],
                                          seed=batch_seed(opts, split, int(rec["meta"]["index"])))
            same[split].append(np.array_equal(np.asarray(rec["mb"], np.int64), clustered))
    assert same["eval"] and all(same["eval"]), same
    assert not all(same["train"]), same


@pytest.mark.slow
def test_trainer_reports_token_imbalance_and_collective_waits(gr_pair, tmp_path):
    """metrics.json's token_imbalance (max / mean - 1 of the ranks' batch costs, per step, averaged) is small on
    balanced shards and larger on the same data unbalanced; every rank's waits at its collectives are reported."""
    import torch

    from nestpipe.measure.launcher import run_plan, write_run

    sets = {"hstu": {"num_layers": 1, "num_random_negatives": 32}, "pipe": {"gantt_steps": 0}}
    runs = {}
    for mode, shards in gr_pair.items():
        runs[mode] = write_run(str(tmp_path / mode), shards, "hstu", "off", 8, sets)
    runs["nested"] = write_run(str(tmp_path / "nested"), gr_pair["tokens"], "hstu", "nested", 8, sets)
    p = run_plan([{"run": r} for r in runs.values()], 2, str(tmp_path / "plan.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    m = {mode: json.load(open(os.path.join(r, "metrics.json"))) for mode, r in runs.items() if mode != "nested"}
    assert m["tokens"]["token_imbalance_steps"] == 8
    imb = {k: v["token_imbalance"] for k, v in m.items()}
    assert imb["tokens"] < 0.01 and imb["off"] > 5 * imb["tokens"], imb
    assert m["off"]["token_count_imbalance"] > m["tokens"]["token_count_imbalance"]
    # balanced shards train in nested bitwise like off
    from nestpipe.trainer.export import assemble

    ref, nested = assemble(runs["tokens"]), assemble(runs["nested"])
    assert [k for k in ref if not torch.equal(ref[k], nested[k])] == []
    waits = m["tokens"]["collective_wait_s_per_step"]
    assert len(waits) == 2 and all(set(w) == {"grad_all2all", "dense_allreduce"} for w in waits)
    assert all(v >= 0 for w in waits for v in w.values())


@pytest.mark.slow
@pytest.mark.serial  # timings
def test_sequence_cost_model_predicts_measured_layer_time():
    """The fitted a n^2 + b n of the HSTU layer stack predicts a length it was not fitted on within 35% (one
    thread, best of 3 timings, a missed length timed again; the tolerance covers a shared machine's noise), and the
    fit's own points within 35%."""
    import torch

    from nestpipe.measure.sequence_cost import fit, relative_errors, sequence_seconds

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        secs = sequence_seconds([32, 64, 128, 256, 384, 768], tokens_per_call=3072)
        # A length whose time misses the fit is measured again (twice at most) and keeps its best time: a
        # transient load on a shared machine goes, a wrong model stays.
        for _ in range(2):
            cost = fit({n: s for n, s in secs.items() if n != 384})
            misses = [n for n, e in relative_errors(cost, secs).items() if abs(e) >= 0.35]
            if not misses:
                break
            for n, s in sequence_seconds(misses, tokens_per_call=3072, max_length=768).items():
                secs[n] = min(secs[n], s)
    finally:
        torch.set_num_threads(threads)
    held = secs.pop(384)
    cost = fit(secs)
    assert cost.a > 0 and cost.b > 0
    assert all(abs(e) < 0.35 for e in relative_errors(cost, secs).values()), relative_errors(cost, secs)
    assert abs(cost(384) / held - 1) < 0.35, (cost(384), held)
