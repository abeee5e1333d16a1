"""``nestpipe cluster-report`` on shards written with the shard-format helpers."""

import json
import os

import numpy as np
import pytest

from nestpipe.cli import main
from nestpipe.clustering import assign, unique_keys
from nestpipe.clustering.report import cluster_report
from nestpipe.datasets.shards import Manifest, ShardEntry, TableSpec, save_manifest, write_shard

B, N = 64, 4


def _batch(index, rng, method, corrupt_lists=False):
    """One GR-like batch: ``item`` sequences from 4 disjoint catalogues, ``user`` one id per sample."""
    group = rng.permutation(np.repeat(np.arange(N), B // N))
    item_lengths = rng.integers(4, 12, B).astype(np.int32)
    items = np.concatenate([g * 1000 + rng.choice(60, n, replace=False) for g, n in zip(group, item_lengths)])
    users = rng.integers(0, 10_000, B).astype(np.int64)
    off = np.zeros(B + 1, np.int64)
    off[1:] = np.cumsum(item_lengths)
    mb = assign(items, off, N, method=method, seed=index)
    batch = {"meta": {"index": index, "split": "train", "task": "gr", "samples": B, "micro_batches": N}, "mb": mb}
    for table, values, lengths in (("item", items, item_lengths), ("user", users, np.ones(B, np.int32))):
        o = np.zeros(B + 1, np.int64)
        o[1:] = np.cumsum(lengths)
        uniq, inverse, per_mb = unique_keys(values, o, mb, num_micro_batches=N)
        mb_unique = np.concatenate(per_mb)
        if corrupt_lists and table == "item":
            mb_unique = mb_unique[:-1]
        batch.update({
            f"{table}.values": values, f"{table}.lengths": lengths, f"{table}.unique": uniq,
            f"{table}.inverse": inverse, f"{table}.mb_unique": mb_unique,
            f"{table}.mb_offsets": np.concatenate([[0], np.cumsum([len(p) for p in per_mb])]).astype(np.int64),
        })
    return batch


def _write(directory, method="default", corrupt_lists=False, batches=3):
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    records = [(f"{i:06d}", _batch(i, rng, method, corrupt_lists)) for i in range(batches)]
    digest, size = write_shard(os.path.join(directory, "train-000000.tar"), records)
    manifest = Manifest(
        task="gr", batch_size=B, micro_batches=N,
        tables={"item": TableSpec(vocab=10_000, kind="sequence"), "user": TableSpec(vocab=10_000, kind="single")},
        sets={"train": [ShardEntry("train-000000.tar", batches, batches * B, digest, size)]},
    )
    save_manifest(directory, manifest)
    return directory


def test_report_shows_clustered_partition_beats_random(tmp_path):
    figures = {f.table: f for f in cluster_report(_write(str(tmp_path)))}
    item = figures["item"]
    assert item.batches == 3 and item.lists_consistent
    assert item.stored == pytest.approx(1.0)  # disjoint catalogues: the clustering finds the optimum
    assert item.random > 1.5 and item.excess_cut == pytest.approx(1.0)
    # negative control: shards partitioned at random show no cut
    figures = {f.table: f for f in cluster_report(_write(str(tmp_path / "rand"), method="random"))}
    assert figures["item"].stored > 1.5 and abs(figures["item"].excess_cut) < 0.2


def test_cli_table_and_json(tmp_path, capsys):
    directory = _write(str(tmp_path))
    assert main(["cluster-report", directory]) == 0
    out = capsys.readouterr().out
    assert "item" in out and "user" in out and "excess cut" in out
    assert main(["cluster-report", directory, "--json", "--max-batches", "1"]) == 0
    rows = {r["table"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["item"]["batches"] == 1 and rows["item"]["stored_redundancy"] == pytest.approx(1.0)


def test_cli_flags_lists_that_do_not_match_the_partition(tmp_path, capsys):
    directory = _write(str(tmp_path), corrupt_lists=True)
    assert main(["cluster-report", directory]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_cli_clear_errors(tmp_path, capsys):
    assert main(["cluster-report", str(tmp_path)]) == 1
    assert "no manifest" in capsys.readouterr().err
    directory = _write(str(tmp_path / "ok"))
    assert main(["cluster-report", directory, "--split", "eval"]) == 1
    assert "no 'eval' set" in capsys.readouterr().err
    assert main(["cluster-report", directory, "--max-batches", "0"]) == 1
    assert "--max-batches must be >= 1" in capsys.readouterr().err


def test_truncated_shard_is_one_line_naming_it(tmp_path, capsys):
    """A truncated shard: one error line naming the shard and pointing at shard-report (before: a raw
    tarfile.ReadError traceback). Negative control: the intact shard reports fine."""
    directory = _write(str(tmp_path), batches=3)
    path = os.path.join(directory, "train-000000.tar")
    assert main(["cluster-report", directory]) == 0
    capsys.readouterr()
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2 + 100])
    assert main(["cluster-report", directory]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train-000000.tar: cannot read the shard" in err, err
    assert "shard-report" in err and "Traceback" not in err
