"""The data stage: shard reading split by rank, and per-batch preparation on the host.

Split rule: rank ``r`` of ``W`` reads the manifest's train shards ``r, r + W, r + 2W, ...`` (WebDataset order inside
a shard). Every rank runs ``batches_per_rank = min over ranks of its shards' batch counts`` batches per epoch (the
remainder is dropped and reported), so collectives never hang on uneven shards. A split of fewer shards than ranks
(small data) has its batches dealt instead: batch ``g`` of the split (manifest order) goes to rank ``g mod W``, and
every rank runs ``total div W`` of them. Epoch ``e`` replays the same order.
Global step ``s`` is batch ``s mod batches_per_rank`` of epoch ``s div batches_per_rank`` on every rank: the data
position is a pure function of the step, which is what checkpoints record.

:func:`prepare_batch` turns one record into :class:`PreparedBatch`: the shard's unique keys mapped into each
table's vocabulary, the per-micro-batch unique positions and, per value, where its row sits. Nothing is deduplicated
again here; the only new keys are the GR negatives, drawn per batch (random and in-batch popularity ids) from a
generator keyed by (seed, step, rank) and shared by all micro-batches.
"""

from __future__ import annotations

import os
from typing import Dict, Iterator, Optional, Tuple

import numpy as np
import torch

from nestpipe.datasets.shards import (Manifest, ShardError, decode_sample, load_manifest, table_offsets,
                                      verify_shard)
from nestpipe.trainer.embedding.batch import MicroBatchData, PreparedBatch
from nestpipe.trainer.embedding.placement import to_vocab
from nestpipe import kernels
from nestpipe.utils.hashing import splitmix64



def keyed_generator(seed: int, step: int, micro_batch: int, rank: int) -> torch.Generator:
    """A torch.Generator keyed by (seed, step, micro-batch, rank); the global RNG is never used."""
    key = np.array([seed, step, micro_batch, rank], dtype=np.int64).view(np.uint64)
    h = np.uint64(0)
    for k in key:
        h = splitmix64(np.array([h ^ k], dtype=np.uint64))[0]
    g = torch.Generator()
    g.manual_seed(int(h) & ((1 << 63) - 1))
    return g


def random_partition(b: int, n: int, seed: int, step: int, rank: int) -> np.ndarray:
    """A uniformly random balanced partition of ``b`` samples into ``n`` micro-batches (clustering off), keyed by
    (seed, step, rank): the same samples as the shard's clustered partition, only grouped differently."""
    g = keyed_generator(seed, step, -2, rank)
    perm = torch.randperm(b, generator=g).numpy()
    mb = np.empty(b, dtype=np.int64)
    mb[perm] = np.arange(b) % n
    return mb


MICRO_BATCHINGS = ("clustered", "random", "whole")


def prepare_batch(record: Dict, manifest: Manifest, step: int, rank: int, seed: int,
                  num_negatives: Tuple[int, int] = (0, 0), where: str = "",
                  micro_batching: str = "clustered") -> PreparedBatch:
    """Host-side preparation of one batch record (see the module docstring).

    ``micro_batching``: ``clustered`` keeps the shard's key-centric partition; ``random`` replaces it by
    :func:`random_partition` and recomputes each micro-batch's unique keys (clustering off); ``whole`` makes the
    batch one micro-batch (every sample, every unique key: the schedules without a frozen window have nothing to
    overlap, so splitting the batch would only add passes). A malformed record raises :class:`ShardError` naming
    ``where`` before anything is built from it."""
    mb, n_shard = _checked_partition(record, manifest, where, micro_batching)
    b = len(mb)
    if micro_batching == "random":
        mb, n = random_partition(b, n_shard, seed, step, rank), n_shard
    elif micro_batching == "whole":
        mb, n = np.zeros(b, dtype=np.int64), 1
    else:
        n = n_shard
    keys, offsets = _checked_tables(record, manifest, where, micro_batching, n_shard)
    per_sample = {k: np.asarray(v) for k, v in record.items() if k in ("dense", "labels", "user")}
    per_value = {k: np.asarray(v) for k, v in record.items() if k in ("play", "duration", "time")}
    micro = []
    for i in range(n):
        samples = np.nonzero(mb == i)[0].astype(np.int64)
        if len(samples) == 0:
            raise ShardError(f"{where}: micro-batch {i} is empty")
        micro.append(_micro_batch(record, keys, offsets, i, samples, micro_batching, where, per_sample, per_value))
    negatives = _negatives(record, manifest, keys, step, rank, seed, num_negatives)
    return PreparedBatch(step=step, batch_size=b, keys=keys, micro=micro, negatives=negatives)


def _checked_partition(record: Dict, manifest: Manifest, where: str, micro_batching: str) -> Tuple[np.ndarray, int]:
    """The record's sample -> micro-batch assignment and its micro-batch count, checked against the manifest."""
    meta = record.get("meta", {})
    mb = np.asarray(record["mb"]).astype(np.int64)
    b = len(mb)
    if b != manifest.batch_size:
        raise ShardError(f"{where}: record has {b} samples, manifest batch_size is {manifest.batch_size}")
    n_shard = int(meta.get("micro_batches", manifest.micro_batches))
    if b and (mb.min() < 0 or mb.max() >= n_shard):  # a sample outside every micro-batch would not be trained
        raise ShardError(f"{where}: mb assigns a sample to micro-batch {int(mb.min() if mb.min() < 0 else mb.max())}, "
                         f"the record has {n_shard} (0..{n_shard - 1})")
    if micro_batching not in MICRO_BATCHINGS:
        raise ValueError(f"micro_batching {micro_batching!r}: expected one of {', '.join(MICRO_BATCHINGS)}")
    return mb, n_shard


def _checked_tables(record: Dict, manifest: Manifest, where: str, micro_batching: str,
                    n_shard: int) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]:
    """Per table: the batch's unique keys (vocabulary ids) and the per-sample value offsets, the fields checked."""
    keys: Dict[str, np.ndarray] = {}
    offsets: Dict[str, np.ndarray] = {}
    for t in sorted(manifest.tables):
        for f in ("lengths", "unique", "inverse", "mb_unique", "mb_offsets"):
            if f"{t}.{f}" not in record:
                raise ShardError(f"{where}: record lacks field {t}.{f}")
        keys[t] = to_vocab(record[f"{t}.unique"], manifest.tables[t].vocab)
        offsets[t] = table_offsets(record, t)
        # the compiled pass of the clustered partition checks the indices it reads; the whole batch skips it and the
        # random partition reads them first (np.unique)
        inverse = np.asarray(record[f"{t}.inverse"])
        if micro_batching != "clustered" and len(inverse) and (inverse.min() < 0 or inverse.max() >= len(keys[t])):
            raise ShardError(f"{where}: table {t}: {t}.inverse points outside the table's unique keys")
        if len(record[f"{t}.mb_offsets"]) != n_shard + 1:
            raise ShardError(f"{where}: {t}.mb_offsets has {len(record[f'{t}.mb_offsets'])} entries, "
                             f"expected {n_shard + 1}")
    return keys, offsets


def _micro_batch(record: Dict, keys: Dict[str, np.ndarray], offsets: Dict[str, np.ndarray], i: int,
                 samples: np.ndarray, micro_batching: str, where: str, per_sample: Dict[str, np.ndarray],
                 per_value: Dict[str, np.ndarray]) -> MicroBatchData:
    """Micro-batch ``i`` of ``samples``: per table its lengths, per value its key position, sample and position
    among the micro-batch's keys, and the per-sample and per-value fields of its samples."""
    lengths, vkey, vsample, mkeys, vpos, vindex = {}, {}, {}, {}, {}, {}
    for t in keys:
        inverse = np.asarray(record[f"{t}.inverse"])
        if micro_batching == "whole":
            lengths[t], vkey[t], vsample[t], mkeys[t], vpos[t], vindex[t] = _whole_values(
                offsets[t], inverse, len(keys[t]), len(samples), t, where)
            continue
        if micro_batching == "random":
            off = offsets[t]
            mk = np.unique(inverse[kernels.concat_ranges(off[samples], off[samples + 1] - off[samples])])
            mk = mk.astype(np.int64)
        else:
            mo = record[f"{t}.mb_offsets"]
            mk = np.asarray(record[f"{t}.mb_unique"][mo[i]:mo[i + 1]], dtype=np.int64)
        # per value: its key position, its sample, and its position in mk (a position map over the batch keys:
        # O(U + nnz) and cache-resident, where a searchsorted would be O(nnz log U))
        lens, inv, vs, pos, vindex[t], status = kernels.micro_batch_values(offsets[t], samples, inverse, mk,
                                                                           len(keys[t]))
        if status:
            raise ShardError(f"{where}: table {t}: " + (
                f"micro-batch {i}'s mb_unique is not a sorted set of key positions" if status == 1 else
                f"{t}.inverse points outside the table's unique keys" if status == 2 else
                f"micro-batch {i}'s mb_unique does not cover its values"))
        lengths[t], vkey[t], vsample[t], mkeys[t], vpos[t] = lens, inv, vs, mk, pos
    fields = {k: v[samples] for k, v in per_sample.items()}
    if per_value:
        idx = vindex["item" if "item" in offsets else next(iter(offsets))]
        for k, v in per_value.items():
            fields[k] = v[idx]
    return MicroBatchData(i, samples, lengths, vkey, vsample, mkeys, vpos, fields)


def _whole_values(off: np.ndarray, inverse: np.ndarray, num_keys: int, b: int, t: str, where: str):
    """The whole batch as one micro-batch, for one table: every sample in order and every key, so a value's key
    position is its inverse index and its position among the micro-batch's keys the same (what the compiled pass
    gives, without its position map). Returns (lengths, key positions, samples, keys, positions, value indices)."""
    if off[-1] != len(inverse):
        raise ShardError(f"{where}: table {t}: its lengths add up to {off[-1]} values, {t}.inverse "
                         f"holds {len(inverse)}")
    inv = inverse.astype(np.int64)
    lengths = np.diff(off)
    samples = np.repeat(np.arange(b, dtype=np.int64), lengths)
    return lengths, inv, samples, np.arange(num_keys, dtype=np.int64), inv, np.arange(len(inv), dtype=np.int64)


def _negatives(record: Dict, manifest: Manifest, keys: Dict[str, np.ndarray], step: int, rank: int, seed: int,
               num_negatives: Tuple[int, int]) -> Optional[np.ndarray]:
    """The batch's shared negatives: uniform draws from the catalog, then draws from the batch's item values (in
    proportion to their frequency), keyed by (seed, step, rank); None without any."""
    n_rand, n_pop = num_negatives
    if n_rand + n_pop == 0:
        return None
    vocab = manifest.tables["item"].vocab
    g = keyed_generator(seed, step, -1, rank)
    rand = torch.randint(0, vocab, (n_rand,), generator=g).numpy()
    item_values = keys["item"][np.asarray(record["item.inverse"], dtype=np.int64)]
    pop = item_values[torch.randint(0, len(item_values), (n_pop,), generator=g).numpy()] if n_pop else rand[:0]
    return np.concatenate([rand, pop]).astype(np.int64)


def _identity(src):
    return src


def iter_shard(path: str, values: bool = True) -> Iterator[Dict]:
    """Read one shard with stock WebDataset. This module splits shards by rank itself, so WebDataset's node and
    worker splitters are identities (its default refuses to run inside an initialised process group).
    ``values=False``: packed tables without ``{t}.values`` (:func:`prepare_batch` reads ``unique`` and
    ``inverse``)."""
    import webdataset as wds

    if not os.path.exists(path):
        raise ShardError(f"{path}: shard missing")
    ds = wds.WebDataset(path, shardshuffle=False, empty_check=False, nodesplitter=_identity,
                        workersplitter=_identity).decode()
    try:
        for sample in ds:
            yield decode_sample(sample, values=values)
    except (OSError, ValueError) as e:
        raise ShardError(f"{path}: cannot read shard: {e}") from e


def world_problem(manifest: Manifest, split: str, world: int, shards_dir: str) -> str:
    """Why the ``split`` batches of ``manifest`` cannot feed ``world`` ranks (every rank needs one batch at least),
    with the ingest options that fix it; "" when they can (with fewer shards than ranks, batches are dealt)."""
    entries = manifest.sets.get(split) or []
    batches = sum(e.batches for e in entries)
    if batches >= world:
        return ""
    return (f"{shards_dir}: {batches} {split} batch(es) cannot feed world size {world} (every rank needs one at "
            f"least); re-run `nestpipe ingest` with a smaller --batch-size (now {manifest.batch_size})")


class ShardStream:
    """The train (or eval) records of one rank, equalised across ranks (see the module docstring).

    With at least as many shards as ranks, rank ``r`` reads shards ``r, r + W, ...``. With fewer (small data), the
    batches are dealt instead: numbering every batch of the split in manifest order (shard by shard, records in
    order) as ``g``, rank ``r`` takes ``g = r, r + W, r + 2W, ...``; every rank reads every shard and keeps its own.
    Either way the batch of a step is a pure function of (step, rank, world), so a resumed run reads the same."""

    def __init__(self, shards_dir: str, split: str, rank: int, world: int, verify: bool = True,
                 values: bool = True):
        self.dir = shards_dir
        self.values = values  # False: records for prepare_batch only (see iter_shard)
        self.manifest = load_manifest(shards_dir)
        if split not in self.manifest.sets or not self.manifest.sets[split]:
            raise ShardError(f"{shards_dir}: manifest has no {split!r} shards")
        entries = self.manifest.sets[split]
        problem = world_problem(self.manifest, split, world, shards_dir)
        if problem:
            raise ShardError(problem)
        self.rank, self.world = rank, world
        self.dealt = len(entries) < world
        if self.dealt:
            total = sum(e.batches for e in entries)
            self.entries = list(entries)
            self.batches_per_rank = total // world
            self.dropped = total - world * self.batches_per_rank
        else:
            self.entries = entries[rank::world]
            per_rank = [sum(e.batches for e in entries[r::world]) for r in range(world)]
            self.batches_per_rank = min(per_rank)
            self.dropped = sum(per_rank) - world * self.batches_per_rank
        if self.batches_per_rank == 0:
            raise ShardError(f"{shards_dir}: some rank gets no {split} batches with world size {world}")
        if verify:
            for e in self.entries:
                verify_shard(shards_dir, e)

    def _own(self, skip: int = 0) -> Iterator[Tuple[int, Dict, str]]:
        """(this rank's batch index in the epoch, record, shard path) in order, from index ``skip`` on at the
        earliest (shards wholly before it are not read); every shard read whole has its record count checked."""
        g = 0  # the batch's number among the records read (dealt: of the whole split)
        for e in self.entries:
            path = os.path.join(self.dir, e.path)
            last = g + e.batches - 1
            if (last // self.world if self.dealt else last) < skip:
                g += e.batches
                continue
            got = 0
            for rec in iter_shard(path, values=self.values):
                got += 1
                if not self.dealt:
                    yield g, rec, path
                elif g % self.world == self.rank:
                    yield g // self.world, rec, path
                g += 1
            if got != e.batches:
                raise ShardError(f"{path}: holds {got} records, manifest says {e.batches}")

    def records(self, start: int = 0) -> Iterator[Tuple[int, Dict, str]]:
        """Yield (global step, record, shard path) from global step ``start`` on, cycling epochs forever."""
        step = start
        while True:
            skip = step % self.batches_per_rank
            for i, rec, path in self._own(skip):
                if i >= self.batches_per_rank:
                    break
                if i >= skip:
                    yield step, rec, path
                    step += 1
