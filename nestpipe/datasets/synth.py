"""Synthetic KuaiRand-27K-format data with planted, documented, learnable structure.

:func:`generate` writes the ten files of the KuaiRand-27K release (same names, headers and value formats as the
published ones, see :mod:`nestpipe.datasets.kuairand`) into a directory. Every file is byte-identical for the same
:class:`SynthConfig` (scale, seed, interactions); a different seed gives different files. Generation streams in
chunks, so memory stays bounded (about 1 GiB) even at the real 27K vocabulary (32,038,725 videos).

Planted structure (all parameters are fields of :class:`SynthConfig`)
--------------------------------------------------------------------
*Catalogues.* The video id space is laid out in "slots": slots ``[0, head_size)`` are the **global popular head**;
then ``num_communities`` **community catalogues** of ``catalogue_size = (num_videos - head_size) //
num_communities`` slots each; the few remaining slots are cold videos that appear only in the feature tables. A
seeded affine bijection ``video_id = (A * slot + B) mod num_videos`` scatters slots over ids, so ids carry no
visible structure; :func:`video_slots` / :func:`video_communities` invert it.

*Communities.* Each user belongs to one latent community (uniform, seeded; :func:`user_communities` recomputes
the map from the config, nothing extra is written into the KuaiRand files). Each item a user starts from is drawn
with probability ``in_community_prob`` (0.8) from the user's community catalogue and otherwise from the global
head, in both cases with **Zipf popularity** ``P(rank r) ~ r ** -zipf_exponent`` (1.2) inside the catalogue. As all
catalogues share the exponent, the overall rank-frequency curve also has a log-log slope of about -1.2 over ranks
well above ``num_communities`` (at the top, items of equal rank in the equally sized catalogues form small plateaus).

*Sessions and transitions.* A user's history is cut into sessions (a new session starts with probability
``1 / mean_session_length``). Inside a session, with probability ``successor_prob`` (0.3) the next item is the
**fixed successor** of the previous one instead of a fresh draw: ``succ(slot)`` is the slot 1 to
``successor_max_offset`` ranks further down in the same catalogue (offset fixed per slot by a hash; the catalogue
wraps around). Successors stay in their catalogue, so the community share is unchanged, and being close in rank
they keep the Zipf curve. Sessions are laid out chronologically in the user's timeline (2022-04-08 .. 2022-05-08,
Beijing time), so a chronological sequence model sees successor pairs as consecutive items.

*Session topics* (off by default). With ``session_topics`` K > 0 every catalogue has K interleaved topics (in-catalogue
rank r is in topic ``r % K``); each session draws a topic uniformly, and its fresh in-community draws come with
probability ``topic_prob`` from that topic (Zipf over the topic's ranks ``z, z + K, ...``), else from the whole
catalogue. Nothing records the topic: it is a latent state a model infers from the session's items.

*Feedback depends on the match.* With ``m`` = 1 for an item of the user's own community, ``s`` = 1 for a successor
transition, ``h`` = 1 for a head item and ``b_u ~ N(0, 0.3)`` a per-user bias (logistic ``σ``)::

    P(is_click)        = σ(-1.0 + click_community_boost(1.4)·m + click_successor_boost(1.0)·s + 0.4·h + b_u
                           + click_taste_boost(0)·t_uv)
    watch ratio        = exp(N(-1.0 + 0.6·m + 0.5·s + 0.3·is_click, 0.6)),   play_time_ms = ratio · duration_ms
                         (ratio > 1 are replays, so play_time_ms sometimes exceeds duration_ms)
    long_view          = play_time_ms >= min(duration_ms, 18000)
    P(is_like)         = σ(-4.0 + 1.5·m + 0.8·s + 1.0·long_view)
    P(is_follow)       = σ(-6.0 + 1.5·m + 1.0·long_view)
    P(is_comment)      = σ(-5.0 + 1.0·m + 0.8·long_view)
    P(is_forward)      = σ(-5.5 + 1.0·m)
    P(is_hate)         = σ(-4.5 - 1.5·m)
    P(is_profile_enter)= σ(-4.0 + 1.0·m + 0.5·is_click)

``t_uv`` (:func:`taste_match`) is a latent taste match, off by default (``click_taste_boost = 0``: the click model
above without it); ``click_taste_boost = 1.0`` (``nestpipe synth --set click_taste_boost=1.0``) turns it on. It is
``<t_u, w_v> / sqrt(TASTE_RANK)`` of a user's and (``click_taste_of = "author"``) the video's author's
standard-normal vectors: a user x creator cross no function of the user or the video alone describes (``m`` is a
function of the video in the standard log: users draw from their own community or the head). It changes clicks only
(the item sequences stay the same; the gr shards' tokens, which carry the actions, change). Generator defaults come
from what real logs show or from the data's own design, never from a model's score: the term's weight 1.0 had been
picked by the DLRM's score together with the DLRM's matching ``user_id*author_id`` pair term, so it is an option, not
the default (docs/synthetic-data.md).

*Random-policy log.* A fraction ``random_fraction`` of all interactions (default 2%) forms
``log_random_4_22_to_5_08_27k.csv`` (``is_rand = 1``): items uniform over a fixed pool of ``random_pool_size``
videos, times uniform in 2022-04-22 .. 2022-05-08, feedback from the same model (no successor transitions).

*Files.* Standard-log rows go to ``4_08_to_4_21`` or ``4_22_to_5_08`` by their date and to ``part1``/``part2`` by
a seeded coin. All rows of every log are shuffled (seeded two-pass external shuffle through spill files), so no
log is sorted by user or time. The feature tables list videos and users in a seeded permuted order. Video
durations are a hash of the video id, so ``duration_ms`` in the logs equals ``video_duration`` in the basic table
(where that cell is not empty). Video tags come mostly from a small tag set of the video's community.

Negative controls: ``communities=False`` draws the catalogue of every non-head item from a random community instead
of the user's own (structure gone, popularity kept); ``successor_prob=0`` removes transitions;
``zipf_exponent=0`` makes popularity uniform; ``click_community_boost=0`` removes the feedback dependence;
``topic_prob=0`` leaves the session topics without effect.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import polars as pl

from nestpipe.datasets import kuairand
from nestpipe.utils.hashing import splitmix64
from nestpipe.utils.jsonio import write_json_atomic
from nestpipe.utils.progress import progress

SCALES: Dict[str, Dict[str, int]] = {
    "tiny": dict(num_users=300, num_videos=5_000, interactions=30_000, num_communities=8, head_size=200),
    "small": dict(num_users=2_000, num_videos=100_000, interactions=400_000, num_communities=20, head_size=2_000),
    "medium": dict(
        num_users=27_285, num_videos=1_000_000, interactions=5_000_000, num_communities=50, head_size=10_000
    ),
    "27k": dict(
        num_users=27_285, num_videos=32_038_725, interactions=50_000_000, num_communities=100, head_size=20_000
    ),
}

# KuaiRand timestamps are Beijing time (UTC+8): the real row `...,20220408,1600,1649408076860,...` is 16:54 there.
TZ_OFFSET_MS = 8 * 3600 * 1000
DAY_MS = 86_400_000
T_START_MS = 1_649_347_200_000  # 2022-04-08 00:00:00 +08:00
T_SPLIT_MS = T_START_MS + 14 * DAY_MS  # 2022-04-22 00:00:00 +08:00
T_END_MS = T_START_MS + 31 * DAY_MS  # 2022-05-09 00:00:00 +08:00 (exclusive)

LOG_FILES = [  # index = destination code used by the spill files
    "log_standard_4_08_to_4_21_27k_part1.csv",
    "log_standard_4_08_to_4_21_27k_part2.csv",
    "log_standard_4_22_to_5_08_27k_part1.csv",
    "log_standard_4_22_to_5_08_27k_part2.csv",
    "log_random_4_22_to_5_08_27k.csv",
]
USER_FILE = "user_features_27k.csv"
VIDEO_BASIC_FILE = "video_features_basic_27k.csv"
VIDEO_STAT_FILES = [f"video_features_statistic_27k_part{i}.csv" for i in (1, 2, 3)]
TRUTH_FILE = "synth_truth.json"  # not a KuaiRand file: the Bayes ceiling (ClickTruth); ingest copies it beside shards
ALL_FILES = LOG_FILES + [USER_FILE, VIDEO_BASIC_FILE] + VIDEO_STAT_FILES + [TRUTH_FILE]
TMP_DIR_NAME = ".synth-tmp"

NUM_TAGS = 70
TAB_WEIGHTS = np.array([20, 45, 12, 3, 10, 2, 2, 1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5])

# Compact spill record of one log row; date and hourmin are derived from time_ms when the CSV is written.
FLAG_COLUMNS = list(kuairand.ACTION_FLAGS)  # is_click .. is_profile_enter (8 flags)
SPILL_DTYPE = np.dtype(
    [("user_id", "<i4"), ("video_id", "<i4"), ("time_ms", "<i8")]
    + [(c, "u1") for c in FLAG_COLUMNS]
    + [("play_time_ms", "<i4"), ("duration_ms", "<i4"), ("profile_stay_time", "<i4"),
       ("comment_stay_time", "<i4"), ("is_rand", "u1"), ("tab", "u1"), ("p_click", "<f8")]
)  # p_click: the generator's own click probability (never written into the logs; see ClickTruth)

# Random streams (first word after the seed) so that every piece has its own independent, reproducible stream.
_S_LAYOUT, _S_USERS, _S_LOG, _S_SHUFFLE, _S_USERFEAT, _S_VBASIC, _S_VSTAT = range(7)


@dataclasses.dataclass(frozen=True)
class SynthConfig:
    """Everything that determines the generated files (same config -> byte-identical files)."""

    num_users: int = 300
    num_videos: int = 5_000
    interactions: int = 30_000  # rows over all five log files (standard + random)
    num_communities: int = 8
    head_size: int = 200
    seed: int = 0
    zipf_exponent: float = 1.2
    in_community_prob: float = 0.8
    communities: bool = True  # False: non-head items come from a random community (negative control)
    successor_prob: float = 0.3
    successor_max_offset: int = 3
    mean_session_length: float = 8.0
    session_topics: int = 0  # K topics per catalogue (in-catalogue rank r is in topic r % K); 0: no session topics
    topic_prob: float = 0.0  # share of a session's fresh in-community draws taken from the session's topic
    topic_authors: int = 0  # A > 0 (with session topics): a topic's videos belong to A authors in turn; 0: 4 ranks each
    random_fraction: float = 0.02
    random_pool_size: int = 7_583
    user_activity_sigma: float = 1.0  # lognormal spread of interactions per user
    click_community_boost: float = 1.4
    click_successor_boost: float = 1.0
    click_taste_boost: float = 0.0  # weight of the latent user x video taste match t_uv (taste_match); 0: none
    click_taste_of: str = "author"  # whose taste vector w_v is: "author" (the video's author's) or "video" (its own)
    chunk_rows: int = 1_000_000  # log rows generated per chunk (bounds memory)
    bucket_rows: int = 2_000_000  # rows per spill bucket of the external shuffle (bounds memory)
    video_chunk_rows: int = 1_000_000  # feature-table rows per chunk

    @staticmethod
    def for_scale(scale: str = "tiny", seed: int = 0, interactions: Optional[int] = None, **overrides) -> "SynthConfig":
        if scale not in SCALES:
            raise ValueError(f"unknown scale {scale!r}; expected one of {sorted(SCALES)}")
        params = dict(SCALES[scale])
        if interactions is not None:
            params["interactions"] = int(interactions)
        params.update(overrides)
        return SynthConfig(seed=int(seed), **params).validated()

    @property
    def catalogue_size(self) -> int:
        return (self.num_videos - self.head_size) // self.num_communities

    def validated(self) -> "SynthConfig":
        if self.num_users < 1 or self.num_videos < 2:
            raise ValueError(f"num_users ({self.num_users}) and num_videos ({self.num_videos}) must be positive")
        if self.interactions < 0:
            raise ValueError(f"interactions must be >= 0, got {self.interactions}")
        if self.num_videos >= 2**31 or self.num_users >= 2**31:
            raise ValueError("num_users and num_videos must fit in int32")
        if not (1 <= self.head_size < self.num_videos):
            raise ValueError(f"head_size must be in [1, num_videos), got {self.head_size}")
        if self.num_communities < 1 or self.catalogue_size < 1:
            raise ValueError(
                f"num_communities={self.num_communities} leaves no catalogue for "
                f"{self.num_videos - self.head_size} non-head videos"
            )
        if self.session_topics < 0 or self.session_topics > self.catalogue_size:
            raise ValueError(f"session_topics must be in [0, catalogue_size={self.catalogue_size}], "
                             f"got {self.session_topics}")
        if self.topic_authors < 0 or (self.topic_authors and not self.session_topics):
            raise ValueError(f"topic_authors must be >= 0 and needs session_topics > 0, got topic_authors="
                             f"{self.topic_authors}, session_topics={self.session_topics}")
        if self.topic_authors and _topic_author_count(self) >= _author_range(self):
            raise ValueError(f"topic_authors={self.topic_authors}: num_communities x session_topics x topic_authors "
                             f"= {_topic_author_count(self)} authors must stay under num_videos // 8 = "
                             f"{_author_range(self)}")
        for name in ("in_community_prob", "successor_prob", "random_fraction", "topic_prob"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if self.mean_session_length < 1:
            raise ValueError(f"mean_session_length must be >= 1, got {self.mean_session_length}")
        _check_taste_of(self)
        return self


# --------------------------------------------------------------------------------------------- layout helpers
def _rng(cfg: SynthConfig, *words: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([cfg.seed, *words]))


def _hash_u64(x: np.ndarray, salt: int) -> np.ndarray:
    """``splitmix64(x, salt + 1)`` (:mod:`nestpipe.utils.hashing`): per-id pseudo-random attributes that do not
    depend on chunking."""
    return splitmix64(x, salt + 1)


def _hash_unit(x: np.ndarray, salt: int) -> np.ndarray:
    """Uniform float64 in [0, 1) from a hash of ``x``."""
    return (_hash_u64(x, salt) >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def _coprime_multiplier(n: int, rng: np.random.Generator) -> int:
    a = int(rng.integers(max(1, n // 3), n)) if n > 2 else 1
    while math.gcd(a, n) != 1:
        a += 1
    return a


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Seeded bijections: slot <-> video id, and feature-table row -> video id."""

    n: int
    a: int
    b: int
    a_inv: int
    row_a: int
    row_b: int

    @staticmethod
    def build(cfg: SynthConfig) -> "_Layout":
        rng = _rng(cfg, _S_LAYOUT)
        n = cfg.num_videos
        a = _coprime_multiplier(n, rng)
        b = int(rng.integers(n))
        row_a = _coprime_multiplier(n, rng)
        row_b = int(rng.integers(n))
        return _Layout(n, a, b, pow(a, -1, n), row_a, row_b)

    def slot_to_video(self, slot: np.ndarray) -> np.ndarray:
        return (np.asarray(slot, dtype=np.int64) * self.a + self.b) % self.n

    def video_to_slot(self, video: np.ndarray) -> np.ndarray:
        return ((np.asarray(video, dtype=np.int64) - self.b) % self.n) * self.a_inv % self.n

    def row_to_video(self, row: np.ndarray) -> np.ndarray:
        return (np.asarray(row, dtype=np.int64) * self.row_a + self.row_b) % self.n


def _slot_community(cfg: SynthConfig, slot: np.ndarray) -> np.ndarray:
    """-1 for the global head, -2 for cold slots, else the community whose catalogue holds the slot."""
    slot = np.asarray(slot, dtype=np.int64)
    comm = (slot - cfg.head_size) // cfg.catalogue_size
    comm = np.where(slot < cfg.head_size, -1, comm)
    return np.where(comm >= cfg.num_communities, -2, comm)


def _catalogue_rank(cfg: SynthConfig, slot: np.ndarray) -> np.ndarray:
    """A catalogue slot's popularity rank inside its catalogue (meaningful where ``_slot_community >= 0``)."""
    return (np.asarray(slot, np.int64) - cfg.head_size) % cfg.catalogue_size


def video_slots(cfg: SynthConfig, video_ids: np.ndarray) -> np.ndarray:
    """Slot (position in the planted layout) of each video id."""
    return _Layout.build(cfg).video_to_slot(video_ids)


def video_communities(cfg: SynthConfig, video_ids: np.ndarray) -> np.ndarray:
    """Community whose catalogue holds each video: -1 = global head, -2 = cold (in no catalogue)."""
    return _slot_community(cfg, video_slots(cfg, video_ids))


def community_catalogue(cfg: SynthConfig, community: int) -> np.ndarray:
    """Video ids of one community's catalogue, most popular first."""
    start = cfg.head_size + community * cfg.catalogue_size
    return _Layout.build(cfg).slot_to_video(np.arange(start, start + cfg.catalogue_size))


def head_catalogue(cfg: SynthConfig) -> np.ndarray:
    """Video ids of the global popular head, most popular first."""
    return _Layout.build(cfg).slot_to_video(np.arange(cfg.head_size))


def user_communities(cfg: SynthConfig) -> np.ndarray:
    """Latent community of every user id (index = user id); recomputed from the config and seed."""
    return _rng(cfg, _S_USERS, 0).integers(0, cfg.num_communities, size=cfg.num_users)


def _user_bias(cfg: SynthConfig, users: np.ndarray) -> np.ndarray:
    u1 = _hash_unit(users, 11 + cfg.seed * 131)
    u2 = _hash_unit(users, 12 + cfg.seed * 131)
    return 0.3 * np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2 * np.pi * u2)


TASTE_RANK = 4  # dimensions of the latent taste vectors


def _normal(ids: np.ndarray, salt: int) -> np.ndarray:
    """Standard normal per id (Box-Muller on two hashes of it)."""
    u1 = _hash_unit(ids, salt)
    u2 = _hash_unit(ids, salt + 1)
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2 * np.pi * u2)


def video_authors(cfg: SynthConfig, video_ids: np.ndarray) -> np.ndarray:
    """``author_id`` of each video (as the basic feature table lists it): about four neighbouring slots share one;
    with ``topic_authors`` A, a topic's catalogue videos belong to its A authors in turn instead."""
    return _slot_author(cfg, video_slots(cfg, video_ids))


def _author_range(cfg: SynthConfig) -> int:
    return max(1, cfg.num_videos // 8)


def _topic_author_count(cfg: SynthConfig) -> int:
    return cfg.num_communities * cfg.session_topics * cfg.topic_authors


def _slot_author(cfg: SynthConfig, slot: np.ndarray) -> np.ndarray:
    slot = np.asarray(slot, np.int64)
    key = _hash_u64(slot // 4, 42 + cfg.seed * 131)
    if not cfg.topic_authors:
        return (key % np.uint64(_author_range(cfg))).astype(np.int64)
    # Place j of topic z in catalogue c (in-catalogue rank z + K j) -> author (c, z, j mod A), ids 0 .. n - 1
    # (permuted); every other video's author is hashed into n .. range - 1 as without the option. Each topic
    # author's videos are all of one topic and span its popularity, so the author of even a rarely seen video is
    # frequent and tells the video's topic.
    k, a, n = cfg.session_topics, cfg.topic_authors, _topic_author_count(cfg)
    comm = _slot_community(cfg, slot)
    rank = _catalogue_rank(cfg, slot)
    topical = (comm >= 0) & (rank < k * (cfg.catalogue_size // k))
    group = (comm * k + rank % k) * a + (rank // k) % a
    # x -> (x * step + seed) mod n with step coprime to n near 0.618 n: a bijection of 0 .. n - 1 that spreads
    # neighbouring groups apart
    step = next(m for m in range(int(0.618 * n) + 1, 2 * n + 2) if math.gcd(m, n) == 1)
    other = n + (key % np.uint64(_author_range(cfg) - n)).astype(np.int64)
    return np.where(topical, (group * step + cfg.seed) % n, other)


def user_tastes(cfg: SynthConfig, users: np.ndarray) -> np.ndarray:
    """``t_u`` per user id ``[n, TASTE_RANK]``: standard normal, from hashes of the id and the seed."""
    return np.stack([_normal(users, 1000 + 10 * k + cfg.seed * 131) for k in range(TASTE_RANK)], 1)


def _check_taste_of(cfg: SynthConfig) -> None:
    if cfg.click_taste_of not in ("video", "author"):
        raise ValueError(f"click_taste_of {cfg.click_taste_of!r}: expected 'video' or 'author'")


def video_tastes(cfg: SynthConfig, videos: np.ndarray) -> np.ndarray:
    """``w_v`` per video id ``[n, TASTE_RANK]``: standard normal, hashed from the video's author id
    (``click_taste_of = "author"``: a user likes or dislikes a creator's videos alike) or from the video id."""
    _check_taste_of(cfg)
    owners = video_authors(cfg, videos) if cfg.click_taste_of == "author" else np.asarray(videos, np.int64)
    return np.stack([_normal(owners, 2000 + 10 * k + cfg.seed * 131) for k in range(TASTE_RANK)], 1)


def taste_match(cfg: SynthConfig, users: np.ndarray, videos: np.ndarray) -> np.ndarray:
    """``t_uv = <t_u, w_v> / sqrt(TASTE_RANK)`` per (user id, video id) row (:func:`user_tastes`,
    :func:`video_tastes`): mean 0 and variance 1 over random pairs, and no function of the user or the video alone."""
    t_u, w_v = user_tastes(cfg, users), video_tastes(cfg, videos)
    out = np.zeros(len(users))
    for k in range(TASTE_RANK):
        out += t_u[:, k] * w_v[:, k]
    return out / np.sqrt(TASTE_RANK)


def user_interaction_counts(cfg: SynthConfig) -> Tuple[np.ndarray, np.ndarray]:
    """Rows per user in the standard logs and in the random log (each sums exactly to its total)."""
    n_rand = int(round(cfg.interactions * cfg.random_fraction))
    n_std = cfg.interactions - n_rand
    rng = _rng(cfg, _S_USERS, 1)
    weights = rng.lognormal(0.0, cfg.user_activity_sigma, size=cfg.num_users)
    return _split_total(n_std, weights, minimum=min(5, n_std // cfg.num_users)), _split_total(
        n_rand, np.ones(cfg.num_users), minimum=0
    )


def _split_total(total: int, weights: np.ndarray, minimum: int) -> np.ndarray:
    """Largest-remainder apportionment: non-negative ints proportional to weights, summing exactly to total."""
    rest = total - minimum * len(weights)
    share = weights / weights.sum() * rest
    counts = np.floor(share).astype(np.int64)
    short = rest - int(counts.sum())
    if short > 0:
        order = np.argsort(-(share - counts), kind="stable")
        counts[order[:short]] += 1
    return counts + minimum


def video_duration_ms(cfg: SynthConfig, video_ids: np.ndarray) -> np.ndarray:
    """Duration of each video (ms, int64): lognormal around 30 s, clipped to [3 s, 10 min]; a hash of the id."""
    u1 = _hash_unit(video_ids, 21 + cfg.seed * 131)
    u2 = _hash_unit(video_ids, 22 + cfg.seed * 131)
    z = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2 * np.pi * u2)
    return np.clip(np.exp(np.log(30_000.0) + 0.8 * z), 3_000, 600_000).astype(np.int64)


def _zipf_cdf(n: int, exponent: float) -> np.ndarray:
    w = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    c = np.cumsum(w)
    return c / c[-1]


def _zipf_draw(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    return np.minimum(np.searchsorted(cdf, u, side="right"), len(cdf) - 1)


def _topic_zipf(cfg: SynthConfig) -> Tuple[np.ndarray, np.ndarray]:
    """Per in-catalogue rank 0 .. catalogue_size - 1: its session topic (``rank % session_topics``; -1 for the few
    ranks past ``K * (catalogue_size // K)``, which no topic holds) and its probability in a draw from that topic
    (Zipf over the topic's ranks ``z, z + K, ...``; 0 where no topic holds it)."""
    k = cfg.session_topics
    per_topic = cfg.catalogue_size // k
    ranks = np.arange(cfg.catalogue_size)
    topic = np.where(ranks < k * per_topic, ranks % k, -1)
    in_topic = np.diff(_zipf_cdf(per_topic, cfg.zipf_exponent), prepend=0.0)
    return topic, np.where(topic >= 0, in_topic[np.minimum(ranks // k, per_topic - 1)], 0.0)


def _successor(cfg: SynthConfig, slot: np.ndarray) -> np.ndarray:
    """Fixed successor of each slot: 1..successor_max_offset ranks further down its own catalogue (wrapping)."""
    off = 1 + (_hash_u64(slot, 31 + cfg.seed * 131) % np.uint64(max(1, cfg.successor_max_offset))).astype(np.int64)
    head = slot < cfg.head_size
    rel = slot - cfg.head_size
    in_cat = rel % cfg.catalogue_size
    base = slot - in_cat
    out = np.where(head, (slot + off) % cfg.head_size, base + (in_cat + off) % cfg.catalogue_size)
    return out


def _random_pool(cfg: SynthConfig) -> np.ndarray:
    """Slots of the random-policy exposure pool (distinct, spread over head and catalogues)."""
    m = cfg.head_size + cfg.num_communities * cfg.catalogue_size
    size = min(cfg.random_pool_size, m)
    rng = _rng(cfg, _S_USERS, 2)
    a = _coprime_multiplier(m, rng)
    return (np.arange(size, dtype=np.int64) * a + int(rng.integers(m))) % m


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


# --------------------------------------------------------------------------------------------- log generation
def _feedback(cfg, rng, users, videos, match, successor, head) -> Dict[str, np.ndarray]:
    n = len(users)
    m = match.astype(np.float64)
    s = successor.astype(np.float64)
    h = head.astype(np.float64)
    duration = video_duration_ms(cfg, videos)
    p_click = _sigmoid(
        -1.0 + cfg.click_community_boost * m + cfg.click_successor_boost * s + 0.4 * h + _user_bias(cfg, users)
        + (cfg.click_taste_boost * taste_match(cfg, users, videos) if cfg.click_taste_boost else 0.0)
    )
    click = rng.random(n) < p_click
    ratio = np.exp(rng.normal(-1.0 + 0.6 * m + 0.5 * s + 0.3 * click, 0.6))
    play = np.minimum(ratio * duration, 5.0 * duration).astype(np.int64)
    long_view = play >= np.minimum(duration, 18_000)
    like = rng.random(n) < _sigmoid(-4.0 + 1.5 * m + 0.8 * s + 1.0 * long_view)
    follow = rng.random(n) < _sigmoid(-6.0 + 1.5 * m + 1.0 * long_view)
    comment = rng.random(n) < _sigmoid(-5.0 + 1.0 * m + 0.8 * long_view)
    forward = rng.random(n) < _sigmoid(-5.5 + 1.0 * m)
    hate = rng.random(n) < _sigmoid(-4.5 - 1.5 * m)
    profile = rng.random(n) < _sigmoid(-4.0 + 1.0 * m + 0.5 * click)
    profile_stay = np.where(profile, rng.geometric(1 / 20.0, n), 0)
    comment_open = comment | (rng.random(n) < 0.03)
    comment_stay = np.where(comment_open, rng.geometric(1 / 15.0, n), 0)
    tab = rng.choice(len(TAB_WEIGHTS), size=n, p=TAB_WEIGHTS / TAB_WEIGHTS.sum())
    return {
        "is_click": click, "is_like": like, "is_follow": follow, "is_comment": comment, "is_forward": forward,
        "is_hate": hate, "long_view": long_view, "is_profile_enter": profile, "play_time_ms": play,
        "duration_ms": duration, "profile_stay_time": profile_stay, "comment_stay_time": comment_stay, "tab": tab,
        "p_click": p_click,
    }


def _pack(users, videos, times, fb, is_rand) -> np.ndarray:
    rec = np.empty(len(users), dtype=SPILL_DTYPE)
    rec["user_id"] = users
    rec["video_id"] = videos
    rec["time_ms"] = times
    for c in FLAG_COLUMNS:
        rec[c] = fb[c]
    for c in ("play_time_ms", "duration_ms", "profile_stay_time", "comment_stay_time", "tab", "p_click"):
        rec[c] = fb[c]
    rec["is_rand"] = is_rand
    return rec


class _LogModel:
    """Shared state for generating log chunks (catalogue CDFs, user communities, layout)."""

    def __init__(self, cfg: SynthConfig):
        self.cfg = cfg
        self.layout = _Layout.build(cfg)
        self.user_comm = user_communities(cfg)
        self.std_counts, self.rand_counts = user_interaction_counts(cfg)
        self.cat_cdf = _zipf_cdf(cfg.catalogue_size, cfg.zipf_exponent)
        self.head_cdf = _zipf_cdf(cfg.head_size, cfg.zipf_exponent)
        self.topic_cdf = (_zipf_cdf(cfg.catalogue_size // cfg.session_topics, cfg.zipf_exponent)
                          if cfg.session_topics else None)
        self.pool = _random_pool(cfg)

    def user_chunks(self) -> Iterator[Tuple[int, int, int]]:
        """(chunk index, first user, end user) with at most about chunk_rows rows each (one user may exceed it)."""
        total = self.std_counts + self.rand_counts
        start, acc, idx = 0, 0, 0
        for u in range(self.cfg.num_users):
            if acc and acc + total[u] > self.cfg.chunk_rows:
                yield idx, start, u
                idx, start, acc = idx + 1, u, 0
            acc += int(total[u])
        yield idx, start, self.cfg.num_users

    def standard_chunk(self, rng: np.random.Generator, u0: int, u1: int) -> np.ndarray:
        cfg = self.cfg
        counts = self.std_counts[u0:u1]
        n = int(counts.sum())
        if n == 0:
            return np.empty(0, dtype=SPILL_DTYPE)
        users = np.repeat(np.arange(u0, u1, dtype=np.int64), counts)
        user_start = np.zeros(n, dtype=bool)
        firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])[counts > 0]
        user_start[firsts] = True
        # Sessions.
        sess_start = user_start | (rng.random(n) < 1.0 / cfg.mean_session_length)
        # Fresh draws: own community catalogue (or head) with Zipf popularity inside.
        comm = self.user_comm[users]
        if not cfg.communities:
            comm = rng.integers(0, cfg.num_communities, size=n)
        in_comm = rng.random(n) < cfg.in_community_prob
        u = rng.random(n)
        rank = _zipf_draw(self.cat_cdf, u)
        if cfg.session_topics:
            # Each session has a topic; its fresh in-community draws come from that topic with topic_prob.
            k = cfg.session_topics
            sess_topic = rng.integers(0, k, size=n)[np.maximum.accumulate(np.where(sess_start, np.arange(n), 0))]
            on_topic = rng.random(n) < cfg.topic_prob
            rank = np.where(on_topic, sess_topic + k * _zipf_draw(self.topic_cdf, u), rank)
        slot = np.where(
            in_comm,
            cfg.head_size + comm * cfg.catalogue_size + rank,
            _zipf_draw(self.head_cdf, u),
        )
        # Successor transitions: item t = succ^k(fresh item at the start of its run of k follow steps).
        follow = (rng.random(n) < cfg.successor_prob) & ~sess_start
        pos = np.arange(n)
        run_start = np.maximum.accumulate(np.where(follow, 0, pos))
        steps = pos - run_start
        slot = slot[run_start]
        for k in range(1, int(steps.max()) + 1 if n else 1):
            sel = steps >= k
            slot[sel] = _successor(cfg, slot[sel])
        videos = self.layout.slot_to_video(slot)
        slot_comm = _slot_community(cfg, slot)
        match = slot_comm == self.user_comm[users]
        fb = _feedback(cfg, rng, users, videos, match, follow, slot_comm == -1)
        times = self._session_times(rng, users, sess_start, user_start, fb["play_time_ms"])
        return _pack(users, videos, times, fb, 0)

    def _session_times(self, rng, users, sess_start, user_start, play) -> np.ndarray:
        """Sessions spread over the user's month in order; items of a session follow each other in time."""
        n = len(users)
        sess_id = np.cumsum(sess_start) - 1
        first_sess_of_user = np.maximum.accumulate(np.where(user_start, sess_id, 0))
        sess_local = sess_id - first_sess_of_user
        sessions_per_user = np.bincount(users - users[0], weights=sess_start).astype(np.int64)
        n_sess = sessions_per_user[users - users[0]]
        slot_len = (T_END_MS - T_START_MS) / n_sess
        gap = play + rng.integers(1_000, 10_000, size=n)
        cum = np.cumsum(gap)
        sess_first_pos = np.flatnonzero(sess_start)
        before = (cum - gap)[sess_first_pos][sess_id]  # cumulative gap before the session's first item
        offset = (cum - gap) - before
        total = np.bincount(sess_id, weights=gap)[sess_id]
        scale = np.minimum(1.0, 0.45 * slot_len / total)
        start_jitter = rng.random(len(sess_first_pos))[sess_id] * 0.5 * slot_len
        t = T_START_MS + sess_local * slot_len + start_jitter + offset * scale
        return np.minimum(t.astype(np.int64), T_END_MS - 1)

    def random_chunk(self, rng: np.random.Generator, u0: int, u1: int) -> np.ndarray:
        cfg = self.cfg
        counts = self.rand_counts[u0:u1]
        n = int(counts.sum())
        if n == 0:
            return np.empty(0, dtype=SPILL_DTYPE)
        users = np.repeat(np.arange(u0, u1, dtype=np.int64), counts)
        slot = self.pool[rng.integers(0, len(self.pool), size=n)]
        videos = self.layout.slot_to_video(slot)
        slot_comm = _slot_community(cfg, slot)
        match = slot_comm == self.user_comm[users]
        fb = _feedback(cfg, rng, users, videos, match, np.zeros(n, dtype=bool), slot_comm == -1)
        times = rng.integers(T_SPLIT_MS, T_END_MS, size=n)
        return _pack(users, videos, times, fb, 1)


def _log_frame(rec: np.ndarray) -> pl.DataFrame:
    """Spill records -> the 19 published log columns (all integers), date/hourmin in Beijing time."""
    local = rec["time_ms"] + TZ_OFFSET_MS
    day = local // DAY_MS
    start_day = (T_START_MS + TZ_OFFSET_MS) // DAY_MS
    ymd = np.array(
        [int(str(np.datetime64(int(start_day + d), "D")).replace("-", "")) for d in range(31)], np.int64
    )
    date = ymd[day - start_day]
    hourmin = (local % DAY_MS) // 3_600_000 * 100
    cols = {
        "user_id": rec["user_id"], "video_id": rec["video_id"], "date": date, "hourmin": hourmin,
        "time_ms": rec["time_ms"],
    }
    for c in kuairand.LOG_COLUMNS:
        if c not in cols:
            cols[c] = rec[c]
    return pl.DataFrame({c: np.asarray(cols[c], dtype=np.int64) for c in kuairand.LOG_COLUMNS})


# --------------------------------------------------------------------------------------------- feature tables
_FOLLOW_BINS = ([0, 1, 11, 51, 101, 151, 251, 501],
                ["0", "(0,10]", "(10,50]", "(50,100]", "(100,150]", "(150,250]", "(250,500]", "500+"])
_FANS_BINS = ([0, 1, 10, 100, 1_000, 5_000, 10_000, 100_000],
              ["0", "[1,10)", "[10,100)", "[100,1k)", "[1k,5k)", "[5k,1w)", "[1w,10w)", "[10w,100w)"])
_FRIEND_BINS = ([0, 1, 5, 30, 60, 120, 250],
                ["0", "[1,5)", "[5,30)", "[30,60)", "[60,120)", "[120,250)", "250+"])
_REGISTER_BINS = ([0, 31, 61, 91, 181, 366, 731],
                  ["15-30", "31-60", "61-90", "91-180", "181-365", "366-730", "730+"])


def _range_strings(values: np.ndarray, bins) -> np.ndarray:
    edges, labels = bins
    return np.asarray(labels, dtype=object)[np.searchsorted(edges, values, side="right") - 1]


def _user_frame(cfg: SynthConfig, std_counts: np.ndarray) -> pl.DataFrame:
    rng = _rng(cfg, _S_USERFEAT)
    n = cfg.num_users
    comm = user_communities(cfg)
    activity_rank = np.argsort(np.argsort(-std_counts, kind="stable"), kind="stable") / max(1, n - 1)
    degree = np.where(activity_rank < 0.4, "full_active",
                      np.where(activity_rank < 0.7, "high_active",
                               np.where(activity_rank < 0.95, "middle_active", "UNKNOWN")))
    follow = np.minimum(rng.lognormal(3.0, 1.5, n).astype(np.int64) * (rng.random(n) > 0.05), 5_000)
    fans = np.minimum(rng.lognormal(2.0, 2.0, n).astype(np.int64) * (rng.random(n) > 0.1), 99_999)
    friend = np.minimum(rng.lognormal(1.5, 1.5, n).astype(np.int64) * (rng.random(n) > 0.2), 2_000)
    register = rng.integers(15, 2_500, n)
    cols: Dict[str, object] = {
        "user_id": np.arange(n, dtype=np.int64),
        "user_active_degree": degree,
        "is_lowactive_period": (rng.random(n) < 0.05).astype(np.int64),
        "is_live_streamer": (rng.random(n) < 0.03).astype(np.int64),
        "is_video_author": (rng.random(n) < 0.3).astype(np.int64),
        "follow_user_num": follow, "follow_user_num_range": _range_strings(follow, _FOLLOW_BINS),
        "fans_user_num": fans, "fans_user_num_range": _range_strings(fans, _FANS_BINS),
        "friend_user_num": friend, "friend_user_num_range": _range_strings(friend, _FRIEND_BINS),
        "register_days": register, "register_days_range": _range_strings(register, _REGISTER_BINS),
    }
    for i, card in enumerate(kuairand.USER_ONEHOT_CARDINALITY):
        v = rng.integers(0, card, n)
        if i == 1:  # a user feature that carries the community (70% of users), as a CTR model could learn
            v = np.where(rng.random(n) < 0.7, comm % card, v)
        cols[f"onehot_feat{i}"] = v
    df = pl.DataFrame({c: cols[c] for c in kuairand.USER_COLUMNS}, schema=kuairand.USER_DTYPES)
    # Empty cells, as in the real file.
    empty = {c: rng.random(n) < 0.03 for c in ("onehot_feat4", "onehot_feat10", "fans_user_num_range")}
    df = df.with_columns([pl.when(pl.Series(m)).then(None).otherwise(pl.col(c)).alias(c) for c, m in empty.items()])
    return df[rng.permutation(n)]


def _video_basic_frame(cfg: SynthConfig, layout: _Layout, rows: np.ndarray) -> pl.DataFrame:
    rng = _rng(cfg, _S_VBASIC, int(rows[0]))
    n = len(rows)
    vid = layout.row_to_video(rows)
    slot = layout.video_to_slot(vid)
    comm = _slot_community(cfg, slot)
    duration = video_duration_ms(cfg, vid).astype(np.float64)
    duration_missing = _hash_unit(vid, 41 + cfg.seed * 131) < 0.01
    # Tags: 1-3 per video; the first from the community's own 3-tag set (head/cold videos: any tag).
    ntags = 1 + (rng.random(n) < 0.4) + (rng.random(n) < 0.15)
    own = np.where(comm >= 0, (comm * 7 + rng.integers(0, 3, n) * 23) % NUM_TAGS, rng.integers(0, NUM_TAGS, n))
    t2 = rng.integers(0, NUM_TAGS, n)
    t3 = rng.integers(0, NUM_TAGS, n)
    upload_day = rng.integers(0, 700, n)
    df = pl.DataFrame({
        "video_id": vid,
        "author_id": _slot_author(cfg, slot),
        "video_type": np.where(rng.random(n) < 0.03, "AD", "NORMAL"),
        "upload_day": upload_day,
        "upload_type": np.asarray(["ShortImport", "LongImport", "Web", "ShortCamera", "LongCamera", "PictureSet"],
                                  dtype=object)[rng.choice(6, n, p=[0.45, 0.2, 0.05, 0.2, 0.05, 0.05])],
        "visible_status": np.where(rng.random(n) < 0.97, "public", "private"),
        "video_duration": np.where(duration_missing, np.nan, duration),
        "server_width": np.where(rng.random(n) < 0.8, 720, 1080),
        "server_height": np.where(rng.random(n) < 0.8, 1280, 1920),
        "music_id": rng.integers(0, max(1, cfg.num_videos // 4), n),
        "music_type": rng.choice([4, 9, 11, 0], n, p=[0.6, 0.2, 0.15, 0.05]),
        "t1": own, "t2": np.where(ntags >= 2, t2, -1), "t3": np.where(ntags >= 3, t3, -1),
    })
    return df.select(
        "video_id", "author_id", "video_type",
        (pl.date(2020, 6, 1) + pl.duration(days=pl.col("upload_day"))).cast(pl.Utf8).alias("upload_dt"),
        "upload_type", "visible_status",
        pl.col("video_duration").fill_nan(None),
        "server_width", "server_height", "music_id", "music_type",
        pl.concat_str(
            [pl.when(pl.col(c) >= 0).then(pl.col(c).cast(pl.Utf8)) for c in ("t1", "t2", "t3")], separator=",",
            ignore_nulls=True,
        ).alias("tag"),
    )


def _exposure_weight(cfg: SynthConfig, slot: np.ndarray) -> np.ndarray:
    """Expected share of standard-log interactions going to each slot under the planted model."""
    comm = _slot_community(cfg, slot)
    head_norm = (np.arange(1, cfg.head_size + 1, dtype=np.float64) ** -cfg.zipf_exponent).sum()
    cat_norm = (np.arange(1, cfg.catalogue_size + 1, dtype=np.float64) ** -cfg.zipf_exponent).sum()
    rank = np.where(comm == -1, slot, (slot - cfg.head_size) % cfg.catalogue_size) + 1.0
    w = np.where(comm == -1, (1 - cfg.in_community_prob) / head_norm,
                 cfg.in_community_prob / cfg.num_communities / cat_norm) * rank ** -cfg.zipf_exponent
    if cfg.session_topics:  # a share topic_prob of the catalogue draws is Zipf inside a uniform topic instead
        _, in_topic = _topic_zipf(cfg)
        topical = in_topic[(slot - cfg.head_size) % cfg.catalogue_size] / cfg.session_topics
        w = np.where(comm == -1, w, (1 - cfg.topic_prob) * w + cfg.topic_prob * cfg.in_community_prob
                     / cfg.num_communities * topical)
    return np.where(comm == -2, 0.0, w)


def _video_stat_frame(cfg: SynthConfig, layout: _Layout, rows: np.ndarray) -> pl.DataFrame:
    """52 statistic columns with show >= play >= valid >= long_time, *_user_num <= *_cnt, and so on."""
    rng = _rng(cfg, _S_VSTAT, int(rows[0]))
    n = len(rows)
    vid = layout.row_to_video(rows)
    slot = layout.video_to_slot(vid)
    lam = 3.0 + _exposure_weight(cfg, slot) * max(cfg.interactions, 1) * 50.0 * rng.lognormal(0, 0.5, n)
    show = rng.poisson(lam).astype(np.int64)
    b = rng.binomial

    def users(cnt, lo=0.6):  # distinct users <= count
        return b(cnt, rng.uniform(lo, 1.0, n))

    play = b(show, rng.beta(6, 3, n))
    complete = b(play, rng.beta(2, 5, n))
    valid = b(play, rng.beta(5, 2, n))
    long_t = b(valid, rng.beta(2, 3, n))
    short_t = b(play - long_t, rng.beta(2, 5, n))
    duration = video_duration_ms(cfg, vid).astype(np.float64)
    progress = np.round(np.clip(rng.beta(3, 3, n) * 1.3, 0, None), 6)
    like = b(play, rng.beta(1, 30, n))
    click_like = b(like, 0.8)
    comment = b(play, rng.beta(1, 100, n))
    direct_comment = b(comment, 0.7)
    comment_user = users(comment)
    follow = b(play, rng.beta(1, 300, n))
    share = b(play, rng.beta(1, 200, n))
    share_all = share + b(play, rng.beta(1, 400, n))
    collect = b(play, rng.beta(1, 300, n))
    report = b(show, rng.beta(1, 2000, n))
    reduce_similar = b(show, rng.beta(1, 500, n))
    cols = {
        "video_id": vid, "counts": rng.integers(1, 31, n), "show_cnt": show, "show_user_num": users(show),
        "play_cnt": play, "play_user_num": users(play), "play_duration": (play * duration * progress).astype(np.int64),
        "complete_play_cnt": complete, "complete_play_user_num": users(complete),
        "valid_play_cnt": valid, "valid_play_user_num": users(valid),
        "long_time_play_cnt": long_t, "long_time_play_user_num": users(long_t),
        "short_time_play_cnt": short_t, "short_time_play_user_num": users(short_t),
        "play_progress": progress,
        "comment_stay_duration": np.round(np.where(comment > 0, rng.gamma(2.0, 15.0, n), 0.0) * (comment + 1), 3),
        "like_cnt": like, "like_user_num": users(like, 0.9), "click_like_cnt": click_like,
        "double_click_cnt": like - click_like, "cancel_like_cnt": b(like, 0.02),
        "cancel_like_user_num": 0, "comment_cnt": comment, "comment_user_num": comment_user,
        "direct_comment_cnt": direct_comment, "reply_comment_cnt": comment - direct_comment,
        "delete_comment_cnt": b(comment, 0.01), "delete_comment_user_num": 0,
        "comment_like_cnt": b(comment * 3, 0.3), "comment_like_user_num": 0,
        "follow_cnt": follow, "follow_user_num": users(follow, 0.95), "cancel_follow_cnt": b(follow, 0.05),
        "cancel_follow_user_num": 0, "share_cnt": share, "share_user_num": users(share),
        "download_cnt": b(play, rng.beta(1, 1000, n)), "download_user_num": 0, "report_cnt": report,
        "report_user_num": users(report, 0.9), "reduce_similar_cnt": reduce_similar,
        "reduce_similar_user_num": users(reduce_similar, 0.9), "collect_cnt": collect,
        "collect_user_num": users(collect, 0.95), "cancel_collect_cnt": b(collect, 0.05),
        "cancel_collect_user_num": 0,
        "direct_comment_user_num": np.minimum(b(comment_user, 0.8), direct_comment),
        "reply_comment_user_num": np.minimum(b(comment_user, 0.3), comment - direct_comment), "share_all_cnt": share_all,
        "share_all_user_num": users(share_all), "outsite_share_all_cnt": b(share_all, 0.3),
    }
    for paired, src in (("cancel_like_user_num", "cancel_like_cnt"), ("delete_comment_user_num", "delete_comment_cnt"),
                        ("comment_like_user_num", "comment_like_cnt"), ("cancel_follow_user_num", "cancel_follow_cnt"),
                        ("download_user_num", "download_cnt"), ("cancel_collect_user_num", "cancel_collect_cnt")):
        cols[paired] = users(cols[src], 0.8)
    return pl.DataFrame({c: cols[c] for c in kuairand.VIDEO_STAT_COLUMNS}, schema=kuairand.VIDEO_STAT_DTYPES)


# --------------------------------------------------------------------------------------------- driver
def check_output_dir(out_dir: str, force: bool = False) -> None:
    """Refuse a directory holding files other than the ones this generator writes, unless ``force``."""
    if not os.path.exists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir}: exists and is not a directory")
    own = set(ALL_FILES) | {n + ".partial" for n in ALL_FILES} | {TMP_DIR_NAME}  # incl. leftovers of a killed run
    foreign = sorted(set(os.listdir(out_dir)) - own)
    if foreign and not force:
        raise FileExistsError(
            f"{out_dir}: directory is not empty and holds files that are not synthetic KuaiRand output "
            f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}); choose an empty directory or pass "
            f"--force to write the KuaiRand files beside them"
        )


def _progress_bar(total: int, enabled: bool):
    return progress(total, "synth", "row", enabled=enabled, unit_scale=True)


@contextlib.contextmanager
def _atomic_file(path: str):
    """A binary file written as ``path.partial`` and renamed to ``path`` when the block ends without an error."""
    with open(path + ".partial", "wb") as out:
        yield out
    os.replace(path + ".partial", path)


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


def generate(
    out_dir: str,
    scale: str = "tiny",
    seed: int = 0,
    interactions: Optional[int] = None,
    progress: bool = True,
    *,
    config: Optional[SynthConfig] = None,
    force: bool = False,
) -> dict:
    """Write the ten KuaiRand-27K files of a synthetic dataset into ``out_dir``.

    ``config`` (if given) replaces ``scale``/``seed``/``interactions``. Returns ``{"out_dir", "files": {kind:
    [paths]}, "counts": {...}, "config": SynthConfig}``; :func:`user_communities` (config) gives the planted
    user -> community map. Each file is written under a temporary name and renamed when complete.
    """
    cfg = (config or SynthConfig.for_scale(scale, seed, interactions)).validated()
    check_output_dir(out_dir, force)
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, TMP_DIR_NAME)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    model = _LogModel(cfg)
    n_buckets = max(1, -(-cfg.interactions // cfg.bucket_rows))
    bar = _progress_bar(2 * cfg.interactions + 2 * cfg.num_videos + cfg.num_users, progress)
    try:
        rows_per_file = _spill_log_rows(cfg, model, tmp, n_buckets, bar)
        truth = _write_log_files(cfg, out_dir, tmp, n_buckets, bar)
        write_json_atomic(os.path.join(out_dir, TRUTH_FILE), {**truth.summary(), "config": dataclasses.asdict(cfg)})
        _write_user_features(cfg, model, out_dir, bar)
        basic_path, stat_paths = _write_video_features(cfg, model.layout, out_dir, bar)
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
    files = {
        "log_standard": [os.path.join(out_dir, n) for n in LOG_FILES[:4]],
        "log_random": [os.path.join(out_dir, LOG_FILES[4])],
        "user_features": [os.path.join(out_dir, USER_FILE)],
        "video_features_basic": [basic_path],
        "video_features_statistic": stat_paths,
    }
    counts = {
        "users": cfg.num_users,
        "videos": cfg.num_videos,
        "interactions": int(rows_per_file.sum()),
        "log_standard_rows": int(rows_per_file[:4].sum()),
        "log_random_rows": int(rows_per_file[4]),
        "rows_per_log_file": {n: int(c) for n, c in zip(LOG_FILES, rows_per_file)},
        "communities": cfg.num_communities,
    }
    return {"out_dir": os.path.abspath(out_dir), "files": files, "counts": counts, "config": cfg}


def _spill_log_rows(cfg: SynthConfig, model: "_LogModel", tmp: str, n_buckets: int, bar) -> np.ndarray:
    """Pass 1: generate the log rows user chunk by user chunk and scatter every row to a (file, random bucket)
    spill file, so no file's rows are ever all in memory. Returns the rows per log file."""
    rows_per_file = np.zeros(len(LOG_FILES), dtype=np.int64)
    spill = {}
    try:
        for idx, u0, u1 in model.user_chunks():
            rng = _rng(cfg, _S_LOG, idx)
            std = model.standard_chunk(rng, u0, u1)
            rnd = model.random_chunk(rng, u0, u1)
            dest = np.concatenate([
                np.where(std["time_ms"] < T_SPLIT_MS, 0, 2) + (rng.random(len(std)) < 0.5),
                np.full(len(rnd), 4),
            ]).astype(np.int64)
            recs = np.concatenate([std, rnd])
            key = dest * n_buckets + rng.integers(0, n_buckets, len(recs))
            order = np.argsort(key, kind="stable")
            recs, key = recs[order], key[order]
            bounds = np.flatnonzero(np.diff(key)) + 1
            for part in np.split(np.arange(len(recs)), bounds):
                if len(part) == 0:
                    continue
                k = int(key[part[0]])
                if k not in spill:
                    spill[k] = open(os.path.join(tmp, f"spill-{k:06d}.bin"), "wb")
                recs[part].tofile(spill[k])
            rows_per_file += np.bincount(dest, minlength=len(LOG_FILES))
            bar.update(len(recs))
    finally:
        for f in spill.values():
            f.close()
    return rows_per_file


def _write_log_files(cfg: SynthConfig, out_dir: str, tmp: str, n_buckets: int, bar) -> "ClickTruth":
    """Pass 2: per log file, shuffle each of its buckets and append it as CSV (rows in no user or time order).
    Returns the click truth of every row written."""
    truth = ClickTruth()
    for fi, name in enumerate(LOG_FILES):
        with _atomic_file(os.path.join(out_dir, name)) as out:
            out.write((",".join(kuairand.LOG_COLUMNS) + "\n").encode())
            for bucket in range(n_buckets):
                sp = os.path.join(tmp, f"spill-{fi * n_buckets + bucket:06d}.bin")
                if not os.path.exists(sp):
                    continue
                recs = np.fromfile(sp, dtype=SPILL_DTYPE)
                recs = recs[_rng(cfg, _S_SHUFFLE, fi, bucket).permutation(len(recs))]
                frame = _log_frame(recs)
                frame.write_csv(out, include_header=False)
                truth.add(frame["date"].to_numpy(), recs["p_click"], recs["is_click"])
                os.remove(sp)
                bar.update(len(recs))
    return truth


def _write_user_features(cfg: SynthConfig, model: "_LogModel", out_dir: str, bar) -> None:
    with _atomic_file(os.path.join(out_dir, USER_FILE)) as out:
        _user_frame(cfg, model.std_counts).write_csv(out)
    bar.update(cfg.num_users)


def _write_video_features(cfg: SynthConfig, layout, out_dir: str, bar) -> Tuple[str, List[str]]:
    """Video basic and statistic features, chunk by chunk (rows in a seeded permuted id order); the statistic
    table is split over three files like the release's."""
    basic_path = os.path.join(out_dir, VIDEO_BASIC_FILE)
    stat_paths = [os.path.join(out_dir, n) for n in VIDEO_STAT_FILES]
    stat_bounds = [(cfg.num_videos * i) // 3 for i in range(4)]
    with _atomic_file(basic_path) as basic_out:
        header = True
        for r0 in range(0, cfg.num_videos, cfg.video_chunk_rows):
            rows = np.arange(r0, min(r0 + cfg.video_chunk_rows, cfg.num_videos), dtype=np.int64)
            _video_basic_frame(cfg, layout, rows).write_csv(basic_out, include_header=header)
            header = False
            bar.update(len(rows))
    for part, path in enumerate(stat_paths):
        lo, hi = stat_bounds[part], stat_bounds[part + 1]
        with _atomic_file(path) as out:
            out.write((",".join(kuairand.VIDEO_STAT_COLUMNS) + "\n").encode())
            for r0 in range(lo, hi, cfg.video_chunk_rows):
                rows = np.arange(r0, min(r0 + cfg.video_chunk_rows, hi), dtype=np.int64)
                _video_stat_frame(cfg, layout, rows).write_csv(out, include_header=False)
                bar.update(len(rows))
    return basic_path, stat_paths
