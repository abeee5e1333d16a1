"""What every ingest task shares: the task interface the stages call, the work directory's layout, fault
injection for the resume tests, the memory-mapped sample partitions, per-batch seeds, and the clustering of one
batch."""

from __future__ import annotations

import os
import signal
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from nestpipe.datasets import shards
from nestpipe.ingest.balance import balance_micro_batches
from nestpipe.ingest.config import MICRO_TOLERANCE
from nestpipe.ingest.executor import Executor
from nestpipe.ingest.parse import ColumnSpec
from nestpipe.ingest.workdir import WorkDir

WORK = "_work"


class IngestTask:
    """One kind of sample (``gr``, ``ctr``, ...): everything of the ingest that depends on the task, behind the
    task-agnostic stages of :mod:`nestpipe.ingest.stages` (parse, join, samples, shards).

    A task object holds no state: the stage units run in spawn workers and look the task up by name
    (``stages.TASKS``), so their arguments stay plain picklable values. Adding a task is one module with one
    subclass, registered in ``stages.TASKS`` and named in ``config.TASKS``.
    """

    name: str  # the --task value
    input_kinds: Tuple[str, ...]  # kuairand file kinds the task reads, in the order they are numbered
    partition_bytes: int  # raw input per hash partition (the unit of memory of the join and samples stages)
    cluster_tables: Sequence[str]  # tables whose keys the micro-batch clustering sees
    log_columns: Sequence[str]  # log columns kept after validation (every column is still validated)
    video_basic_columns: Sequence[str]  # video_features_basic columns kept after validation
    # Raised when the samples a task writes change for the same inputs and options: part of the ingest's fingerprint,
    # so that an interrupted run of another version is never resumed into a mix and a complete output is not reused.
    version: int = 1

    def column_spec(self, kind: str) -> ColumnSpec:
        """Validation spec of an input kind other than the logs and the basic video features."""
        raise KeyError(kind)

    def partition_by_user(self, kind: str) -> bool:
        """Whether the parse stage spills file kind ``kind`` by user id (else by video id, for the join)."""
        raise NotImplementedError

    def join(self, ex: Executor, cfg, work: WorkDir, maxima: Dict[str, int], num_parts: int) -> List[Dict[str, Any]]:
        """Stage 2 on ``ex``: bring the video tables to the logs; one stats dict per unit."""
        raise NotImplementedError

    def samples(self, work: WorkDir, q: int, opts: Dict[str, Any]) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
        """Stage 3 of user partition ``q``: its sample arrays (saved as .npy) and stats (``train_samples``,
        ``eval_samples``, ...)."""
        raise NotImplementedError

    def shard_records(self, cache: "PartitionCache", parts: np.ndarray, idxs: np.ndarray, split: str, k: int,
                      first_batch: int, n_batches: int, opts: Dict[str, Any]) -> Iterator[Tuple[str, shards.Batch]]:
        """Stage 4: the (key, batch) records of shard ``k`` of ``split``, from the samples at (partition ``parts``,
        index ``idxs``) in batch order."""
        raise NotImplementedError

    def tables(self, cfg, maxima: Dict[str, int]) -> Dict[str, shards.TableSpec]:
        """The manifest's embedding tables, from the input maxima of the parse stage."""
        raise NotImplementedError

    def manifest_fields(self, cfg) -> Dict[str, Any]:
        """The task's manifest fields: ``max_seq_len``, ``dense_features``, ``labels``."""
        raise NotImplementedError

    def derive(self, ex: Executor, cfg, work: WorkDir, num_parts: int) -> Dict[str, Any]:
        """Between stages 3 and 4, on ``ex``: features that need every partition's samples (a reduce over the user
        partitions), written as further arrays of each partition (:meth:`PartitionArrays.derived`); their stats
        for the manifest's stats."""
        raise NotImplementedError

    def bytes_per_sample(self, cfg, s3: List[Dict[str, Any]]) -> float:
        """Estimated shard bytes per sample (sizes the default batches per shard)."""
        raise NotImplementedError


def crash_point(stage: str, unit: int, where: str = "start") -> None:
    """Fault injection for the resume tests: ``NESTPIPE_INGEST_CRASH_AT=stage:unit[:where]`` makes the process
    SIGKILL itself there (e.g. ``shard:1:mid`` dies after shard 1 has begun writing records). With
    ``NESTPIPE_INGEST_CRASH_ONCE=MARKER`` only the first process to get there dies (it creates MARKER first): the
    rerun of the unit, by a resumed driver or by Dask on another worker, goes through."""
    spec = os.environ.get("NESTPIPE_INGEST_CRASH_AT")
    if not spec:
        return
    parts = spec.split(":")
    if parts[0] == stage and int(parts[1]) == unit and (parts[2] if len(parts) > 2 else "start") == where:
        marker = os.environ.get("NESTPIPE_INGEST_CRASH_ONCE")
        if marker:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return
        os.kill(os.getpid(), signal.SIGKILL)


class PartitionCache:
    """The sample arrays of stage-3 partitions, each memory-mapped when first used (from the working directory in
    place, or from the local copy a URL working directory fetches, ``nestpipe.ingest.workdir``); the most recent
    few partitions are kept open (bounded memory: only the pages of gathered rows are touched)."""

    def __init__(self, work: WorkDir, keep: int = 3):
        self.work = work
        self.keep = keep
        self.items: Dict[int, "PartitionArrays"] = {}

    def get(self, q: int) -> "PartitionArrays":
        if q not in self.items:
            if len(self.items) >= self.keep:
                self.items.pop(next(iter(self.items)))
            self.items[q] = PartitionArrays(self.work, q)
        return self.items[q]


def samples_dir(q: int) -> str:
    """The stage-3 unit of user partition ``q``: its arrays (``NAME.npy``) and its marker (``stats.json``)."""
    return f"s3/samples-{q:05d}"


def derived_dir(kind: str, q: int) -> str:
    """The unit of user partition ``q`` that derives the arrays ``kind`` after stage 3 (``IngestTask.derive``)."""
    return f"s3/{kind}-{q:05d}"


class PartitionArrays:
    """The arrays of one stage-3 partition by name (``arrays["item"]``), each memory-mapped on first use; the
    arrays derived after stage 3 by ``arrays.derived(kind, name)``."""

    def __init__(self, work: WorkDir, q: int):
        self.work, self.q = work, q
        self.arrays: Dict[str, np.ndarray] = {}

    def _load(self, rel: str) -> np.ndarray:
        if rel not in self.arrays:
            self.arrays[rel] = np.load(self.work.fetch(rel), mmap_mode="r", allow_pickle=False)
        return self.arrays[rel]

    def __getitem__(self, name: str) -> np.ndarray:
        return self._load(f"{samples_dir(self.q)}/{name}.npy")

    def derived(self, kind: str, name: str) -> np.ndarray:
        return self._load(f"{derived_dir(kind, self.q)}/{name}.npy")


def runs(cache: "PartitionCache", bp: np.ndarray, bx: np.ndarray) -> List[Tuple["PartitionArrays", np.ndarray]]:
    """(partition arrays, indices) per consecutive run of one partition, in sample order."""
    cut = np.flatnonzero(np.diff(bp)) + 1
    starts = np.concatenate([[0], cut]).astype(np.int64)
    ends = np.concatenate([cut, [len(bp)]]).astype(np.int64)
    return [(cache.get(int(bp[s])), bx[s:e]) for s, e in zip(starts, ends)]


def batch_seed(opts: Dict[str, Any], split: str, bi: int) -> int:
    return (opts["seed"] * 1_000_003 + bi * 2 + (0 if split == "train" else 1)) % (2**63)


def cluster_fields(batch: Dict[str, Any], tables: Sequence[str], cluster_tables: Sequence[str], n: int,
                   method: str, seed: int, sample_costs: Optional[np.ndarray] = None) -> Dict[str, Any]:
    """Add the micro-batch partition and per-table unique keys to a batch. With ``sample_costs``, the clustering's
    partition is then balanced by cost (:func:`nestpipe.ingest.balance.balance_micro_batches`)."""
    from nestpipe import clustering  # here, not at import: parse and join workers never load scipy

    offs = [shards.table_offsets(batch, t) for t in cluster_tables]
    if len(cluster_tables) == 1:
        values, offsets = batch[f"{cluster_tables[0]}.values"], offs[0]
    else:
        # Several tables: one combined id space, per-sample concatenation of every table's keys.
        b = len(offs[0]) - 1
        lens = np.zeros(b, np.int64)
        for off in offs:
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
    if sample_costs is not None:
        mb, _ = balance_micro_batches(mb, sample_costs, n, keys=(values, offsets))
        if method != "random":
            # exact-gain swaps that keep the costs within the tolerance win back part of the rows the balancing
            # cost the clustering
            costs = np.asarray(sample_costs, dtype=np.float64)
            mb = clustering.refine(values, offsets, mb, n, costs=costs,
                                   max_load=(1.0 + MICRO_TOLERANCE) * costs.sum() / n)
    mb = mb.astype(np.int32)
    batch["mb"] = mb
    fields = clustering.tables_fields(
        {t: (batch[f"{t}.values"], np.diff(shards.table_offsets(batch, t))) for t in tables}, mb, num_micro_batches=n)
    for t in tables:
        for name in ("unique", "inverse", "mb_unique", "mb_offsets"):
            batch[f"{t}.{name}"] = fields[t][name]
    return batch
