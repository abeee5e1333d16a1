"""The truth beside the data, for evaluation and research: ``synth_truth.json`` (:data:`TRUTH_FILE`;
:class:`ClickTruth`, the Bayes ceiling of ``is_click`` from the generator's own click probabilities, which
:func:`generate` writes and the ingest copies beside the shards) and :class:`NextItemOracle`, the generator's own
next-item ranking (:func:`next_item_oracle` builds it from the config a truth file records)."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import numpy as np

from nestpipe.datasets import kuairand
from nestpipe.datasets.synth.config import SynthConfig
from nestpipe.datasets.synth.planted import (
    _catalogue_rank, _Layout, _slot_community, _successor, _topic_zipf, _zipf_cdf,
)

TRUTH_FILE = "synth_truth.json"  # not a KuaiRand file: the Bayes ceiling (ClickTruth); ingest copies it beside shards

TRUTH_EVAL_DAYS = range(1, 8)  # the ctr eval splits (`ingest --ctr-eval-days D`) the ceiling is written for


class ClickTruth:
    """The Bayes ceiling of ``is_click``: AUC and logloss of the generator's own click probabilities over the rows
    of the last D dates (the ctr eval split of ``nestpipe ingest --ctr-eval-days D``), for D in 1..7, and over the
    date before them (the valid split of ``--validation``).

    Streams: per date, histograms of the probability (``BINS`` equal bins) for clicked and not-clicked rows (the AUC
    from them counts two rows in one bin as a tie: within 1e-4 of the exact AUC, tested) and exact float64 logloss
    sums; memory does not grow with the rows."""

    BINS = 1 << 16

    def __init__(self):
        self.hist: Dict[int, np.ndarray] = {}  # date -> [2, BINS] (not clicked, clicked)
        self.logloss: Dict[int, float] = {}

    def add(self, dates: np.ndarray, p: np.ndarray, clicked: np.ndarray) -> None:
        p = np.asarray(p, np.float64)
        y = np.asarray(clicked).astype(bool)
        b = np.minimum((p * self.BINS).astype(np.int64), self.BINS - 1)
        q = np.clip(p, 1e-15, 1 - 1e-15)
        ll = -np.where(y, np.log(q), np.log1p(-q))
        for d in np.unique(dates).tolist():
            sel = dates == d
            h = self.hist.setdefault(d, np.zeros((2, self.BINS), np.int64))
            h += np.stack([np.bincount(b[sel & ~y], minlength=self.BINS), np.bincount(b[sel & y], minlength=self.BINS)])
            self.logloss[d] = self.logloss.get(d, 0.0) + float(ll[sel].sum())

    def result(self, eval_days: int, split: str = "eval") -> Dict[str, float]:
        """``split`` ``eval``: the last ``eval_days`` dates; ``valid``: the one date before them (``--validation``)."""
        last = max(self.hist)
        if split == "valid":
            first = kuairand.valid_date(last, eval_days)
            dates = [d for d in self.hist if d == first]
        else:
            first = kuairand.eval_cutoff(last, eval_days)
            dates = [d for d in self.hist if d >= first]
        h = sum((self.hist[d] for d in dates), np.zeros((2, self.BINS), np.int64))
        neg, pos = h[0].astype(np.float64), h[1].astype(np.float64)
        below = np.concatenate([[0.0], np.cumsum(neg)[:-1]])
        n_pos, n_neg = pos.sum(), neg.sum()
        auc = float((pos * (below + 0.5 * neg)).sum() / (n_pos * n_neg)) if n_pos and n_neg else float("nan")
        return {"rows": int(n_pos + n_neg), "first_date": int(first), "AUC": auc,
                "logloss": sum(self.logloss[d] for d in dates) / max(n_pos + n_neg, 1)}

    def summary(self) -> Dict:
        return {"label": "is_click", "what": "the generator's own click probabilities on every interaction of the "
                "last D dates (the ctr eval split of `nestpipe ingest --ctr-eval-days D`); the valid entries: of the "
                "date before them (the valid split of `--validation`)",
                "bayes_ceiling_by_eval_days": {str(d): self.result(d) for d in TRUTH_EVAL_DAYS},
                "bayes_ceiling_valid_by_eval_days": {str(d): self.result(d, "valid") for d in TRUTH_EVAL_DAYS}}


class NextItemOracle:
    """The generator's own next-item ranking: the ceiling of next-item HR / NDCG on synthetic data.

    Given the items a sample reads (``history``, oldest first), the generator draws the next item of a user of
    community c as the fixed successor of the last item with probability ``P_follow = (1 - 1/L) successor_prob``
    (L = ``mean_session_length``: the next item continues the session), else fresh: with ``in_community_prob``
    from c's catalogue, else from the head, Zipf inside either. With ``session_topics`` K > 0 a fresh
    in-community draw comes with ``topic_prob`` from the session's topic (ranks ``z, z + K, ...`` of the
    catalogue, Zipf inside): the session's topic is hidden, and the oracle takes its posterior from the history by
    the forward recursion of the generator's session process (a new session, with a uniform new topic, before each
    item with probability 1/L; else the successor with ``successor_prob``, else a fresh draw in the current topic)
    over the last ``TOPIC_WINDOW`` items; a new session's topic is uniform, so the next item's fresh part is
    ``(1 - 1/L)(1 - successor_prob) P(z | history) + 1 / (L K)`` over the topics z.
    The oracle scores every item by that probability, with c the most frequent community among the history's
    items (its catalogue items; a uniform mixture over the communities when the history holds none, or when the
    config has ``communities`` off). It ignores the random-policy log's exposures (uniform over
    ``random_pool_size`` items: below the probability of the 50th item here) and does not see time gaps (neither
    do the models). No learned ranker reading the same items can expect to beat it; ranks count the items with a
    strictly higher probability, as the evaluation does.

    Item ids are video ids (the gr ingest's ``item`` table, ``to_vocab`` leaves them unchanged)."""

    TOPIC_WINDOW = 64  # a session outlives 64 items with probability (1 - 1/L) ** 64 (2e-4 at L = 8)

    def __init__(self, cfg: SynthConfig):
        self.cfg = cfg
        self.layout = _Layout.build(cfg)
        self.p_new = 1.0 / cfg.mean_session_length
        p_follow = (1.0 - self.p_new) * cfg.successor_prob
        self.p_follow = p_follow
        p_fresh = 1.0 - p_follow
        self.head_p = p_fresh * (1.0 - cfg.in_community_prob) * np.diff(_zipf_cdf(cfg.head_size, cfg.zipf_exponent),
                                                                          prepend=0.0)
        self._head_asc = np.sort(self.head_p)
        # A fresh in-community draw of catalogue rank r: (1 - topic_prob) of the catalogue's Zipf, plus topic_prob
        # of its topic's Zipf at place r // K when the draw's topic is r's (the ranks past K * (C // K) are in none).
        self.cat_zipf = cfg.in_community_prob * np.diff(_zipf_cdf(cfg.catalogue_size, cfg.zipf_exponent), prepend=0.0)
        if cfg.session_topics:
            self.rank_topic, in_topic = _topic_zipf(cfg)
            self.topic_zipf = cfg.in_community_prob * cfg.topic_prob * in_topic
            self.cat_zipf = self.cat_zipf * (1.0 - cfg.topic_prob)

    def _community(self, history_slots: np.ndarray) -> Optional[int]:
        if not self.cfg.communities:
            return None
        comm = _slot_community(self.cfg, history_slots)
        comm = comm[comm >= 0]
        return int(np.bincount(comm).argmax()) if len(comm) else None

    def _topic_posterior(self, hs: np.ndarray, community: Optional[int]) -> np.ndarray:
        """P(the current session's topic | the history's last TOPIC_WINDOW slots), by the forward recursion."""
        cfg, k = self.cfg, self.cfg.session_topics
        hs = hs[-self.TOPIC_WINDOW:]
        comm = _slot_community(cfg, hs)
        rank = _catalogue_rank(cfg, hs)
        # P(item | fresh draw, topic z), up to the factors every z shares; items of another community (or, with no
        # community known, of any) carry nothing about z.
        topical = (comm == community) & (comm >= 0)
        emit = np.ones((len(hs), k))
        emit[topical] = self.cat_zipf[rank[topical], None]
        t = np.flatnonzero(topical & (self.rank_topic[rank] >= 0))
        emit[t, self.rank_topic[rank[t]]] += self.topic_zipf[rank[t]]
        follows = np.r_[False, hs[1:] == _successor(cfg, hs[:-1])]
        post = np.full(k, 1.0 / k)
        for i in range(len(hs)):
            e = emit[i]
            if i == 0:
                post = post * e
            elif not topical[i]:
                continue  # a head item or another community's: the same fresh probability under every topic
            else:
                stay = (1.0 - self.p_new) * post * (cfg.successor_prob * follows[i] + (1.0 - cfg.successor_prob) * e)
                post = stay + self.p_new / k * e
            post = post / post.sum()
        return post

    def _context(self, history: np.ndarray):
        """(community, the last item's successor slot as a 1-element array, fresh probability of every
        catalogue rank of that community: per-community when the community is unknown)."""
        hs = self.layout.video_to_slot(np.asarray(history, dtype=np.int64))
        community = self._community(hs)
        fresh = 1.0 - self.p_follow
        cat = fresh * self.cat_zipf
        if self.cfg.session_topics:
            k = self.cfg.session_topics
            post = self._topic_posterior(hs, community) if community is not None else np.full(k, 1.0 / k)
            w = (1.0 - self.p_new) * (1.0 - self.cfg.successor_prob) * post + self.p_new / k  # sums to P_fresh
            cat = cat + np.where(self.rank_topic >= 0, self.topic_zipf * w[np.maximum(self.rank_topic, 0)], 0.0)
        if community is None:
            cat = cat / self.cfg.num_communities
        return community, _successor(self.cfg, hs[-1:]), cat

    def _fresh(self, slots: np.ndarray, context) -> np.ndarray:
        community, _, cat = context
        cfg = self.cfg
        comm = _slot_community(cfg, slots)
        out = np.zeros(len(slots), dtype=np.float64)
        head = comm == -1
        out[head] = self.head_p[slots[head]]
        sel = comm >= 0 if community is None else comm == community
        out[sel] = cat[(slots[sel] - cfg.head_size) % cfg.catalogue_size]
        return out

    def _count_above(self, p: float, context) -> int:
        """Items whose fresh-draw probability exceeds ``p``."""
        community, _, cat = context
        head = len(self._head_asc) - int(np.searchsorted(self._head_asc, p, side="right"))
        per_catalogue = int((cat > p).sum())
        return head + (self.cfg.num_communities * per_catalogue if community is None else per_catalogue)

    def _probabilities(self, context, items: np.ndarray) -> np.ndarray:
        succ = context[1]
        slots = self.layout.video_to_slot(np.asarray(items, dtype=np.int64))
        return self._fresh(slots, context) + self.p_follow * (slots == succ[0])

    def probabilities(self, history: np.ndarray, items: np.ndarray) -> np.ndarray:
        """P(next item = each of ``items`` | the history), as the generator draws it (see the class docstring)."""
        return self._probabilities(self._context(history), items)

    def session_topic(self, history: np.ndarray) -> Tuple[Optional[int], Optional[np.ndarray]]:
        """``(community, P(the current session's topic | history))`` as the oracle infers them (the posterior over
        the K topics; None without session topics or when the history holds no community item)."""
        hs = self.layout.video_to_slot(np.asarray(history, dtype=np.int64))
        community = self._community(hs)
        if not self.cfg.session_topics or community is None:
            return community, None
        return community, self._topic_posterior(hs, community)

    def item_topics(self, items: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """``(community, topic)`` of each item: the catalogue that holds it (-1 head, -2 cold) and its session topic
        in that catalogue (in-catalogue rank mod K; -1 for head and cold items, the few ranks no topic holds, and
        every item without session topics)."""
        slots = self.layout.video_to_slot(np.asarray(items, dtype=np.int64))
        comm = _slot_community(self.cfg, slots)
        if not self.cfg.session_topics:
            return comm, np.full(len(slots), -1, dtype=np.int64)
        return comm, np.where(comm >= 0, self.rank_topic[_catalogue_rank(self.cfg, slots)], -1)

    def item_ranks(self, items: np.ndarray) -> np.ndarray:
        """Each item's popularity rank inside its catalogue (0 the most popular; -1 for head and cold items)."""
        slots = self.layout.video_to_slot(np.asarray(items, dtype=np.int64))
        comm = _slot_community(self.cfg, slots)
        return np.where(comm >= 0, _catalogue_rank(self.cfg, slots), -1)

    def target_kind(self, history: np.ndarray, target: int) -> str:
        """How the generator can have drawn ``target`` after ``history``: ``"successor"`` (the last item's fixed
        successor), else a fresh draw from ``"head"``, from ``"community"`` (the history's community's catalogue)
        or from ``"elsewhere"`` (another catalogue: an exposure of the random-policy log, or a guess of the
        community gone wrong)."""
        hs = self.layout.video_to_slot(np.asarray(history, dtype=np.int64))
        slot = self.layout.video_to_slot(np.array([target], dtype=np.int64))
        if slot[0] == _successor(self.cfg, hs[-1:])[0]:
            return "successor"
        community = self._community(hs)
        comm = int(_slot_community(self.cfg, slot)[0])
        return "head" if comm == -1 else "community" if comm >= 0 and comm == community else "elsewhere"

    def rank(self, history: np.ndarray, target: int, negatives: Optional[np.ndarray] = None) -> int:
        """Items ranked strictly above ``target`` (among ``negatives`` when given, else the whole catalogue)."""
        context = self._context(history)
        pt = float(self._probabilities(context, np.array([target]))[0])
        if negatives is not None:
            return int((self._probabilities(context, negatives) > pt).sum())
        succ = context[1]
        fresh_succ = float(self._fresh(succ, context)[0])
        above = self._count_above(pt, context) - int(fresh_succ > pt)  # the successor, counted by its full p
        return above + int(fresh_succ + self.p_follow > pt)


def next_item_oracle(truth: Dict) -> Optional["NextItemOracle"]:
    """The oracle of a ``synth_truth.json`` that records its generator config (None for older files)."""
    params = truth.get("config")
    if not params:
        return None
    fields = {f.name for f in dataclasses.fields(SynthConfig)}
    return NextItemOracle(SynthConfig(**{k: v for k, v in params.items() if k in fields}).validated())
