"""The memory-mapped tier: an owner's rows and AdaGrad state in files on local disk, hot rows in a DRAM cache.

For tables larger than host memory (``embedding.tier = mmap``). The store has :class:`RowStore`'s interface for
the buffered path the trainer takes with it (the device path's order: :meth:`gather` the batch's rows into the
batch's buffer, update the buffer, :meth:`write_back`); the trainer never reads or updates a tiered store in place.
The values moved are bitwise those of the DRAM store, so a run on this tier trains bitwise like one on DRAM.

Files (``STORE_DIR/TABLE.rankR.{weight,state}``, raw float32, ``[rows, dim]`` and ``[rows]``, with
``TABLE.rankR.json`` naming the run, world size and shape): the weights are memory-mapped, but their pages are
not kept mapped for long: the store drops them from the process (``MADV_DONTNEED``; the data stays in the page
cache, and dirty pages are written by the kernel) whenever the rows touched could map a quarter of the cache's
bytes, so the process's resident memory is the cache, not the table. The AdaGrad state, one float per row
(1 / (dim + 1) of the shard), is kept in DRAM whole: read from disk it would cost a page per row like the weights;
its file is written at every flush (checkpoints).

Cache (``embedding.dram_cache_mb`` per rank, split over the rank's tiered stores by their row bytes), invariants:
- a row is in at most one cache slot; ``slot_of[row]`` is its slot or -1;
- admission: every row a batch gathers is admitted (the shards name each batch's rows exactly, so the prefetch and
  retrieval stages bring them in one batch ahead: a batch never misses at compute time); when a batch misses more
  rows than the cache can free, the rest pass through uncached (read from the files, their write-back goes there);
- eviction: least recently gathered first (each slot carries the batch counter of its last gather), only slots
  no gather in progress holds (a gather pins its hits and the slots it loads until it has copied them out);
- a slot is dirty from the write-back of its row until its eviction or a flush; an evicted dirty row is written to
  the file before its slot is reused (``write_back=False`` turns that off, for the negative-control test
  only), and :meth:`flush` writes every dirty row (checkpoints);
- a write-back of a row not in the cache (evicted between its gather and its write-back) goes to the file.

Rows are initialised on first touch from ``init_rows(seed, table, id)`` as in the DRAM store.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import threading
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

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
                 store_dir: str, cache_rows: int, run_id: str, world: int, table: str = "", first_col: int = 0,
                 write_back: bool = True):
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
        # the AdaGrad state (one float per row: 1 / (dim + 1) of the shard) is worked on in DRAM, a read of it would
        # cost a disk page per row like the weights; its file is written when the store is flushed (checkpoints)
        self.state_mem = np.array(self.state_file)
        self._fds = [os.open(p, os.O_RDONLY) for p in self.paths]  # for read-ahead advice
        self.materialized = torch.zeros(n, dtype=torch.bool)
        self.num_materialized = 0
        self.timer = StageTimer()
        self._touched = 0  # rows read or written through the mappings since their pages were last dropped
        self.slot_of = np.full(n, -1, dtype=np.int32 if n < 2**31 else np.int64)
        self.resize_cache(cache_rows)
        # negative control only (testing hook skip_tier_write_back): evicted dirty rows are lost
        self.skip_dirty_write_back = not write_back  # negative control only: evicted dirty rows are lost
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
        self.slot_pins = np.zeros(self.cache_rows, dtype=np.int32)  # gathers between their reserve and copy-out
        self.slot_written = np.zeros(self.cache_rows, dtype=bool)  # written back while loading
        self.slot_of[:] = -1
        self.clock = 0

    # -- the file side ----------------------------------------------------------------------------------------
    def _will_need(self, rows: np.ndarray) -> None:
        """Ask the kernel to read the pages of ``rows`` in both files now, all at once (``POSIX_FADV_WILLNEED``):
        touching them one at a time through the mapping waits for one disk read after another, while advised
        together they are read concurrently and the disk's queue stays full."""
        if not len(rows) or not hasattr(os, "posix_fadvise"):
            return
        for fd, row_bytes in zip(self._fds[:1], (self.dim * 4,)):
            first = rows * row_bytes // mmap.PAGESIZE
            last = (rows * row_bytes + row_bytes - 1) // mmap.PAGESIZE
            pages = np.unique(np.concatenate([first, last]))
            # runs of consecutive pages, one advice each
            breaks = np.flatnonzero(np.diff(pages) != 1) + 1
            for run in np.split(pages, breaks):
                os.posix_fadvise(fd, int(run[0]) * mmap.PAGESIZE, len(run) * mmap.PAGESIZE, os.POSIX_FADV_WILLNEED)

    def _read_rows(self, rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows from the files (read in ascending order), the never-touched ones initialised; and which those were
        (the caller marks them materialised once they are held somewhere that is written back)."""
        with self.timer.span("tier.read"):
            order = np.argsort(rows, kind="stable")
            srt = rows[order]
            self._will_need(srt)
            w = np.empty((len(rows), self.dim), dtype=np.float32)
            s = np.empty(len(rows), dtype=np.float32)
            w[order] = self.weight_file[srt]
            s[order] = self.state_mem[srt]
            fresh = ~self.materialized.numpy()[rows]
            if fresh.any():
                ids = self.placement.ids_of_rows(self.rank, rows[fresh])
                w[fresh] = init_rows(self.seed, self.placement.table_id, ids, self.dim, self.init_scale,
                                     self.first_col)
                s[fresh] = 0.0
            return w, s, fresh

    def _write_rows(self, rows: np.ndarray, w: np.ndarray, s: np.ndarray) -> None:
        with self.timer.span("tier.write"):
            order = np.argsort(rows, kind="stable")
            self._will_need(rows[order])  # a row is part of a page: the page is read before it is written
            try:
                self.weight_file[rows[order]] = w[order]
                self.state_mem[rows[order]] = s[order]
            except OSError as e:  # a full disk reaches a memory-mapped write as SIGBUS unless the blocks exist
                raise TierError(f"{self.paths[0]}: writing rows failed ({e})") from e

    def release_pages(self, touched_rows: int = -1) -> None:
        """Drop the mappings' pages from this process (the page cache keeps them) once the rows read or written
        through them since the last drop could map more than a quarter of the cache's bytes (one 4 KiB weight page
        per row at worst); ``touched_rows`` < 0: now. Resident memory stays about the cache's."""
        if touched_rows >= 0:
            self._touched += touched_rows
            if self._touched * mmap.PAGESIZE <= self.cache_rows * (self.dim + 1) * 4 // 4:
                return
        self._touched = 0
        for mm in (self.weight_file, self.state_file):
            raw = getattr(mm, "_mmap", None)
            if raw is not None and hasattr(raw, "madvise"):
                raw.madvise(mmap.MADV_DONTNEED)

    # -- the cache ------------------------------------------------------------------------------------------
    def _reserve(self, rows: np.ndarray):
        """Under the lock: the slots of ``rows`` (unique); cache slots reserved for the missing ones (evicting the
        least recently gathered slots not used by this gather); -1 for rows that pass through uncached. Returns
        (slots, indices of the missing rows, the reserved slots, evicted rows written to the file)."""
        self.clock += 1
        slots = self.slot_of[rows].astype(np.int64)
        miss = slots < 0
        self.slot_used[slots[~miss]] = self.clock
        self.stats["hits"] += int((~miss).sum())
        self.stats["misses"] += int(miss.sum())
        miss_idx = np.flatnonzero(miss)
        if not len(miss_idx):
            return slots, miss_idx, miss_idx, 0
        free = np.flatnonzero(self.slot_row < 0)
        take = free[:len(miss_idx)]
        if len(take) < len(miss_idx):
            cand = np.flatnonzero((self.slot_row >= 0) & (self.slot_used < self.clock) & (self.slot_pins == 0))
            victims = cand[np.argsort(self.slot_used[cand], kind="stable")[:len(miss_idx) - len(take)]]
            written = self._evict(victims)
            take = np.concatenate([take, victims])
        else:
            written = 0
        k = len(take)
        reserved_rows = rows[miss_idx[:k]]
        self.slot_row[take] = reserved_rows
        self.slot_used[take] = self.clock
        self.slot_dirty[take] = False
        self.slot_written[take] = False
        self.slot_of[reserved_rows] = take
        slots[miss_idx[:k]] = take
        self.stats["passed_through"] += len(miss_idx) - k
        return slots, miss_idx, take, written

    def _install(self, rows: np.ndarray, miss_idx: np.ndarray, take: np.ndarray, w: np.ndarray, s: np.ndarray,
                 fresh: np.ndarray) -> None:
        """Under the lock: the rows read for the reserved slots go into them, except where a write-back reached the
        slot while it loaded (the cache holds the newer value then); rows passed through that were initialised by
        the read are written to the files (they are materialised from now on)."""
        k = len(take)
        keep = ~self.slot_written[take]
        put = take[keep]
        if len(put):
            pt = torch.from_numpy(put)
            sel = torch.from_numpy(np.flatnonzero(keep))
            self.cache_w.index_copy_(0, pt, torch.from_numpy(w[:k]).index_select(0, sel))
            self.cache_s.index_copy_(0, pt, torch.from_numpy(s[:k]).index_select(0, sel))
            # a row initialised by the read exists only in the cache: dirty, so that its eviction writes it
            self.slot_dirty[put] = fresh[:k][keep]
        newly = rows[miss_idx][fresh] if fresh.any() else miss_idx[:0]
        if k < len(miss_idx) and fresh[k:].any():
            f = np.flatnonzero(fresh[k:]) + k
            f = f[~self.materialized.numpy()[rows[miss_idx[f]]]]  # not written back meanwhile
            if len(f):
                self._write_rows(rows[miss_idx[f]], w[f], s[f])
        if len(newly):
            was = self.materialized.numpy()[newly]
            self.materialized[torch.from_numpy(newly)] = True
            self.num_materialized += int((~was).sum())

    def _evict(self, victims: np.ndarray) -> int:
        """Free ``victims``, writing their updated rows to the file first; returns how many were written."""
        dirty = victims[self.slot_dirty[victims]]
        if len(dirty) and not self.skip_dirty_write_back:
            vt = torch.from_numpy(dirty)
            self._write_rows(self.slot_row[dirty], self.cache_w.index_select(0, vt).numpy(),
                             self.cache_s.index_select(0, vt).numpy())
        self.stats["evicted_dirty"] += len(dirty)
        self.slot_of[self.slot_row[victims]] = -1
        self.slot_row[victims] = -1
        self.slot_dirty[victims] = False
        return len(dirty)

    # -- RowStore's interface (the buffered path) ------------------------------------------------------------
    def gather(self, rows: torch.Tensor, with_state: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The rows' weights and state; missing rows are read from the files outside the lock, so a concurrent
        :meth:`write_back` (the compute thread, while the retrieval stage gathers the next batch) never waits for
        the disk."""
        r = rows.numpy().astype(np.int64, copy=False)
        with self.lock:
            slots, miss_idx, take, evicted = self._reserve(r)
            # pinned until copied out: a concurrent gather (2D-SP's replica sync beside the retrieval stage) evicts
            # neither this gather's hits nor the slots it is loading
            pinned = slots[slots >= 0]
            self.slot_pins[pinned] += 1
        w_m = s_m = None
        if len(miss_idx):
            w_m, s_m, fresh = self._read_rows(r[miss_idx])
        with self.lock:
            if len(miss_idx):
                self._install(r, miss_idx, take, w_m, s_m, fresh)
            self.slot_pins[pinned] -= 1
            cached = slots >= 0
            sl = torch.from_numpy(np.where(cached, slots, 0))
            w = self.cache_w.index_select(0, sl)
            s = self.cache_s.index_select(0, sl)
            if not cached.all():  # passed through: the rows as read
                k = len(take)
                idx = torch.from_numpy(np.flatnonzero(~cached))
                w.index_copy_(0, idx, torch.from_numpy(w_m[k:]))
                s.index_copy_(0, idx, torch.from_numpy(s_m[k:]))
            self.release_pages(len(miss_idx) + evicted)
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
                self.slot_written[slots[cached]] = True  # a slot still loading keeps this value
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
                self.state_mem[lo:lo + len(rows)] = 0.0
                self.release_pages()
            self.materialized[:] = True
            self.num_materialized = self._n
            self.weight_file.flush()
            self.state_file[:] = self.state_mem
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
            self.state_file[:] = self.state_mem
            self.state_file.flush()
            self.release_pages()

    # -- checkpoints (row file snapshots; a DRAM store's rows load too) and export ------------------------------
    def snapshot_names(self) -> List[str]:
        """The names of the files :meth:`snapshot` writes into a checkpoint directory."""
        return [os.path.basename(p) for p in self.paths]

    def snapshot(self, directory: str) -> Dict[str, object]:
        """A checkpoint of this store that never holds the table in memory: every updated cached row written to the
        files, the files copied into ``directory`` (streamed by the kernel), and which rows are materialised."""
        self.flush()
        with self.lock:
            names = []
            for path in self.paths:
                name = os.path.basename(path)
                shutil.copyfile(path, os.path.join(directory, name))
                names.append(name)
            return {"snapshot": names, "materialized": self.materialized.clone(), "rows_total": self._n,
                    "dim": self.dim}

    def restore(self, directory: str, d: Dict[str, object]) -> None:
        """Back to a :meth:`snapshot` in ``directory``: its files over the store's, its materialised rows; the cache
        restarts empty."""
        if int(d["rows_total"]) != self._n or int(d["dim"]) != self.dim:
            raise ValueError(f"{directory}: table {self.name}: snapshot of {d['rows_total']} x {d['dim']} rows, this "
                             f"store has {self._n} x {self.dim}")
        with self.lock:
            for path, name in zip(self.paths, d["snapshot"]):
                src = os.path.join(directory, name)
                if not os.path.exists(src):
                    raise FileNotFoundError(f"{src}: row file of the checkpoint is missing")
                del self.weight_file, self.state_file
                shutil.copyfile(src, path + ".restore")
                os.replace(path + ".restore", path)
                self.weight_file = np.memmap(self.paths[0], dtype=np.float32, mode="r+", shape=(self._n, self.dim))
                self.state_file = np.memmap(self.paths[1], dtype=np.float32, mode="r+", shape=(self._n,))
            for fd in self._fds:
                os.close(fd)
            self._fds = [os.open(p, os.O_RDONLY) for p in self.paths]
            self.state_mem = np.array(self.state_file)
            self.resize_cache(self.cache_rows)
            self.materialized.copy_(d["materialized"])
            self.num_materialized = int(self.materialized.sum())

    def load_state_dict(self, d: Dict[str, torch.Tensor], where: str = "") -> None:
        if "snapshot" in d:
            self.restore(where, d)
            return
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


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
