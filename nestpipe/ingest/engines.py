"""The ingest's engines: which executor runs the stages' units (standard library only, like the executors' modules,
so that ``nestpipe ingest`` starts its pool before importing Polars)."""

from __future__ import annotations

from typing import Sequence

from nestpipe.ingest.dask_engine import DaskExecutor
from nestpipe.ingest.executor import Executor


def make_executor(cfg, preload: Sequence[str] = ()):
    """The engine of an ingest config: this host's pool (``cfg.engine == "local"``, workers importing ``preload``)
    or a Dask client (``dask``: Dask itself is imported when the client starts)."""
    if cfg.engine == "dask":
        return DaskExecutor(cfg.workers, cfg.scheduler)
    return Executor(cfg.workers, preload=preload)
