"""A counting model of item co-occurrence on gr shards: what a learner can read from the training split's pairs.

    python research/cooccurrence_counts.py SHARDS [--split valid] [--window 4] [--last 4] [--decay 0.7]

From the training split's windows, ``P(c | i)``: the share of the items within ``--window`` places after each
occurrence of item ``i`` that are ``c``. A sample's scores are ``sum_k decay**(k - 1) P(. | h[-k])`` over its last
``--last`` items, ties in the most-popular baseline's order (so ``--last 0`` is that baseline); HR@10 and NDCG@10
on the split, on ``nestpipe eval``'s protocol (full catalogue, chronological leave-one-out; ranks count the items
scored strictly higher). On synthetic data with session topics (``nestpipe synth --set session_topics=K``) it also
prints the topic share of ``research/next_item_breakdown.py`` (the share of the top 10 community items in the
session's topic, for the first 256 samples whose topic the oracle puts at >= 0.9): whether co-occurrence counts,
unlike the successor counting model, see a session's topic. Not a baseline of ``nestpipe eval``: a measurement of
what the data volume allows.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import scipy.sparse as sp

from nestpipe.datasets.shards import load_manifest
from nestpipe.trainer import baselines
from nestpipe.trainer import evaluate as ev
from nestpipe.trainer.data import iter_shard

TOPIC_SURE, TOPIC_SAMPLES = 0.9, 256  # as research/next_item_breakdown.py


def cooccurrence(shards: str, vocab: int, window: int):
    """(row-normalised ``[V, V]`` co-occurrence matrix ``P(c | i)``, the most-popular baseline's order of every item:
    0 the most frequent in training, ties by id)."""
    rows, cols = [], []
    popular = baselines.MostPopular(vocab)
    for entry in load_manifest(shards).sets["train"]:  # the manifest's training shards, as the baselines read them
        for rec in iter_shard(os.path.join(shards, entry.path)):
            windows = baselines.item_windows(rec, vocab)  # the ids the model's table and the baselines use
            popular.add(windows)
            for seq in windows:
                for k in range(1, window + 1):
                    rows.append(seq[:-k])
                    cols.append(seq[k:])
    r, c = np.concatenate(rows), np.concatenate(cols)
    counts = sp.csr_matrix((np.ones(len(r), dtype=np.float32), (r, c)), shape=(vocab, vocab))
    counts.sum_duplicates()
    totals = np.asarray(counts.sum(1)).ravel()
    return (sp.diags(1.0 / np.maximum(totals, 1)) @ counts).tocsr(), popular.finish().pop_rank


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shards", help="a gr shards directory (nestpipe ingest --task gr)")
    ap.add_argument("--split", default="valid", choices=["eval", "valid"])
    ap.add_argument("--window", type=int, default=4, help="places after an item whose items count as its pairs")
    ap.add_argument("--last", type=int, default=4, help="the history's last items whose pairs score a sample")
    ap.add_argument("--decay", type=float, default=0.7, help="weight per place back from the history's last item")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args(argv)
    vocab = load_manifest(args.shards).tables["item"].vocab
    pairs, pop_rank = cooccurrence(args.shards, vocab, args.window)
    tie_break = 1e-6 * (1.0 - pop_rank / vocab)  # below any pair's share: the popularity order where pairs tie
    oracle = ev._next_item_oracle(args.shards)
    topics = oracle is not None and oracle.cfg.session_topics > 0
    if topics:
        item_comm, item_topic = oracle.item_topics(np.arange(vocab))
    ranks, shares, n = [], [], 0
    for _, _, inputs, targets, _ in ev.next_item_examples(args.shards, vocab, None, 0, 0, args.split):
        for h, t in zip(inputs, targets):
            score = tie_break.copy()
            for k in range(1, min(args.last, len(h)) + 1):
                row = pairs[int(h[-k])]
                score[row.indices] += row.data * args.decay ** (k - 1)
            ranks.append(int((score > score[int(t)]).sum()))
            n += 1
            if topics and n <= TOPIC_SAMPLES:
                community, post = oracle.session_topic(h)
                if post is not None and post.max() >= TOPIC_SURE:
                    topical = np.flatnonzero((item_comm == community) & (item_topic >= 0))
                    ten = topical[np.argsort(-score[topical], kind="stable")[:10]]
                    shares.append(float(np.mean(item_topic[ten] == post.argmax())))
    r = np.array(ranks)
    figures = {"samples": len(r), "HR@10": float(np.mean(r < 10)),
               "NDCG@10": float(np.mean(np.where(r < 10, 1.0 / np.log2(r + 2.0), 0.0)))}
    print(f"{args.shards}, {args.split} split, {len(r)} samples: co-occurrence counts (window {args.window}, last "
          f"{args.last}, decay {args.decay}) HR@10 {figures['HR@10']:.4f}, NDCG@10 {figures['NDCG@10']:.4f}"
          + (f"; topic share {np.mean(shares):.3f} over {len(shares)} samples "
             f"(chance {1 / oracle.cfg.session_topics:.3f})" if shares else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shards": args.shards, "split": args.split, "window": args.window, "last": args.last,
                       "decay": args.decay, **figures,
                       "topic_share": float(np.mean(shares)) if shares else None}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
