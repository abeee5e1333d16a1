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


def test_gather_into_given_memory_is_the_plain_gather():
    """The retrieval's gather straight into (pinned, on an accelerator) staging memory: the same values, written
    into the given tensors (no second copy), materialising untouched rows as the plain gather does."""
    pl = make_placement(3, 1000, 1, owners=(0,))
    a = RowStore("t", pl, 0, 12, seed=7, init_scale=0.05)
    b = RowStore("t", pl, 0, 12, seed=7, init_scale=0.05)
    rows = torch.tensor([3, 17, 400, 999], dtype=torch.int64)
    w_out, s_out = torch.full((4, 12), float("nan")), torch.full((4,), float("nan"))
    w, s = a.gather(rows, out=(w_out, s_out))
    assert w.data_ptr() == w_out.data_ptr() and s.data_ptr() == s_out.data_ptr()
    w_ref, s_ref = b.gather(rows)
    assert torch.equal(w, w_ref) and torch.equal(s, s_ref) and a.num_materialized == b.num_materialized == 4
    w2, none = a.gather(rows, with_state=False, out=(torch.empty(4, 12), None))
    assert torch.equal(w2, w_ref) and none is None
