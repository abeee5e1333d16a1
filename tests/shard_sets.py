"""Small valid shard sets for the tests, written with the shard format's own writer.

GR: tables ``item`` (Zipf ids with a planted successor rule, some ids outside the vocabulary), ``author``
(``item // 4``), ``action`` (bitmask 0..255); CTR: single-id ``user_id``/``video_id``/``author_id``, pooled ``tag`` and
``history``, 4 dense features, labels ``is_click`` (depends on the video and a dense feature) and ``is_like``.
Micro-batches come from ``nestpipe.clustering.assign`` and unique keys from ``unique_keys``.
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

import numpy as np

from nestpipe.clustering import assign, table_fields
from nestpipe.datasets.shards import Manifest, TableSpec, save_manifest, write_split_shards


def _zipf(rng, n, vocab, a=1.3):
    return (rng.zipf(a, n) - 1) % vocab


def _gr_batch(rng, b, n_mb, vocab, seq_len, split, index, oov_rate):
    lengths = rng.integers(max(3, seq_len // 2), seq_len + 1, size=b).astype(np.int32)
    vals = []
    for L in lengths:
        s = [int(_zipf(rng, 1, vocab)[0])]
        for _ in range(L - 1):
            s.append((s[-1] * 7 + 3) % vocab if rng.random() < 0.7 else int(_zipf(rng, 1, vocab)[0]))
        vals.extend(s)
    item = np.array(vals, dtype=np.int64)
    oov = rng.random(len(item)) < oov_rate
    item[oov] = vocab + rng.integers(0, 10 * vocab, oov.sum())
    off = np.concatenate([[0], np.cumsum(lengths)])
    mb = assign(item, off, n_mb, seed=index).astype(np.int32)
    rec = {"meta": {"index": index, "split": split, "task": "gr", "samples": b, "micro_batches": n_mb}, "mb": mb}
    author = np.where(item < vocab, item // 4, item)
    action = rng.integers(0, 256, len(item))
    for name, v in (("item", item), ("author", author), ("action", action)):
        for f, arr in table_fields(v, lengths, mb).items():
            rec[f"{name}.{f}"] = arr
    rec["user"] = rng.integers(0, 1000, b)
    rec["time"] = np.arange(len(item), dtype=np.int64) * 1000
    rec["play"] = rng.integers(0, 10_000, len(item))
    rec["duration"] = rng.integers(1, 10_000, len(item))
    return rec


def _ctr_batch(rng, b, n_mb, vocabs, split, index):
    video = _zipf(rng, b, vocabs["video_id"])
    dense = rng.normal(size=(b, 4)).astype(np.float32)
    dense[:, 3] = np.abs(dense[:, 3]) * 100
    logit = np.where(video % 3 == 0, 1.5, -1.0) + 0.8 * dense[:, 0]
    click = (rng.random(b) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    like = (rng.random(b) < 0.1).astype(np.float32)
    feats = {
        "user_id": (rng.integers(0, vocabs["user_id"], b), np.ones(b, np.int32)),
        "video_id": (video, np.ones(b, np.int32)),
        "author_id": (video // 4, np.ones(b, np.int32)),
    }
    tl = rng.integers(1, 6, b).astype(np.int32)
    feats["tag"] = (_zipf(rng, int(tl.sum()), vocabs["tag"]), tl)
    hl = rng.integers(2, 12, b).astype(np.int32)
    feats["history"] = (_zipf(rng, int(hl.sum()), vocabs["history"]), hl)
    off = np.concatenate([[0], np.cumsum(hl)])
    mb = assign(feats["history"][0], off, n_mb, seed=index).astype(np.int32)
    rec = {"meta": {"index": index, "split": split, "task": "ctr", "samples": b, "micro_batches": n_mb}, "mb": mb}
    for name, (v, lens) in feats.items():
        for f, arr in table_fields(np.asarray(v, np.int64), lens, mb).items():
            rec[f"{name}.{f}"] = arr
    rec["dense"] = dense
    rec["labels"] = np.stack([click, like], 1)
    return rec


def make_shards(out: str, task: str, *, batch_size: int = 16, micro_batches: int = 4, shards: Tuple[int, ...] = (3, 3),
                eval_shards: Tuple[int, ...] = (2,), vocab: int = 500, seq_len: int = 12, seed: int = 0,
                oov_rate: float = 0.02) -> Manifest:
    """Write ``len(shards)`` train shards holding ``shards[i]`` batches each (and eval shards); return the manifest."""
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    if task == "gr":
        tables = {"item": TableSpec(vocab, 16, "sequence"), "author": TableSpec(vocab // 4 + 1, 16, "sequence"),
                  "action": TableSpec(256, 16, "sequence")}
    else:
        vocabs = {"user_id": 200, "video_id": vocab, "author_id": vocab // 4 + 1, "tag": 300, "history": vocab}
        tables = {t: TableSpec(v, 8, "pooled" if t in ("tag", "history") else "single") for t, v in vocabs.items()}
    def record(split: str, index: int) -> Dict:
        if task == "gr":
            return _gr_batch(rng, batch_size, micro_batches, vocab, seq_len, split, index, oov_rate)
        return _ctr_batch(rng, batch_size, micro_batches, vocabs, split, index)

    sets = write_split_shards(out, (("train", shards), ("eval", eval_shards)), batch_size, record)
    man = Manifest(task=task, batch_size=batch_size, micro_batches=micro_batches, tables=tables, sets=sets,
                   max_seq_len=seq_len if task == "gr" else None,
                   dense_features=["d0", "d1", "d2", "d3"] if task == "ctr" else [],
                   labels=["is_click", "is_like"] if task == "ctr" else [])
    save_manifest(out, man)
    return man


def column_split_plan(shards: str, path: str, world: int, replicate_max_rows: int,
                      splits: Dict[str, List[Tuple[int, ...]]]) -> Dict:
    """Write to ``path`` a ``nestpipe plan`` document for ``shards`` at group size ``world`` in which each table of
    ``splits`` is cut into ``len(splits[t])`` equal column ranges, range ``j`` held row-wise by the ranks
    ``splits[t][j]`` (in row-shard order); the other tables as the planner places them (no column splits). The
    replicated tables are those the trainer's rule replicates at ``replicate_max_rows``."""
    import math

    from nestpipe.datasets.shards import load_manifest
    from nestpipe.planning.hardware import load_hardware
    from nestpipe.planning.planner import PlannerConfig, make_plan, save_plan, tables_from_manifest

    man = load_manifest(shards)
    fixed = {t: s.vocab <= replicate_max_rows for t, s in man.tables.items()}
    plan = make_plan(tables_from_manifest(man), PlannerConfig(workers=world, group_size=world, column_split=False,
                                                             fixed_replicated=fixed), load_hardware("cpu-gloo"))
    for t, cols in splits.items():
        spec = plan["tables"][t]
        assert spec["sharding"] != "replicated", t
        c, dim, vocab = len(cols), spec["dim"], spec["vocab"]
        shards_ = []
        for j, ranks in enumerate(cols):
            per = math.ceil(vocab / len(ranks))
            shards_ += [{"rank": r, "rows": [i * per, min(vocab, (i + 1) * per)],
                         "cols": [j * dim // c, (j + 1) * dim // c]} for i, r in enumerate(ranks)]
        spec.update(sharding="column_wise" if all(len(r) == 1 for r in cols) else "table_row_wise",
                    col_shards=c, row_shards=max(len(r) for r in cols), shards=shards_)
    save_plan(plan, path)
    return plan
