"""The trainer's sharding plan: placement with owner subsets, the planned default, plan files, checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nestpipe.datasets.shards import load_manifest
from nestpipe.planning.hardware import load_hardware
from nestpipe.planning.planner import PlannerConfig, TableInfo, make_plan, save_plan, tables_from_manifest
from nestpipe.trainer.config import EmbeddingConfig
from nestpipe.trainer.embedding.collection import choose_kind, table_dims
from nestpipe.trainer.embedding.placement import TablePlacement, make_placement
from nestpipe.trainer.sharding_plan import resolve_plan, table_owners
from shard_sets import make_shards


@pytest.mark.parametrize("owners", [(), (1,), (2, 0), (0, 1, 2), (3, 1, 0)])
def test_owner_subsets_give_every_id_exactly_one_row(owners):
    world, vocab = 4, 1001
    pl = make_placement(5, vocab, world, owners=owners)
    ids = np.arange(vocab)
    owner, local = pl.owner_and_row(ids)
    holders = set(owners) if owners else set(range(world))
    assert set(owner.tolist()) == holders
    # every id maps to a distinct (owner, row) and back
    assert len(set(zip(owner.tolist(), local.tolist()))) == vocab
    assert sum(pl.local_rows(r) for r in range(world)) == vocab
    for r in range(world):
        mine = owner == r
        assert mine.sum() == pl.local_rows(r)
        if pl.local_rows(r):
            assert np.array_equal(np.sort(pl.ids_of_rows(r, local[mine])), ids[mine])
            assert local[mine].max() < pl.local_rows(r)
        else:
            assert r not in holders
            with pytest.raises(ValueError, match="holds no shard"):
                pl.ids_of_rows(r, np.arange(1))


def test_owner_subsets_are_validated():
    with pytest.raises(ValueError, match="distinct ranks"):
        make_placement(0, 10, 2, owners=(0, 0))
    with pytest.raises(ValueError, match="distinct ranks"):
        make_placement(0, 10, 2, owners=(2,))
    # all ranks in order is the default layout, stored as ()
    assert make_placement(0, 10, 3, owners=(0, 1, 2)).owners == ()
    assert TablePlacement(0, 10, 2, 3, 1).owner_ranks == (0, 1)


@pytest.fixture(scope="module")
def ctr_manifest(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("plan") / "ctr")
    make_shards(d, "ctr", batch_size=16, micro_batches=4, shards=(2, 2), vocab=400, seed=2)
    return d, load_manifest(d)


def _resolve(man, placement, world, cfg=None):
    cfg = cfg or EmbeddingConfig(replicate_max_rows=256)
    kinds = {t: choose_kind(t, s.vocab, s.kind, cfg) for t, s in man.tables.items()}
    return kinds, resolve_plan(man, placement, kinds, {t: s.kind for t, s in man.tables.items()},
                               table_dims(man, cfg), world, "cpu")


def test_planned_layout_respects_the_exchange_kinds_and_balances(ctr_manifest):
    _, man = ctr_manifest
    kinds, plan = _resolve(man, "planned", 2)
    sharded = sorted(t for t, k in kinds.items() if k != "replicated")
    assert sharded and plan["group_size"] == 2
    for t in sharded:
        spec = plan["tables"][t]
        assert spec["sharding"] in ("table_wise", "row_wise") and spec["col_shards"] == 1
        assert spec["exchange"] == kinds[t]
        own = table_owners(plan, t)
        assert len(own) == spec["row_shards"] and len(set(own)) == len(own)
    for t, k in kinds.items():
        assert (plan["tables"][t]["sharding"] == "replicated") == (k == "replicated")
    # the greedy search uses both ranks (it is not "everything on rank 0")
    assert {r for t in sharded for r in table_owners(plan, t)} == {0, 1}
    assert _resolve(man, "hashed", 2)[1] is None


def test_plan_file_is_used_and_checked(ctr_manifest, tmp_path):
    d, man = ctr_manifest
    kinds, _ = _resolve(man, "planned", 2)
    tables = tables_from_manifest(man)
    hw = load_hardware("cpu-gloo")
    fixed = {t: k == "replicated" for t, k in kinds.items()}
    good = make_plan(tables, PlannerConfig(workers=2, group_size=2, column_split=False, fixed_replicated=fixed), hw)
    path = str(tmp_path / "plan.json")
    save_plan(good, path)
    assert _resolve(man, path, 2)[1]["tables"] == good["tables"]
    with pytest.raises(ValueError, match="groups of 2 workers, the run has 3"):
        _resolve(man, path, 3)
    split = make_plan(tables, PlannerConfig(workers=4, group_size=4, fixed_replicated=fixed, min_col_dim=2,
                                            batch_per_worker=100000), hw)
    save_plan(split, path)
    assert _resolve(man, path, 4)[1]["tables"] == split["tables"]  # column splits included (column_shards)
    rep = dict(good, tables={t: dict(v, sharding="replicated") for t, v in good["tables"].items()})
    save_plan(rep, path)
    with pytest.raises(ValueError, match="replicated in the plan"):
        _resolve(man, path, 2)


def test_column_split_off_never_splits_columns():
    # one hot pooled table dominates: splitting it by columns is what the cost model prefers
    tables = [TableInfo("hot", 10_000_000, 128, "pooled", 50.0, 0.5), TableInfo("a", 1_000_000, 64, "single"),
              TableInfo("b", 1_000_000, 64, "single")]
    hw = load_hardware("cpu-gloo")
    on = make_plan(tables, PlannerConfig(workers=8, group_size=8, batch_per_worker=4096, hbm_cap=1e6), hw)
    off = make_plan(tables, PlannerConfig(workers=8, group_size=8, batch_per_worker=4096, hbm_cap=1e6,
                                          column_split=False), hw)
    assert any(v["col_shards"] > 1 for v in on["tables"].values())  # the control: splits happen when allowed
    assert all(v["col_shards"] <= 1 for v in off["tables"].values())


def test_column_shards_map_the_plans_columns_onto_the_run(ctr_manifest, tmp_path):
    """A plan's column ranges become column shards in column order, scaled to the run's row width; ranges that do not
    tile the row, land between columns, or put two row shards of one range on a rank are refused."""
    from nestpipe.trainer.sharding_plan import column_shards

    from shard_sets import column_split_plan

    d, _ = ctr_manifest
    plan = column_split_plan(d, str(tmp_path / "p.json"), 2, 256, {"history": [(1,), (0,)],
                                                                   "video_id": [(0, 1), (1, 0)]})
    cs = column_shards(plan, "history", 16)  # the plan says 8 columns; the run's rows are 16 wide
    assert [(c.store, c.first_col, c.dim, c.owners) for c in cs] == [("history@c0", 0, 8, (1,)),
                                                                     ("history@c1", 8, 8, (0,))]
    assert [c.owners for c in column_shards(plan, "video_id", 8)] == [(0, 1), (1, 0)]
    assert [(c.store, c.dim) for c in column_shards(plan, "tag", 8)] == [("tag", 8)]  # not split: whole rows
    assert [(c.store, c.owners) for c in column_shards(None, "tag", 8)] == [("tag", ())]  # hashed
    with pytest.raises(ValueError, match="whole columns"):
        column_shards(plan, "history", 5)  # the plan's boundary at column 4 of 8 would be column 2.5 of 5
    bad = json.loads(json.dumps(plan))
    bad["tables"]["history"]["shards"][1]["cols"] = [5, 8]
    with pytest.raises(ValueError, match="do not tile"):
        column_shards(bad, "history", 8)
    bad = json.loads(json.dumps(plan))
    bad["tables"]["video_id"]["shards"][1]["rank"] = 0
    with pytest.raises(ValueError, match="two row shards on one rank"):
        column_shards(bad, "video_id", 8)


def test_initial_rows_of_a_column_shard_are_the_whole_rows_columns():
    from nestpipe.trainer.embedding.placement import init_rows

    ids = np.array([0, 5, 399, 12345], dtype=np.int64)
    whole = init_rows(7, 3, ids, 16, 0.1)
    assert np.array_equal(np.concatenate([init_rows(7, 3, ids, 8, 0.1), init_rows(7, 3, ids, 8, 0.1, 8)], 1), whole)
    assert not np.array_equal(init_rows(7, 3, ids, 8, 0.1), whole[:, 8:])  # the control: the offset matters
