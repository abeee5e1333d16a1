"""Paths or fsspec URLs: the few file operations the ingest needs on its inputs and outputs, for both.

A path without ``://`` is a local path and goes through ``os`` and ``open`` as always. Anything else (``file://``,
``s3://``, ``gs://``, ``abfs://``, ``hdfs://`` ...) goes through fsspec (a dependency of torch; the protocol's own
package, such as s3fs for ``s3://``, must be installed), so ``file://`` URLs run the same code as object storage.

Object stores have no atomic rename: where the ingest writes to a URL, every file is written whole (one upload per
file) and the manifest is uploaded last, as the commit point (``nestpipe/ingest/stages.py``).
"""

from __future__ import annotations

import os
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
    fs.put_file(local, p)


def read_bytes(path: str) -> bytes:
    with open_read(path) as f:
        return f.read()


def makedirs(url: str) -> None:
    fs, p = filesystem(url)
    fs.makedirs(p, exist_ok=True)


def remove_tree(url: str) -> None:
    fs, p = filesystem(url)
    if fs.exists(p):
        fs.rm(p, recursive=True)
