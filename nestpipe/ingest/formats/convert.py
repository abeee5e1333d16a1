"""A public dataset -> the KuaiRand tables the ingest reads (Pure release names, as Parquet), streamed in chunks.

What each table holds:

- ``log_standard_4_08_to_4_21_pure/part-NNNNN.parquet``: one row per interaction, in file order, one part per chunk
  of the interaction file(s): ``user_id``, ``video_id`` (the item), ``time_ms``, ``date`` (UTC ``YYYYMMDD``),
  ``hourmin`` (UTC hour x 100) and the feedback flags from the rating ``r`` and ``--positive-rating p``:
  ``is_click = r >= p`` (the positive label), ``is_like = r >= p + 1`` (the scale's top at the default),
  ``is_hate = r < p - 1`` (a low rating); without a rating every interaction is a click. Every other column is 0.
- ``video_features_basic_pure.parquet``: per item its side tokens as ids ``1..K`` in sorted token order (0: none):
  ``author_id`` is the main (first listed) token, ``tag`` every token; ``video_type`` NORMAL, ``music_id`` 0.
- ``user_features_pure.parquet``: ``onehot_feat0`` gender, ``onehot_feat1`` age group, ``onehot_feat2`` occupation
  where the data has them; ``user_active_degree`` UNKNOWN.
- the random log, the second standard log and the video statistics: empty (no such data).

Ids: numeric formats keep theirs; token ids become ``0..n-1`` in sorted token order (users and items each), read
from the interactions; a side row of an item or user that never interacts is not written. Memory: one chunk of
interactions at a time, plus the id vocabularies and the side tables.

Nothing is lost: every line that gives no row is a reject (file relative to the dataset's directory, line, reason,
raw text) in ``rejects.jsonl``; ``conversion.json`` (written last: the conversion's commit) counts them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from typing import Any, Dict, List, Optional

import polars as pl

from nestpipe.datasets import kuairand
from nestpipe.ingest.formats.source import FormatError, Source, SideTables, line_chunks, numeric_ids
from nestpipe.ingest.common import crash_point
from nestpipe.ingest.parse import Reject
from nestpipe.utils import storage
from nestpipe.utils.jsonio import read_json, write_json_atomic

CONVERSION = "conversion.json"
REJECTS = "rejects.jsonl"
CONVERSION_VERSION = 1
LOG_DIR = "log_standard_4_08_to_4_21_pure"
EMPTY_TABLES = {  # the tables the data has nothing for: written with their columns and no rows
    "log_standard_4_22_to_5_08_pure.parquet": kuairand.LOG_DTYPES,
    "log_random_4_22_to_5_08_pure.parquet": kuairand.LOG_DTYPES,
    "video_features_statistic_pure.parquet": kuairand.VIDEO_STAT_DTYPES,
}
FLAG_COLUMNS = [c for c in kuairand.LOG_COLUMNS if c not in ("user_id", "video_id", "date", "hourmin", "time_ms")]


def converted(dest: str) -> Optional[Dict[str, Any]]:
    """The statistics of a finished conversion in ``dest``, None where there is none."""
    path = os.path.join(dest, CONVERSION)
    return read_json(path, "conversion record") if os.path.exists(path) else None


def convert(src: Source, dest: str, *, positive_rating: float = 4.0, chunk_bytes: int = 64 << 20,
            progress: bool = False) -> Dict[str, Any]:
    """Write the KuaiRand tables of ``src`` into ``dest`` (a local directory; replaced unless it holds a finished
    conversion, which is returned as it is). Returns the conversion's statistics."""
    done = converted(dest)
    if done is not None and done.get("version") == CONVERSION_VERSION:
        return done
    if os.path.exists(dest):
        shutil.rmtree(dest)
    parsed = os.path.join(dest, "_parsed")
    os.makedirs(parsed)
    os.makedirs(os.path.join(dest, LOG_DIR))
    rel = lambda p: storage.relative(p, src.root)  # noqa: E731
    n_rows = n_rejected = 0
    parts: List[str] = []
    id_type = pl.Int64 if src.numeric_ids else pl.Utf8
    users = pl.Series("user", [], dtype=id_type)
    items = pl.Series("item", [], dtype=id_type)
    rmin = rmax = None
    with open(os.path.join(dest, REJECTS + ".tmp"), "w") as rf:
        def keep(rejects: List[Reject]) -> None:
            for r in rejects:
                rf.write(json.dumps({**dataclasses.asdict(r), "file": rel(r.file)}) + "\n")

        for fidx, path in enumerate(src.interactions):
            for first, lines in line_chunks(path, chunk_bytes, src.encoding, skip=src.header_lines):
                crash_point("convert", len(parts))
                df, rejects = src.parse(lines, path, first)
                if src.numeric_ids:
                    df, more = numeric_ids(df, path, lines, first)
                    rejects = sorted(rejects + more, key=lambda r: r.line)
                keep(rejects)
                n_rows += len(lines)
                n_rejected += len(rejects)
                part = os.path.join(parsed, f"{fidx:03d}-{len(parts):05d}.arrow")
                df.write_ipc(part)
                parts.append(part)
                users = pl.concat([users, df["user"].unique()]).unique()
                items = pl.concat([items, df["item"].unique()]).unique()
                if df["rating"].null_count() < len(df):
                    lo, hi = df["rating"].min(), df["rating"].max()
                    rmin = lo if rmin is None else min(rmin, lo)
                    rmax = hi if rmax is None else max(rmax, hi)
                if progress:
                    print(f"\r[convert] {src.format} {src.variant}: {n_rows:,} lines read", end="", file=sys.stderr)
        if progress:
            print(file=sys.stderr)
        side = src.side(src) if src.side else SideTables()
        keep(side.rejects)
    good = n_rows - n_rejected
    if good == 0:
        raise FormatError(f"{src.root}: no usable interaction in {', '.join(rel(p) for p in src.interactions)} "
                          f"({n_rejected} line(s) rejected: see {os.path.join(dest, REJECTS)})")
    user_ids = _vocabulary(users, "user", "user_id", src.numeric_ids)
    item_ids = _vocabulary(items, "item", "video_id", src.numeric_ids)
    for k, part in enumerate(parts):
        df = pl.read_ipc(part)
        df = df.join(user_ids, on="user", how="left").join(item_ids, on="item", how="left")
        _log_rows(df, positive_rating).write_parquet(os.path.join(dest, LOG_DIR, f"part-{k:05d}.parquet"))
        os.remove(part)
    os.rmdir(parsed)
    videos, tokens = _video_table(side.items, item_ids, id_type)
    videos.write_parquet(os.path.join(dest, "video_features_basic_pure.parquet"))
    user_rows = _user_table(side.users, user_ids, id_type)
    user_rows.write_parquet(os.path.join(dest, "user_features_pure.parquet"))
    for name, dtypes in EMPTY_TABLES.items():
        pl.DataFrame(schema=dtypes).write_parquet(os.path.join(dest, name))
    os.replace(os.path.join(dest, REJECTS + ".tmp"), os.path.join(dest, REJECTS))
    positives = None
    if rmin is not None:
        positives = int(pl.scan_parquet(os.path.join(dest, LOG_DIR, "*.parquet")).select(
            pl.col("is_click").sum()).collect().item())
    stats = {
        "version": CONVERSION_VERSION, "format": src.format, "variant": src.variant,
        "files": [{"role": role, "file": rel(p)} for role, p in src.files()],
        "rows": n_rows, "rejected": n_rejected, "side_rows": side.rows, "side_rejected": len(side.rejects),
        "users": len(user_ids), "items": len(item_ids), "side_tokens": tokens,
        "items_with_side_tokens": int((videos["author_id"] > 0).sum()),
        "users_with_features": len(user_rows),
        "rating": None if rmin is None else {"min": rmin, "max": rmax, "positive_rating": positive_rating,
                                             "positives": positives},
    }
    write_json_atomic(os.path.join(dest, CONVERSION), stats)
    return stats


def _vocabulary(values: pl.Series, name: str, id_name: str, numeric: bool) -> pl.DataFrame:
    """Original id -> dense id: the same integer for numeric ids, the rank in sorted order for tokens."""
    values = values.sort()
    ids = values if numeric else pl.int_range(0, len(values), dtype=pl.Int64, eager=True)
    return pl.DataFrame({name: values, id_name: ids.cast(pl.Int64)})


def _log_rows(df: pl.DataFrame, p: float) -> pl.DataFrame:
    r = pl.col("rating")
    flag = lambda cond: pl.when(r.is_null()).then(pl.lit(0)).otherwise(cond.cast(pl.Int64))  # noqa: E731
    moment = pl.from_epoch(pl.col("time_ms"), time_unit="ms")
    out = df.select(
        pl.col("user_id"), pl.col("video_id"),
        moment.dt.strftime("%Y%m%d").cast(pl.Int64).alias("date"),
        (moment.dt.hour().cast(pl.Int64) * 100).alias("hourmin"),
        pl.col("time_ms"),
        pl.when(r.is_null()).then(pl.lit(1)).otherwise((r >= p).cast(pl.Int64)).alias("is_click"),
        flag(r >= p + 1).alias("is_like"),
        flag(r < p - 1).alias("is_hate"),
    )
    zeros = [pl.lit(0, dtype=pl.Int64).alias(c) for c in FLAG_COLUMNS if c not in out.columns]
    return out.with_columns(zeros).select([pl.col(c).cast(pl.Int64) for c in kuairand.LOG_COLUMNS])


def _video_table(items: Optional[pl.DataFrame], item_ids: pl.DataFrame, id_type) -> "tuple[pl.DataFrame, int]":
    """video_features_basic rows of every interacted item listed in the side table, and the number of side
    tokens."""
    if items is None or len(items) == 0:
        items = pl.DataFrame(schema={"item": id_type, "tokens": pl.List(pl.Utf8)})
    items = items.with_columns(pl.col("item").cast(id_type)).unique("item", keep="first", maintain_order=True)
    items = items.join(item_ids, on="item", how="inner").sort("video_id")
    vocab = sorted(set(items["tokens"].explode().drop_nulls().to_list()))
    token_id = {t: k + 1 for k, t in enumerate(vocab)}
    ids = [[token_id[t] for t in ts] for ts in items["tokens"].to_list()]
    out = pl.DataFrame({
        "video_id": items["video_id"],
        "author_id": pl.Series([t[0] if t else 0 for t in ids], dtype=pl.Int64),
        "video_type": pl.Series(["NORMAL"] * len(items), dtype=pl.Utf8),
        "tag": pl.Series([",".join(str(t) for t in dict.fromkeys(ts)) or None for ts in ids], dtype=pl.Utf8),
        "music_id": pl.Series([0] * len(items), dtype=pl.Int64),
    })
    nulls = [pl.lit(None, dtype=kuairand.VIDEO_BASIC_DTYPES[c]).alias(c)
             for c in kuairand.VIDEO_BASIC_COLUMNS if c not in out.columns]
    return out.with_columns(nulls).select(kuairand.VIDEO_BASIC_COLUMNS), len(vocab)


def _user_table(users: Optional[pl.DataFrame], user_ids: pl.DataFrame, id_type) -> pl.DataFrame:
    if users is None or len(users) == 0:
        return pl.DataFrame(schema=kuairand.USER_DTYPES)
    users = users.with_columns(pl.col("user").cast(id_type)).unique("user", keep="first", maintain_order=True)
    users = users.join(user_ids, on="user", how="inner").sort("user_id")
    card = kuairand.USER_ONEHOT_CARDINALITY
    clip = lambda c, k: pl.when(pl.col(c).is_between(0, card[k] - 1)).then(pl.col(c))  # noqa: E731
    out = users.select(
        pl.col("user_id"), pl.lit("UNKNOWN").alias("user_active_degree"),
        clip("gender", 0).alias("onehot_feat0"), clip("age_group", 1).alias("onehot_feat1"),
        clip("occupation", 2).alias("onehot_feat2"),
    )
    nulls = [pl.lit(None, dtype=kuairand.USER_DTYPES[c]).alias(c) for c in kuairand.USER_COLUMNS
             if c not in out.columns]
    return out.with_columns(nulls).select([pl.col(c).cast(kuairand.USER_DTYPES[c]) for c in kuairand.USER_COLUMNS])
