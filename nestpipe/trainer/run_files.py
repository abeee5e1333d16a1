"""What a run directory keeps so that it stands on its own: a copy of the shards' manifest (tables, vocabularies,
batch shape, every shard's sha256) beside ``config.json`` (the model config). ``export`` needs nothing else;
``eval`` needs the data too and takes the shards from where they are now (``--shards``) when they moved, after
checking that they are the shards the run trained on (the same manifest).
"""

from __future__ import annotations

import os
import shutil
from typing import Optional, Tuple

from nestpipe.datasets.shards import MANIFEST_NAME, Manifest, ShardError, load_manifest


def keep_manifest(run: str, shards: str) -> None:
    """Copy ``shards``' manifest into ``run`` (atomically)."""
    tmp = os.path.join(run, MANIFEST_NAME + ".tmp")
    shutil.copyfile(os.path.join(shards, MANIFEST_NAME), tmp)
    os.replace(tmp, os.path.join(run, MANIFEST_NAME))


def run_manifest(run: str, cfg, shards: Optional[str] = None, need_data: bool = False) -> Tuple[Manifest, str]:
    """``(manifest, shards directory)`` of a run: ``shards`` when given (checked against the run's copy), else the
    configured shards, else (``need_data`` False) the run's own copy with the configured path."""
    kept = os.path.join(run, MANIFEST_NAME)
    own = load_manifest(kept) if os.path.exists(kept) else None
    where = shards or cfg.shards
    if os.path.exists(os.path.join(where, MANIFEST_NAME)):
        man = load_manifest(where)
        if own is not None and man.to_json() != own.to_json():
            raise ShardError(f"{where}: not the shards run {run} trained on (its manifest differs from "
                             f"{kept}); pass --shards with the shards of that run")
        return man, where
    if own is not None and not need_data:
        return own, where
    moved = " (its copy of the manifest is kept, but scoring needs the shards themselves)" if own else ""
    raise ShardError(f"{where}: no manifest: the run's shards are not there any more{moved}; pass --shards with "
                     "their new location")
