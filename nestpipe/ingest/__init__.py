"""Streaming ingest: raw KuaiRand-format logs -> clustered WebDataset batch shards with a manifest."""

from nestpipe.ingest.config import IngestConfig

__all__ = ["IngestConfig", "IngestError", "ingest"]


def __getattr__(name):
    # The stages (Polars, NumPy) are imported on first use, so `nestpipe ingest` can start its worker pool first
    # (nestpipe.ingest.executor) and let the workers import it alongside this process.
    if name in ("IngestError", "ingest"):
        from nestpipe.ingest import stages  # start-up time: see above

        return getattr(stages, name)
    raise AttributeError(f"module 'nestpipe.ingest' has no attribute {name!r}")
