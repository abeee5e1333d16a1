"""Generative-recommendation samples: per user, chronological windows of interactions.

Per user the interactions are sorted by (time_ms, video_id, source file, line): a total order, so the result does
not depend on the order rows arrive in. The last interaction is held out (chronological leave-one-out):

- train windows cover ``seq[:-1]`` with length at most L and stride L-1 (consecutive windows share one token), so
  every next-item target of the training prefix is predicted exactly once;
- the eval window is the last min(L, n) interactions of the whole sequence; its last token is the target.

Users with fewer than 3 interactions give no training window (counted as ``users_too_short``); users with 2
give only an eval window; users with 1 give nothing.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import polars as pl

from nestpipe.datasets import shards as S
from nestpipe.datasets.kuairand import ACTION_FLAGS

TOKEN_FIELDS = ("item", "author", "action", "time", "play", "duration")
TABLES = ("item", "author", "action")
SORT_KEYS = ["user_id", "time_ms", "video_id", "src", "line"]


def action_bitmask() -> pl.Expr:
    expr = pl.lit(0, dtype=pl.Int64)
    for bit, flag in enumerate(ACTION_FLAGS):
        expr = expr + (pl.col(flag).fill_null(0).clip(0, 1).cast(pl.Int64) * (1 << bit))
    return expr


def windows(user_starts: np.ndarray, user_ends: np.ndarray, max_len: int) -> Dict[str, np.ndarray]:
    """Window slices (into the partition's sorted token arrays) for every user."""
    if max_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_len}")
    stride = max_len - 1
    tr_s: List[np.ndarray] = []
    tr_e: List[np.ndarray] = []
    ev_s: List[int] = []
    ev_e: List[int] = []
    short = 0
    for s, e in zip(user_starts.tolist(), user_ends.tolist()):
        n = e - s
        if n >= 2:
            ev_s.append(max(s, e - max_len))
            ev_e.append(e)
        train_end = e - 1
        n_train = n - 1
        if n_train >= 2:
            starts = s + np.arange(0, n_train - 1, stride)
            tr_s.append(starts)
            tr_e.append(np.minimum(starts + max_len, train_end))
        else:
            short += 1
    cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)  # noqa: E731
    return {
        "train_start": cat(tr_s), "train_end": cat(tr_e),
        "eval_start": np.asarray(ev_s, np.int64), "eval_end": np.asarray(ev_e, np.int64),
        "users_too_short": np.asarray([short], np.int64),
    }


USER_BITS, TIME_BITS = 21, 42  # (user, time) packed into one non-negative int64 when both fit


def _packable(df: pl.DataFrame) -> bool:
    if len(df) == 0:
        return False
    u, t = df["user_id"], df["time_ms"]
    return bool(u.min() >= 0 and u.max() < (1 << USER_BITS) and t.min() >= 0 and t.max() < (1 << TIME_BITS))


def sort_interactions(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` sorted by (user_id, time_ms, video_id, src, line): a total order.

    When every user id is below 2**21 and every time in [0, 2**42) ms (until the year 2109), user and time are
    packed into one int64 key first: the same order, and Polars sorts 4 keys instead of 5 (about 40% faster here).
    """
    if _packable(df):
        key = (pl.col("user_id") * (1 << TIME_BITS) + pl.col("time_ms")).alias("_user_time")
        # One key first: when no two rows share (user, time), it is already the total order (a user rarely has
        # two interactions in one millisecond); only then is the full sort needed. One key sorts ~25% faster.
        out = df.with_columns(key).sort("_user_time", maintain_order=True)
        if len(out) > 1 and out["_user_time"].diff().min() == 0:
            out = out.sort(["_user_time", *SORT_KEYS[2:]])
        return out.drop("_user_time")
    return df.sort(SORT_KEYS)


def build_partition(df: pl.DataFrame, max_len: int) -> Tuple[Dict[str, np.ndarray], Dict[str, int]]:
    """Joined log rows of one user partition -> token arrays + window slices (all numpy, no pickle)."""
    df = sort_interactions(df)
    tokens = df.select(
        pl.col("user_id").alias("user"),
        pl.col("video_id").alias("item"),
        pl.col("author_id").fill_null(-1).alias("author"),
        action_bitmask().alias("action"),
        pl.col("time_ms").alias("time"),
        pl.col("play_time_ms").fill_null(0).alias("play"),
        pl.col("duration_ms").fill_null(0).alias("duration"),
    )
    # int32 where every value fits (all but time here): half the bytes to write now and to gather per shard later
    arrays = {c: S.narrow_int(tokens[c].to_numpy()) for c in tokens.columns}
    user = arrays["user"]
    if len(user):
        cut = np.flatnonzero(np.diff(user)) + 1
        starts = np.concatenate([[0], cut])
        ends = np.concatenate([cut, [len(user)]])
    else:
        starts = ends = np.zeros(0, np.int64)
    w = windows(starts, ends, max_len)
    arrays.update(w)
    stats = {
        "tokens": int(len(user)),
        "users": int(len(starts)),
        "train_samples": int(len(w["train_start"])),
        "eval_samples": int(len(w["eval_start"])),
        "users_too_short": int(w["users_too_short"][0]),
    }
    return arrays, stats


def assemble(parts: List[Tuple[Dict[str, np.ndarray], np.ndarray, np.ndarray]]) -> Dict[str, np.ndarray]:
    """Fields of one batch from (partition arrays, window starts, window ends) pieces, in order."""
    starts_all, lens_all, users, cols = [], [], [], {f: [] for f in TOKEN_FIELDS}
    for arrays, st, en in parts:
        lens = (en - st).astype(np.int64)
        idx = np.repeat(st - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens) + np.arange(lens.sum())
        for f in TOKEN_FIELDS:
            cols[f].append(arrays[f][idx])
        users.append(arrays["user"][st])
        lens_all.append(lens)
    lengths = np.concatenate(lens_all).astype(np.int32)
    out = {"user": np.concatenate(users).astype(np.int64)}
    for t in TABLES:
        out[f"{t}.values"] = np.concatenate(cols[t]).astype(np.int64)
        out[f"{t}.lengths"] = lengths
    for f in ("time", "play", "duration"):
        out[f] = np.concatenate(cols[f]).astype(np.int64)
    return out
