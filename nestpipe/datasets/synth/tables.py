"""The feature tables of the release, one Polars frame per chunk of rows: the user table (activity categories,
range strings, one-hot ids, one of them carrying the community), the video basic table (authors, durations, tags
mostly from the video's community's tag set) and the video statistic table (52 mutually consistent counts, scaled
by each video's expected exposure under the planted model)."""

from __future__ import annotations

from typing import Dict

import numpy as np
import polars as pl

from nestpipe.datasets import kuairand
from nestpipe.datasets.synth.config import _S_USERFEAT, _S_VBASIC, _S_VSTAT, SynthConfig, _rng
from nestpipe.datasets.synth.planted import (
    _hash_unit, _Layout, _slot_author, _slot_community, _topic_zipf, user_communities, video_duration_ms,
)

NUM_TAGS = 70

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
