"""The CTR pair count (``log1p_pair_count``, nestpipe.ingest.ctr): how often a sample's (previous video, video)
pair occurs as consecutive interactions in the training split, over every user partition, without the sample's own
occurrence; never counted from valid or eval rows (negative control: counting every row changes the eval
features), and the same whatever the number of partitions."""

from __future__ import annotations

import glob
import os
from collections import Counter

import numpy as np
import polars as pl
import pytest

from nestpipe.datasets import kuairand, shards
from nestpipe.datasets.synth import generate
from nestpipe.ingest import IngestConfig, ctr, ingest


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("raw"))
    generate(d, scale="tiny", seed=5, progress=False)
    return d


def _ingest(raw, out, **kw):
    opts = dict(raw=raw, out=out, task="ctr", batch_size=64, micro_batches=2, batches_per_shard=8, progress=False,
                workers=1, validation=True, partitions=3)
    opts.update(kw)
    return ingest(IngestConfig(**opts))


def _logs(raw) -> pl.DataFrame:
    return pl.concat([pl.read_csv(p, schema_overrides=kuairand.LOG_DTYPES).with_columns(
        pl.lit(i).alias("src"), pl.int_range(pl.len()).alias("line"))
        for i, p in enumerate(sorted(glob.glob(os.path.join(raw, "log_*.csv"))))])


def _training_pairs(raw, validation: bool = True, valid_days: int = 1) -> Counter:
    """The reference: consecutive (previous, video) pairs of every user in the total order, training dates only."""
    logs = _logs(raw).sort(["user_id", "time_ms", "video_id", "src", "line"])
    cutoff = kuairand.eval_cutoff(int(logs["date"].max()), 3)
    if validation:  # the last valid_days dates before the eval dates are the valid split
        cutoff = kuairand.valid_date(int(logs["date"].max()), 3, valid_days)
    pairs = Counter()
    for (_,), g in logs.group_by(["user_id"], maintain_order=True):
        v, d = g["video_id"].to_list(), g["date"].to_list()
        for p in range(1, len(v)):
            if d[p] < cutoff:
                pairs[(v[p - 1], v[p])] += 1
    return pairs


def _features(out, m):
    """(split, previous video, video, pair count) of every sample of the shards."""
    col = m.dense_features.index("log1p_pair_count")
    rows = []
    for split, entries in m.sets.items():
        for e in entries:
            for b in shards.iter_shard(os.path.join(out, e.path)):
                count = np.rint(np.expm1(b["dense"][:, col].astype(np.float64))).astype(np.int64)
                rows += [(split, int(lv) - 1, int(v), int(c))
                         for lv, v, c in zip(b["last_video.values"], b["video_id.values"], count)]
    return rows


def _mismatches(rows, pairs):
    bad = {"train": 0, "valid": 0, "eval": 0}
    for split, prev, video, count in rows:
        want = 0 if prev < 0 else pairs[(prev, video)] - (split == "train")
        bad[split] += count != want
    return bad


def test_pair_count_is_the_training_transitions_count(raw, tmp_path):
    out = str(tmp_path / "o")
    m = _ingest(raw, out)
    assert m.dense_features[-1] == "log1p_pair_count"
    rows = _features(out, m)
    pairs = _training_pairs(raw)
    assert _mismatches(rows, pairs) == {"train": 0, "valid": 0, "eval": 0}
    # a feature that says something: successor pairs recur, so many rows of every split have seen pairs
    for split in ("train", "valid", "eval"):
        seen = [c for s, _, _, c in rows if s == split and c > 0]
        assert len(seen) > 0.05 * sum(s == split for s, _, _, _ in rows), split
    stats = m.stats["pair_count"]
    assert stats["train_transitions"] == sum(pairs.values()) and stats["distinct_pairs"] == len(pairs)
    # one partition: the same reference holds (the reduce above spanned three), and the splits scored whole have the
    # same features (in another order: partitions are shuffled one by one; training drops another tail)
    one = _ingest(raw, str(tmp_path / "one"), partitions=1)
    rows_one = _features(str(tmp_path / "one"), one)
    assert _mismatches(rows_one, pairs) == {"train": 0, "valid": 0, "eval": 0}
    scored = [r for r in rows if r[0] != "train"]
    assert sorted(r for r in rows_one if r[0] != "train") == sorted(scored) and scored


def test_pair_count_never_counts_valid_or_eval_rows(raw, tmp_path, monkeypatch):
    """Negative control: counting every row's pair (all dates) changes the valid and eval features, which the
    reference check above would catch."""
    monkeypatch.setattr(ctr, "counted_pairs", lambda is_train: np.ones_like(is_train))
    out = str(tmp_path / "o")
    m = _ingest(raw, out)
    bad = _mismatches(_features(out, m), _training_pairs(raw))
    assert bad["eval"] > 0 and bad["valid"] > 0, bad


@pytest.mark.slow
def test_valid_split_spans_ctr_valid_days_dates(raw, tmp_path):
    """``ctr_valid_days=3``: the three dates before the eval dates are the valid split, every one of their rows a valid
    sample and none a training one (the training pair counts exclude them); eval is unchanged. One date (the default)
    keeps the fingerprint of outputs written before the option existed."""
    logs = _logs(raw)
    last = int(logs["date"].max())
    first_eval = kuairand.eval_cutoff(last, 3)
    one = _ingest(raw, str(tmp_path / "one"))
    three = _ingest(raw, str(tmp_path / "three"), ctr_valid_days=3)
    assert "ctr_valid_days" not in one.options and three.options["ctr_valid_days"] == 3
    rows = _features(str(tmp_path / "three"), three)
    assert _mismatches(rows, _training_pairs(raw, valid_days=3)) == {"train": 0, "valid": 0, "eval": 0}
    first_valid = kuairand.valid_date(last, 3, 3)
    in_window = int(((logs["date"] >= first_valid) & (logs["date"] < first_eval)).sum())
    counts = {k: sum(r[0] == k for r in rows) for k in ("valid", "eval")}
    counts_one = {k: sum(r[0] == k for r in _features(str(tmp_path / "one"), one)) for k in ("valid", "eval")}
    assert counts["valid"] == in_window and counts["eval"] == counts_one["eval"]
    # negative control: the one-date split is smaller, and its pair counts disagree with a three-date reference
    assert counts_one["valid"] < counts["valid"]
    assert _mismatches(_features(str(tmp_path / "one"), one), _training_pairs(raw, valid_days=3))["train"] > 0
    with pytest.raises(ValueError, match="--ctr-valid-days must be >= 1"):
        _ingest(raw, str(tmp_path / "zero"), ctr_valid_days=0)
