"""The ingest: raw KuaiRand-format logs -> clustered WebDataset batch shards + manifest, with bounded memory.

Stages (each unit of work commits its files with a marker written after them, in the working directory, a path or
an fsspec URL: ``nestpipe.ingest.workdir``; an interrupted run redoes only the units without their marker):

1. parse    every input file in fixed-size byte chunks (Polars native CSV, validating fallback); bad rows go to
            the rejects; good rows are spilled to Arrow IPC files hash-partitioned by video id (one row group each).
2. join     per video partition: the logs meet the video tables (deduplicated by video id), then are spilled
            again, hash-partitioned by user id.
3. samples  per user partition: a total sort by (user, time, video, source, line), then samples (GR windows or
            CTR rows with their recent history), kept as flat numpy arrays; then what the task derives over every
            partition (``IngestTask.derive``; CTR: the pair counts, one unit per key bucket, then per partition).
4. shards   the samples of each split, in a seeded order, cut into batches of exactly B; each batch is partitioned
            into N micro-batches by key-centric clustering and carries its unique keys per table; S batches per
            WebDataset shard.

Memory is bounded by the chunk size and by one partition at a time (the number of partitions grows with the
input), never by the whole input. The output depends only on the inputs and the semantic options, not on
``--workers``.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import io
import json
import math
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import polars as pl

from nestpipe.datasets import kuairand, shards
from nestpipe.ingest import formats
from nestpipe.ingest.formats.convert import CONVERSION_VERSION, REJECTS as CONVERSION_REJECTS, convert
from nestpipe.datasets.synth import TRUTH_FILE
from nestpipe.ingest.balance import balanced_order
from nestpipe.ingest.common import WORK, IngestTask, PartitionCache, crash_point, runs, samples_dir
from nestpipe.ingest.config import IngestConfig
from nestpipe.ingest.ctr import CTRTask
from nestpipe.ingest.engines import make_executor
from nestpipe.ingest.executor import Executor
from nestpipe.ingest.gr import GRTask
from nestpipe.ingest.parse import (Chunk, ColumnSpec, parse_chunk, parse_parquet_chunk, plan_chunks,
                                   plan_parquet_chunks, read_chunk_bytes)
from nestpipe.ingest.spill import write_partitioned
from nestpipe.ingest.workdir import WorkDir, open_work, release_cache, save_array
from nestpipe.utils import storage
from nestpipe.utils.jsonio import read_json, write_json_atomic

LINE_KEY_BITS = 40  # at most 2**40 lines per chunk
STATE = "state.json"
REJECTS = "rejects.csv"
UPLOADED = ".uploaded.json"  # s4/NAME.uploaded.json: a URL --out's shard NAME, uploaded whole (its digest and size)


class IngestError(RuntimeError):
    """The ingest cannot go on (too many rejects, a foreign output directory, ...)."""


# ----------------------------------------------------------------------------------------------------------------
# input specs

# The tasks by ``--task`` name (their names are listed in ``config.TASKS`` too, for the command line).
TASKS: Dict[str, IngestTask] = {task.name: task for task in (GRTask(), CTRTask())}
# Feedback flags are used as 0/1 only: clipped and narrowed to Int8 in the spills.
NARROW = {f: pl.Int8 for f in kuairand.ACTION_FLAGS}


def _input_units(found: kuairand.Discovered, cfg: IngestConfig) -> List[Tuple[str, int, str]]:
    """(kind, file index, path) of every file this task reads; file index is global and stable."""
    units = []
    idx = 0
    for kind in TASKS[cfg.task].input_kinds:
        for path in found.paths(kind):
            units.append((kind, idx, path))
            idx += 1
    return units


def _spec_for(kind: str, task: str) -> ColumnSpec:
    """The columns file kind ``kind`` is validated against and those the task keeps (every column is still
    validated: a malformed cell in a column the task does not use still makes the row malformed)."""
    t = TASKS[task]
    if kind.startswith("log_"):
        return ColumnSpec(kuairand.LOG_COLUMNS, kuairand.LOG_DTYPES, ["user_id", "video_id", "time_ms"],
                          keep=t.log_columns)
    if kind == "video_features_basic":
        return ColumnSpec(kuairand.VIDEO_BASIC_COLUMNS, kuairand.VIDEO_BASIC_DTYPES, ["video_id"], quoted_last=True,
                          keep=t.video_basic_columns)
    return t.column_spec(kind)


def _fingerprint_file(path: str) -> Dict[str, Any]:
    """Name, size and sha256 of the first and last MiB: cheap, and catches replaced or appended files."""
    size = storage.size(path)
    h = hashlib.sha256()
    with storage.open_read(path) as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read(1 << 20))
    return {"name": os.path.basename(path.rstrip("/")), "bytes": size, "head_tail_sha256": h.hexdigest()}


# ----------------------------------------------------------------------------------------------------------------
# unit functions (top level: they run in worker processes)

def _unit_parse(args: Tuple[WorkDir, str, str, int, str, int, int, int, int]) -> Dict[str, Any]:
    work, task, kind, file_idx, path, chunk_idx, start, end, num_parts = args
    # Rows are numbered by a chunk-relative key (chunk index in the high bits, line within the chunk below), so
    # chunks parse independently; keys sort like file lines, and rejects get absolute line numbers at the end.
    first_line = (chunk_idx << LINE_KEY_BITS) + 1
    rel = _spill_name(kind, file_idx, chunk_idx)
    marker = rel + ".stats.json"
    done = work.done(marker)
    if done is not None:
        return done
    crash_point("parse", file_idx)  # parse:F dies when a chunk of input file F starts
    if kuairand.is_parquet(path):  # start/end: row groups
        df, rejects = parse_parquet_chunk(Chunk(path, chunk_idx, start, end, first_line), _spec_for(kind, task),
                                          first_line=first_line)
    else:
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
    if TASKS[task].partition_by_user(kind):
        df = df.with_columns((pl.col("user_id") % num_parts).alias("_part"))
    else:
        df = df.with_columns((pl.col("video_id") % num_parts).alias("_part"))
    with work.output(marker) as out:
        spill = out.path(rel)
        with open(spill + ".rejects.jsonl.tmp", "w") as f:
            for r in rejects:
                f.write(json.dumps(dataclasses.asdict(r)) + "\n")
        os.replace(spill + ".rejects.jsonl.tmp", spill + ".rejects.jsonl")
        write_partitioned(spill, df, "_part", num_parts)
        return out.commit(stats)


def _spill_name(kind: str, file_idx: int, chunk_idx: int) -> str:
    """The stage-1 spill of one parse unit (beside it: its index ``.json``, ``.rejects.jsonl`` and marker
    ``.stats.json``)."""
    return f"s1/{kind}-{file_idx:03d}-{chunk_idx:05d}.arrow"


def _unit_samples(args: Tuple[WorkDir, str, int, Dict[str, Any]]) -> Dict[str, Any]:
    work, task, q, opts = args
    # One directory of .npy files per partition, so the shard stage memory-maps the arrays and reads only the rows
    # it gathers instead of loading the whole partition for every shard; the marker stats.json is written last.
    sub = samples_dir(q)
    done = work.done(f"{sub}/stats.json")
    if done is not None:
        return done
    arrays, stats = TASKS[task].samples(work, q, opts)
    with work.output(f"{sub}/stats.json") as out:
        for name, arr in arrays.items():
            save_array(out.path(f"{sub}/{name}.npy"), arr)
        return out.commit(stats)


def _batch_order(counts: Sequence[int], seed: int, split: str) -> Tuple[np.ndarray, np.ndarray]:
    """Global sample order of a split: partitions in order, each shuffled by a generator keyed by
    (seed, split, partition). Returns (partition id, index within partition) per sample."""
    parts, idxs = [], []
    split_key = {"train": 0, "eval": 1, "valid": 2}[split]
    for q, n in enumerate(counts):
        rng = np.random.default_rng([seed, split_key, q])
        parts.append(np.full(n, q, np.int32))
        idxs.append(rng.permutation(n))
    if not parts:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    return np.concatenate(parts), np.concatenate(idxs).astype(np.int64)


def _sample_lengths(work: WorkDir, split: str, parts: np.ndarray, idxs: np.ndarray) -> np.ndarray:
    """The token count of every sample of a split's order (gr windows: end - start), read partition by partition
    from the memory-mapped stage-3 arrays."""
    cache = PartitionCache(work, keep=1)
    out = np.empty(len(parts), dtype=np.int64)
    at = 0
    for arrays, ix in runs(cache, parts, idxs):
        out[at:at + len(ix)] = arrays[f"{split}_end"][ix] - arrays[f"{split}_start"][ix]
        at += len(ix)
    return out


def _unit_shard(args: Tuple[WorkDir, Optional[str], str, int, int, int, Dict[str, Any]]) -> Dict[str, Any]:
    """One shard, written whole into ``out_dir`` (the output, or the staging directory of a URL ``--out``; None: a
    scratch directory of this unit, for a working directory on object storage). For a URL ``--out`` it is then
    uploaded whole and its marker ``s4/NAME.uploaded.json`` (sha256, bytes) written in the working directory; a
    marked shard whose object has that size is not rebuilt."""
    work, out_dir, split, k, first_batch, n_batches, opts = args
    name = f"{split}-{k:06d}.tar"
    B = opts["batch_size"]
    entry = {"path": name, "batches": n_batches, "samples": n_batches * B}
    upload = opts.get("upload_to")  # a URL --out: the shard is staged, uploaded whole, then removed
    marker = f"s4/{name}{UPLOADED}"
    if upload:
        done = work.done(marker)
        url = storage.join(upload, name)
        if done is not None and storage.exists(url) and storage.size(url) == done["bytes"]:
            return {**entry, "sha256": done["sha256"], "bytes": done["bytes"], "resumed": True}
    with contextlib.ExitStack() as stack:
        if out_dir is None:
            out_dir = stack.enter_context(work.scratch())
        path = os.path.join(out_dir, name)
        if os.path.exists(path):  # written whole by an earlier run (write_shard renames into place)
            digest, size = shards.sha256_file(path)
            resumed = True
        else:
            start = opts.get("first_sample", first_batch * B)  # a tail unit's batch is smaller than the split's B
            # a shard reads only its own slice of the split's sample order
            parts = work.array_slice(f"order-{split}-parts.npy", start, start + n_batches * B)
            idxs = work.array_slice(f"order-{split}-idxs.npy", start, start + n_batches * B)
            cache = PartitionCache(work)
            crash_point("shard", k)
            records = TASKS[opts["task"]].shard_records(cache, parts, idxs, split, k, first_batch, n_batches, opts)
            digest, size = shards.write_shard(path, records)
            resumed = False
        if upload:
            with work.output(marker) as out:
                storage.put_file(path, url)
                out.commit({"sha256": digest, "bytes": size})
            os.remove(path)
    return {**entry, "sha256": digest, "bytes": size, "resumed": resumed}


# ----------------------------------------------------------------------------------------------------------------
# orchestration

def _prepare_out(cfg: IngestConfig, fingerprint: Dict[str, Any]) -> str:
    """Create or reuse the output directory. Returns "fresh", "resume" or "complete"."""
    out = cfg.out
    work = os.path.join(out, WORK)
    if os.path.isdir(out) and os.listdir(out):
        state_path = os.path.join(work, STATE)
        manifest_path = os.path.join(out, shards.MANIFEST_NAME)
        same = False
        complete = False
        if os.path.exists(state_path):
            same = read_json(state_path, "ingest state").get("fingerprint") == fingerprint
        elif os.path.exists(manifest_path):
            try:
                m = read_json(manifest_path, "manifest")
                same = m.get("stats", {}).get("fingerprint") == fingerprint
                complete = same
            except (OSError, ValueError):
                same = False
        if same and not cfg.force:
            if not complete:
                # a killed run may leave temporary files: they are never part of the output
                for entry in os.listdir(out):
                    if ".tmp" in entry:
                        os.remove(os.path.join(out, entry))
            return "complete" if complete else "resume"
        if not cfg.force:
            held = ("an unfinished ingest of other inputs or options" if os.path.exists(state_path) else
                    "the output of an ingest with other inputs or options (or of another NestPipe version whose "
                    "samples differ)" if os.path.exists(manifest_path) else
                    "files of something else")
            raise FileExistsError(
                f"{out}: output directory holds {held}; choose another --out or pass --force to replace its "
                "contents"
            )
        for entry in os.listdir(out):
            p = os.path.join(out, entry)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
    os.makedirs(out, exist_ok=True)
    for sub in ("s1", "s2", "s3"):
        os.makedirs(os.path.join(work, sub), exist_ok=True)
    write_json_atomic(os.path.join(work, STATE), {"fingerprint": fingerprint})
    return "fresh"


def _auto_partitions(total_bytes: int, task: IngestTask) -> int:
    # the task's bytes of raw input per partition, at least 4; a partition is the unit of memory in stages 2-3
    return int(min(4096, max(4, math.ceil(total_bytes / task.partition_bytes))))


def _write_rejects(cfg: IngestConfig, work: WorkDir, parse_units, s1: List[Dict[str, Any]], found_root: str,
                   conversion: Optional[Dict[str, Any]] = None) -> Tuple[int, str]:
    """Gather every chunk's rejects into OUT/rejects.csv in input order, with absolute file line numbers; a converted
    public dataset's rejects (named by its own files and lines) come first."""
    path = os.path.join(cfg.out, REJECTS)
    tmp = path + ".tmp"
    n = 0
    next_line: Dict[int, int] = {}
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["file", "line", "reason", "raw"])
        if conversion is not None:
            with open(os.path.join(conversion["dir"], CONVERSION_REJECTS)) as rf:
                for line in rf:
                    r = json.loads(line)
                    w.writerow([r["file"], r["line"], r["reason"], r["raw"]])
                    n += 1
        for u, stats in zip(parse_units, s1):
            _, _, kind, fidx, fpath, cidx, *_ = u
            # chunks of a file come in order; a CSV header is line 1, a Parquet file's rows are numbered from 1
            first = next_line.get(fidx, 1 if kuairand.is_parquet(fpath) else 2)
            next_line[fidx] = first + stats["lines"]
            with io.TextIOWrapper(work.open(_spill_name(kind, fidx, cidx) + ".rejects.jsonl"), "utf-8") as rf:
                for line in rf:
                    r = json.loads(line)
                    within = r["line"] - (cidx << LINE_KEY_BITS) - 1
                    # the file as named under --raw (a Parquet table may be a directory of files)
                    w.writerow([storage.relative(r["file"], found_root), first + within, r["reason"], r["raw"]])
                    n += 1
    os.replace(tmp, path)
    return n, REJECTS


def ingest(cfg: IngestConfig, executor: Optional[Executor] = None) -> shards.Manifest:
    """Run (or resume) the ingest; returns the manifest written beside the shards. ``executor``: a started
    :class:`~nestpipe.ingest.executor.Executor` of ``cfg.workers`` workers (default: one is started here).

    Where things are written: a local ``--out`` holds the shards and its working directory ``OUT/_work``. A URL
    ``--out`` gets the shards, uploaded whole as they complete, then ``rejects.csv`` and the manifest, uploaded last
    (the commit point); its working directory is ``WORK_DIR/_work`` (:func:`staging_dir`), a path or a URL
    (``nestpipe.ingest.workdir``: on a URL every unit's files are uploaded before its marker, and shards are staged
    in the scratch directory of their unit). The driver's own files (``rejects.csv``, the manifest) are written in
    the staging directory, or in a scratch directory of its own when that is a URL."""
    cfg.validate()
    for url in (cfg.out, cfg.work_dir):
        if url and storage.is_url(url):
            storage.probe(url)  # an unusable or unreachable URL fails now, before any work, naming it
    t_start = time.time()
    source = formats.detect(cfg.raw, cfg.format)  # None: KuaiRand tables, read as they are
    if source is None:
        found = kuairand.discover(cfg.raw, cfg.release)
        inputs = _input_units(found, cfg)
        fps = [_fingerprint_file(p) for _, _, p in inputs]
        input_records = [{**f, "kind": kind} for f, (kind, _, _) in zip(fps, inputs)]
        release = found.release
    else:
        if cfg.release:
            raise formats.FormatError(f"--release chooses among KuaiRand releases; {cfg.raw} holds {source.format} "
                                      f"data ({source.variant})")
        fps = input_records = [{**_fingerprint_file(p), "kind": role} for role, p in source.files()]
        release = f"{source.format}:{source.variant}"
    total_bytes = sum(f["bytes"] for f in fps)
    num_parts = cfg.partitions or _auto_partitions(total_bytes, TASKS[cfg.task])
    semantic = cfg.semantic()
    semantic["partitions"] = num_parts
    fingerprint = {"inputs": fps, "options": semantic, "format_version": shards.FORMAT_VERSION,
                   "task_version": TASKS[cfg.task].version, "release": release}
    if source is not None:  # the conversion's own settings (KuaiRand fingerprints stay as they were)
        fingerprint["source"] = {"format": source.format, "variant": source.variant,
                                 "positive_rating": cfg.positive_rating, "version": CONVERSION_VERSION}
    run = uuid.uuid4().hex  # names this run's caches of a URL working directory in every process
    remote = cfg.out if storage.is_url(cfg.out) else None
    staging = None
    driver_dir = None
    if remote:
        done = _prepare_remote(cfg, fingerprint)
        if done is not None:
            print(f"{cfg.out}: already complete for these inputs and options; nothing to do", file=sys.stderr)
            return done
        staging = staging_dir(cfg)
    if staging is not None and storage.is_url(staging) and source is not None:
        raise formats.FormatError(f"{source.format} data is converted into a local working directory first: give "
                                  f"--work-dir a path (a URL --out is fine), not {staging}")
    if staging is not None and storage.is_url(staging):
        _prepare_url_work(staging, fingerprint)
        work = open_work(storage.join(staging, WORK), run)
        # the driver's files before their upload; every shard is staged in its own unit's scratch directory
        driver_dir = tempfile.mkdtemp(prefix="nestpipe-ingest-driver-")
        cfg = dataclasses.replace(cfg, out=driver_dir)
        shard_dir = None
    else:
        if staging is not None:
            # everything is written to the staging directory as for a local --out, shards uploaded as they complete
            cfg = dataclasses.replace(cfg, out=staging)
        status = _prepare_out(cfg, fingerprint)
        if status == "complete":
            print(f"{cfg.out}: already complete for these inputs and options; nothing to do", file=sys.stderr)
            return shards.load_manifest(cfg.out)
        work = open_work(os.path.join(cfg.out, WORK), run)
        shard_dir = cfg.out
    conversion = None
    if source is not None:  # into the KuaiRand tables the stages read (done once: a resumed run reuses it)
        conv_dir = os.path.join(cfg.out, WORK, "s0")
        conversion = {**convert(source, conv_dir, positive_rating=cfg.positive_rating,
                                chunk_bytes=max(1, int(cfg.chunk_mb * (1 << 20))), progress=cfg.progress),
                      "dir": conv_dir}
        found = kuairand.discover(conv_dir, "pure")
        inputs = _input_units(found, cfg)
    try:
        with contextlib.nullcontext(executor) if executor is not None else make_executor(cfg, (__name__,)) as ex:
            try:
                m = _ingest_stages(cfg, ex, found, inputs, input_records, num_parts, semantic, fingerprint, work,
                                   shard_dir, t_start, remote, conversion)
            finally:
                release_cache()  # units that ran in this process
            ex.on_workers(release_cache)
    finally:
        if driver_dir is not None:
            shutil.rmtree(driver_dir, ignore_errors=True)
    if not cfg.keep_work:
        storage.remove_tree(staging) if staging is not None else work.remove()
    return m


def staging_dir(cfg: IngestConfig) -> str:
    """Where a URL ``--out`` is staged: ``--work-dir`` (a path or a URL), else a directory named after the URL in
    the system's temporary directory (the same for every run with that ``--out``, so an interrupted run
    resumes)."""
    if cfg.work_dir:
        return cfg.work_dir
    return os.path.join(tempfile.gettempdir(), "nestpipe-ingest-" + hashlib.sha256(cfg.out.encode()).hexdigest()[:16])


def _staged_fingerprint(staging: str) -> Optional[Dict[str, Any]]:
    """The fingerprint of the run staged in ``staging`` (a path or a URL), None if none is."""
    work = open_work(storage.join(staging, WORK))
    return work.read_json(STATE, "ingest state").get("fingerprint") if work.exists(STATE) else None


def _prepare_remote(cfg: IngestConfig, fingerprint: Dict[str, Any]) -> Optional[shards.Manifest]:
    """A URL ``--out``: the manifest there if it is this ingest's (complete: nothing to do), else None once the
    destination may be written. Only the manifest commits: shards it does not list (a run killed between uploads)
    are rewritten or ignored, never read."""
    names = storage.listdir(cfg.out)
    if cfg.force:
        storage.remove_tree(cfg.out)
        storage.remove_tree(staging_dir(cfg))
    elif shards.MANIFEST_NAME in names:
        man_url = storage.join(cfg.out, shards.MANIFEST_NAME)
        m = shards.Manifest.from_json(json.loads(storage.read_bytes(man_url)), where=man_url)
        if (m.stats or {}).get("fingerprint") == fingerprint:
            return m
        raise FileExistsError(f"{cfg.out}: holds the output of an ingest with other inputs or options; choose "
                              "another --out or pass --force to replace its contents")
    elif names and _staged_fingerprint(staging_dir(cfg)) != fingerprint:
        raise FileExistsError(f"{cfg.out}: holds files of something else (or of an unfinished ingest staged "
                              f"elsewhere: pass its --work-dir); choose another --out or pass --force")
    storage.makedirs(cfg.out)
    return None


def _prepare_url_work(staging: str, fingerprint: Dict[str, Any]) -> str:
    """A working directory at a URL (``--work-dir``): resume the run of this fingerprint staged there, start a fresh
    one where there is nothing, refuse anything else (``--force`` has removed it already). Returns "fresh" or
    "resume"."""
    if storage.listdir(staging):
        staged = _staged_fingerprint(staging)
        if staged == fingerprint:
            return "resume"
        held = "an unfinished ingest of other inputs or options" if staged is not None else "files of something else"
        raise FileExistsError(f"{staging}: working directory holds {held}; choose another --work-dir or pass "
                              "--force to replace its contents")
    work = open_work(storage.join(staging, WORK))
    try:
        work.write_json(STATE, {"fingerprint": fingerprint})
    except Exception as e:  # the first write there: a missing bucket or a read-only credential shows here
        raise storage.StorageError(f"{work.path(STATE)}: cannot be written ({type(e).__name__}: {e})") from e
    return "fresh"


def _ingest_stages(cfg: IngestConfig, ex: Executor, found, inputs, input_records, num_parts: int, semantic,
                   fingerprint, work: WorkDir, shard_dir: Optional[str], t_start: float,
                   remote: Optional[str] = None, conversion: Optional[Dict[str, Any]] = None) -> shards.Manifest:
    # 1. parse
    s1, rows, rejected, rejects_file = _stage_parse(cfg, ex, found, inputs, num_parts, work, remote, conversion)
    maxima: Dict[str, int] = {}
    for s in s1:
        for k, v in s["max"].items():
            maxima[k] = max(maxima.get(k, -1), v)
    # 2. join (CTR: logs x video tables per video partition; GR: only the author, into a dense table by video id)
    task = TASKS[cfg.task]
    s2 = task.join(ex, cfg, work, maxima, num_parts)
    # 3. samples
    opts = {"max_seq_len": cfg.max_seq_len, "history_len": cfg.history_len, "ctr_eval_days": cfg.ctr_eval_days,
            "validation": cfg.validation, "ctr_valid_days": cfg.ctr_valid_days,
            "max_date": maxima.get("date", 0), "maxima": maxima, "pair_buckets": num_parts}
    s3 = ex.run(_unit_samples, [(work, cfg.task, q, opts) for q in range(num_parts)], cfg, "3/4 samples",
                rows_of=lambda s: s.get("tokens", s.get("rows", 0)))
    derived = task.derive(ex, cfg, work, num_parts)  # features over every partition (CTR: pair counts)
    # 4. shards
    tables = task.tables(cfg, maxima)
    B, N, why = cfg.fit_batches(int(sum(s["train_samples"] for s in s3)))
    cfg = dataclasses.replace(cfg, batch_size=B, micro_batches=N)
    if why:
        print(f"nestpipe ingest: {cfg.raw}: {why}", file=sys.stderr)
    sets, dropped, s4 = _stage_shards(cfg, ex, s3, tables, work, shard_dir, remote)
    stats = {
        "fingerprint": fingerprint,
        "input_rows": rows,
        "partitions": num_parts,
        "missing_video_features": sum(s.get("missing_video_features", 0) for s in s2 + s3),
        "duplicate_video_rows": sum(s["duplicate_video_rows"] for s in s2),
        "samples": {split: int(sum(s[f"{split}_samples"] for s in s3)) for split in cfg.splits()},
        **derived,
        "resumed_shards": sum(1 for r in s4 if r.get("resumed")),
        "seconds": round(time.time() - t_start, 3),
        "stage_seconds": dict(ex.stage_seconds),
    }
    if conversion is not None:
        stats["source"] = {k: v for k, v in conversion.items() if k not in ("dir", "version")}
    if why:
        stats["sized_to_data"] = why
    for key in ("users", "tokens", "users_too_short"):
        if all(key in s for s in s3):
            stats[key] = int(sum(s[key] for s in s3))
    manifest = shards.Manifest(
        task=cfg.task, batch_size=B, micro_batches=cfg.micro_batches, tables=tables, sets=sets,
        **task.manifest_fields(cfg),
        rejected_rows=rejected, rejects_file=rejects_file, dropped_samples=dropped,
        inputs=input_records,
        options=semantic, stats=stats,
    )
    _commit(cfg, manifest, rejects_file, remote)
    return manifest


def _stage_parse(cfg: IngestConfig, ex: Executor, found, inputs, num_parts: int, work: WorkDir,
                 remote: Optional[str], conversion: Optional[Dict[str, Any]]):
    """Stage 1: every input chunk parsed into the partitions' spills, the rejected rows written to the rejects file;
    too many rejects stop the ingest (naming the file). Returns (per-unit results, rows, rejected, rejects file)."""
    parse_units = []
    chunk_bytes = max(1, int(cfg.chunk_mb * (1 << 20)))
    for kind, fidx, path in inputs:
        parquet = kuairand.is_parquet(path)
        chunks = plan_parquet_chunks(path, chunk_bytes) if parquet else plan_chunks(path, chunk_bytes)[1]
        for ch in chunks:
            parse_units.append((work, cfg.task, kind, fidx, path, ch.index, ch.start, ch.end, num_parts))
    s1 = ex.run(_unit_parse, parse_units, cfg, "1/4 parse", cost=lambda u: u[7] - u[6])  # chunk bytes
    rows = sum(s["rows"] for s in s1)
    rejected = sum(s["rejected"] for s in s1)
    if conversion is not None:  # the lines of the public dataset's files that gave no row of the converted tables
        lost = conversion["rejected"] + conversion["side_rejected"]
        rows, rejected = rows + lost, rejected + lost
    n_rejects, rejects_file = _write_rejects(cfg, work, parse_units, s1, found.root, conversion)
    assert n_rejects == rejected
    if rows and rejected / rows > cfg.max_reject_fraction:
        where = os.path.join(cfg.out, rejects_file)
        if remote:  # beside the output, where the driver's own directory may be gone after the run
            storage.put_file(where, storage.join(remote, rejects_file))
            where = storage.join(remote, rejects_file)
        raise IngestError(
            f"{rejected} of {rows} input rows ({rejected / rows:.3%}) were rejected, more than "
            f"--max-reject-fraction {cfg.max_reject_fraction:g}; see {where} "
            "(file, line, reason, raw text of each)"
        )
    return s1, rows, rejected, rejects_file


def _stage_shards(cfg: IngestConfig, ex: Executor, s3, tables: Dict[str, shards.TableSpec], work: WorkDir,
                  shard_dir: Optional[str], remote: Optional[str]):
    """Stage 4: per split, the samples in batch order (cost-balanced for gr training) cut into shards of
    ``batches_per_shard`` batches; a scored split's remainder is one smaller last batch. Returns (the manifest's
    sets, the samples dropped per split, per-unit results); no training batch at all stops the ingest."""
    B = cfg.batch_size
    sets: Dict[str, List[shards.ShardEntry]] = {}
    dropped: Dict[str, int] = {}
    shard_units = []
    for split in cfg.splits():
        counts = [s[f"{split}_samples"] for s in s3]
        parts, idxs = _batch_order(counts, cfg.seed, split)
        if split == "train" and cfg.balanced():  # cost-balanced batches (nestpipe.ingest.balance)
            perm = balanced_order(_sample_lengths(work, split, parts, idxs), B, cfg.cost())
            parts, idxs = parts[perm], idxs[perm]
        for name, arr in (("parts", parts), ("idxs", idxs)):
            work.save_array(f"order-{split}-{name}.npy", arr)
        n_batches = len(parts) // B
        tail = int(len(parts) - n_batches * B)
        # training needs whole batches (every rank steps together); the splits that are only scored keep their
        # remainder as one smaller last batch, in a shard of its own, so that every sample is evaluated
        dropped[split] = tail if split == "train" else 0
        per_shard = cfg.batches_per_shard or _auto_batches_per_shard(cfg, s3)
        k = -1
        for k, first in enumerate(range(0, n_batches, per_shard)):
            shard_units.append((work, shard_dir, split, k, first, min(per_shard, n_batches - first),
                                _shard_opts(cfg, tables, remote)))
        if tail and split != "train":
            opts = {**_shard_opts(cfg, tables, remote), "batch_size": tail,
                    "micro_batches": min(cfg.micro_batches, tail), "first_sample": n_batches * B}
            shard_units.append((work, shard_dir, split, k + 1, n_batches, 1, opts))
    s4 = ex.run(_unit_shard, shard_units, cfg, "4/4 shards", rows_of=lambda s: s["samples"],
                cost=lambda u: u[5])  # batches
    for u, r in zip(shard_units, s4):
        entry = shards.ShardEntry(r["path"], r["batches"], r["samples"], r["sha256"], r["bytes"])
        sets.setdefault(u[2], []).append(entry)
    for split in cfg.splits():
        sets.setdefault(split, [])
    if not sets["train"]:
        n = dropped["train"]
        fit = 1 << max(0, (n // 8).bit_length() - 1)  # a power of two that gives at least 8 batches
        hint = (f"rerun with --batch-size {fit}" + (f" --micro-batches {fit}" if fit < cfg.micro_batches else "")
                + " --force (8 or more batches)"
                if n >= 8 else "provide more data")
        raise IngestError(
            f"no complete training batch of {B} samples could be formed from the {n} training samples; {hint}"
        )
    return sets, dropped, s4


def _commit(cfg: IngestConfig, manifest: shards.Manifest, rejects_file: str, remote: Optional[str]) -> None:
    """The manifest written last (with a synthetic input's truth file beside it): the commit point of the output;
    with a URL output the local files are uploaded, the manifest last."""
    truth = storage.join(cfg.raw, TRUTH_FILE)
    if storage.isfile(truth):  # synthetic inputs: the generator's own click probabilities (the eval's Bayes ceiling)
        write_json_atomic(os.path.join(cfg.out, TRUTH_FILE), json.loads(storage.read_bytes(truth)))
    shards.save_manifest(cfg.out, manifest)
    if remote:
        # the shards are there already; the manifest goes last: it is the commit point
        for name in (rejects_file, TRUTH_FILE, shards.MANIFEST_NAME):
            if os.path.exists(os.path.join(cfg.out, name)):
                storage.put_file(os.path.join(cfg.out, name), storage.join(remote, name))


def _shard_opts(cfg: IngestConfig, tables: Dict[str, shards.TableSpec], upload_to: Optional[str]) -> Dict[str, Any]:
    return {
        "upload_to": upload_to,  # a URL --out: each shard uploaded whole as it completes
        "task": cfg.task, "batch_size": cfg.batch_size, "micro_batches": cfg.micro_batches, "seed": cfg.seed,
        "clustering": cfg.clustering, "tables": list(tables), "history_len": cfg.history_len,
        "cluster_tables": TASKS[cfg.task].cluster_tables,
        # micro-batches balanced by cost after the clustering (--balance tokens)
        "balance": cfg.cost().to_dict() if cfg.balanced() and cfg.balance != "batches" else None,
    }


def _auto_batches_per_shard(cfg: IngestConfig, s3: List[Dict[str, Any]]) -> int:
    per_sample = TASKS[cfg.task].bytes_per_sample(cfg, s3)
    per_batch = per_sample * cfg.batch_size
    return int(max(1, min(256, (128 << 20) // max(1, int(per_batch)))))
