"""Public datasets in: the formats ``nestpipe ingest --format`` reads besides the KuaiRand releases.

Each adapter (``movielens``, ``amazon``, ``atomic``) recognises its files in a directory and describes them as a
:class:`~nestpipe.ingest.formats.source.Source`; :func:`~nestpipe.ingest.formats.convert.convert` streams a source
into the KuaiRand tables the ingest reads, so that the same stages (and the same guarantees: bounded memory, rejects
with file and line, resume, determinism) make the same kind of shards from every format. docs/datasets.md says where
each dataset comes from and its licence.
"""

from __future__ import annotations

from typing import Optional

from nestpipe.datasets import kuairand
from nestpipe.ingest.formats import amazon, atomic, movielens
from nestpipe.ingest.formats.source import FormatError, Source
from nestpipe.utils import storage

FORMATS = ("auto", "kuairand", "movielens", "amazon", "atomic")
ADAPTERS = {"movielens": movielens.detect, "atomic": atomic.detect, "amazon": amazon.detect}


def detect(root: str, fmt: str = "auto") -> Optional[Source]:
    """The public dataset in ``root`` (None: KuaiRand files, read as they are). ``fmt``: one of :data:`FORMATS`;
    ``auto`` tries KuaiRand, then MovieLens, atomic files and Amazon, by their file names."""
    if fmt not in FORMATS:
        raise FormatError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if not storage.isdir(root):
        raise FormatError(f"{root}: not a directory")
    if fmt == "kuairand":
        return None
    if fmt == "auto":
        try:
            kuairand.detect_release(root)
            return None
        except kuairand.SchemaError:
            pass
        for adapter in ADAPTERS.values():
            found = adapter(root)
            if found is not None:
                return found
        names = sorted(storage.listdir(root))
        more = f" and {len(names) - 12} more" if len(names) > 12 else ""
        raise FormatError(
            f"{root}: no dataset recognised among {names[:12]}{more}; expected KuaiRand "
            "files (log_standard_*.csv, ...), MovieLens (u.data, ratings.dat or ratings.csv), atomic files (NAME.inter) "
            "or Amazon reviews (a ratings CSV, or review JSON lines); pass --format to say which")
    found = ADAPTERS[fmt](root)
    if found is None:
        raise FormatError(f"{root}: no {fmt} files found ({_expected[fmt]})")
    return found


_expected = {
    "movielens": "u.data (100K), ratings.dat (1M, 10M) or ratings.csv with userId,movieId,... (20M, 25M, latest)",
    "atomic": "NAME.inter, with NAME.item and NAME.user beside it",
    "amazon": "one ratings CSV (user,item,rating,timestamp) or review JSON lines (*.json, *.jsonl, optionally .gz)",
}

__all__ = ["FORMATS", "FormatError", "Source", "detect"]
