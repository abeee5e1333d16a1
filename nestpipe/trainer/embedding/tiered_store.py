"""The memory-mapped tier: an owner's rows and AdaGrad state in files on local disk, hot rows in a DRAM cache.

For tables larger than host memory (``embedding.tier = mmap``). The store has :class:`RowStore`'s interface for
the buffered path the trainer takes with it (the device path's order: :meth:`gather` the batch's rows into the
batch's buffer, update the buffer, :meth:`write_back`); the trainer never reads or updates a tiered store in place.
The values moved are bitwise those of the DRAM store, so a run on this tier trains bitwise like one on DRAM.

Files (``STORE_DIR/TABLE.rankR.{weight,state}``, raw float32, ``[rows, dim]`` and ``[rows]``, with
``TABLE.rankR.json`` naming the run, world size and shape): memory-mapped, but never read through the mapping's
pages for long: after every batch the store drops its mapping's pages (``MADV_DONTNEED``; the data stays in the
page cache, and dirty pages are written by the kernel), so the process's resident memory is the cache, not the
table.

Cache (``embedding.dram_cache_mb`` per rank, split over the rank's tiered stores by their row bytes), invariants:
- a row is in at most one cache slot; ``slot_of[row]`` is its slot or -1;
- admission: every row a batch gathers is admitted (the shards name each batch's rows exactly, so the prefetch and
  retrieval stages bring them in one batch ahead: a batch never misses at compute time); when a batch misses more
  rows than the cache can free, the rest pass through uncached (read from the files, their write-back goes there);
- eviction: least recently gathered first (each slot carries the batch counter of its last gather), only slots
  not gathered by the current gather;
- a slot is dirty from the write-back of its row until its eviction or a flush; an evicted dirty row is written to
  the file before its slot is reused (``skip_dirty_write_back`` turns that off, for the negative-control test
  only), and :meth:`flush` writes every dirty row (checkpoints);
- a write-back of a row not in the cache (evicted between its gather and its write-back) goes to the file.

Rows are initialised on first touch from ``init_rows(seed, table, id)`` as in the DRAM store.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from nestpipe.trainer import testing_hooks
from nestpipe.trainer.embedding.placement import TablePlacement, init_rows
from nestpipe.utils.timing import StageTimer

ROW_FILES = ("weight", "state")


class TierError(RuntimeError):
    """A store directory that cannot be used (another run's, another world size, too little disk)."""


def _open_file(path: str, shape) -> np.memmap:
    """The row file, its blocks reserved on disk (``posix_fallocate``): a disk without room fails here, before
    training, naming the file; a write through the mapping can then not hit a full disk (which would be a SIGBUS,
    not an error)."""
    nbytes = int(np.prod(shape)) * 4
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if hasattr(os, "posix_fallocate") and nbytes:
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
    except OSError as e:
        raise TierError(f"{path}: cannot reserve {nbytes / 2**30:.2f} GiB for the rows ({e.strerror or e})") from e
    finally:
        os.close(fd)
    return np.memmap(path, dtype=np.float32, mode="r+", shape=shape)


class TieredRowStore:
    """Rows ``placement`` assigns rank ``rank`` for one table (or column shard), in files with a DRAM cache."""

    in_dram = False

    def __init__(self, name: str, placement: TablePlacement, rank: int, dim: int, seed: int, init_scale: float,
                 store_dir: str, cache_rows: int, run_id: str, world: int, table: str = "", first_col: int = 0):
        self.name = name
        self.table = table or name
        self.first_col = first_col
        self.placement = placement
        self.rank = rank
        self.dim = dim
        self.seed = seed
        self.init_scale = init_scale
        self.lock = threading.Lock()
        n = placement.local_rows(rank)
        self._n = n
        os.makedirs(store_dir, exist_ok=True)
        base = os.path.join(store_dir, f"{name}.rank{rank}")
        meta = {"run": run_id, "world": world, "rank": rank, "table": self.table, "store": name, "rows": n,
                "dim": dim}
        meta_path = base + ".json"
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                had = json.load(f)
            if had != meta:
                diff = {k: (had.get(k), v) for k, v in meta.items() if had.get(k) != v}
                raise TierError(f"{meta_path}: this store directory belongs to another run or layout "
                                f"(found vs this run: {diff}); use another embedding.store_dir or remove it")
        need = n * (dim + 1) * 4
        free = _free_bytes(store_dir)
        have = sum(os.path.getsize(base + "." + k) for k in ROW_FILES if os.path.exists(base + "." + k))
        if need - have > free:
            raise TierError(f"{store_dir}: table {name} needs {need / 2**30:.2f} GiB for rank {rank}'s rows and "
                            f"AdaGrad state, the disk has {free / 2**30:.2f} GiB free")
        self.weight_file = _open_file(base + ".weight", (n, dim))
        self.state_file = _open_file(base + ".state", (n,))
        with open(meta_path + ".tmp", "w") as f:
            json.dump(meta, f)
        os.replace(meta_path + ".tmp", meta_path)
        self.paths = (base + ".weight", base + ".state")
        self.materialized = torch.zeros(n, dtype=torch.bool)
        self.num_materialized = 0
        self.timer = StageTimer()
        self._touched = 0  # rows read or written through the mappings since their pages were last dropped
        self._last_evicted = self._last_read = 0
        self.slot_of = np.full(n, -1, dtype=np.int32 if n < 2**31 else np.int64)
        self.resize_cache(cache_rows)
        # negative control only (testing hook skip_tier_write_back): evicted dirty rows are lost
        self.skip_dirty_write_back = testing_hooks.active().skip_tier_write_back
        self.stats = {"hits": 0, "misses": 0, "evicted_dirty": 0, "passed_through": 0}

    @property
    def num_rows(self) -> int:
        return self._n

    def resize_cache(self, cache_rows: int) -> None:
        """An empty cache of ``cache_rows`` rows (at least 1, at most the store's rows); only before training."""
        self.cache_rows = max(1, min(int(cache_rows), max(self._n, 1)))
        self.cache_w = torch.zeros((self.cache_rows, self.dim), dtype=torch.float32)
        self.cache_s = torch.zeros(self.cache_rows, dtype=torch.float32)
        self.slot_row = np.full(self.cache_rows, -1, dtype=np.int64)
        self.slot_used = np.zeros(self.cache_rows, dtype=np.int64)  # gather counter of the slot's last use
        self.slot_dirty = np.zeros(self.cache_rows, dtype=bool)
        self.slot_of[:] = -1
        self.clock = 0

    # -- the file side ----------------------------------------------------------------------------------------
    def _read_rows(self, rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows from the files (read in ascending order), the never-touched ones initialised; and which those were
        (the caller marks them materialised once they are held somewhere that is written back)."""
        t0 = time.perf_counter()
        order = np.argsort(rows, kind="stable")
        srt = rows[order]
        w = np.empty((len(rows), self.dim), dtype=np.float32)
        s = np.empty(len(rows), dtype=np.float32)
        w[order] = self.weight_file[srt]
        s[order] = self.state_file[srt]
        fresh = ~self.materialized.numpy()[rows]
        if fresh.any():
            ids = self.placement.ids_of_rows(self.rank, rows[fresh])
            w[fresh] = init_rows(self.seed, self.placement.table_id, ids, self.dim, self.init_scale, self.first_col)
            s[fresh] = 0.0
        self.timer.add("tier.read", time.perf_counter() - t0)
        return w, s, fresh

    def _write_rows(self, rows: np.ndarray, w: np.ndarray, s: np.ndarray) -> None:
        t0 = time.perf_counter()
        order = np.argsort(rows, kind="stable")
        try:
            self.weight_file[rows[order]] = w[order]
            self.state_file[rows[order]] = s[order]
        except OSError as e:  # a full disk reaches a memory-mapped write as SIGBUS unless the blocks exist
            raise TierError(f"{self.paths[0]}: writing rows failed ({e})") from e
        self.timer.add("tier.write", time.perf_counter() - t0)

    def release_pages(self, touched_rows: int = -1) -> None:
        """Drop the mappings' pages from this process (the page cache keeps them) once the rows read or written
        through them since the last drop could map more than a quarter of the cache's bytes (one 4 KiB page per
        row and file at worst); ``touched_rows`` < 0: now. Resident memory stays about the cache's."""
        if touched_rows >= 0:
            self._touched += touched_rows
            if self._touched * 2 * mmap.PAGESIZE <= self.cache_rows * (self.dim + 1) * 4 // 4:
                return
        self._touched = 0
        for mm in (self.weight_file, self.state_file):
            raw = getattr(mm, "_mmap", None)
            if raw is not None and hasattr(raw, "madvise"):
                raw.madvise(mmap.MADV_DONTNEED)

    # -- the cache ------------------------------------------------------------------------------------------
    def _admit(self, rows: np.ndarray) -> Tuple[np.ndarray, Optional[Tuple[np.ndarray, np.ndarray]]]:
        """Slots of ``rows`` (unique), admitting the missing ones; -1 for rows passed through uncached (a batch with
        more missing rows than the cache can free), whose (weights, state) come second."""
        self.clock += 1
        self._last_evicted = self._last_read = 0
        slots = self.slot_of[rows].astype(np.int64)
        miss = slots < 0
        self.slot_used[slots[~miss]] = self.clock
        self.stats["hits"] += int((~miss).sum())
        self.stats["misses"] += int(miss.sum())
        if not miss.any():
            return slots, None
        miss_idx = np.flatnonzero(miss)
        self._last_read = len(miss_idx)
        free = np.flatnonzero(self.slot_row < 0)
        take = free[:len(miss_idx)]
        if len(take) < len(miss_idx):  # evict the least recently gathered slots not used by this gather
            cand = np.flatnonzero((self.slot_row >= 0) & (self.slot_used < self.clock))
            victims = cand[np.argsort(self.slot_used[cand], kind="stable")[:len(miss_idx) - len(take)]]
            self._evict(victims)
            take = np.concatenate([take, victims])
        w, s, fresh = self._read_rows(rows[miss_idx])
        if fresh.any():
            self.materialized[torch.from_numpy(rows[miss_idx][fresh])] = True
            self.num_materialized += int(fresh.sum())
        k = len(take)
        cached_rows = rows[miss_idx[:k]]
        take_t = torch.from_numpy(take)
        self.cache_w.index_copy_(0, take_t, torch.from_numpy(w[:k]))
        self.cache_s.index_copy_(0, take_t, torch.from_numpy(s[:k]))
        self.slot_row[take] = cached_rows
        self.slot_used[take] = self.clock
        # a row initialised here exists only in the cache: dirty, so that its eviction writes it to the file
        self.slot_dirty[take] = fresh[:k]
        self.slot_of[cached_rows] = take
        slots[miss_idx[:k]] = take
        if k == len(miss_idx):
            return slots, None
        # the rest pass through: read from the files, not cached (fresh ones written at once: they are materialised)
        self.stats["passed_through"] += len(miss_idx) - k
        if fresh[k:].any():
            f = np.flatnonzero(fresh[k:]) + k
            self._write_rows(rows[miss_idx[f]], w[f], s[f])
        return slots, (w[k:], s[k:])

    def _evict(self, victims: np.ndarray) -> None:
        dirty = victims[self.slot_dirty[victims]]
        if len(dirty) and not self.skip_dirty_write_back:
            vt = torch.from_numpy(dirty)
            self._write_rows(self.slot_row[dirty], self.cache_w.index_select(0, vt).numpy(),
                             self.cache_s.index_select(0, vt).numpy())
        self.stats["evicted_dirty"] += len(dirty)
        self._last_evicted += len(dirty)
        self.slot_of[self.slot_row[victims]] = -1
        self.slot_row[victims] = -1
        self.slot_dirty[victims] = False

    # -- RowStore's interface (the buffered path) ------------------------------------------------------------
    def gather(self, rows: torch.Tensor, with_state: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        with self.lock:
            r = rows.numpy().astype(np.int64, copy=False)
            slots, passed = self._admit(r)
            cached = slots >= 0
            sl = torch.from_numpy(np.where(cached, slots, 0))
            w = self.cache_w.index_select(0, sl)
            s = self.cache_s.index_select(0, sl)
            if passed is not None:
                idx = torch.from_numpy(np.flatnonzero(~cached))
                w.index_copy_(0, idx, torch.from_numpy(passed[0]))
                s.index_copy_(0, idx, torch.from_numpy(passed[1]))
            self.release_pages(self._last_read + self._last_evicted)
            return w, (s if with_state else None)

    def write_back(self, rows: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> None:
        with self.lock:
            r = rows.numpy().astype(np.int64, copy=False)
            slots = self.slot_of[r].astype(np.int64)
            cached = slots >= 0
            if cached.any():
                st = torch.from_numpy(slots[cached])
                sel = torch.from_numpy(np.flatnonzero(cached))
                self.cache_w.index_copy_(0, st, weight.index_select(0, sel).to(torch.float32))
                self.cache_s.index_copy_(0, st, state.index_select(0, sel).to(torch.float32))
                self.slot_dirty[slots[cached]] = True
            if (~cached).any():  # evicted since its gather: straight to the file
                sel = np.flatnonzero(~cached)
                self._write_rows(r[sel], weight.numpy()[sel], state.numpy()[sel])
            self.release_pages(int((~cached).sum()))

    def materialize_all(self, chunk: int = 1 << 18) -> None:
        """Write every row's initial value to the files (a benchmark's fully materialised table)."""
        with self.lock:
            for lo in range(0, self._n, chunk):
                rows = np.arange(lo, min(self._n, lo + chunk), dtype=np.int64)
                ids = self.placement.ids_of_rows(self.rank, rows)
                w = init_rows(self.seed, self.placement.table_id, ids, self.dim, self.init_scale, self.first_col)
                self.weight_file[lo:lo + len(rows)] = w
                self.state_file[lo:lo + len(rows)] = 0.0
                self.release_pages()
            self.materialized[:] = True
            self.num_materialized = self._n
            self.weight_file.flush()
            self.state_file.flush()

    def drop_page_cache(self) -> None:
        """Evict the row files from the page cache (``POSIX_FADV_DONTNEED`` after a flush): the next reads are cold."""
        self.flush()
        for path in self.paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def ensure_materialized(self, rows: torch.Tensor) -> None:
        return None  # rows are initialised when first read from the files

    def flush(self) -> None:
        """Write every dirty cached row to the files (they stay cached, clean)."""
        with self.lock:
            dirty = np.flatnonzero(self.slot_dirty)
            if len(dirty):
                vt = torch.from_numpy(dirty)
                self._write_rows(self.slot_row[dirty], self.cache_w.index_select(0, vt).numpy(),
                                 self.cache_s.index_select(0, vt).numpy())
                self.slot_dirty[dirty] = False
            self.weight_file.flush()
            self.state_file.flush()
            self.release_pages()

    # -- checkpoints and export: the materialised rows, as the DRAM store gives them --------------------------
    def state_dict(self) -> Dict[str, torch.Tensor]:
        self.flush()
        rows = torch.nonzero(self.materialized).flatten()
        r = rows.numpy()
        with self.lock:
            w = torch.from_numpy(np.ascontiguousarray(self.weight_file[r]))
            s = torch.from_numpy(np.ascontiguousarray(self.state_file[r]))
            self.release_pages()
        return {"rows": rows, "weight": w, "state": s}

    def load_state_dict(self, d: Dict[str, torch.Tensor], where: str = "") -> None:
        rows = d["rows"].to(torch.int64)
        if len(rows) and int(rows.max()) >= self.num_rows:
            raise ValueError(f"{where}: table {self.name}: checkpoint row {int(rows.max())} >= {self.num_rows} rows")
        if d["weight"].shape != (len(rows), self.dim):
            raise ValueError(f"{where}: table {self.name}: weight shape {tuple(d['weight'].shape)} != "
                             f"({len(rows)}, {self.dim})")
        with self.lock:
            # the cache restarts empty; the files take the checkpoint's rows (the others are never read: they are
            # not materialised)
            self.slot_of[:] = -1
            self.slot_row[:] = -1
            self.slot_dirty[:] = False
            self.materialized.zero_()
            self._write_rows(rows.numpy(), d["weight"].to(torch.float32).numpy(),
                             d["state"].to(torch.float32).numpy())
            self.materialized[rows] = True
            self.num_materialized = int(self.materialized.sum())
            self.release_pages()

    def full_rows(self, start: int, stop: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Local rows ``[start, stop)`` (export): the files after a flush hold every cached row."""
        self.flush()
        with self.lock:
            w, s, _ = self._read_rows(np.arange(start, stop, dtype=np.int64))
            self.release_pages()
        return torch.from_numpy(w), torch.from_numpy(s)


def tiered_store(name: str, placement: TablePlacement, rank: int, dim: int, seed: int, cfg, run_dir: str,
                 world: int, table: str, first_col: int, dtype: torch.dtype) -> TieredRowStore:
    """The ``embedding.tier = mmap`` store of one table (or column shard) on ``rank``; its cache is sized by
    :func:`split_cache` once every store of the rank exists."""
    if dtype != torch.float32:
        raise ValueError(f"embedding.tier=mmap stores float32 rows; the run's dtype is {dtype}")
    store_dir = cfg.store_dir or os.path.join(run_dir or ".", "store")
    return TieredRowStore(name, placement, rank, dim, seed, cfg.init_scale, store_dir, 1,
                          os.path.abspath(run_dir or store_dir), world, table, first_col)


def split_cache(stores: Dict[str, "TieredRowStore"], cache_mb: float, timer) -> None:
    """``embedding.dram_cache_mb`` of this rank split over its tiered stores in proportion to their row bytes."""
    total = sum(s.num_rows * (s.dim + 1) * 4 for s in stores.values()) or 1
    for s in stores.values():
        share = cache_mb * (1 << 20) * s.num_rows * (s.dim + 1) * 4 / total
        s.resize_cache(int(share // ((s.dim + 1) * 4)))
        s.timer = timer


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
