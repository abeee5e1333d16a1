"""The simulation: log rows user chunk by user chunk (sessions, fresh draws, successor steps, feedback; the
random-policy log) scattered into spill files (pass 1 of the external shuffle), and :func:`generate`, which runs it
and has :mod:`.writers` write the files.

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
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Dict, Iterator, Optional, Tuple

import numpy as np

from nestpipe.datasets.synth.config import _S_LOG, SynthConfig, _rng
from nestpipe.datasets.synth.planted import (
    _Layout, _random_pool, _slot_community, _successor, _user_bias, _zipf_cdf, _zipf_draw, taste_match,
    user_communities, user_interaction_counts, video_duration_ms,
)
from nestpipe.datasets.synth.records import SPILL_DTYPE, T_END_MS, T_SPLIT_MS, T_START_MS, _pack
from nestpipe.datasets.synth.truth import TRUTH_FILE
from nestpipe.datasets.synth.writers import (
    LOG_FILES, TMP_DIR_NAME, USER_FILE, _write_log_files, _write_user_features, _write_video_features,
    check_output_dir,
)
from nestpipe.utils.jsonio import write_json_atomic
from nestpipe.utils.progress import progress

TAB_WEIGHTS = np.array([20, 45, 12, 3, 10, 2, 2, 1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5])


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


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


def _progress_bar(total: int, enabled: bool):
    return progress(total, "synth", "row", enabled=enabled, unit_scale=True)


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
