"""Where a next-item model gains and loses against the counting model: the figures split by what the target is.

    python research/next_item_breakdown.py RUN [--split valid] [--max-batches N]

Synthetic data only (the shards' ``synth_truth.json``): the generator draws a user's next item as the fixed successor
of the previous one (probability ``successor_prob`` inside a session) or fresh from the user's community or the
popular head (docs/synthetic-data.md). This scores the trained run (full catalogue, the protocol of ``nestpipe
eval``), the successor counting model and the generator oracle on the same samples, and prints HR@1, HR@10 and
NDCG@10 for the samples whose target is the last input item's successor -- split by how often the counting model
saw that transition in training (the pairs a model can memorise) -- and for the fresh draws, split by where they
come from (``NextItemOracle.target_kind``: the popular head, the history's community, elsewhere). A model that
trails the counting model on successors but not on fresh draws is short of memorising transitions, not of modelling
interests; one that trails it on head items ranks the items every community shares too low. For the first
``--top-samples`` samples it also prints what the model's and the oracle's top 10 hold (by the same kinds) and where
each ranks the most popular head item, and the oracle's HR@10 with the successors of transitions never seen in
training nor earlier in the sample's own history counted as misses (what the data can teach: no learner knows
those successors). With session topics (``nestpipe synth --set session_topics=K``) it also
prints, for those of the samples whose current session's topic the oracle is sure of (posterior >= 0.9), the share
of each ranker's top 10 among the history's community's catalogue that lies in that topic (chance: 1 / K): whether
the model reads the session's topic from its items at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Dict

import numpy as np
import torch

from nestpipe.datasets.synth import head_catalogue
from nestpipe.trainer import evaluate as ev
from nestpipe.trainer.config import load_run_config
from nestpipe.trainer.run_files import run_manifest


TOP_KINDS = ("successor", "head", "community", "elsewhere")
TOPIC_SURE = 0.9  # the oracle's posterior of the session's topic above which a sample counts in topic recognition
TOPIC_FIT_RANKS = 200  # the community's most popular items whose scores the topic-effect fit reads


@dataclasses.dataclass
class Breakdown:
    """Per sample of the split: ``ranks`` (per ranker: model, successor counts, oracle) of the target; ``kinds``
    (``NextItemOracle.target_kind``); ``seen``, how often the (last, target) transition occurs in the training
    split; ``seen_here``, whether the sample's own history already holds that pair. For the first ``top_samples``
    samples, per ranker (model, oracle): ``top``, the kinds of its top 10 items (counts in ``TOP_KINDS`` order) and
    its rank of the most popular head item; ``in_topic`` (with session topics), the share of its top 10 community
    items in the session's topic, for the samples whose topic the oracle is sure of; ``topic_fit``, for the same
    samples, the least-squares fit of its scores (the model's logits, the oracle's log probabilities) over the
    community's ``TOPIC_FIT_RANKS`` most popular items not read, ``score ~ c + a x (-zipf_exponent log(1 + rank)) +
    b x [in the session's topic]``: ``(a, b)`` per sample, what popularity and the topic weigh in its scores.
    ``topics``: K (0: none)."""

    ranks: Dict[str, np.ndarray]
    kinds: np.ndarray
    seen: np.ndarray
    seen_here: np.ndarray
    top: Dict[str, np.ndarray]
    in_topic: Dict[str, np.ndarray]
    topic_fit: Dict[str, np.ndarray]
    topics: int


def ranks_and_kinds(run: str, split: str, max_batches=None, top_samples: int = 256) -> Breakdown:
    """The :class:`Breakdown` of a trained gr run on ``split``."""
    cfg = load_run_config(run)
    man, cfg.shards = run_manifest(run, cfg, None, need_data=True)
    oracle = ev._next_item_oracle(cfg.shards)
    if oracle is None:
        raise SystemExit(f"{cfg.shards}: no synth_truth.json with the generator's config (synthetic data only)")
    full, model = ev.load_trained(run, cfg, man)
    vocab = man.tables["item"].vocab
    items = ev.next_item_candidates(model, full["embedding.item.weight"].float())
    counts = ev.fit_next_item_baselines(cfg.shards, vocab)["successor_counts"]
    ranks = {"model": [], "successor_counts": [], "generator_oracle": []}
    kinds, seen, seen_here = [], [], []
    top = {"model": [], "generator_oracle": []}
    in_topic = {"model": [], "generator_oracle": []}
    topic_fit = {"model": [], "generator_oracle": []}
    item_comm, item_topic = oracle.item_topics(np.arange(vocab))
    item_rank = oracle.item_ranks(np.arange(vocab))
    most_popular_head = int(head_catalogue(oracle.cfg)[0])
    with torch.no_grad():
        for rec, keep, inputs, target, _ in ev.next_item_examples(cfg.shards, vocab, max_batches, 0, cfg.seed, split):
            q = ev.next_item_queries(cfg, man, full, model, rec, keep, split)
            scores = q @ items.t()
            ranks["model"].append((scores > scores.gather(1, torch.from_numpy(target)[:, None])).sum(1).numpy())
            ranks["successor_counts"].append(ev.baseline_ranks({"c": counts}, inputs, target, None)["c"])
            ranks["generator_oracle"].append(ev.baseline_ranks({"o": oracle}, inputs, target, None)["o"])
            for i, (h, t) in enumerate(zip(inputs, target)):
                kinds.append(oracle.target_kind(h, int(t)))
                followers, n = counts._successors(int(h[-1]))
                seen.append(int(n[followers == t].sum()))
                seen_here.append(bool(np.any((h[:-1] == h[-1]) & (h[1:] == t))))
                if len(top["model"]) < top_samples:
                    s, p = scores[i].numpy(), oracle.probabilities(h, np.arange(vocab))
                    for name, v in (("model", s), ("generator_oracle", p)):
                        ten = [oracle.target_kind(h, int(x)) for x in np.argsort(-v, kind="stable")[:10]]
                        top[name].append([ten.count(k) for k in TOP_KINDS] + [int((v > v[most_popular_head]).sum())])
                    community, post = oracle.session_topic(h)
                    if post is not None and post.max() >= TOPIC_SURE:
                        topical = np.flatnonzero((item_comm == community) & (item_topic >= 0))
                        fit = topical[item_rank[topical] < TOPIC_FIT_RANKS]
                        fit = fit[~np.isin(fit, h)]  # items read: their scores carry repeats, not the topic
                        x = np.stack([np.ones(len(fit)), -oracle.cfg.zipf_exponent * np.log1p(item_rank[fit]),
                                      (item_topic[fit] == post.argmax()).astype(np.float64)], 1)
                        for name, v in (("model", s), ("generator_oracle", np.log(np.maximum(p, 1e-300)))):
                            ten = topical[np.argsort(-v[topical], kind="stable")[:10]]
                            in_topic[name].append(float(np.mean(item_topic[ten] == post.argmax())))
                            topic_fit[name].append(np.linalg.lstsq(x, v[fit], rcond=None)[0][1:])
    return Breakdown(ranks={k: np.concatenate(v) for k, v in ranks.items()}, kinds=np.array(kinds),
                     seen=np.array(seen), seen_here=np.array(seen_here),
                     top={k: np.array(v).reshape(-1, len(TOP_KINDS) + 1) for k, v in top.items()},
                     in_topic={k: np.array(v) for k, v in in_topic.items()},
                     topic_fit={k: np.array(v).reshape(-1, 2) for k, v in topic_fit.items()},
                     topics=oracle.cfg.session_topics)


def figures(r: np.ndarray) -> dict:
    return {"samples": int(len(r)), "HR@1": float(np.mean(r < 1)), "HR@10": float(np.mean(r < 10)),
            "NDCG@10": float(np.mean(np.where(r < 10, 1.0 / np.log2(r + 2.0), 0.0)))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a trained gr run directory (hstu or sasrec)")
    ap.add_argument("--split", default="valid", choices=["eval", "valid"])
    ap.add_argument("--max-batches", type=int, default=None)
    ap.add_argument("--top-samples", type=int, default=256,
                    help="samples whose top 10 (model and oracle) are broken down by kind (0: none)")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args(argv)
    b = ranks_and_kinds(args.run, args.split, args.max_batches, args.top_samples)
    ranks, kinds, seen, seen_here, top, in_topic, topics = (b.ranks, b.kinds, b.seen, b.seen_here, b.top,
                                                            b.in_topic, b.topics)
    succ = kinds == "successor"
    groups = {"all": np.ones_like(succ), "successor": succ, "successor, transition seen >= 2x": succ & (seen >= 2),
              "successor, seen once": succ & (seen == 1), "successor, never seen": succ & (seen == 0),
              "fresh draw": ~succ, "fresh: head": kinds == "head", "fresh: the history's community":
              kinds == "community", "fresh: elsewhere": kinds == "elsewhere"}
    out = {g: {name: figures(r[mask]) for name, r in ranks.items()} for g, mask in groups.items()}
    print(f"{args.run}, {args.split} split: {len(succ)} samples, {succ.mean():.3f} of them the last item's successor")
    print(f"{'targets':34s} {'n':>6s}  " + "  ".join(f"{n + ' HR@1 / HR@10 / NDCG@10':>46s}" for n in ranks))
    for g, row in out.items():
        n = row["model"]["samples"]
        print(f"{g:34s} {n:6d}  " + "  ".join(f"{row[k]['HR@1']:>20.3f} / {row[k]['HR@10']:.3f} / {row[k]['NDCG@10']:.4f}"
                                              for k in ranks))
    # The successors of transitions neither the training split nor the sample's own history shows: the oracle
    # knows them, no learner can.
    known = ~(succ & (seen == 0) & ~seen_here)
    counting_hr = float(np.mean(ranks["successor_counts"] < 10))
    learnable = {"HR@10": float(np.mean((ranks["generator_oracle"] < 10) & known)),
                 "never-seen successors": float(np.mean(~known))}
    learnable["of counting"] = learnable["HR@10"] / counting_hr if counting_hr else None
    print(f"generator oracle with the successors of transitions seen neither in training nor earlier in the sample "
          f"counted as misses "
          f"({learnable['never-seen successors']:.4f} of the samples): HR@10 {learnable['HR@10']:.4f}"
          + (f", {learnable['of counting']:.3f}x the counting model's" if counting_hr else ""))
    top_figures = {name: {"samples": int(len(t)), **{f"top10 {k}": float(t[:, j].mean()) for j, k in
                                                      enumerate(TOP_KINDS)},
                          "most popular head item, median rank": float(np.median(t[:, -1])) if len(t) else None}
                   for name, t in top.items()}
    for name, f in top_figures.items():
        if f["samples"]:
            print(f"{name}, first {f['samples']} samples: the top 10 holds " + ", ".join(
                f"{f[f'top10 {k}']:.2f} {k}" for k in TOP_KINDS) + f"; the most popular head item ranks "
                f"{f['most popular head item, median rank']:.0f} (median: items above it)")
    topic_figures = {name: {"samples": int(len(t)), "top10 share in the topic": float(t.mean()), "chance": 1 / topics,
                            "popularity weight": float(b.topic_fit[name][:, 0].mean()),
                            "topic weight": float(b.topic_fit[name][:, 1].mean())}
                     for name, t in in_topic.items() if len(t)}
    if topic_figures:
        print(f"topic recognition, the {topic_figures['model']['samples']} of them whose session topic the oracle "
              f"puts at >= {TOPIC_SURE}: share of the top 10 community items in that topic " + ", ".join(
                  f"{name} {f['top10 share in the topic']:.3f}" for name, f in topic_figures.items())
              + f" (chance {1 / topics:.3f}); in its scores (logits; the oracle's log probabilities) over the "
              f"community's {TOPIC_FIT_RANKS} most popular items not read, popularity weighs " + ", ".join(
                  f"{name} {f['popularity weight']:.2f}" for name, f in topic_figures.items())
              + " per unit of log Zipf probability and the session's topic adds " + ", ".join(
                  f"{name} {f['topic weight']:.2f}" for name, f in topic_figures.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": args.run, "split": args.split, "groups": out, "top10": top_figures,
                       "topic_recognition": topic_figures, "oracle_without_unseen_successors": learnable}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
