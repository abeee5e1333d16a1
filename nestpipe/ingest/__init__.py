"""Streaming ingest: raw KuaiRand-format logs -> clustered WebDataset batch shards with a manifest."""

from nestpipe.ingest.config import IngestConfig
from nestpipe.ingest.pipeline import IngestError, ingest

__all__ = ["IngestConfig", "IngestError", "ingest"]
