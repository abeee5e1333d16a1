"""The Python API: the README's example runs as written; the jagged layout of a shard batch."""

import os
import re

import numpy as np
import pytest
import torch

from nestpipe.datasets import to_jagged, to_kjt
from nestpipe.datasets.shards import iter_shard, load_manifest, shard_paths
from nestpipe.trainer.embedding.placement import to_vocab
from shard_sets import make_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_to_jagged_is_torchrec_layout_with_ids_in_the_vocabulary(tmp_path):
    """keys-major: every table's ids one table after another, lengths per (table, sample), offsets their running
    sum; ids mapped into the vocabulary as the trainer does (the shards hold out-of-vocabulary ids). Negative
    control: the sample-major concatenation differs, and without the manifest out-of-vocabulary ids stay raw."""
    d = str(tmp_path / "gr")
    make_shards(d, "gr", batch_size=12, micro_batches=3, shards=(1,), eval_shards=(1,), vocab=300, seq_len=8, seed=5,
                oov_rate=0.2)
    man = load_manifest(d)
    batch = next(iter_shard(shard_paths(d, man, "train")[0]))
    j = to_jagged(batch, man)
    assert j["keys"] == sorted(man.tables)
    want_values, want_lengths = [], []
    for t in j["keys"]:
        want_values.append(to_vocab(np.asarray(batch[f"{t}.values"], np.int64), man.tables[t].vocab))
        want_lengths.append(np.asarray(batch[f"{t}.lengths"], np.int64))
    assert torch.equal(j["values"], torch.from_numpy(np.concatenate(want_values)))
    assert torch.equal(j["lengths"], torch.from_numpy(np.concatenate(want_lengths)))
    assert j["offsets"][0] == 0 and torch.equal(j["offsets"].diff(), j["lengths"])
    assert all(int(v.max()) < man.tables[t].vocab for t, v in zip(j["keys"], want_values))
    # negative controls
    raw = to_jagged(batch)
    assert not torch.equal(raw["values"], j["values"])  # out-of-vocabulary ids present in the raw batch
    per_sample = []
    offs = {t: np.concatenate([[0], np.cumsum(batch[f"{t}.lengths"])]) for t in j["keys"]}
    for s in range(len(batch[f"{j['keys'][0]}.lengths"])):
        for t, v in zip(j["keys"], want_values):
            per_sample.append(v[offs[t][s]:offs[t][s + 1]])
    assert not torch.equal(torch.from_numpy(np.concatenate(per_sample)), j["values"])
    with pytest.raises(KeyError, match="no table"):
        to_jagged(batch, man, tables=["nope"])


def test_to_kjt_without_torchrec_names_the_install():
    pytest.importorskip("torch")
    try:
        import torchrec  # noqa: F401
        pytest.skip("torchrec is installed here: tests/test_torchrec_kjt.py checks to_kjt against it")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="pip install torchrec"):
        to_kjt({"a.values": np.zeros(1, np.int64), "a.lengths": np.ones(1, np.int64)})


@pytest.mark.slow
def test_readme_python_example_runs(tmp_path):
    """The README's "From Python" block, run as written (in a scratch working directory)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## From Python.*?```python\n(.*?)```", text, re.S).group(1)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(block, "README.md", "exec"), {})
    finally:
        os.chdir(cwd)
    assert (tmp_path / "runs/py/hstu/metrics.json").exists() and (tmp_path / "runs/py/hstu.pt").exists()
