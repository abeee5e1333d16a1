"""The DRAM store: eager and lazy initialisation give the same rows."""

import torch

from nestpipe.trainer.embedding.store import RowStore
from nestpipe.trainer.embedding.placement import make_placement


def test_eager_and_lazy_initialisation_agree_bitwise():
    pl = make_placement(3, 5000, 2, owners=(1, 0))
    lazy = RowStore("t", pl, 0, 12, seed=7, init_scale=0.05)
    eager = RowStore("t", pl, 0, 12, seed=7, init_scale=0.05, eager_rows=10_000)
    n = pl.local_rows(0)
    assert lazy.num_materialized == 0 and eager.num_materialized == n == int(eager.materialized.sum())
    rows = torch.randperm(n)[:700]
    assert torch.equal(lazy.gather(rows)[0], eager.gather(rows)[0])
    assert torch.equal(lazy.gather(torch.arange(n))[0], eager.weight)
    # the control: another seed gives other rows, so equality above is not vacuous
    other = RowStore("t", pl, 0, 12, seed=8, init_scale=0.05, eager_rows=10_000)
    assert not torch.equal(other.weight, eager.weight)
    # above the threshold the store stays lazy
    assert RowStore("t", pl, 0, 12, seed=7, init_scale=0.05, eager_rows=n - 1).num_materialized == 0
