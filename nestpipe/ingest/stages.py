"""The ingest: raw KuaiRand-format logs -> clustered WebDataset batch shards + manifest, with bounded memory.

Stages (each unit of work writes one file atomically; an interrupted run redoes only missing units):

1. parse    every input file in fixed-size byte chunks (Polars native CSV, validating fallback); bad rows go to
            the rejects; good rows are spilled to Arrow IPC files hash-partitioned by video id (one row group each).
2. join     per video partition: the logs meet the video tables (deduplicated by video id), then are spilled
            again, hash-partitioned by user id.
3. samples  per user partition: a total sort by (user, time, video, source, line), then samples (GR windows or
            CTR rows with their recent history), kept as flat numpy arrays.
4. shards   the samples of each split, in a seeded order, cut into batches of exactly B; each batch is partitioned
            into N micro-batches by key-centric clustering and carries its unique keys per table; S batches per
            WebDataset shard.

Memory is bounded by the chunk size and by one partition at a time (the number of partitions grows with the
input), never by the whole input. The output depends only on the inputs and the semantic options, not on
``--workers``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import math
import os
import shutil
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import polars as pl

from nestpipe.datasets import kuairand as K
from nestpipe.datasets import shards as S
from nestpipe.ingest import ctr, gr
from nestpipe.ingest.config import IngestConfig
from nestpipe.ingest.executor import Executor
from nestpipe.ingest.parse import Chunk, ColumnSpec, Reject, parse_chunk, plan_chunks, read_chunk_bytes
from nestpipe.ingest.spill import read_partition, write_partitioned

WORK = "_work"
LINE_KEY_BITS = 40  # at most 2**40 lines per chunk
STATE = "state.json"
REJECTS = "rejects.csv"


class IngestError(RuntimeError):
    """The ingest cannot go on (too many rejects, a foreign output directory, ...)."""


def _crash_point(stage: str, unit: int, where: str = "start") -> None:
    """Fault injection for the resume tests: ``NESTPIPE_INGEST_CRASH_AT=stage:unit[:where]`` makes the process
    SIGKILL itself there (e.g. ``shard:1:mid`` dies after shard 1 has begun writing records)."""
    spec = os.environ.get("NESTPIPE_INGEST_CRASH_AT")
    if not spec:
        return
    parts = spec.split(":")
    if parts[0] == stage and int(parts[1]) == unit and (parts[2] if len(parts) > 2 else "start") == where:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------------------------------------------
# input specs

# Columns each task keeps after validation (every column is still validated: a malformed cell in a column the
# task does not use still makes the row malformed).
LOG_KEEP = {
    "gr": ["user_id", "video_id", "time_ms", *K.ACTION_FLAGS, "play_time_ms", "duration_ms"],
    "ctr": ["user_id", "video_id", "date", "hourmin", "time_ms", *K.ACTION_FLAGS, "tab"],
}
VBASIC_KEEP = {"gr": ["video_id", "author_id"], "ctr": ["video_id", *ctr.VIDEO_BASIC_FEATURES]}
VSTAT_SPEC = ColumnSpec(K.VIDEO_STAT_COLUMNS, K.VIDEO_STAT_DTYPES, ["video_id"], keep=["video_id", *ctr.STAT_FEATURES])
# Feedback flags are used as 0/1 only: clipped and narrowed to Int8 in the spills.
NARROW = {f: pl.Int8 for f in K.ACTION_FLAGS}


def _input_units(found: K.Discovered, cfg: IngestConfig) -> List[Tuple[str, int, str]]:
    """(kind, file index, path) of every file this task reads; file index is global and stable."""
    units = []
    idx = 0
    kinds = ["log_standard", "log_random", "video_features_basic"]
    if cfg.task == "ctr":
        kinds += ["video_features_statistic", "user_features"]
    for kind in kinds:
        for path in found.paths(kind):
            units.append((kind, idx, path))
            idx += 1
    return units


def _spec_for(kind: str, task: str) -> ColumnSpec:
    if kind.startswith("log_"):
        return ColumnSpec(K.LOG_COLUMNS, K.LOG_DTYPES, ["user_id", "video_id", "time_ms"], keep=LOG_KEEP[task])
    if kind == "video_features_basic":
        return ColumnSpec(K.VIDEO_BASIC_COLUMNS, K.VIDEO_BASIC_DTYPES, ["video_id"], quoted_last=True,
                          keep=VBASIC_KEEP[task])
    if kind == "video_features_statistic":
        return VSTAT_SPEC
    if kind == "user_features":
        return ctr.USER_SPEC
    raise KeyError(kind)


def _fingerprint_file(path: str) -> Dict[str, Any]:
    """Name, size and sha256 of the first and last MiB: cheap, and catches replaced or appended files."""
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read(1 << 20))
    return {"name": os.path.basename(path), "bytes": size, "head_tail_sha256": h.hexdigest()}


# ----------------------------------------------------------------------------------------------------------------
# unit functions (top level: they run in worker processes)

def _unit_parse(args: Tuple[str, str, str, int, str, int, int, int, int, int]) -> Dict[str, Any]:
    work, task, kind, file_idx, path, chunk_idx, start, end, num_parts = args
    # Rows are numbered by a chunk-relative key (chunk index in the high bits, line within the chunk below), so
    # chunks parse independently; keys sort like file lines, and rejects get absolute line numbers at the end.
    first_line = (chunk_idx << LINE_KEY_BITS) + 1
    out = os.path.join(work, "s1", f"{kind}-{file_idx:03d}-{chunk_idx:05d}.arrow")
    if os.path.exists(out):
        with open(out + ".stats.json") as f:
            return json.load(f)
    _crash_point("parse", file_idx)  # parse:F dies when a chunk of input file F starts
    data = read_chunk_bytes(Chunk(path, chunk_idx, start, end, first_line))
    df, rejects = parse_chunk(data, _spec_for(kind, task), path=path, first_line=first_line)
    n_lines = len(df) + len(rejects)  # parse_chunk returns every line of the chunk as a row or as a reject
    df = df.with_columns(
        pl.lit(file_idx, dtype=pl.Int16).alias("src"),
        *[pl.col(c).clip(0, 1).cast(t) for c, t in NARROW.items() if c in df.columns and kind.startswith("log_")],
    )
    stats: Dict[str, Any] = {"rows": len(df) + len(rejects), "good": len(df), "rejected": len(rejects), "max": {},
                             "lines": n_lines}
    for c in ("user_id", "video_id", "author_id", "music_id", "date"):
        if c in df.columns and len(df):
            v = df[c].max()
            stats["max"][c] = int(v) if v is not None else -1
    if kind == "video_features_basic" and "tag" in df.columns and len(df):
        tags = df["tag"].str.split(",").explode().str.to_integer(strict=False).max()
        stats["max"]["tag"] = int(tags) if tags is not None else -1
    with open(out + ".rejects.jsonl.tmp", "w") as f:
        for r in rejects:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")
    os.replace(out + ".rejects.jsonl.tmp", out + ".rejects.jsonl")
    with open(out + ".stats.json.tmp", "w") as f:
        json.dump(stats, f)
    os.replace(out + ".stats.json.tmp", out + ".stats.json")
    if kind == "user_features" or (task == "gr" and kind.startswith("log_")):
        # GR logs go straight to their user partition: their one video feature (the author) is looked up from a
        # dense table at the samples stage, so they need no join by video
        df = df.with_columns((pl.col("user_id") % num_parts).alias("_part"))
    else:
        df = df.with_columns((pl.col("video_id") % num_parts).alias("_part"))
    write_partitioned(out, df, "_part", num_parts)
    return stats


def _unit_join(args: Tuple[str, str, int, int]) -> Dict[str, Any]:
    work, task, p, num_parts = args
    out = os.path.join(work, "s2", f"joined-{p:05d}.arrow")
    if os.path.exists(out):
        with open(out + ".stats.json") as f:
            return json.load(f)
    s1 = os.path.join(work, "s1")
    logs = read_partition(sorted(glob.glob(os.path.join(s1, "log_*.arrow"))), p)
    videos = read_partition(sorted(glob.glob(os.path.join(s1, "video_features_basic-*.arrow"))), p)
    dup = 0
    if len(videos):
        n0 = len(videos)
        videos = videos.sort(["video_id", "src", "line"]).unique(subset="video_id", keep="first", maintain_order=True)
        dup = n0 - len(videos)
    vcols = ["video_id", "author_id"] if task == "gr" else ["video_id", *ctr.VIDEO_BASIC_FEATURES]
    if len(videos) == 0:
        videos = pl.DataFrame(schema={c: K.VIDEO_BASIC_DTYPES[c] for c in vcols})
    joined = logs.join(videos.select(vcols), on="video_id", how="left", maintain_order="left")
    missing = int(joined["author_id"].null_count()) if len(joined) else 0
    if task == "ctr":
        stats_df = read_partition(sorted(glob.glob(os.path.join(s1, "video_features_statistic-*.arrow"))), p)
        if len(stats_df):
            stats_df = stats_df.sort(["video_id", "src", "line"]).unique(
                subset="video_id", keep="first", maintain_order=True
            )
        else:
            stats_df = pl.DataFrame(schema={c: K.VIDEO_STAT_DTYPES[c] for c in ["video_id", *ctr.STAT_FEATURES]})
        joined = joined.join(
            stats_df.select(["video_id", *ctr.STAT_FEATURES]), on="video_id", how="left", maintain_order="left"
        )
    joined = joined.with_columns((pl.col("user_id") % num_parts).alias("_part"))
    write_partitioned(out, joined, "_part", num_parts)
    stats = {"rows": len(joined), "missing_video_features": missing, "duplicate_video_rows": dup}
    with open(out + ".stats.json.tmp", "w") as f:
        json.dump(stats, f)
    os.replace(out + ".stats.json.tmp", out + ".stats.json")
    return stats


AUTHORS = "authors.npy"


def _authors_table(work: str, n_videos: int, max_author: int) -> str:
    """Create (once) the dense video -> author table the GR authors units fill: ``author_id + 1`` per video id, 0
    where the video has no features row. A sparse file of zeros: untouched pages cost no disk and no memory."""
    path = os.path.join(work, "s2", AUTHORS)
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        dtype = np.int32 if max_author + 1 < np.iinfo(np.int32).max else np.int64
        tmp = path + ".tmp.npy"
        np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(max(n_videos, 1),)).flush()
        os.replace(tmp, path)
    return path


def _unit_authors(args: Tuple[str, int]) -> Dict[str, Any]:
    """GR: the authors of the videos of partition ``p`` into the dense table. Units write disjoint entries
    (video_id % P == p) and rewriting one gives the same values, so an interrupted unit is simply redone."""
    work, p = args
    done = os.path.join(work, "s2", f"authors-{p:05d}.stats.json")
    if os.path.exists(done):
        with open(done) as f:
            return json.load(f)
    videos = read_partition(sorted(glob.glob(os.path.join(work, "s1", "video_features_basic-*.arrow"))), p)
    dup = 0
    if len(videos):
        n0 = len(videos)
        # the first row of a video (file order) wins, as in the CTR join
        videos = videos.sort(["video_id", "src", "line"]).unique(subset="video_id", keep="first", maintain_order=True)
        dup = n0 - len(videos)
        table = np.load(os.path.join(work, "s2", AUTHORS), mmap_mode="r+")
        vid = videos["video_id"].to_numpy()
        author = videos["author_id"].fill_null(-1).to_numpy()
        table[vid] = (author + 1).astype(table.dtype)
        table.flush()
        del table
    stats = {"rows": len(videos), "duplicate_video_rows": dup, "missing_video_features": 0}
    with open(done + ".tmp", "w") as f:
        json.dump(stats, f)
    os.replace(done + ".tmp", done)
    return stats


def _gr_rows_with_authors(work: str, q: int) -> Tuple[pl.DataFrame, int]:
    """The log rows of user partition ``q`` with ``author_id`` from the dense table (-1 where the video has no
    features row), and how many rows had none."""
    rows = read_partition(sorted(glob.glob(os.path.join(work, "s1", "log_*.arrow"))), q)
    table = np.load(os.path.join(work, "s2", AUTHORS), mmap_mode="r")
    vid = rows["video_id"].to_numpy() if len(rows) else np.zeros(0, np.int64)
    ok = (vid >= 0) & (vid < len(table))
    author = np.full(len(vid), -1, np.int64)
    author[ok] = table[vid[ok]].astype(np.int64) - 1
    return rows.with_columns(pl.Series("author_id", author)), int(np.count_nonzero(author < 0))


def _unit_samples(args: Tuple[str, str, int, Dict[str, Any]]) -> Dict[str, Any]:
    work, task, q, opts = args
    # One directory of .npy files per partition (renamed into place when whole), so the shard stage memory-maps
    # the arrays and reads only the rows it gathers instead of loading the whole partition for every shard.
    out = os.path.join(work, "s3", f"samples-{q:05d}")
    if os.path.exists(out):
        with open(os.path.join(out, "stats.json")) as f:
            return json.load(f)
    if task == "gr":
        rows, missing = _gr_rows_with_authors(work, q)
        arrays, stats = gr.build_partition(rows, opts["max_seq_len"])
        stats["missing_video_features"] = missing
    else:
        rows = read_partition(sorted(glob.glob(os.path.join(work, "s2", "joined-*.arrow"))), q)
        users = read_partition(sorted(glob.glob(os.path.join(work, "s1", "user_features-*.arrow"))), q)
        arrays, stats = ctr.build_partition(rows, users, opts)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name, arr in arrays.items():
        np.save(os.path.join(tmp, f"{name}.npy"), arr, allow_pickle=False)
    with open(os.path.join(tmp, "stats.json"), "w") as f:
        json.dump(stats, f)
    os.replace(tmp, out)
    return stats


class _PartitionCache:
    """Memory-maps per-partition sample arrays on demand, keeping the most recent few open (bounded memory: only
    the pages of gathered rows are touched)."""

    def __init__(self, work: str, keep: int = 3):
        self.work = work
        self.keep = keep
        self.items: Dict[int, Dict[str, np.ndarray]] = {}

    def get(self, q: int) -> Dict[str, np.ndarray]:
        if q not in self.items:
            if len(self.items) >= self.keep:
                self.items.pop(next(iter(self.items)))
            d = os.path.join(self.work, "s3", f"samples-{q:05d}")
            self.items[q] = {f[:-4]: np.load(os.path.join(d, f), mmap_mode="r", allow_pickle=False)
                             for f in sorted(os.listdir(d)) if f.endswith(".npy")}
        return self.items[q]


def _batch_order(counts: Sequence[int], seed: int, split: str) -> Tuple[np.ndarray, np.ndarray]:
    """Global sample order of a split: partitions in order, each shuffled by a generator keyed by
    (seed, split, partition). Returns (partition id, index within partition) per sample."""
    parts, idxs = [], []
    split_key = {"train": 0, "eval": 1}[split]
    for q, n in enumerate(counts):
        rng = np.random.default_rng([seed, split_key, q])
        parts.append(np.full(n, q, np.int32))
        idxs.append(rng.permutation(n))
    if not parts:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    return np.concatenate(parts), np.concatenate(idxs).astype(np.int64)


def cluster_fields(batch: Dict[str, Any], tables: Sequence[str], cluster_tables: Sequence[str], n: int,
                   method: str, seed: int) -> Dict[str, Any]:
    """Add the micro-batch partition and per-table unique keys to a batch."""
    from nestpipe import clustering  # here, not at import: parse and join workers never load scipy

    offs = [S.table_offsets(batch, t) for t in cluster_tables]
    if len(cluster_tables) == 1:
        values, offsets = batch[f"{cluster_tables[0]}.values"], offs[0]
    else:
        # Several tables: one combined id space, per-sample concatenation of every table's keys.
        b = len(offs[0]) - 1
        lens = np.zeros(b, np.int64)
        for tid, (t, off) in enumerate(zip(cluster_tables, offs)):
            lens += np.diff(off)
        offsets = np.zeros(b + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        values = np.empty(offsets[-1], np.int64)
        cursor = offsets[:-1].copy()
        for tid, (t, off) in enumerate(zip(cluster_tables, offs)):
            v = clustering.combine_keys(tid, batch[f"{t}.values"])
            ln = np.diff(off)
            dst = np.repeat(cursor - off[:-1], ln) + np.arange(off[-1])
            values[dst] = v
            cursor += ln
    mb = clustering.assign(values, offsets, n, method=method, seed=seed).astype(np.int32)
    batch["mb"] = mb
    results = clustering.unique_keys_packed(
        [(batch[f"{t}.values"], S.table_offsets(batch, t)) for t in tables], mb, num_micro_batches=n)
    for t, (uniq, inverse, mb_unique, mb_offsets) in zip(tables, results):
        batch[f"{t}.unique"] = uniq
        batch[f"{t}.inverse"] = inverse
        batch[f"{t}.mb_unique"] = mb_unique
        batch[f"{t}.mb_offsets"] = mb_offsets
    return batch


def _unit_shard(args: Tuple[str, str, str, int, int, int, Dict[str, Any]]) -> Dict[str, Any]:
    work, out_dir, split, k, first_batch, n_batches, opts = args
    name = f"{split}-{k:06d}.tar"
    path = os.path.join(out_dir, name)
    B = opts["batch_size"]
    if os.path.exists(path):
        digest, size = S.sha256_file(path)
        return {"path": name, "batches": n_batches, "samples": n_batches * B, "sha256": digest, "bytes": size,
                "resumed": True}
    rng = slice(first_batch * B, (first_batch + n_batches) * B)
    # memory-mapped: a shard reads only its own slice of the split's sample order
    parts = np.array(np.load(os.path.join(work, f"order-{split}-parts.npy"), mmap_mode="r")[rng])
    idxs = np.array(np.load(os.path.join(work, f"order-{split}-idxs.npy"), mmap_mode="r")[rng])
    cache = _PartitionCache(work)
    _crash_point("shard", k)
    digest, size = S.write_shard(path, _shard_records(cache, parts, idxs, split, k, first_batch, n_batches, opts))
    return {"path": name, "batches": n_batches, "samples": n_batches * B, "sha256": digest, "bytes": size,
            "resumed": False}


def _runs(cache: "_PartitionCache", bp: np.ndarray, bx: np.ndarray) -> List[Tuple[Dict[str, np.ndarray], np.ndarray]]:
    """(partition arrays, indices) per consecutive run of one partition, in sample order."""
    cut = np.flatnonzero(np.diff(bp)) + 1
    starts = np.concatenate([[0], cut]).astype(np.int64)
    ends = np.concatenate([cut, [len(bp)]]).astype(np.int64)
    return [(cache.get(int(bp[s])), bx[s:e]) for s, e in zip(starts, ends)]


def _batch_seed(opts: Dict[str, Any], split: str, bi: int) -> int:
    return (opts["seed"] * 1_000_003 + bi * 2 + (0 if split == "train" else 1)) % (2**63)


def _shard_records(cache: "_PartitionCache", parts: np.ndarray, idxs: np.ndarray, split: str, k: int,
                   first_batch: int, n_batches: int, opts: Dict[str, Any]):
    """Yield (key, batch) records of one shard, built lazily so only one batch is in memory at a time (CTR: the
    shard's samples are gathered and keyed at once, then cut into records)."""
    if opts["task"] == "ctr":
        yield from _ctr_shard_records(cache, parts, idxs, split, k, first_batch, n_batches, opts)
        return
    B = opts["batch_size"]
    tables = opts["tables"]
    key = "train_start" if split == "train" else "eval_start"
    kend = "train_end" if split == "train" else "eval_end"
    for j in range(n_batches):
        if j == 1:
            _crash_point("shard", k, "mid")
        bi = first_batch + j
        sl = slice(j * B, (j + 1) * B)
        pieces = _runs(cache, parts[sl], idxs[sl])
        batch = gr.assemble([(a, a[key][ix], a[kend][ix]) for a, ix in pieces])
        batch = cluster_fields(batch, tables, ["item"], opts["micro_batches"], opts["clustering"],
                               _batch_seed(opts, split, bi))
        batch["meta"] = {"index": bi, "split": split, "task": "gr", "samples": B,
                         "micro_batches": opts["micro_batches"]}
        # one packed group: values are rebuilt from unique[inverse] by readers (about 40% fewer bytes)
        S.pack_tables(batch, "seq", list(tables))
        batch["mb"] = batch["mb"].astype(np.uint8 if opts["micro_batches"] <= 256 else np.int32)
        for f in S.GR_NARROW_FIELDS:  # readers widen them back to int64
            batch[f] = S.narrow_int(batch[f])
        yield f"{bi:09d}", batch


def _ctr_shard_records(cache: "_PartitionCache", parts: np.ndarray, idxs: np.ndarray, split: str, k: int,
                       first_batch: int, n_batches: int, opts: Dict[str, Any]):
    """CTR records of one shard (format: ``nestpipe.datasets.shards``): single-id tables as packed group
    ``single`` (no lengths: one id per sample and table), the ``tag`` and ``history`` bags as packed group
    ``bags``. Every batch is clustered on its own, exactly as :func:`cluster_fields` would; the unique keys of all
    batches come from one pass per group (:mod:`nestpipe.ingest.shardkeys`)."""
    # the shard units' modules: a worker that only parses or joins never loads the clustering (Numba)
    from nestpipe import clustering
    from nestpipe.ingest.shardkeys import group_keys, load_kernel

    load_kernel()  # Numba now, so the clustering's compiled assignment runs from the first batch (same results)

    B, n, nb = opts["batch_size"], opts["micro_batches"], n_batches
    M = nb * B
    g = ctr.gather(_runs(cache, parts[:M], idxs[:M]), split, opts["history_len"])
    single = g["single"]
    T = single.shape[1]
    col = {t: i for i, t in enumerate(ctr.SINGLE_TABLES)}
    ckeys = np.stack([clustering.combine_keys(tid, single[:, col[t]])
                      for tid, t in enumerate(opts["cluster_tables"])], axis=1)
    c = ckeys.shape[1]
    coffs = np.arange(0, B * c + 1, c, dtype=np.int64)
    mb = np.empty(M, np.int64)
    for j in range(nb):
        sl = slice(j * B, (j + 1) * B)
        mb[sl] = clustering.assign(ckeys[sl].ravel(), coffs, n, method=opts["clustering"],
                                   seed=_batch_seed(opts, split, first_batch + j))
    # single: occurrences in (batch, table, sample) order
    s_vals = single.reshape(nb, B, T).transpose(0, 2, 1).ravel()
    s_batch = np.repeat(np.arange(nb, dtype=np.int64), B * T)
    s_table = np.tile(np.repeat(np.arange(T, dtype=np.int64), B), nb)
    s_mb = np.broadcast_to(mb.reshape(nb, 1, B), (nb, T, B)).ravel()
    sk = group_keys(s_vals, s_batch, s_table, s_mb, nb, T, n)
    del s_vals, s_batch, s_table, s_mb
    # bags: occurrences in (batch, table, value) order. Each table's values are in sample order, so batch b's values
    # of table t are one slice of them: the (batch, table) order interleaves slices (no per-value scatter).
    P = len(ctr.POOLED_TABLES)
    vals, mbs, counts = [], [], []
    for name in ctr.POOLED_TABLES:
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
    bag_lengths = np.stack([g[f"{name}.lengths"] for name in ctr.POOLED_TABLES])  # [P, M]
    mb_dtype = np.uint8 if n <= 256 else np.int32
    for j in range(nb):
        if j == 1:
            _crash_point("shard", k, "mid")
        bi = first_batch + j
        sl = slice(j * B, (j + 1) * B)
        batch: Dict[str, Any] = {"mb": mb[sl].astype(mb_dtype), "dense": g["dense"][sl], "labels": g["labels"][sl]}
        batch["meta"] = {"index": bi, "split": split, "task": "ctr", "samples": B, "micro_batches": n}
        u, cnt, mu, mo = sk.batch(j, T)
        S.pack_group(batch, "single", list(ctr.SINGLE_TABLES), u, cnt, sk.inverse[j * B * T:(j + 1) * B * T],
                     mu, mo, None)
        u, cnt, mu, mo = bk.batch(j, P)
        S.pack_group(batch, "bags", list(ctr.POOLED_TABLES), u, cnt,
                     bk.inverse[bt_start[j * P]:bt_start[(j + 1) * P]], mu, mo, bag_lengths[:, sl])
        yield f"{bi:09d}", batch


# ----------------------------------------------------------------------------------------------------------------
# orchestration

def _prepare_out(cfg: IngestConfig, fingerprint: Dict[str, Any]) -> str:
    """Create or reuse the output directory. Returns "fresh", "resume" or "complete"."""
    out = cfg.out
    work = os.path.join(out, WORK)
    if os.path.isdir(out) and os.listdir(out):
        state_path = os.path.join(work, STATE)
        manifest_path = os.path.join(out, S.MANIFEST_NAME)
        same = False
        complete = False
        if os.path.exists(state_path):
            with open(state_path) as f:
                same = json.load(f).get("fingerprint") == fingerprint
        elif os.path.exists(manifest_path):
            try:
                with open(manifest_path) as f:
                    m = json.load(f)
                same = m.get("stats", {}).get("fingerprint") == fingerprint
                complete = same
            except (OSError, json.JSONDecodeError):
                same = False
        if same and not cfg.force:
            if not complete:
                # a killed run may leave temporary files: they are never part of the output
                for entry in os.listdir(out):
                    if ".tmp" in entry:
                        os.remove(os.path.join(out, entry))
            return "complete" if complete else "resume"
        if not cfg.force:
            raise FileExistsError(
                f"{out}: output directory is not empty and is not a partial run of these inputs and options; "
                "choose another --out or pass --force to replace its contents"
            )
        for entry in os.listdir(out):
            p = os.path.join(out, entry)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
    os.makedirs(out, exist_ok=True)
    for sub in ("s1", "s2", "s3"):
        os.makedirs(os.path.join(work, sub), exist_ok=True)
    tmp = os.path.join(work, STATE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"fingerprint": fingerprint}, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(work, STATE))
    return "fresh"


def _auto_partitions(total_bytes: int, task: str = "gr") -> int:
    # about 128 MB of raw input per partition (64 MB for ctr, whose samples stage holds every feature column of a
    # partition at once: 2.1 GiB per worker at 128 MB), at least 4; a partition is the unit of memory in stages 2-3
    per = (64 << 20) if task == "ctr" else (128 << 20)
    return int(min(4096, max(4, math.ceil(total_bytes / per))))


def _write_rejects(cfg: IngestConfig, work: str, parse_units, s1: List[Dict[str, Any]]) -> Tuple[int, str]:
    """Gather every chunk's rejects into OUT/rejects.csv in input order, with absolute file line numbers."""
    import csv

    path = os.path.join(cfg.out, REJECTS)
    tmp = path + ".tmp"
    n = 0
    next_line: Dict[int, int] = {}
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["file", "line", "reason", "raw"])
        for u, stats in zip(parse_units, s1):
            _, _, kind, fidx, _, cidx, *_ = u
            first = next_line.get(fidx, 2)  # chunks of a file come in order; the header is line 1
            next_line[fidx] = first + stats["lines"]
            rp = os.path.join(work, "s1", f"{kind}-{fidx:03d}-{cidx:05d}.arrow.rejects.jsonl")
            with open(rp) as rf:
                for line in rf:
                    r = json.loads(line)
                    within = r["line"] - (cidx << LINE_KEY_BITS) - 1
                    w.writerow([os.path.basename(r["file"]), first + within, r["reason"], r["raw"]])
                    n += 1
    os.replace(tmp, path)
    return n, REJECTS


def ingest(cfg: IngestConfig, executor: Optional[Executor] = None) -> S.Manifest:
    """Run (or resume) the ingest; returns the manifest written beside the shards. ``executor``: a started
    :class:`~nestpipe.ingest.executor.Executor` of ``cfg.workers`` workers (default: one is started here)."""
    cfg.validate()
    t_start = time.time()
    found = K.discover(cfg.raw, cfg.release)
    inputs = _input_units(found, cfg)
    fps = [_fingerprint_file(p) for _, _, p in inputs]
    total_bytes = sum(f["bytes"] for f in fps)
    num_parts = cfg.partitions or _auto_partitions(total_bytes, cfg.task)
    semantic = cfg.semantic()
    semantic["partitions"] = num_parts
    fingerprint = {"inputs": fps, "options": semantic, "format_version": S.FORMAT_VERSION, "release": found.release}
    status = _prepare_out(cfg, fingerprint)
    if status == "complete":
        print(f"{cfg.out}: already complete for these inputs and options; nothing to do", file=sys.stderr)
        return S.load_manifest(cfg.out)
    work = os.path.join(cfg.out, WORK)
    with contextlib.nullcontext(executor) if executor is not None else Executor(cfg.workers, preload=(__name__,)) as ex:
        return _ingest_stages(cfg, ex, found, inputs, fps, num_parts, semantic, fingerprint, work, t_start)


def _ingest_stages(cfg: IngestConfig, ex: Executor, found, inputs, fps, num_parts: int, semantic, fingerprint,
                   work: str, t_start: float) -> S.Manifest:
    # 1. parse
    parse_units = []
    chunk_bytes = max(1, int(cfg.chunk_mb * (1 << 20)))
    for kind, fidx, path in inputs:
        _, chunks = plan_chunks(path, chunk_bytes)
        for ch in chunks:
            parse_units.append((work, cfg.task, kind, fidx, path, ch.index, ch.start, ch.end, num_parts))
    s1 = ex.run(_unit_parse, parse_units, cfg, "1/4 parse", cost=lambda u: u[7] - u[6])  # chunk bytes
    rows = sum(s["rows"] for s in s1)
    rejected = sum(s["rejected"] for s in s1)
    n_rejects, rejects_file = _write_rejects(cfg, work, parse_units, s1)
    assert n_rejects == rejected
    if rows and rejected / rows > cfg.max_reject_fraction:
        raise IngestError(
            f"{rejected} of {rows} input rows ({rejected / rows:.3%}) were rejected, more than "
            f"--max-reject-fraction {cfg.max_reject_fraction:g}; see {os.path.join(cfg.out, rejects_file)} "
            "(file, line, reason, raw text of each)"
        )
    maxima: Dict[str, int] = {}
    for s in s1:
        for k, v in s["max"].items():
            maxima[k] = max(maxima.get(k, -1), v)

    # 2. join (CTR: logs x video tables per video partition; GR: only the author, into a dense table by video id)
    if cfg.task == "gr":
        _authors_table(work, maxima.get("video_id", -1) + 1, maxima.get("author_id", 0))
        s2 = ex.run(_unit_authors, [(work, p) for p in range(num_parts)], cfg, "2/4 authors")
    else:
        s2 = ex.run(_unit_join, [(work, cfg.task, p, num_parts) for p in range(num_parts)], cfg, "2/4 join")
    # 3. samples
    opts = {"max_seq_len": cfg.max_seq_len, "history_len": cfg.history_len, "ctr_eval_days": cfg.ctr_eval_days,
            "max_date": maxima.get("date", 0)}
    s3 = ex.run(_unit_samples, [(work, cfg.task, q, opts) for q in range(num_parts)], cfg, "3/4 samples",
                    rows_of=lambda s: s.get("tokens", s.get("rows", 0)))

    # 4. shards
    tables = _tables(cfg, maxima)
    B = cfg.batch_size
    sets: Dict[str, List[S.ShardEntry]] = {}
    dropped: Dict[str, int] = {}
    shard_units = []
    for split in ("train", "eval"):
        counts = [s[f"{split}_samples"] for s in s3]
        parts, idxs = _batch_order(counts, cfg.seed, split)
        for name, arr in (("parts", parts), ("idxs", idxs)):
            np.save(os.path.join(work, f"order-{split}-{name}.tmp.npy"), arr, allow_pickle=False)
            os.replace(os.path.join(work, f"order-{split}-{name}.tmp.npy"),
                       os.path.join(work, f"order-{split}-{name}.npy"))
        n_batches = len(parts) // B
        dropped[split] = int(len(parts) - n_batches * B)
        per_shard = cfg.batches_per_shard or _auto_batches_per_shard(cfg, s3)
        for k, first in enumerate(range(0, n_batches, per_shard)):
            shard_units.append((work, cfg.out, split, k, first, min(per_shard, n_batches - first),
                                _shard_opts(cfg, tables)))
    s4 = ex.run(_unit_shard, shard_units, cfg, "4/4 shards", rows_of=lambda s: s["samples"],
                cost=lambda u: u[5])  # batches
    for u, r in zip(shard_units, s4):
        sets.setdefault(u[2], []).append(S.ShardEntry(r["path"], r["batches"], r["samples"], r["sha256"], r["bytes"]))
    for split in ("train", "eval"):
        sets.setdefault(split, [])
    if not sets["train"]:
        raise IngestError(
            f"no complete training batch of {B} samples could be formed ({dropped['train']} samples); "
            "lower --batch-size or provide more data"
        )

    stats = {
        "fingerprint": fingerprint,
        "input_rows": rows,
        "partitions": num_parts,
        "missing_video_features": sum(s.get("missing_video_features", 0) for s in s2 + s3),
        "duplicate_video_rows": sum(s["duplicate_video_rows"] for s in s2),
        "samples": {split: int(sum(s[f"{split}_samples"] for s in s3)) for split in ("train", "eval")},
        "resumed_shards": sum(1 for r in s4 if r.get("resumed")),
        "seconds": round(time.time() - t_start, 3),
        "stage_seconds": dict(ex.stage_seconds),
    }
    for key in ("users", "tokens", "users_too_short"):
        if all(key in s for s in s3):
            stats[key] = int(sum(s[key] for s in s3))
    manifest = S.Manifest(
        task=cfg.task, batch_size=B, micro_batches=cfg.micro_batches, tables=tables, sets=sets,
        max_seq_len=cfg.max_seq_len if cfg.task == "gr" else None,
        dense_features=list(ctr.DENSE_FEATURES) if cfg.task == "ctr" else [],
        labels=list(ctr.LABELS) if cfg.task == "ctr" else [],
        rejected_rows=rejected, rejects_file=rejects_file, dropped_samples=dropped,
        inputs=[{**f, "kind": kind} for f, (kind, _, _) in zip(fps, inputs)],
        options=semantic, stats=stats,
    )
    S.save_manifest(cfg.out, manifest)
    if not cfg.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def _tables(cfg: IngestConfig, maxima: Dict[str, int]) -> Dict[str, S.TableSpec]:
    videos = maxima.get("video_id", 0) + 1
    if cfg.task == "gr":
        return {
            "item": S.TableSpec(vocab=videos, dim=cfg.dim, kind="sequence"),
            "author": S.TableSpec(vocab=maxima.get("author_id", 0) + 1, dim=cfg.dim, kind="sequence"),
            "action": S.TableSpec(vocab=1 << len(K.ACTION_FLAGS), dim=cfg.dim, kind="sequence"),
        }
    return ctr.tables(cfg, maxima)


def _shard_opts(cfg: IngestConfig, tables: Dict[str, S.TableSpec]) -> Dict[str, Any]:
    return {
        "task": cfg.task, "batch_size": cfg.batch_size, "micro_batches": cfg.micro_batches, "seed": cfg.seed,
        "clustering": cfg.clustering, "tables": list(tables), "history_len": cfg.history_len,
        "cluster_tables": ctr.CLUSTER_TABLES if cfg.task == "ctr" else ["item"],
    }


def _auto_batches_per_shard(cfg: IngestConfig, s3: List[Dict[str, Any]]) -> int:
    if cfg.task == "gr":
        tokens = sum(s["tokens"] for s in s3)
        samples = max(1, sum(s["train_samples"] for s in s3))
        per_sample = min(cfg.max_seq_len, max(1.0, tokens / samples)) * 6 * 8 * 2
    else:
        per_sample = (len(ctr.DENSE_FEATURES) + len(ctr.LABELS)) * 4 + (cfg.history_len + 30) * 8 * 2
    per_batch = per_sample * cfg.batch_size
    return int(max(1, min(256, (128 << 20) // max(1, int(per_batch)))))
