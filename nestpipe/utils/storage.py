"""Paths or fsspec URLs: the few file operations the ingest needs on its inputs and outputs, for both.

A path without ``://`` is a local path and goes through ``os`` and ``open`` as always. Anything else (``file://``,
``s3://``, ``gs://``, ``abfs://``, ``hdfs://`` ...) goes through fsspec (a dependency of torch; the protocol's own
package, such as s3fs for ``s3://``, must be installed), so ``file://`` URLs run the same code as object storage.

Object stores have no atomic rename: where the ingest writes to a URL, every file is written whole (one upload per
file) and the manifest is uploaded last, as the commit point (``nestpipe/ingest/stages.py``); its working directory
on a URL commits each unit of work by a marker uploaded after the unit's files (``nestpipe/ingest/workdir.py``).
"""

from __future__ import annotations

import os
import shutil
from typing import IO, List


class StorageError(OSError):
    """A URL whose filesystem cannot be used (unknown protocol, its package not installed)."""


def is_url(path: str) -> bool:
    return "://" in str(path)


def filesystem(url: str):
    """``(fs, path)`` of an fsspec URL, or a :class:`StorageError` naming the URL and what is missing."""
    import fsspec  # only for URL paths

    try:
        return fsspec.core.url_to_fs(url)
    except (ValueError, ImportError) as e:  # "Protocol not known" / the protocol's package is not installed
        raise StorageError(f"{url}: no usable filesystem for this URL ({e})") from e


def probe(url: str) -> None:
    """Fail now, naming ``url``, if its filesystem is unusable (unknown protocol, package missing) or cannot be
    reached: any error but "not found" when asking for its entry (credentials, network, permissions)."""
    fs, p = filesystem(url)
    try:
        fs.info(p)
    except FileNotFoundError:
        pass  # reached; not created yet
    except Exception as e:  # fsspec implementations raise their own types (botocore, aiohttp, ...)
        raise StorageError(f"{url}: cannot be reached ({type(e).__name__}: {e})") from e


def join(base: str, *names: str) -> str:
    if is_url(base):
        return "/".join([base.rstrip("/")] + [n.strip("/") for n in names])
    return os.path.join(base, *names)


def open_read(path: str) -> IO[bytes]:
    """A binary file object (seekable) for ``path``; close it (or use ``with``)."""
    if not is_url(path):
        return open(path, "rb")
    fs, p = filesystem(path)
    return fs.open(p, "rb")


def size(path: str) -> int:
    if not is_url(path):
        return os.path.getsize(path)
    fs, p = filesystem(path)
    return int(fs.size(p))


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, p = filesystem(path)
    return fs.exists(p)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, p = filesystem(path)
    return fs.isdir(p)


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    fs, p = filesystem(path)
    return fs.isfile(p)


def listdir(path: str) -> List[str]:
    """The names (not paths) of the entries of directory ``path``; empty where it does not exist."""
    if not is_url(path):
        return os.listdir(path) if os.path.isdir(path) else []
    fs, p = filesystem(path)
    if not fs.isdir(p):
        return []
    return sorted(os.path.basename(e.rstrip("/")) for e in fs.ls(p, detail=False))


def absolute(path: str) -> str:
    return path if is_url(path) else os.path.abspath(path)


def relative(path: str, root: str) -> str:
    """``path`` as named under ``root`` (``a/b.parquet``), for messages and the rejects file."""
    if not is_url(path):
        return os.path.relpath(path, root)
    root = root.rstrip("/") + "/"
    return path[len(root):] if path.startswith(root) else path


def put_file(local: str, url: str) -> None:
    """Upload local file ``local`` to ``url`` whole (one write: readers of an object store never see a part)."""
    fs, p = filesystem(url)
    fs.makedirs(fs._parent(p), exist_ok=True)  # a local filesystem needs the directory; object stores: nothing
    fs.put_file(local, p)


def get_file(url: str, local: str) -> None:
    """Download ``url`` to local file ``local`` (whole)."""
    fs, p = filesystem(url)
    fs.get_file(p, local)


def read_bytes(path: str) -> bytes:
    with open_read(path) as f:
        return f.read()


def read_range(url: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of ``url`` in one ranged read (fewer at the end of the object)."""
    fs, p = filesystem(url)
    return fs.cat_file(p, start=start, end=end)


def glob(url: str, pattern: str) -> List[str]:
    """The names (not paths) of the entries of directory ``url`` that match ``pattern`` (``*`` wildcards), sorted."""
    fs, p = filesystem(url)
    return sorted(os.path.basename(e.rstrip("/")) for e in fs.glob(p.rstrip("/") + "/" + pattern))


def makedirs(url: str) -> None:
    fs, p = filesystem(url)
    fs.makedirs(p, exist_ok=True)


def remove(url: str) -> None:
    """Delete object ``url`` if it exists."""
    fs, p = filesystem(url)
    if fs.exists(p):
        fs.rm_file(p)


def remove_tree(path: str) -> None:
    """Delete directory ``path`` (a path or a URL) and everything under it, if it exists."""
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, p = filesystem(path)
    if fs.exists(p):
        fs.rm(p, recursive=True)
