"""Generative-recommendation samples: per user, chronological windows of interactions.

Per user the interactions are sorted by (time_ms, video_id, source file, line): a total order, so the result does
not depend on the order rows arrive in. The last interaction is held out (chronological leave-one-out):

- train windows cover ``seq[:-1]`` with length at most L and stride L-1 (consecutive windows share one token), so
  every next-item target of the training prefix is predicted exactly once;
- the eval window is the last min(L, n) interactions of the whole sequence; its last token is the target;
- with ``validation`` the second-to-last interaction is held out the same way: the valid window is the last
  min(L, n - 1) interactions of ``seq[:-1]`` (users with at least 3) and the train windows cover ``seq[:-2]``.

Users with fewer than 3 interactions give no training window (counted as ``users_too_short``); users with 2
give only an eval window; users with 1 give nothing.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import numpy as np
import polars as pl

from nestpipe.datasets import kuairand, shards
from nestpipe.datasets.kuairand import ACTION_FLAGS
from nestpipe.datasets.sequence_cost import SequenceCost
from nestpipe.ingest.common import IngestTask, PartitionCache, batch_seed, cluster_fields, crash_point, runs
from nestpipe.ingest.spill import read_partition
from nestpipe.ingest.workdir import WorkDir, save_array

TOKEN_FIELDS = ("item", "author", "action", "time", "play", "duration")
TABLES = ("item", "author", "action")
SORT_KEYS = ["user_id", "time_ms", "video_id", "src", "line"]


def action_bitmask() -> pl.Expr:
    expr = pl.lit(0, dtype=pl.Int64)
    for bit, flag in enumerate(ACTION_FLAGS):
        expr = expr + (pl.col(flag).fill_null(0).clip(0, 1).cast(pl.Int64) * (1 << bit))
    return expr


def windows(user_starts: np.ndarray, user_ends: np.ndarray, max_len: int,
            validation: bool = False) -> Dict[str, np.ndarray]:
    """Window slices (into the partition's sorted token arrays) for every user."""
    if max_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_len}")
    stride = max_len - 1
    tr_s: List[np.ndarray] = []
    tr_e: List[np.ndarray] = []
    ev_s: List[int] = []
    ev_e: List[int] = []
    va_s: List[int] = []
    va_e: List[int] = []
    held = 2 if validation else 1  # interactions held out at the end of every user's sequence
    short = 0
    for s, e in zip(user_starts.tolist(), user_ends.tolist()):
        n = e - s
        if n >= 2:
            ev_s.append(max(s, e - max_len))
            ev_e.append(e)
        if validation and n >= 3:
            va_s.append(max(s, e - 1 - max_len))
            va_e.append(e - 1)
        train_end = e - held
        n_train = n - held
        if n_train >= 2:
            starts = s + np.arange(0, n_train - 1, stride)
            tr_s.append(starts)
            tr_e.append(np.minimum(starts + max_len, train_end))
        else:
            short += 1
    cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)  # noqa: E731
    out = {
        "train_start": cat(tr_s), "train_end": cat(tr_e),
        "eval_start": np.asarray(ev_s, np.int64), "eval_end": np.asarray(ev_e, np.int64),
        "users_too_short": np.asarray([short], np.int64),
    }
    if validation:
        out.update({"valid_start": np.asarray(va_s, np.int64), "valid_end": np.asarray(va_e, np.int64)})
    return out


USER_BITS, TIME_BITS = 21, 42  # (user, time) packed into one non-negative int64 when both fit


def _packable(df: pl.DataFrame) -> bool:
    if len(df) == 0:
        return False
    u, t = df["user_id"], df["time_ms"]
    return bool(u.min() >= 0 and u.max() < (1 << USER_BITS) and t.min() >= 0 and t.max() < (1 << TIME_BITS))


def sort_interactions(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` sorted by (user_id, time_ms, video_id, src, line): a total order.

    When every user id is below 2**21 and every time in [0, 2**42) ms (until the year 2109), user and time are
    packed into one int64 key first: the same order, and Polars sorts 4 keys instead of 5.
    """
    if _packable(df):
        key = (pl.col("user_id") * (1 << TIME_BITS) + pl.col("time_ms")).alias("_user_time")
        # One key first: when no two rows share (user, time), it is already the total order (a user rarely has
        # two interactions in one millisecond); only then is the full sort needed.
        out = df.with_columns(key).sort("_user_time", maintain_order=True)
        if len(out) > 1 and out["_user_time"].diff().min() == 0:
            out = out.sort(["_user_time", *SORT_KEYS[2:]])
        return out.drop("_user_time")
    return df.sort(SORT_KEYS)


def build_partition(df: pl.DataFrame, max_len: int,
                    validation: bool = False) -> Tuple[Dict[str, np.ndarray], Dict[str, int]]:
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
    arrays = {c: shards.narrow_int(tokens[c].to_numpy()) for c in tokens.columns}
    user = arrays["user"]
    if len(user):
        cut = np.flatnonzero(np.diff(user)) + 1
        starts = np.concatenate([[0], cut])
        ends = np.concatenate([cut, [len(user)]])
    else:
        starts = ends = np.zeros(0, np.int64)
    w = windows(starts, ends, max_len, validation)
    arrays.update(w)
    stats = {
        "tokens": int(len(user)),
        "users": int(len(starts)),
        "train_samples": int(len(w["train_start"])),
        "eval_samples": int(len(w["eval_start"])),
        "users_too_short": int(w["users_too_short"][0]),
    }
    if validation:
        stats["valid_samples"] = int(len(w["valid_start"]))
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


# -- stage 2: the author of every video, into a dense table (GR needs no join) ----------------------------------
AUTHORS = "s2/authors.npy"


def _authors_marker(p: int) -> str:
    return f"s2/authors-{p:05d}.stats.json"


def _authors_part(p: int) -> str:
    return f"s2/authors-{p:05d}.npy"


def _table_shape(maxima: Dict[str, int]) -> Tuple[int, Any]:
    """Length and dtype of the dense author table, from the parse stage's maxima."""
    max_author = maxima.get("author_id", 0)
    return max(maxima.get("video_id", -1) + 1, 1), np.int32 if max_author + 1 < np.iinfo(np.int32).max else np.int64


def authors_table(work: WorkDir, maxima: Dict[str, int]) -> str:
    """Create (once) the dense video -> author table the GR authors units fill in place: ``author_id + 1`` per video
    id, 0 where the video has no features row. A sparse file of zeros: untouched pages cost no disk and no memory.
    Only for a working directory units may write in place (``work.writes_in_place``)."""
    path = work.path(AUTHORS)
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        n, dtype = _table_shape(maxima)
        tmp = path + ".tmp.npy"
        np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(n,)).flush()
        os.replace(tmp, path)
    return path


def unit_authors(args: Tuple[WorkDir, int]) -> Dict[str, Any]:
    """GR: the authors of the videos of partition ``p`` (video_id % P == p). In place, into the dense table: units
    write disjoint entries and rewriting one gives the same values, so an interrupted unit is simply redone. On
    object storage (no shared writes), into the unit's own part ``s2/authors-P.npy``: its (video id, author + 1)
    pairs, from which every reader assembles the same dense table (:func:`author_table`). Either way the unit's
    marker is written last."""
    work, p = args
    marker = _authors_marker(p)
    done = work.done(marker)
    if done is not None:
        return done
    videos = read_partition(work, work.glob("s1", "video_features_basic-*.arrow"), p)
    dup = 0
    if len(videos):
        n0 = len(videos)
        # the first row of a video (file order) wins, as in the CTR join
        videos = videos.sort(["video_id", "src", "line"]).unique(subset="video_id", keep="first", maintain_order=True)
        dup = n0 - len(videos)
    vid = videos["video_id"].to_numpy().astype(np.int64) if len(videos) else np.zeros(0, np.int64)
    author = videos["author_id"].fill_null(-1).to_numpy().astype(np.int64) if len(videos) else np.zeros(0, np.int64)
    stats = {"rows": len(videos), "duplicate_video_rows": dup, "missing_video_features": 0}
    with work.output(marker) as out:
        if work.writes_in_place:
            if len(vid):
                table = np.load(out.path(AUTHORS), mmap_mode="r+")
                table[vid] = (author + 1).astype(table.dtype)
                table.flush()
                del table
        else:
            save_array(out.path(_authors_part(p)), np.stack([vid, author + 1], axis=1))
        return out.commit(stats)


def _assemble_authors(work: WorkDir, maxima: Dict[str, int], path: str) -> None:
    """The dense video -> author + 1 table from every authors unit's part, written to local file ``path``: the
    table the units fill in place (same length, dtype and entries), made from the parts in partition order."""
    n, dtype = _table_shape(maxima)
    table = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(n,))
    for rel in work.glob("s2", "authors-*.npy"):
        pairs = work.load_array(rel)
        table[pairs[:, 0]] = pairs[:, 1].astype(dtype)
    table.flush()
    del table


def author_table(work: WorkDir, maxima: Dict[str, int]) -> np.ndarray:
    """The dense video -> author + 1 table, memory-mapped: in place, or assembled from the parts once per process
    and run into the local cache of a URL working directory."""
    if work.writes_in_place:
        return np.load(work.fetch(AUTHORS), mmap_mode="r")
    return np.load(work.cached(AUTHORS, lambda path: _assemble_authors(work, maxima, path)), mmap_mode="r")


def rows_with_authors(work: WorkDir, q: int, maxima: Dict[str, int]) -> Tuple[pl.DataFrame, int]:
    """The log rows of user partition ``q`` with ``author_id`` from the dense table (-1 where the video has no
    features row), and how many rows had none. ``maxima``: the parse stage's."""
    rows = read_partition(work, work.glob("s1", "log_*.arrow"), q)
    table = author_table(work, maxima)
    vid = rows["video_id"].to_numpy() if len(rows) else np.zeros(0, np.int64)
    ok = (vid >= 0) & (vid < len(table))
    author = np.full(len(vid), -1, np.int64)
    author[ok] = table[vid[ok]].astype(np.int64) - 1
    return rows.with_columns(pl.Series("author_id", author)), int(np.count_nonzero(author < 0))


# -- stage 4 ------------------------------------------------------------------------------------------------------
def shard_records(cache: "PartitionCache", parts: np.ndarray, idxs: np.ndarray, split: str, k: int,
                  first_batch: int, n_batches: int, opts: Dict[str, Any]):
    """Yield (key, batch) records of one GR shard, built lazily so only one batch is in memory at a time."""
    B = opts["batch_size"]
    tables = opts["tables"]
    key, kend = f"{split}_start", f"{split}_end"
    for j in range(n_batches):
        if j == 1:
            crash_point("shard", k, "mid")
        bi = first_batch + j
        sl = slice(j * B, (j + 1) * B)
        pieces = runs(cache, parts[sl], idxs[sl])
        batch = assemble([(a, a[key][ix], a[kend][ix]) for a, ix in pieces])
        costs = None
        # micro-batches of equal attention cost (nestpipe.ingest.balance), where they are trained: valid and eval
        # batches are scored whole, so their micro-batches stay as the clustering made them
        if opts.get("balance") and split == "train":
            costs = SequenceCost(**opts["balance"]).units(batch["item.lengths"])
        batch = cluster_fields(batch, tables, ["item"], opts["micro_batches"], opts["clustering"],
                               batch_seed(opts, split, bi), sample_costs=costs)
        batch["meta"] = {"index": bi, "split": split, "task": "gr", "samples": B,
                         "micro_batches": opts["micro_batches"]}
        # one packed group: values are not stored; readers rebuild them from unique[inverse]
        shards.pack_tables(batch, "seq", list(tables))
        batch["mb"] = batch["mb"].astype(np.uint8 if opts["micro_batches"] <= 256 else np.int32)
        for f in shards.GR_NARROW_FIELDS:  # readers widen them back to int64
            batch[f] = shards.narrow_int(batch[f])
        yield f"{bi:09d}", batch


class GRTask(IngestTask):
    """Generative recommendation: per-user chronological windows of item, author and action tokens."""

    name = "gr"
    input_kinds = ("log_standard", "log_random", "video_features_basic")
    # about 128 MB of raw input per partition (the unit of memory in stages 2-3)
    partition_bytes = 128 << 20
    cluster_tables = ["item"]
    log_columns = ["user_id", "video_id", "time_ms", *kuairand.ACTION_FLAGS, "play_time_ms", "duration_ms"]
    video_basic_columns = ["video_id", "author_id"]

    def partition_by_user(self, kind: str) -> bool:
        # GR logs go straight to their user partition: their one video feature (the author) is looked up from a
        # dense table at the samples stage, so they need no join by video
        return kind.startswith("log_")

    def join(self, ex, cfg, work: WorkDir, maxima: Dict[str, int], num_parts: int) -> List[Dict[str, Any]]:
        if work.writes_in_place:  # else every unit writes a part of its own (unit_authors)
            authors_table(work, maxima)
        return ex.run(unit_authors, [(work, p) for p in range(num_parts)], cfg, "2/4 authors")

    def samples(self, work: WorkDir, q: int, opts: Dict[str, Any]):
        rows, missing = rows_with_authors(work, q, opts["maxima"])
        arrays, stats = build_partition(rows, opts["max_seq_len"], bool(opts.get("validation")))
        stats["missing_video_features"] = missing
        return arrays, stats

    def derive(self, ex, cfg, work, num_parts: int) -> Dict[str, Any]:
        """Nothing: a GR window needs only its own user's interactions (the samples stage has them all)."""
        return {}

    def shard_records(self, cache, parts, idxs, split, k, first_batch, n_batches, opts):
        return shard_records(cache, parts, idxs, split, k, first_batch, n_batches, opts)

    def tables(self, cfg, maxima: Dict[str, int]) -> Dict[str, shards.TableSpec]:
        return {
            "item": shards.TableSpec(vocab=maxima.get("video_id", 0) + 1, dim=cfg.dim, kind="sequence"),
            "author": shards.TableSpec(vocab=maxima.get("author_id", 0) + 1, dim=cfg.dim, kind="sequence"),
            "action": shards.TableSpec(vocab=1 << len(kuairand.ACTION_FLAGS), dim=cfg.dim, kind="sequence"),
        }

    def manifest_fields(self, cfg) -> Dict[str, Any]:
        return {"max_seq_len": cfg.max_seq_len, "dense_features": [], "labels": []}

    def bytes_per_sample(self, cfg, s3: List[Dict[str, Any]]) -> float:
        tokens = sum(s["tokens"] for s in s3)
        samples = max(1, sum(s["train_samples"] for s in s3))
        return min(cfg.max_seq_len, max(1.0, tokens / samples)) * 6 * 8 * 2
