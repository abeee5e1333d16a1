"""One log row between the simulation and the files: the release's Beijing-time calendar (2022-04-08 ..
2022-05-08), the compact spill record the generator writes (:func:`_pack`) and the writers read back, and its
conversion into the 19 published log columns (:func:`_log_frame`)."""

from __future__ import annotations

import numpy as np
import polars as pl

from nestpipe.datasets import kuairand

# KuaiRand timestamps are Beijing time (UTC+8): the real row `...,20220408,1600,1649408076860,...` is 16:54 there.
TZ_OFFSET_MS = 8 * 3600 * 1000
DAY_MS = 86_400_000
T_START_MS = 1_649_347_200_000  # 2022-04-08 00:00:00 +08:00
T_SPLIT_MS = T_START_MS + 14 * DAY_MS  # 2022-04-22 00:00:00 +08:00
T_END_MS = T_START_MS + 31 * DAY_MS  # 2022-05-09 00:00:00 +08:00 (exclusive)

# Compact spill record of one log row; date and hourmin are derived from time_ms when the CSV is written.
FLAG_COLUMNS = list(kuairand.ACTION_FLAGS)  # is_click .. is_profile_enter (8 flags)
SPILL_DTYPE = np.dtype(
    [("user_id", "<i4"), ("video_id", "<i4"), ("time_ms", "<i8")]
    + [(c, "u1") for c in FLAG_COLUMNS]
    + [("play_time_ms", "<i4"), ("duration_ms", "<i4"), ("profile_stay_time", "<i4"),
       ("comment_stay_time", "<i4"), ("is_rand", "u1"), ("tab", "u1"), ("p_click", "<f8")]
)  # p_click: the generator's own click probability (never written into the logs; see ClickTruth)


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
