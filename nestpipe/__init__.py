"""NestPipe: synchronous, staleness-free training of embedding-heavy recommendation models at scale."""

__version__ = "0.1.0"

__all__ = ["__version__", "train", "evaluate", "export"]


def __getattr__(name):
    # the Python API (nestpipe.api), imported on first use: ``nestpipe ingest`` never pays for torch
    if name in ("train", "evaluate", "export"):
        from nestpipe import api  # start-up time: `nestpipe ingest` never imports the API's torch

        return getattr(api, name)
    raise AttributeError(f"module 'nestpipe' has no attribute {name!r}")
