"""A shard batch as the plain jagged tensors other libraries take, and as a TorchRec ``KeyedJaggedTensor``.

Layout (TorchRec's): ``keys`` the tables, ``values`` every table's ids one table after another (within a table,
sample after sample), ``lengths`` [len(keys) x B] ids per (table, sample) in the same order, ``offsets`` their
running sum from 0. With a manifest, ids are mapped into each table's vocabulary exactly as the trainer maps them
(in-vocabulary ids unchanged, others ``splitmix64(id) mod V``), so the rows are the rows NestPipe trains.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from nestpipe.datasets.shards import Batch, Manifest
from nestpipe.utils.hashing import to_vocab


def _tables(batch: Batch, tables: Optional[Sequence[str]]) -> List[str]:
    found = sorted(k[: -len(".values")] for k in batch if k.endswith(".values"))
    if tables is None:
        return found
    missing = [t for t in tables if t not in found]
    if missing:
        raise KeyError(f"batch has no table(s) {missing} (it has {found})")
    return list(tables)


def to_jagged(batch: Batch, manifest: Optional[Manifest] = None, tables: Optional[Sequence[str]] = None
              ) -> Dict[str, object]:
    """``{"keys", "values", "lengths", "offsets"}`` of a shard batch (``nestpipe.datasets.shards.iter_shard``):
    int64 tensors in TorchRec's layout (module docstring); ``tables`` picks and orders the keys (default: all,
    sorted); ``manifest`` maps ids into the vocabularies."""
    import torch

    keys = _tables(batch, tables)
    values, lengths = [], []
    for t in keys:
        v = np.asarray(batch[f"{t}.values"], dtype=np.int64)
        if manifest is not None:
            if t not in manifest.tables:
                raise KeyError(f"table {t!r} is not in the manifest (tables: {sorted(manifest.tables)})")
            v = to_vocab(v, manifest.tables[t].vocab)
        values.append(v)
        lengths.append(np.asarray(batch[f"{t}.lengths"], dtype=np.int64))
    lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return {"keys": keys, "values": torch.from_numpy(np.concatenate(values) if values else np.zeros(0, np.int64)),
            "lengths": torch.from_numpy(lens), "offsets": torch.from_numpy(offsets)}


def to_kjt(batch: Batch, manifest: Optional[Manifest] = None, tables: Optional[Sequence[str]] = None):
    """The batch as a TorchRec ``KeyedJaggedTensor`` (the layout of :func:`to_jagged`)."""
    try:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except ImportError as e:
        raise ImportError("to_kjt needs TorchRec: pip install torchrec (with fbgemm-gpu; `make torchrec-env` "
                          "builds a tested environment), or use nestpipe.datasets.to_jagged") from e
    j = to_jagged(batch, manifest, tables)
    return KeyedJaggedTensor(keys=j["keys"], values=j["values"], lengths=j["lengths"], offsets=j["offsets"])
