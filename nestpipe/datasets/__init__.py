"""Dataset schemas (KuaiRand), the synthetic generator, and the training-shard format."""


def __getattr__(name):
    # interop helpers on first use (they import torch; ingest never does)
    if name in ("to_jagged", "to_kjt"):
        from nestpipe.datasets import interop  # start-up time: torch only for these helpers

        return getattr(interop, name)
    raise AttributeError(f"module 'nestpipe.datasets' has no attribute {name!r}")
