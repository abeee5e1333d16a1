"""``nestpipe.datasets.to_kjt`` against real TorchRec, runnable without pytest (the TorchRec environment that
``make torchrec-env`` builds has no pytest): ``tests/test_torchrec_kjt.py`` calls :func:`check` in-process where
torchrec imports, and runs ``python -c 'import kjt_check; kjt_check.main()'`` under that environment's python."""

from __future__ import annotations

import numpy as np

B, VOCAB = 7, {"item": 50, "user": 20, "hist": 30}


def check() -> str:
    """Every key's jagged values and lengths of the KeyedJaggedTensor equal the batch's fields mapped into the
    vocabulary; negative control: the raw ids (out-of-vocabulary ones included) differ from the KJT's values."""
    import torchrec

    from nestpipe.datasets.interop import to_kjt
    from nestpipe.datasets.shards import Manifest, TableSpec
    from nestpipe.trainer.embedding.placement import to_vocab

    rng = np.random.default_rng(0)
    batch = {}
    for t, v in VOCAB.items():
        lens = rng.integers(0, 5, B)
        batch[f"{t}.lengths"] = lens.astype(np.int32)
        batch[f"{t}.values"] = rng.integers(-5, 2 * v, int(lens.sum()))  # out-of-vocabulary ids too
    man = Manifest(task="ctr", batch_size=B, micro_batches=1, tables={t: TableSpec(vocab=v) for t, v in VOCAB.items()},
                   sets={})
    kjt = to_kjt(batch, man)
    assert isinstance(kjt, torchrec.KeyedJaggedTensor), type(kjt)
    assert kjt.keys() == sorted(VOCAB), kjt.keys()
    raw_differs = False
    for t, v in VOCAB.items():
        jt = kjt[t]
        want = to_vocab(batch[f"{t}.values"], v)
        assert np.array_equal(jt.values().numpy(), want), t
        assert np.array_equal(jt.lengths().numpy(), batch[f"{t}.lengths"]), t
        raw_differs |= not np.array_equal(jt.values().numpy(), batch[f"{t}.values"])
    assert raw_differs, "the batch held no out-of-vocabulary id: the comparison would not see a missing mapping"
    return f"to_kjt agrees with torchrec {torchrec.__version__}'s KeyedJaggedTensor on {len(VOCAB)} keys x {B} samples"


def main() -> int:
    print(check())
    return 0
