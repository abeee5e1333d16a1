"""Key-centric sample clustering and unique-key extraction (see ``docs/clustering.md``)."""

from nestpipe.clustering.core import assign, redundancy, unique_keys

__all__ = ["assign", "redundancy", "unique_keys"]
