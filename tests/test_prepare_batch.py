"""The data stage's per-batch preparation (``nestpipe.trainer.data.prepare_batch``) on both host-op paths.

Every micro-batch's per-value arrays are checked against their definition (values of the micro-batch's samples in
sample order), and a corrupt record fails naming the table and what is wrong.
"""

from __future__ import annotations

import numpy as np
import pytest

from nestpipe import kernels
from nestpipe.clustering import tables_fields
from nestpipe.datasets.shards import Manifest, ShardError, TableSpec
from nestpipe.trainer.data import prepare_batch

PATHS = ["reference"] + (["numba"] if kernels.select.has_numba() else [])


def _batch(micro_batches=3, B=30, seed=0):
    rng = np.random.default_rng(seed)
    feats = {}
    for t in ("a", "b"):
        lens = rng.integers(0, 5, B)
        feats[t] = (rng.integers(0, 40, int(lens.sum())).astype(np.int64), lens)
    mb = rng.integers(0, micro_batches, B).astype(np.int32)
    mb[:micro_batches] = np.arange(micro_batches)
    rec = {"meta": {"micro_batches": micro_batches}, "mb": mb, "dense": rng.normal(size=(B, 2)).astype(np.float32),
           "labels": rng.integers(0, 2, (B, 1)).astype(np.float32)}
    for name, fields in tables_fields(feats, mb).items():
        rec.update({f"{name}.{f}": arr for f, arr in fields.items()})
    man = Manifest(task="ctr", batch_size=B, micro_batches=micro_batches, sets={},
                   tables={t: TableSpec(100, 4, "pooled") for t in feats}, dense_features=["x", "y"],
                   labels=["is_click"])
    return rec, man, feats


@pytest.mark.parametrize("path", PATHS)
def test_micro_batches_hold_their_samples_values(path):
    rec, man, feats = _batch()
    with kernels.forced({"micro_batch_values": path}):
        batch = prepare_batch(rec, man, step=0, rank=0, seed=0, where="shard-0.tar record 0")
    for t, (values, lens) in feats.items():
        off = np.concatenate([[0], np.cumsum(lens)])
        for mbd in batch.micro:
            expect = np.concatenate([values[off[s]:off[s + 1]] for s in mbd.samples])
            assert np.array_equal(batch.keys[t][mbd.value_key[t]], expect)
            assert np.array_equal(mbd.mb_keys[t][mbd.value_pos[t]], mbd.value_key[t])
            assert np.array_equal(mbd.value_sample[t], np.repeat(np.arange(len(mbd.samples)), lens[mbd.samples]))


@pytest.mark.parametrize("path", PATHS)
def test_whole_batch_is_one_micro_batch_of_every_sample_and_key(path):
    """micro_batching="whole": one micro-batch holding every sample in order, every unique key, the dense fields
    and labels of all samples; the same values as the clustered micro-batches together."""
    rec, man, feats = _batch()
    with kernels.forced({"micro_batch_values": path}):
        whole = prepare_batch(rec, man, step=0, rank=0, seed=0, micro_batching="whole")
        clustered = prepare_batch(rec, man, step=0, rank=0, seed=0)
    (mbd,) = whole.micro
    assert np.array_equal(mbd.samples, np.arange(man.batch_size))
    assert np.array_equal(mbd.fields["dense"], rec["dense"]) and np.array_equal(mbd.fields["labels"], rec["labels"])
    for t, (values, lens) in feats.items():
        assert np.array_equal(whole.keys[t][mbd.value_key[t]], values)
        assert np.array_equal(mbd.mb_keys[t], np.arange(len(whole.keys[t])))
        assert np.array_equal(mbd.value_sample[t], np.repeat(np.arange(man.batch_size), lens))
        per_sample = {int(s): list(clustered.keys[t][m.value_key[t][m.value_sample[t] == j]])
                      for m in clustered.micro for j, s in enumerate(m.samples)}
        assert [v for s in range(man.batch_size) for v in per_sample[s]] == list(values)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("corrupt,message", [
    ("unsorted", "table a: micro-batch 0's mb_unique is not a sorted set of key positions"),
    ("inverse", "table a: a.inverse points outside the table's unique keys"),
    ("uncovered", "table a: micro-batch 0's mb_unique does not cover its values"),
])
def test_corrupt_record_names_table_and_fault(path, corrupt, message):
    rec, man, _ = _batch()
    mo = rec["a.mb_offsets"]
    mu = rec["a.mb_unique"].copy()
    if corrupt == "unsorted":
        mu[mo[0]:mo[1]] = mu[mo[0]:mo[1]][::-1]
    elif corrupt == "inverse":
        inv = rec["a.inverse"].copy()
        inv[:] = len(rec["a.unique"])
        rec["a.inverse"] = inv
    else:
        mu = np.delete(mu, mo[0])
        rec["a.mb_offsets"] = mo - np.array([0] + [1] * (len(mo) - 1))
    rec["a.mb_unique"] = mu
    with kernels.forced({"micro_batch_values": path}), pytest.raises(ShardError) as err:
        prepare_batch(rec, man, step=0, rank=0, seed=0, where="shard-0.tar record 0")
    assert str(err.value) == "shard-0.tar record 0: " + message


def _same_batches(a, b) -> bool:
    if a.keys.keys() != b.keys.keys() or any(not np.array_equal(a.keys[t], b.keys[t]) for t in a.keys):
        return False
    for x, y in zip(a.micro, b.micro, strict=True):
        for name in ("value_key", "value_sample", "mb_keys", "value_pos", "lengths"):
            fx, fy = getattr(x, name), getattr(y, name)
            if any(not np.array_equal(fx[t], fy[t]) for t in fx):
                return False
        if not np.array_equal(x.samples, y.samples):
            return False
    return True


@pytest.mark.parametrize("path", PATHS)
def test_packed_record_without_values_prepares_the_same_batch(path):
    """The trainer reads packed tables without ``{t}.values`` (``unpack_tables(values=False)``): the prepared batch
    is the one of the full record, and an inverse index outside the keys still fails, now in prepare_batch."""
    import copy

    from nestpipe.datasets.shards import pack_tables, unpack_tables

    rec, man, _ = _batch()
    packed = pack_tables(copy.deepcopy(rec), "bags", ["a", "b"])
    lean = unpack_tables(copy.deepcopy(packed), values=False)
    assert "a.values" not in lean and "a.inverse" in lean
    assert "a.values" in unpack_tables(copy.deepcopy(packed))
    with kernels.forced({"micro_batch_values": path}):
        full = prepare_batch(rec, man, step=0, rank=0, seed=0)
        assert _same_batches(prepare_batch(lean, man, step=0, rank=0, seed=0), full)
        other = prepare_batch(_batch(seed=1)[0], man, step=0, rank=0, seed=0)
        assert not _same_batches(other, full)  # the comparison can fail
        packed["bags.inverse"] = packed["bags.inverse"].copy()
        packed["bags.inverse"][0] = packed["bags.unique_counts"][0]  # table a's first value: one past its keys
        with pytest.raises(ShardError, match="a.inverse points outside the table's unique keys"):
            prepare_batch(unpack_tables(packed, values=False), man, step=0, rank=0, seed=0, where="r")


@pytest.mark.parametrize("path", PATHS)
def test_whole_batch_equals_the_compiled_pass_over_every_sample_and_key(path):
    """The whole-batch shortcut (no position map) gives the arrays of ``kernels.micro_batch_values`` over every
    sample and every key, and fails on an inverse index outside the keys or lengths that miss values."""
    rec, man, _ = _batch()
    whole = prepare_batch(rec, man, step=0, rank=0, seed=0, micro_batching="whole")
    (mbd,) = whole.micro
    from nestpipe.datasets.shards import table_offsets

    for t in ("a", "b"):
        with kernels.forced({"micro_batch_values": path}):
            lens, key, sample, pos, _, status = kernels.micro_batch_values(
                table_offsets(rec, t), np.arange(man.batch_size), rec[f"{t}.inverse"],
                np.arange(len(rec[f"{t}.unique"])), len(rec[f"{t}.unique"]))
        assert status == 0
        for got, want in ((mbd.lengths[t], lens), (mbd.value_key[t], key), (mbd.value_sample[t], sample),
                          (mbd.value_pos[t], pos)):
            assert got.dtype == want.dtype and np.array_equal(got, want)
    bad = dict(rec, **{"a.inverse": np.full_like(rec["a.inverse"], len(rec["a.unique"]))})
    with pytest.raises(ShardError, match="^r: table a: a.inverse points outside the table's unique keys$"):
        prepare_batch(bad, man, step=0, rank=0, seed=0, where="r", micro_batching="whole")
    short = dict(rec, **{"b.inverse": rec["b.inverse"][:-1]})
    with pytest.raises(ShardError, match="table b: its lengths add up to"):
        prepare_batch(short, man, step=0, rank=0, seed=0, where="r", micro_batching="whole")


@pytest.mark.parametrize("micro_batching", ["clustered", "random", "whole"])
def test_sample_outside_every_micro_batch_fails(micro_batching):
    """A record whose ``mb`` puts a sample outside 0..N-1 would leave that sample untrained (and its values
    unchecked): it fails, naming the record, in every micro-batching."""
    rec, man, _ = _batch()
    rec["mb"] = rec["mb"].copy()
    rec["mb"][-1] = 7
    with pytest.raises(ShardError, match=r"^r: mb assigns a sample to micro-batch 7, the record has 3 \(0..2\)$"):
        prepare_batch(rec, man, step=0, rank=0, seed=0, where="r", micro_batching=micro_batching)
    rec["mb"][-1] = -1
    with pytest.raises(ShardError, match="micro-batch -1"):
        prepare_batch(rec, man, step=0, rank=0, seed=0, where="r", micro_batching=micro_batching)


def test_random_micro_batches_name_an_inverse_outside_the_keys():
    rec, man, _ = _batch()
    rec["a.inverse"] = np.full_like(rec["a.inverse"], len(rec["a.unique"]))
    with pytest.raises(ShardError, match="^r: table a: a.inverse points outside the table's unique keys$"):
        prepare_batch(rec, man, step=0, rank=0, seed=0, where="r", micro_batching="random")
