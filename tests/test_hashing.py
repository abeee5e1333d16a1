"""One SplitMix64 (``nestpipe.utils.hashing``) and one row-placement rule for the whole package.

The values every user derives from the hash are pinned here (they were computed before the users shared one
module): the synthetic data, the clustering's combined keys and the trainer's placement and row initialisation must
not move, or shards, synthetic sets and checkpoints written earlier would no longer match.
"""

import pathlib
import re

import numpy as np
import pytest
import torch

from nestpipe import kernels
from nestpipe.clustering.keys import combine_keys
from nestpipe.datasets.synth import _hash_u64
from nestpipe.trainer.embedding.placement import init_rows, make_placement, to_vocab
from nestpipe.utils import hashing

IDS = np.array([0, 1, 2, 12345, -1, -2**63, 2**63 - 1, 99999999, 7, 1 << 40], dtype=np.int64)


def test_the_three_forms_agree_at_the_extremes():
    for k in (1, 2, 37):
        ints = [hashing.splitmix64_int(int(x), k) for x in IDS]
        assert [int(v) for v in hashing.splitmix64(IDS, k)] == ints
        assert hashing.splitmix64_torch(torch.from_numpy(IDS), k).tolist() == [hashing.signed64(v) for v in ints]
    assert [int(v) for v in hashing.mix64(IDS.view(np.uint64))] == [hashing.mix64_int(int(x)) for x in IDS]
    # the generator's step is the finaliser of state + gamma (negative control: not the bare finaliser)
    assert hashing.splitmix64_int(5) == hashing.mix64_int(5 + hashing.GAMMA) != hashing.mix64_int(5)


def test_every_user_keeps_its_values():
    """Pinned outputs of each user of the hash (values from before the users shared the module)."""
    assert [int(x) for x in combine_keys(3, IDS[:3])] == [-2971997915922819399, -4986418406098498070,
                                                          4489693845822620136]
    assert [int(x) for x in _hash_u64(np.abs(IDS[:3]), 5)] == [6038094601263162090, 14072917602864530048,
                                                               6394052312532759219]
    assert [(p.a, p.b) for p in (make_placement(0, 1, 3), make_placement(0, 2, 3), make_placement(0, 1000, 3))] == [
        (1, 0), (1, 1), (547, 253)]
    np.testing.assert_array_equal(init_rows(7, 2, IDS[:1], 4, 0.1)[0], np.array(
        [-0.014851081185042858, 0.07850680500268936, -0.07354798167943954, -0.02970989979803562], dtype=np.float32))
    assert to_vocab(IDS[:4], 1000).tolist() == [0, 1, 2, int(hashing.splitmix64_int(12345) % 1000)]


def test_splitmix64_is_written_once():
    """No module of the package carries the SplitMix64 multipliers except ``nestpipe.utils.hashing`` (negative
    control: the search finds them there)."""
    root = pathlib.Path(__file__).resolve().parents[1] / "nestpipe"
    pattern = re.compile(r"0x(BF58476D1CE4E5B9|94D049BB133111EB)", re.IGNORECASE)
    holders = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if pattern.search(p.read_text()))
    assert holders == ["utils/hashing.py"], holders


@pytest.mark.parametrize("vocab, world, owners", [(1, 2, ()), (2, 3, ()), (1000, 3, ()), (99_991, 4, ()),
                                                  (2**31 - 1, 8, ()), (5000, 3, (2, 0))])
def test_kernels_and_trainer_place_every_id_alike(vocab, world, owners):
    """``nestpipe.kernels.placement`` and the trainer's ``TablePlacement`` are one rule: the same owner and local
    row for every id, in and out of the vocabulary (a table-wise or subset layout maps shard j to ``owners[j]``).
    Negative control: an affine permutation derived another way (the kernels' rule before the two were merged)
    agrees on few ids."""
    rng = np.random.default_rng(vocab)
    ids = np.concatenate([IDS, rng.integers(0, vocab, 2000), rng.integers(-2**63, 2**63 - 1, 500)])
    for table in (0, 5):
        pl = make_placement(table, vocab, world, owners=owners)
        owner, row = pl.owner_and_row(to_vocab(ids, vocab))
        k_owner, k_row = kernels.placement(table, torch.from_numpy(ids), vocab, pl.shards)
        if owners:
            k_owner = torch.tensor(owners)[k_owner]
        assert k_owner.tolist() == owner.tolist() and k_row.tolist() == row.tolist()
    if vocab > 1000:
        x = to_vocab(ids, vocab)
        a = 1 + hashing.splitmix64_int(0) % (vocab - 1)
        while np.gcd(a, vocab) != 1:
            a += 1
        other = (x * a + hashing.splitmix64_int(1) % vocab) % vocab
        assert np.mean(other == make_placement(0, vocab, world).permute(x)) < 0.05


def test_place_keys_paths_agree():
    """The trainer's routing arithmetic through the dispatch: the Numba pass and the NumPy reference give the same
    owners and rows, and the call is recorded under the path taken (negative control: a forced path is what is
    recorded, so a record that did not follow the call would show)."""
    pl = make_placement(4, 99_991, 3, owners=(2, 0, 1))
    ids = np.random.default_rng(0).integers(0, 99_991, 5000)
    kernels.reset_taken()
    got = {}
    for path in ("numba", "reference"):
        with kernels.forced({"place_keys": path}):
            got[path] = pl.owner_and_row(ids)
    assert all(np.array_equal(x, y) for x, y in zip(got["numba"], got["reference"]))
    assert sorted(kernels.taken_paths()["place_keys"]) == ["numba", "reference"]
    assert set(got["numba"][0].tolist()) == {0, 1, 2} and got["numba"][1].max() < pl.rows_per_rank
