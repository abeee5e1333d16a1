"""The generator's settings: :class:`SynthConfig` (everything that determines the files: same config ->
byte-identical files), the scale presets (:data:`SCALES`), and the seeded random streams every piece of the data
draws from (:func:`_rng`)."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import numpy as np

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


def _rng(cfg: SynthConfig, *words: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([cfg.seed, *words]))


def _author_range(cfg: SynthConfig) -> int:
    return max(1, cfg.num_videos // 8)


def _topic_author_count(cfg: SynthConfig) -> int:
    return cfg.num_communities * cfg.session_topics * cfg.topic_authors


def _check_taste_of(cfg: SynthConfig) -> None:
    if cfg.click_taste_of not in ("video", "author"):
        raise ValueError(f"click_taste_of {cfg.click_taste_of!r}: expected 'video' or 'author'")
