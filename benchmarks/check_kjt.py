"""Check ``nestpipe.datasets.to_kjt`` against real TorchRec (run with the TorchRec environment's python, e.g.
``.venv-torchrec/bin/python benchmarks/check_kjt.py``; `make torchrec-env` builds it): every key's jagged values
and lengths of the KeyedJaggedTensor equal the batch's fields mapped into the vocabulary."""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nestpipe.datasets.interop import to_kjt  # noqa: E402
from nestpipe.datasets.shards import Manifest, TableSpec  # noqa: E402
from nestpipe.trainer.embedding.placement import to_vocab  # noqa: E402


def main() -> int:
    rng = np.random.default_rng(0)
    B, vocab = 7, {"item": 50, "user": 20, "hist": 30}
    batch = {}
    for t, v in vocab.items():
        lens = rng.integers(0, 5, B)
        batch[f"{t}.lengths"] = lens.astype(np.int32)
        batch[f"{t}.values"] = rng.integers(-5, 2 * v, int(lens.sum()))  # out-of-vocabulary ids too
    man = Manifest(task="ctr", batch_size=B, micro_batches=1, tables={t: TableSpec(vocab=v) for t, v in vocab.items()},
                   sets={})
    kjt = to_kjt(batch, man)
    assert kjt.keys() == sorted(vocab), kjt.keys()
    for t, v in vocab.items():
        jt = kjt[t]
        want = to_vocab(batch[f"{t}.values"], v)
        assert np.array_equal(jt.values().numpy(), want), t
        assert np.array_equal(jt.lengths().numpy(), batch[f"{t}.lengths"]), t
    import torchrec

    print(f"to_kjt agrees with torchrec {torchrec.__version__}'s KeyedJaggedTensor on {len(vocab)} keys x {B} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
