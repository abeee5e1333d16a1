"""CTR samples: one per interaction, with user features, video features (basic and statistic), labels and the
user's recent-history window of video ids.

Split: interactions on the last ``ctr_eval_days`` dates of the logs form the ``eval`` set, the rest ``train``
(a chronological split); with ``validation`` the last ``ctr_valid_days`` dates before the eval dates (default one)
form the ``valid`` set instead of training. The history of a sample is the user's previous ``history_len`` video ids in the total
order (time, video, source, line), never including the sample's own interaction.

Sparse tables: single-id features (kind ``single``) and two multi-hot bags (kind ``pooled``): ``tag`` (the
video's tags) and ``history``. Categorical strings map to small ids (0 = missing or unknown); one-hot features
are shifted by one so 0 means missing.

Sequence context besides the pooled history: ``last_video`` (single) is the user's previous video id plus one (0 for
the user's first interaction), a table of its own so that a model can learn which item follows which (a pooled
bag loses the position); the dense ``log1p_gap_s`` is the seconds since the user's previous interaction (the first
interaction counts as a 30-day gap), which separates a session's first item from its continuation.

The pair count (dense ``log1p_pair_count``): how often the pair (previous video, video) of a sample occurs as
consecutive interactions of one user in the **training split**, over every user (a reduce over the user partitions
between stages 3 and 4, :meth:`CTRTask.derive`); a training sample's own occurrence is not counted, so that a pair
seen k times elsewhere reads k in every split. Valid and eval rows never count: their features are the same
whatever the logs hold on those dates. The count says which video tends to follow which, from every impression,
clicked or not; an embedding pair learns it from clicks alone, a few times per pair.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np
import polars as pl

from nestpipe.datasets import kuairand, shards
from nestpipe.ingest.common import (IngestTask, PartitionArrays, PartitionCache, batch_seed, crash_point,
                                    derived_dir, runs)
from nestpipe.ingest.gr import sort_interactions
from nestpipe.ingest.parse import ColumnSpec
from nestpipe.ingest.spill import read_partition, write_partitioned
from nestpipe.ingest.workdir import WorkDir, save_array

USER_SPEC = ColumnSpec(kuairand.USER_COLUMNS, kuairand.USER_DTYPES, ["user_id"], quoted_any=True)
VIDEO_BASIC_FEATURES = ["author_id", "video_type", "upload_type", "video_duration", "music_id", "tag"]
STAT_FEATURES = [
    "show_cnt", "play_cnt", "complete_play_cnt", "valid_play_cnt", "long_time_play_cnt", "like_cnt",
    "comment_cnt", "follow_cnt", "share_cnt", "collect_cnt", "play_progress",
]
USER_LOG_FEATURES = ["follow_user_num", "fans_user_num", "friend_user_num", "register_days"]
USER_FLAG_FEATURES = ["is_lowactive_period", "is_live_streamer", "is_video_author"]
PARTITION_DENSE = (  # the dense features stage 3 computes per user partition
    [f"log1p_{c}" for c in USER_LOG_FEATURES] + USER_FLAG_FEATURES + ["log1p_video_duration_s"]
    + [f"log1p_{c}" for c in STAT_FEATURES[:-1]] + ["play_progress", "log1p_gap_s"]
)
DENSE_FEATURES = PARTITION_DENSE + ["log1p_pair_count"]  # the shards' dense columns: the pair count last
PAIR_COUNTS = "pair-counts"  # the derived arrays' kind (common.derived_dir)
FIRST_GAP_S = 30 * 86400.0  # the gap feature of a user's first interaction
LABELS = ["is_click", "long_view", "is_like", "is_follow", "is_comment", "is_forward", "is_hate", "is_profile_enter"]
ACTIVE_DEGREES = {"UNKNOWN": 0, "high_active": 1, "full_active": 2, "middle_active": 3}
VIDEO_TYPES = {"NORMAL": 1, "AD": 2}
SINGLE_TABLES = ["user_id", "video_id", "author_id", "music_id", "user_active_degree", "video_type", "tab", "hour",
                 "last_video"] + [f"onehot_feat{i}" for i in range(18)]
POOLED_TABLES = ["tag", "history"]
# Clustering serves the unique-based tables; pooled bags (tag, history) travel as pooled sums, where the partition
# does not change the volume, so they are left out of the clustering keys.
CLUSTER_TABLES = ["user_id", "video_id", "author_id"]
VSTAT_SPEC = ColumnSpec(kuairand.VIDEO_STAT_COLUMNS, kuairand.VIDEO_STAT_DTYPES, ["video_id"],
                        keep=["video_id", *STAT_FEATURES])


def tables(cfg, maxima: Dict[str, int]) -> Dict[str, shards.TableSpec]:
    videos = maxima.get("video_id", 0) + 1
    vocab = {
        "user_id": maxima.get("user_id", 0) + 1, "video_id": videos, "author_id": maxima.get("author_id", 0) + 1,
        "music_id": maxima.get("music_id", 0) + 1, "user_active_degree": 5, "video_type": 3, "tab": 16,
        "hour": 24, "last_video": videos + 1,
    }
    for i, card in enumerate(kuairand.USER_ONEHOT_CARDINALITY):
        vocab[f"onehot_feat{i}"] = card + 1
    out = {t: shards.TableSpec(vocab=int(vocab[t]), dim=cfg.dim, kind="single") for t in SINGLE_TABLES}
    out["tag"] = shards.TableSpec(vocab=maxima.get("tag", 0) + 1, dim=cfg.dim, kind="pooled")
    out["history"] = shards.TableSpec(vocab=videos, dim=cfg.dim, kind="pooled")
    return out


_eval_cutoff = kuairand.eval_cutoff


def build_partition(rows: pl.DataFrame, users: pl.DataFrame,
                    opts: Dict[str, Any]) -> Tuple[Dict[str, np.ndarray], Dict[str, int]]:
    rows = sort_interactions(rows)
    if len(users):
        users = users.sort(["user_id", "src", "line"]).unique(subset="user_id", keep="first", maintain_order=True)
    ucols = ["user_id", "user_active_degree", *USER_LOG_FEATURES, *USER_FLAG_FEATURES] + [
        f"onehot_feat{i}" for i in range(18)
    ]
    if len(users) == 0:
        users = pl.DataFrame(schema={c: kuairand.USER_DTYPES[c] for c in ucols})
    df = rows.join(users.select(ucols).with_columns(pl.lit(True).alias("_known_user")), on="user_id", how="left",
                   maintain_order="left")
    missing_users = int(df["_known_user"].null_count())
    cutoff = _eval_cutoff(opts["max_date"], opts["ctr_eval_days"]) if opts.get("max_date") else 99999999
    f32 = pl.Float32
    cat = df.select(
        pl.col("user_id"), pl.col("video_id"),
        pl.col("author_id").fill_null(-1),
        pl.col("music_id").fill_null(-1),
        pl.col("user_active_degree").replace_strict(ACTIVE_DEGREES, default=4, return_dtype=pl.Int64)
        .fill_null(0).alias("user_active_degree"),
        pl.col("video_type").replace_strict(VIDEO_TYPES, default=0, return_dtype=pl.Int64).fill_null(0)
        .alias("video_type"),
        pl.col("tab").fill_null(0).clip(0, 15),
        (pl.col("hourmin").fill_null(0) // 100).clip(0, 23).alias("hour"),
        *[(pl.col(f"onehot_feat{i}") + 1).fill_null(0).alias(f"onehot_feat{i}") for i in range(18)],
    )
    dense = df.select(
        *[(pl.col(c).fill_null(0).clip(0).cast(pl.Float64).log1p()).cast(f32).alias(f"log1p_{c}")
          for c in USER_LOG_FEATURES],
        *[pl.col(c).fill_null(0).cast(f32) for c in USER_FLAG_FEATURES],
        (pl.col("video_duration").fill_null(0).clip(0) / 1000.0).log1p().cast(f32).alias("log1p_video_duration_s"),
        *[(pl.col(c).fill_null(0).clip(0).cast(pl.Float64).log1p()).cast(f32).alias(f"log1p_{c}")
          for c in STAT_FEATURES[:-1]],
        pl.col("play_progress").fill_null(0).cast(f32),
    )
    labels = df.select([pl.col(c).fill_null(0).clip(0, 1).cast(pl.UInt8) for c in LABELS])
    tags = df["tag"].fill_null("").str.split(",")
    tag_lens = tags.list.len().to_numpy().astype(np.int64)
    tag_vals = tags.explode().str.to_integer(strict=False)
    # empty strings from "" -> one null element: drop nulls and recount per row
    nonnull = tag_vals.is_not_null().to_numpy()
    row_of = np.repeat(np.arange(len(tag_lens)), tag_lens)
    tag_values = tag_vals.to_numpy()[nonnull].astype(np.int64) if len(tag_vals) else np.zeros(0, np.int64)
    tag_counts = np.bincount(row_of[nonnull], minlength=len(tag_lens)).astype(np.int64)
    tag_off = np.zeros(len(tag_counts) + 1, np.int64)
    np.cumsum(tag_counts, out=tag_off[1:])
    user = df["user_id"].to_numpy().astype(np.int64)
    is_start = np.concatenate([[True], user[1:] != user[:-1]])[:len(user)]  # a user's first interaction
    ustart = np.maximum.accumulate(np.where(is_start, np.arange(len(user)), 0))
    # The previous interaction of the same user in the total order: its video (+1) and the time since it.
    video = df["video_id"].to_numpy().astype(np.int64)
    time_ms = df["time_ms"].to_numpy().astype(np.int64)
    last_video = np.where(is_start, 0, np.concatenate([[0], video[:-1] + 1])[:len(user)])
    gap_s = np.where(is_start, FIRST_GAP_S,
                     np.maximum(time_ms - np.concatenate([[0], time_ms[:-1]])[:len(user)], 0) / 1000.0)
    cat = cat.with_columns(pl.Series("last_video", last_video))
    dense = dense.with_columns(pl.Series("log1p_gap_s", np.log1p(gap_s).astype(np.float32)))
    date = df["date"].fill_null(0).to_numpy()
    is_eval = date >= cutoff
    is_valid = np.zeros(len(df), bool)
    if opts.get("validation") and opts.get("max_date"):
        first = kuairand.valid_date(opts["max_date"], opts["ctr_eval_days"], opts.get("ctr_valid_days", 1))
        is_valid = (date >= first) & ~is_eval
    is_train = ~is_eval & ~is_valid
    pair_key = pair_keys(last_video, video, opts["maxima"].get("video_id", 0))
    # Single-id features as one row-major (C-order) matrix: the shard stage gathers whole rows, and a row is then one
    # run of bytes in the memory-mapped file, not one value per column. int32 where every value fits (half the bytes
    # to write here and to read per shard); the shard stage widens the gathered rows back to int64.
    single = cat.select(pl.col(SINGLE_TABLES).cast(pl.Int64)).to_numpy(order="c")
    if single.dtype != np.int64:  # a null survived the fill_null above: never expected, never silently cast
        raise ValueError(f"CTR single-id features hold nulls ({single.dtype}); columns {SINGLE_TABLES}")
    arrays = {"single": shards.narrow_int(single.reshape(len(df), len(SINGLE_TABLES))),
              "video_id": video}
    dense_rows = np.ascontiguousarray(dense.to_numpy(order="c"), dtype=np.float32)
    arrays.update({
        "dense": dense_rows.reshape(len(df), len(PARTITION_DENSE)),
        "labels": np.ascontiguousarray(labels.to_numpy(order="c"), dtype=np.uint8).reshape(len(df), len(LABELS)),
        "tag_values": tag_values, "tag_offsets": tag_off, "ustart": ustart.astype(np.int64),
        "train_rows": np.flatnonzero(is_train).astype(np.int64), "eval_rows": np.flatnonzero(is_eval).astype(np.int64),
        "valid_rows": np.flatnonzero(is_valid).astype(np.int64),
        "pair_key": pair_key, **train_pairs(pair_key[counted_pairs(is_train)], int(opts["pair_buckets"])),
    })
    stats = {"rows": int(len(df)), "train_samples": int(is_train.sum()), "eval_samples": int(is_eval.sum()),
             "valid_samples": int(is_valid.sum()),
             "users": int(len(np.unique(user))) if len(user) else 0, "missing_users": missing_users}
    return arrays, stats


def pair_keys(last_video: np.ndarray, video: np.ndarray, max_video: int) -> np.ndarray:
    """One int64 per (previous video, video) pair: ``prev * (max_video + 1) + video``; -1 for a user's first
    interaction (no previous video; ``last_video`` is the previous id plus one, 0 for none)."""
    n = int(max_video) + 1
    if n > 3_000_000_000:  # n * n must fit in int64
        raise ValueError(f"video ids up to {max_video}: too large for the pair count's int64 keys")
    return np.where(last_video > 0, (last_video - 1) * n + video, -1).astype(np.int64)


def counted_pairs(is_train: np.ndarray) -> np.ndarray:
    """The rows whose pairs the pair count counts: the training split's (never valid or eval rows)."""
    return is_train


def train_pairs(keys: np.ndarray, buckets: int) -> Dict[str, np.ndarray]:
    """One partition's counted pairs for the reduce: distinct keys with their counts, grouped by bucket
    (``key % buckets``; bucket b is ``[offsets[b], offsets[b + 1])``, keys ascending within it)."""
    keys = keys[keys >= 0]
    u, c = np.unique(keys, return_counts=True)
    order = np.lexsort((u, u % buckets))
    u, c = u[order], c[order]
    offsets = np.searchsorted(u % buckets, np.arange(buckets + 1))  # the buckets are ascending now
    return {"pair_keys": u, "pair_counts": c.astype(np.int64), "pair_offsets": offsets.astype(np.int64)}


def _gather_jagged(values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    lens = (ends - starts).astype(np.int64)
    if lens.sum() == 0:
        return np.zeros(0, np.int64), lens.astype(np.int32)
    idx = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens) + np.arange(lens.sum())
    return values[idx].astype(np.int64), lens.astype(np.int32)


def gather(pieces: List[Tuple[Dict[str, np.ndarray], np.ndarray]], split: str,
           history_len: int) -> Dict[str, np.ndarray]:
    """Every sample of a shard at once from (partition arrays, sample indices) pieces, in order: ``single``
    [M, T] int64, ``tag``/``history`` jagged (``*.values`` int64, ``*.lengths`` int64 [M]), ``dense``, ``labels``."""
    H = int(history_len)
    out: Dict[str, List[np.ndarray]] = {}

    def add(k: str, v: np.ndarray) -> None:
        out.setdefault(k, []).append(v)

    for arrays, ix in pieces:
        rows = np.asarray(arrays[f"{split}_rows"][ix])
        # The arrays are memory-mapped: reading the rows in ascending order touches each page once, in file order
        # (the kernel maps its neighbours at the same fault), then the rows are put back in sample order.
        order = np.argsort(rows, kind="stable")
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        srows = rows[order]

        def take(a, r=srows):
            return np.asarray(a[r])[back]

        add("single", take(arrays["single"]).astype(np.int64))
        tv, tl = _gather_jagged(arrays["tag_values"], take(arrays["tag_offsets"]),
                                take(arrays["tag_offsets"], srows + 1))
        add("tag.values", tv)
        add("tag.lengths", tl.astype(np.int64))
        hs = np.maximum(take(arrays["ustart"]), rows - H)
        hv, hl = _gather_jagged(arrays["video_id"], hs, rows)
        add("history.values", hv)
        add("history.lengths", hl.astype(np.int64))
        pair_count = take(arrays.derived(PAIR_COUNTS, "pair_count"))
        add("dense", np.concatenate([take(arrays["dense"]), np.log1p(pair_count, dtype=np.float32)[:, None]], axis=1))
        add("labels", take(arrays["labels"]))
    return {k: np.concatenate(v) for k, v in out.items()}


# -- stage 2: logs x video tables, per video partition ----------------------------------------------------------
def unit_join(args: Tuple[WorkDir, int, int]) -> Dict[str, Any]:
    work, p, num_parts = args
    rel = f"s2/joined-{p:05d}.arrow"
    marker = rel + ".stats.json"
    done = work.done(marker)
    if done is not None:
        return done
    logs = read_partition(work, work.glob("s1", "log_*.arrow"), p)
    videos = read_partition(work, work.glob("s1", "video_features_basic-*.arrow"), p)
    dup = 0
    if len(videos):
        n0 = len(videos)
        videos = videos.sort(["video_id", "src", "line"]).unique(subset="video_id", keep="first", maintain_order=True)
        dup = n0 - len(videos)
    vcols = ["video_id", *VIDEO_BASIC_FEATURES]
    if len(videos) == 0:
        videos = pl.DataFrame(schema={c: kuairand.VIDEO_BASIC_DTYPES[c] for c in vcols})
    joined = logs.join(videos.select(vcols), on="video_id", how="left", maintain_order="left")
    missing = int(joined["author_id"].null_count()) if len(joined) else 0
    stats_df = read_partition(work, work.glob("s1", "video_features_statistic-*.arrow"), p)
    if len(stats_df):
        stats_df = stats_df.sort(["video_id", "src", "line"]).unique(
            subset="video_id", keep="first", maintain_order=True
        )
    else:
        stats_df = pl.DataFrame(schema={c: kuairand.VIDEO_STAT_DTYPES[c] for c in ["video_id", *STAT_FEATURES]})
    joined = joined.join(
        stats_df.select(["video_id", *STAT_FEATURES]), on="video_id", how="left", maintain_order="left"
    )
    joined = joined.with_columns((pl.col("user_id") % num_parts).alias("_part"))
    stats = {"rows": len(joined), "missing_video_features": missing, "duplicate_video_rows": dup}
    with work.output(marker) as out:
        write_partitioned(out.path(rel), joined, "_part", num_parts)
        return out.commit(stats)


# -- between stages 3 and 4: the pair counts over every user partition -------------------------------------------
def unit_pair_reduce(args: Tuple[WorkDir, int, int]) -> Dict[str, Any]:
    """Bucket ``b`` of the pair counts: every partition's counted pairs of that bucket, summed per key."""
    work, b, num_parts = args
    sub = f"s3/pairs-{b:05d}"
    done = work.done(f"{sub}/stats.json")
    if done is not None:
        return done
    keys, counts = [], []
    for q in range(num_parts):
        arrays = PartitionArrays(work, q)
        lo, hi = arrays["pair_offsets"][b:b + 2]
        keys.append(np.asarray(arrays["pair_keys"][lo:hi]))
        counts.append(np.asarray(arrays["pair_counts"][lo:hi]))
    keys_all = np.concatenate(keys)
    u, inv = np.unique(keys_all, return_inverse=True)
    total = np.bincount(inv, weights=np.concatenate(counts), minlength=len(u)).astype(np.int64)
    with work.output(f"{sub}/stats.json") as out:
        save_array(out.path(f"{sub}/keys.npy"), u)
        save_array(out.path(f"{sub}/counts.npy"), total)
        return out.commit({"rows": int(total.sum()), "pairs": int(len(u))})


def unit_pair_lookup(args: Tuple[WorkDir, int, int]) -> Dict[str, Any]:
    """Partition ``q``'s pair count per row: its pair's count in the reduced buckets, less the row's own
    occurrence where the row was counted."""
    work, q, num_parts = args
    sub = derived_dir(PAIR_COUNTS, q)
    done = work.done(f"{sub}/stats.json")
    if done is not None:
        return done
    arrays = PartitionArrays(work, q)
    key = np.asarray(arrays["pair_key"])
    count = np.zeros(len(key), np.int64)
    bucket = np.where(key >= 0, key % num_parts, -1)
    for b in np.unique(bucket[bucket >= 0]):
        rows = np.flatnonzero(bucket == b)
        keys = np.load(work.fetch(f"s3/pairs-{b:05d}/keys.npy"), mmap_mode="r", allow_pickle=False)
        counts = np.load(work.fetch(f"s3/pairs-{b:05d}/counts.npy"), mmap_mode="r", allow_pickle=False)
        at = np.searchsorted(keys, key[rows])
        hit = at < len(keys)
        hit[hit] = keys[at[hit]] == key[rows[hit]]
        count[rows[hit]] = counts[at[hit]]
    counted = np.zeros(len(key), bool)
    counted[np.asarray(arrays["train_rows"])] = True
    count -= counted_pairs(counted) & (key >= 0)
    if (count < 0).any():  # a counted row's own pair is in the reduce: never expected
        raise ValueError(f"partition {q}: pair counts below zero (the reduce misses counted pairs)")
    with work.output(f"{sub}/stats.json") as out:
        save_array(out.path(f"{sub}/pair_count.npy"), count.astype(np.int32))
        return out.commit({"rows": int(len(key)), "rows_with_seen_pair": int((count > 0).sum())})


# -- stage 4 ------------------------------------------------------------------------------------------------------
def shard_records(cache: "PartitionCache", parts: np.ndarray, idxs: np.ndarray, split: str, k: int,
                  first_batch: int, n_batches: int, opts: Dict[str, Any]):
    """CTR records of one shard (format: ``nestpipe.datasets.shards``): single-id tables as packed group
    ``single`` (no lengths: one id per sample and table), the ``tag`` and ``history`` bags as packed group
    ``bags``. Every batch is clustered on its own, exactly as :func:`cluster_fields` would; the unique keys of all
    batches come from one pass per group (:mod:`nestpipe.ingest.batch_keys`)."""
    # the shard units' modules: a worker that only parses or joins never loads the clustering (Numba)
    from nestpipe import clustering
    from nestpipe.ingest.batch_keys import group_keys, load_kernel

    load_kernel()  # Numba now, so the clustering's compiled assignment runs from the first batch (same results)

    B, n, nb = opts["batch_size"], opts["micro_batches"], n_batches
    M = nb * B
    g = gather(runs(cache, parts[:M], idxs[:M]), split, opts["history_len"])
    single = g["single"]
    T = single.shape[1]
    col = {t: i for i, t in enumerate(SINGLE_TABLES)}
    ckeys = np.stack([clustering.combine_keys(tid, single[:, col[t]])
                      for tid, t in enumerate(opts["cluster_tables"])], axis=1)
    c = ckeys.shape[1]
    coffs = np.arange(0, B * c + 1, c, dtype=np.int64)
    mb = np.empty(M, np.int64)
    for j in range(nb):
        sl = slice(j * B, (j + 1) * B)
        mb[sl] = clustering.assign(ckeys[sl].ravel(), coffs, n, method=opts["clustering"],
                                   seed=batch_seed(opts, split, first_batch + j))
    # single: occurrences in (batch, table, sample) order
    s_vals = single.reshape(nb, B, T).transpose(0, 2, 1).ravel()
    s_batch = np.repeat(np.arange(nb, dtype=np.int64), B * T)
    s_table = np.tile(np.repeat(np.arange(T, dtype=np.int64), B), nb)
    s_mb = np.broadcast_to(mb.reshape(nb, 1, B), (nb, T, B)).ravel()
    sk = group_keys(s_vals, s_batch, s_table, s_mb, nb, T, n)
    del s_vals, s_batch, s_table, s_mb
    # bags: occurrences in (batch, table, value) order. Each table's values are in sample order, so batch b's values
    # of table t are one slice of them: the (batch, table) order interleaves slices (no per-value scatter).
    P = len(POOLED_TABLES)
    vals, mbs, counts = [], [], []
    for name in POOLED_TABLES:
        lens = g[f"{name}.lengths"]
        vals.append(g[f"{name}.values"])
        mbs.append(np.repeat(mb, lens))  # each value's micro-batch
        counts.append(lens.reshape(nb, B).sum(axis=1))
    per_bt = np.stack(counts, axis=1).ravel()  # [nb * P] values per (batch, table)
    bt_start = np.concatenate([[0], np.cumsum(per_bt)]).astype(np.int64)
    starts = [np.concatenate([[0], np.cumsum(c)]).astype(np.int64) for c in counts]

    def interleave(parts_):
        return np.concatenate([parts_[t][starts[t][b]:starts[t][b + 1]] for b in range(nb) for t in range(P)])

    bk = group_keys(interleave(vals), np.repeat(np.arange(nb, dtype=np.int64), per_bt.reshape(nb, P).sum(axis=1)),
                    np.repeat(np.tile(np.arange(P, dtype=np.int64), nb), per_bt), interleave(mbs), nb, P, n)
    bag_lengths = np.stack([g[f"{name}.lengths"] for name in POOLED_TABLES])  # [P, M]
    mb_dtype = np.uint8 if n <= 256 else np.int32
    for j in range(nb):
        if j == 1:
            crash_point("shard", k, "mid")
        bi = first_batch + j
        sl = slice(j * B, (j + 1) * B)
        batch: Dict[str, Any] = {"mb": mb[sl].astype(mb_dtype), "dense": g["dense"][sl], "labels": g["labels"][sl]}
        batch["meta"] = {"index": bi, "split": split, "task": "ctr", "samples": B, "micro_batches": n}
        u, cnt, mu, mo = sk.batch(j, T)
        shards.pack_group(batch, "single", list(SINGLE_TABLES), u, cnt, sk.inverse[j * B * T:(j + 1) * B * T],
                          mu, mo, None)
        u, cnt, mu, mo = bk.batch(j, P)
        shards.pack_group(batch, "bags", list(POOLED_TABLES), u, cnt,
                          bk.inverse[bt_start[j * P]:bt_start[(j + 1) * P]], mu, mo, bag_lengths[:, sl])
        yield f"{bi:09d}", batch


class CTRTask(IngestTask):
    """Click-through rate: one sample per interaction with user and video features, labels and recent history."""

    name = "ctr"
    version = 2  # 2: the pair count
    input_kinds = ("log_standard", "log_random", "video_features_basic", "video_features_statistic", "user_features")
    # about 64 MB of raw input per partition: the samples stage holds every feature column of a partition at once
    partition_bytes = 64 << 20
    cluster_tables = CLUSTER_TABLES
    log_columns = ["user_id", "video_id", "date", "hourmin", "time_ms", *kuairand.ACTION_FLAGS, "tab"]
    video_basic_columns = ["video_id", *VIDEO_BASIC_FEATURES]

    def column_spec(self, kind: str) -> ColumnSpec:
        if kind == "video_features_statistic":
            return VSTAT_SPEC
        if kind == "user_features":
            return USER_SPEC
        raise KeyError(kind)

    def partition_by_user(self, kind: str) -> bool:
        return kind == "user_features"

    def join(self, ex, cfg, work: WorkDir, maxima: Dict[str, int], num_parts: int) -> List[Dict[str, Any]]:
        return ex.run(unit_join, [(work, p, num_parts) for p in range(num_parts)], cfg, "2/4 join")

    def samples(self, work: WorkDir, q: int, opts: Dict[str, Any]):
        rows = read_partition(work, work.glob("s2", "joined-*.arrow"), q)
        users = read_partition(work, work.glob("s1", "user_features-*.arrow"), q)
        return build_partition(rows, users, opts)

    def derive(self, ex, cfg, work: WorkDir, num_parts: int) -> Dict[str, Any]:
        """The pair counts (module docstring): reduced per bucket of keys, then looked up per partition."""
        reduced = ex.run(unit_pair_reduce, [(work, b, num_parts) for b in range(num_parts)], cfg,
                         "3/4 pair counts (reduce)")
        looked = ex.run(unit_pair_lookup, [(work, q, num_parts) for q in range(num_parts)], cfg,
                        "3/4 pair counts (lookup)")
        return {"pair_count": {"train_transitions": sum(r["rows"] for r in reduced),
                               "distinct_pairs": sum(r["pairs"] for r in reduced),
                               "rows_with_seen_pair": sum(r["rows_with_seen_pair"] for r in looked)}}

    def shard_records(self, cache, parts, idxs, split, k, first_batch, n_batches, opts):
        return shard_records(cache, parts, idxs, split, k, first_batch, n_batches, opts)

    def tables(self, cfg, maxima: Dict[str, int]) -> Dict[str, shards.TableSpec]:
        return tables(cfg, maxima)

    def manifest_fields(self, cfg) -> Dict[str, Any]:
        return {"max_seq_len": None, "dense_features": list(DENSE_FEATURES), "labels": list(LABELS)}

    def bytes_per_sample(self, cfg, s3: List[Dict[str, Any]]) -> float:
        return (len(DENSE_FEATURES) + len(LABELS)) * 4 + (cfg.history_len + 30) * 8 * 2
