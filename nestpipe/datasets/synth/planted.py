"""The planted structure as pure functions of a :class:`SynthConfig`: the seeded slot <-> video id layout, the
head and community catalogues, the users' communities and biases, video authors, the latent tastes of users and
videos, interactions per user, video durations, Zipf popularity and session topics' ranks, fixed successors and the
random-policy pool. Nothing here draws a log row: the simulation (:mod:`.generator`), the feature tables
(:mod:`.tables`) and the oracle (:mod:`.truth`) read the structure from here. Per-id attributes are hashes of the
id, so they do not depend on chunking."""

from __future__ import annotations

import dataclasses
import math
from typing import Tuple

import numpy as np

from nestpipe.datasets.synth.config import (
    _S_LAYOUT, _S_USERS, SynthConfig, _author_range, _check_taste_of, _rng, _topic_author_count,
)
from nestpipe.utils.hashing import splitmix64


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
