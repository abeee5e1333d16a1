"""The ingest's working directory: a local (or mounted shared) path, or an fsspec URL (object storage: ``s3://``,
``gs://``, ...), behind one interface, so the stages' units read and write it the same way wherever it is.

Layout under the work root (``OUT/_work``; for a URL ``--out``, ``WORK_DIR/_work``):

- ``state.json``: the run's fingerprint, written by the driver when a run starts;
- ``s1/``, ``s2/``, ``s3/``: the files of the units of stages 1-3 (spills, GR author parts, sample arrays), each
  unit with one marker, its stats JSON (``s1/NAME.arrow.stats.json``, ``s3/samples-Q/stats.json``, ...);
- ``s4/NAME.uploaded.json``: the marker of a shard uploaded to a URL ``--out`` (its sha256 and size);
- ``order-SPLIT-{parts,idxs}.npy``: the shard stage's sample order, written by the driver in every run.

Invariants, for both kinds of working directory:

- Every file has one writer: the unit that owns it (by name), or the driver (``state.json``, the order arrays).
- A unit's marker is its commit point: it is written after every other file of the unit is in place, whole. A unit
  is done exactly when its marker is there (for a URL: and every file the marker lists has the size it records);
  a unit that is not done is redone whole, overwriting what an interrupted attempt left. A unit's outputs depend
  only on the inputs and the options, so a redone unit writes the same bytes.
- Readers read only the files of done units: a stage starts once every unit of the stages before it is done.

:class:`LocalWork` (a path): units write their files in place, each under a temporary name renamed over its final
name (:func:`save_array`), so a file that exists is whole, even while a duplicate of its unit (a task Dask reran
while the first still ran) writes it again; readers memory-map them in place. Units may also write into one file
shared with other units, in place (``writes_in_place``: GR's dense author table).

:class:`RemoteWork` (a URL): object stores have no rename and no writes in place. A unit writes its files into a
scratch directory of its own on the worker's local disk, exactly as it would in place, uploads each whole (one
write per file), then the marker, which lists every file with its size, and removes the scratch. Readers fetch
what they need: one partition's byte range of a spill file, into memory; whole sample arrays and tables derived
from the work directory, into a cache on the local disk of the process (memory-mapped from there). The cache holds
at most :data:`CACHE_BYTES` (least recently used first out) and belongs to one run: it is removed by
:func:`release_cache` at the end of the run, when a unit of another run comes to the process, or when the process
exits.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import glob
import io
import json
import os
import shutil
import sys
import tempfile
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np

from nestpipe.utils import storage
from nestpipe.utils.jsonio import JSONFileError, read_json, write_json_atomic

# The marker key listing a unit's files with their sizes (RemoteWork): never a stats key.
UNIT_FILES = "unit_files"
# Local disk the cache of one process may hold (least recently used files removed first).
CACHE_BYTES = 2 << 30
# The head of an .npy file read to find where its data starts (the headers np.save writes are 128 bytes).
NPY_HEAD_BYTES = 4096


def open_work(root: str, run: str = "") -> "WorkDir":
    """The working directory at ``root``: :class:`RemoteWork` for an fsspec URL, else :class:`LocalWork`. ``run``:
    the driver's id of the run (its units' per-process caches are never read by another run)."""
    return RemoteWork(root, run) if storage.is_url(root) else LocalWork(root, run)


@dataclasses.dataclass(frozen=True)
class WorkDir:
    """A working directory (``root``, a path or a URL), handed to every unit as one of its arguments."""

    root: str
    run: str = ""

    # Units may write into one file shared with other units, in place (a filesystem every worker sees).
    writes_in_place = False

    def path(self, rel: str) -> str:
        """The path or URL of ``rel`` (``s1/NAME.arrow``), for reading in place and for messages."""
        return storage.join(self.root, rel)

    # -- reading ---------------------------------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        raise NotImplementedError

    def glob(self, sub: str, pattern: str) -> List[str]:
        """The files of directory ``sub`` whose names match ``pattern``, as ``sub/NAME``, sorted by name."""
        raise NotImplementedError

    def open(self, rel: str):
        """A binary file object reading ``rel``."""
        raise NotImplementedError

    def read_json(self, rel: str, what: str) -> Any:
        raise NotImplementedError

    def read_range(self, rel: str, start: int, end: int):
        """Bytes ``[start, end)`` of ``rel`` as a buffer (a memory-mapped view in place, or the bytes fetched)."""
        raise NotImplementedError

    def fetch(self, rel: str) -> str:
        """A local path holding file ``rel`` whole, to memory-map: the file itself, or its copy in the cache."""
        raise NotImplementedError

    def load_array(self, rel: str) -> np.ndarray:
        """The whole ``.npy`` array ``rel``, in memory."""
        raise NotImplementedError

    def array_slice(self, rel: str, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of the one-dimensional ``.npy`` array ``rel``, reading only those bytes."""
        raise NotImplementedError

    def done(self, marker: str) -> Optional[Dict[str, Any]]:
        """The stats of the unit whose marker is ``marker`` if the unit is done (see the module docstring), else
        None: the unit is to be (re)done."""
        raise NotImplementedError

    # -- writing ---------------------------------------------------------------------------------------------------
    def output(self, marker: str) -> "contextlib.AbstractContextManager[UnitOutput]":
        """Where a unit writes its files (:meth:`UnitOutput.path`), committed by :meth:`UnitOutput.commit`, which
        writes ``marker`` last."""
        raise NotImplementedError

    def write_json(self, rel: str, obj: Any) -> None:
        """Driver: write ``rel`` whole (the run's state)."""
        raise NotImplementedError

    def save_array(self, rel: str, arr: np.ndarray) -> None:
        """Driver: write array ``rel`` whole (the sample order)."""
        raise NotImplementedError

    def remove(self) -> None:
        """Delete the working directory and everything in it."""
        raise NotImplementedError

    # -- the per-process cache ---------------------------------------------------------------------------------
    def cached(self, rel: str, make: Callable[[str], None]) -> str:
        """A local path holding ``rel``, made once per process and run by ``make(path)`` (which writes the file at
        ``path``) and kept in the process's cache (see the module docstring)."""
        return _CACHE.get((self.root, self.run), rel, make)

    @contextlib.contextmanager
    def scratch(self) -> Iterator[str]:
        """A fresh directory on the local disk, removed with everything in it when the block ends."""
        d = tempfile.mkdtemp(prefix="nestpipe-ingest-unit-")
        try:
            yield d
        finally:
            shutil.rmtree(d, ignore_errors=True)


class UnitOutput:
    """One unit's files: write each at :meth:`path`, then :meth:`commit` the stats (the marker, written last)."""

    def path(self, rel: str) -> str:
        """The local path to write the unit's file ``rel`` at (its directory exists)."""
        raise NotImplementedError

    def commit(self, stats: Dict[str, Any]) -> Dict[str, Any]:
        """Make the unit's files and its marker holding ``stats`` visible to readers; returns ``stats``."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class LocalWork(WorkDir):
    """A working directory on a filesystem path (local, or mounted and shared by every worker)."""

    writes_in_place = True

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def glob(self, sub: str, pattern: str) -> List[str]:
        return [f"{sub}/{n}" for n in sorted(os.path.basename(p)
                                             for p in glob.glob(os.path.join(self.root, sub, pattern)))]

    def open(self, rel: str):
        return open(self.path(rel), "rb")

    def read_json(self, rel: str, what: str) -> Any:
        return read_json(self.path(rel), what)

    def read_range(self, rel: str, start: int, end: int):
        import pyarrow as pa  # the spill reader's buffer type

        mm = pa.memory_map(self.path(rel), "r")
        mm.seek(start)
        return mm.read_buffer(end - start)  # zero-copy: pages are read as the batches are touched

    def fetch(self, rel: str) -> str:
        return self.path(rel)

    def load_array(self, rel: str) -> np.ndarray:
        return np.load(self.path(rel), allow_pickle=False)

    def array_slice(self, rel: str, start: int, stop: int) -> np.ndarray:
        return np.array(np.load(self.path(rel), mmap_mode="r", allow_pickle=False)[start:stop])

    def done(self, marker: str) -> Optional[Dict[str, Any]]:
        path = self.path(marker)
        if not os.path.exists(path):
            return None
        stats = read_json(path, "unit stats (its marker)")
        stats.pop(UNIT_FILES, None)
        return stats

    @contextlib.contextmanager
    def output(self, marker: str) -> Iterator[UnitOutput]:
        yield _InPlaceOutput(self, marker)

    def write_json(self, rel: str, obj: Any) -> None:
        os.makedirs(os.path.dirname(self.path(rel)), exist_ok=True)
        write_json_atomic(self.path(rel), obj)

    def save_array(self, rel: str, arr: np.ndarray) -> None:
        save_array(self.path(rel), arr)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class _InPlaceOutput(UnitOutput):
    """LocalWork: files are written in place (each renamed over its final name), the marker last."""

    def __init__(self, work: LocalWork, marker: str):
        self.work, self.marker = work, marker

    def path(self, rel: str) -> str:
        p = self.work.path(rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        return p

    def commit(self, stats: Dict[str, Any]) -> Dict[str, Any]:
        write_json_atomic(self.path(self.marker), stats)
        return stats


@dataclasses.dataclass(frozen=True)
class RemoteWork(WorkDir):
    """A working directory at an fsspec URL: no rename, no writes in place (see the module docstring)."""

    def exists(self, rel: str) -> bool:
        return storage.exists(self.path(rel))

    def glob(self, sub: str, pattern: str) -> List[str]:
        return [f"{sub}/{n}" for n in storage.glob(self.path(sub), pattern)]

    def open(self, rel: str):
        with _naming(self.path(rel)):
            return storage.open_read(self.path(rel))

    def read_json(self, rel: str, what: str) -> Any:
        url = self.path(rel)
        with _naming(url):
            raw = storage.read_bytes(url)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise JSONFileError(f"{url}: cannot parse {what}: {e}") from e

    def read_range(self, rel: str, start: int, end: int):
        import pyarrow as pa  # the spill reader's buffer type

        url = self.path(rel)
        with _naming(url):
            data = storage.read_range(url, start, end)
        if len(data) != end - start:
            raise ValueError(f"{url}: bytes {start}-{end} asked, {len(data)} read: the object is shorter than its "
                             "index says (cut short)")
        return pa.py_buffer(data)

    def fetch(self, rel: str) -> str:
        url = self.path(rel)

        def download(local: str) -> None:
            with _naming(url):
                storage.get_file(url, local)

        return self.cached(rel, download)

    def load_array(self, rel: str) -> np.ndarray:
        url = self.path(rel)
        with _naming(url):
            return np.load(io.BytesIO(storage.read_bytes(url)), allow_pickle=False)

    def array_slice(self, rel: str, start: int, stop: int) -> np.ndarray:
        url = self.path(rel)
        with _naming(url):
            head = io.BytesIO(storage.read_range(url, 0, NPY_HEAD_BYTES))
        version = np.lib.format.read_magic(head)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
            np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(head)
        if len(shape) != 1 or dtype.hasobject:
            raise ValueError(f"{url}: a one-dimensional array of numbers expected, found shape {shape} {dtype}")
        start, stop, _ = slice(start, stop).indices(shape[0])
        if stop <= start:
            return np.zeros(0, dtype)
        at = head.tell()
        with _naming(url):
            data = storage.read_range(url, at + start * dtype.itemsize, at + stop * dtype.itemsize)
        if len(data) != (stop - start) * dtype.itemsize:
            raise ValueError(f"{url}: shorter than its header says ({shape[0]} x {dtype}): the object is cut short")
        return np.frombuffer(bytearray(data), dtype)

    def done(self, marker: str) -> Optional[Dict[str, Any]]:
        url = self.path(marker)
        if not storage.exists(url):
            return None
        try:
            stats = json.loads(storage.read_bytes(url))
            files = stats.pop(UNIT_FILES)
        except (ValueError, KeyError, UnicodeDecodeError):
            _redo(f"{url}: marker cannot be parsed or lists no files")
            return None
        for rel, size in files.items():
            f = self.path(rel)
            found = storage.size(f) if storage.exists(f) else None
            if found != size:
                what = "missing" if found is None else f"{found} bytes where the marker records {size}"
                _redo(f"{f}: {what} (marker {url})")
                return None
        return stats

    @contextlib.contextmanager
    def output(self, marker: str) -> Iterator[UnitOutput]:
        # a unit redone over an earlier attempt: its objects are not trusted from now until its new marker
        storage.remove(self.path(marker))
        with self.scratch() as d:
            yield _UploadOutput(self, marker, d)

    def write_json(self, rel: str, obj: Any) -> None:
        with self.scratch() as d:
            storage.put_file(write_json_atomic(os.path.join(d, "f.json"), obj), self.path(rel))

    def save_array(self, rel: str, arr: np.ndarray) -> None:
        with self.scratch() as d:
            storage.put_file(save_array(os.path.join(d, "a.npy"), arr), self.path(rel))

    def remove(self) -> None:
        storage.remove_tree(self.root)


class _UploadOutput(UnitOutput):
    """RemoteWork: files are written in a scratch directory under their names, then uploaded, the marker last."""

    def __init__(self, work: RemoteWork, marker: str, scratch: str):
        self.work, self.marker, self.scratch = work, marker, scratch

    def path(self, rel: str) -> str:
        p = os.path.join(self.scratch, *rel.split("/"))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        return p

    def commit(self, stats: Dict[str, Any]) -> Dict[str, Any]:
        files = {}
        for d, _, names in os.walk(self.scratch):
            for n in names:
                p = os.path.join(d, n)
                files[os.path.relpath(p, self.scratch).replace(os.sep, "/")] = os.path.getsize(p)
        if self.marker in files:
            raise ValueError(f"{self.work.path(self.marker)}: the unit wrote its own marker; commit() writes it")
        for rel in sorted(files):
            storage.put_file(os.path.join(self.scratch, *rel.split("/")), self.work.path(rel))
        marker = write_json_atomic(self.path(self.marker), {**stats, UNIT_FILES: files})
        storage.put_file(marker, self.work.path(self.marker))  # last: the commit point
        return stats


def save_array(path: str, arr: np.ndarray) -> str:
    """Write ``arr`` to local file ``path`` (``.npy``, never pickled) under a temporary name renamed over ``path``:
    a reader, or a memory map open on an earlier copy, never sees a part. Returns ``path``."""
    tmp = f"{path[:-len('.npy')] if path.endswith('.npy') else path}.tmp-{os.getpid()}-{threading.get_ident()}.npy"
    try:
        np.save(tmp, arr, allow_pickle=False)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def _redo(why: str) -> None:
    print(f"{why}; redoing its unit", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _naming(url: str) -> Iterator[None]:
    """A missing object of the work directory named by its URL (fsspec names the path without the protocol)."""
    try:
        yield
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{url}: not found in the working directory although the unit that writes it is "
                                f"done; rerun the same command to redo that unit ({e})") from e


class _ProcessCache:
    """The local copies of one run's working directory in this process (see the module docstring)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.lock = threading.Lock()
        self.key = None
        self.dir: Optional[str] = None
        self.sizes: "collections.OrderedDict[str, int]" = collections.OrderedDict()

    def get(self, key, rel: str, make: Callable[[str], None]) -> str:
        with self.lock:
            if key != self.key:
                self._drop()
                self.key, self.dir = key, tempfile.mkdtemp(prefix="nestpipe-ingest-cache-")
            local = os.path.join(self.dir, *rel.split("/"))
            if rel in self.sizes and os.path.exists(local):
                self.sizes.move_to_end(rel)
                return local
            os.makedirs(os.path.dirname(local), exist_ok=True)
            tmp = f"{local}.part-{threading.get_ident()}"
            try:
                make(tmp)
                os.replace(tmp, local)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            self.sizes[rel] = os.path.getsize(local)
            # memory maps of a removed file stay valid: only its pages go once they are unmapped
            while sum(self.sizes.values()) > self.limit and len(self.sizes) > 1:
                old, _ = self.sizes.popitem(last=False)
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.dir, *old.split("/")))
            return local

    def _drop(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.key, self.dir = None, None
        self.sizes.clear()

    def release(self) -> None:
        with self.lock:
            self._drop()


_CACHE = _ProcessCache(CACHE_BYTES)
atexit.register(_CACHE.release)


def release_cache() -> None:
    """Remove this process's cache of a working directory (the driver calls it at the end of a run, in its own
    process and on every Dask worker)."""
    _CACHE.release()
