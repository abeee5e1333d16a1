"""The sharding plan the trainer runs with: which ranks hold the row shards of each sharded table.

``embedding.placement`` chooses (see docs/trainer.md):

- ``planned`` (default): the cost-driven greedy planner of :mod:`nestpipe.planning.planner` places the tables over
  the ranks of one exchange group. The exchange kind of every table is fixed first by the trainer's rule
  (:func:`~nestpipe.trainer.embedding.collection.choose_kind`: replicated / reduction / unique, overridable per
  table), so the planner decides only the layout of the sharded tables: table-wise (one owner) or row-wise over
  ``k`` ranks, and which ranks. It does not split tables by columns (a plan file may).
- ``hashed``: every sharded table row-wise over all ranks of the group (the placement hash balances the rows).
- a path to a ``nestpipe plan --out FILE`` document made for this group size; its exchange kinds (which tables
  are replicated, which exchanged by unique rows or by partial sums) are applied unless ``embedding.kinds`` asks
  for another kind for a table (:func:`plan_kinds`). Its column splits are executed as they are: a table cut into
  ``c`` column ranges becomes ``c`` *column shards* (stores named ``table@c0`` .. ``table@c{c-1}``, each with its
  own row layout and owners, :func:`column_shards`); a requester asks every column shard for its keys and
  concatenates the parts into whole rows. Each column shard keeps its own row-wise AdaGrad state (over its columns,
  as fbgemm's TBE does per shard), so a column-split table trains like ``c`` narrower tables, not bitwise like the
  whole table; every schedule still trains it bitwise alike.

The plan is a pure function of the manifest, the configuration, the group size and the device kind, so every
rank computes the same plan without communicating; rank 0 saves it as ``RUN/plan.json``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Tuple

from nestpipe.datasets.shards import Manifest
from nestpipe.planning.hardware import load_hardware
from nestpipe.planning.planner import PlannerConfig, load_plan, make_plan, tables_from_manifest

# Cost-model hardware per device kind. The CPU figures describe gloo over loopback on a small host: rows are
# copied within DRAM (``pcie_bw`` is a DRAM copy there), messages cost tens of microseconds.
HARDWARE_OF_DEVICE = {"cuda": "h100", "npu": "ascend-910b", "cpu": "cpu-gloo"}


def plan_kinds(placement: str, kinds: Dict[str, str], requested: Dict[str, str]) -> Dict[str, str]:
    """The exchange kind of every table when ``placement`` is a plan file: the plan's own (replicated, unique or
    reduction) for every table whose ``embedding.kinds`` entry is ``auto`` (a plan from ``nestpipe plan`` runs as
    it is), the configured one where a kind was asked for (:func:`resolve_plan` refuses a conflict). Other
    placements: ``kinds`` unchanged."""
    if placement in ("planned", "hashed"):
        return kinds
    plan = load_plan(placement)
    out = dict(kinds)
    for t in kinds:
        spec = plan["tables"].get(t)
        if spec is not None and requested.get(t, "auto") == "auto" and spec.get("exchange"):
            out[t] = spec["exchange"]
    return out


def resolve_plan(manifest: Manifest, placement: str, kinds: Dict[str, str], table_kind: Dict[str, str],
                 dims: Dict[str, int], group: int, device_type: str) -> Optional[Dict[str, Any]]:
    """The plan document for the sharded tables (``kinds[t] != "replicated"``), or None for ``hashed``."""
    sharded = sorted(t for t, k in kinds.items() if k != "replicated")
    if placement == "hashed" or not sharded:
        return None
    if placement == "planned":
        return _make(manifest, kinds, table_kind, dims, group, device_type)

    plan = load_plan(placement)
    if int(plan.get("group_size", -1)) != group:
        raise ValueError(f"{placement}: plan made for exchange groups of {plan.get('group_size')} workers, the run "
                         f"has {group}; re-plan with `nestpipe plan --workers {group}`")
    for t in sharded:
        spec = plan["tables"].get(t)
        if spec is None:
            raise ValueError(f"{placement}: no entry for table {t!r} (plan tables: {sorted(plan['tables'])})")
        if spec["sharding"] == "replicated":
            raise ValueError(f"{placement}: table {t!r} is replicated in the plan but exchanged as {kinds[t]!r} by "
                             "the configuration; set embedding.kinds or re-plan")
        if int(spec.get("col_shards", 1)) > 1:
            column_shards(plan, t, dims[t], where=placement)  # the column ranges tile the row: checked here
    return plan


def _make(manifest, kinds, table_kind, dims, group, device_type) -> Dict[str, Any]:
    infos = {t.name: t for t in tables_from_manifest(manifest)}
    tables = []
    for name in sorted(kinds):
        t = infos[name]
        t.dim = int(dims[name])
        tables.append(t)
    cfg = PlannerConfig(workers=group, batch_per_worker=manifest.batch_size, group_size=group, column_split=False,
                        fixed_replicated={t: kinds[t] == "replicated" for t in kinds},
                        hbm_cap=math.inf, dram_cap=math.inf)
    return make_plan(tables, cfg, load_hardware(HARDWARE_OF_DEVICE.get(device_type, "cpu-gloo")))


def table_owners(plan: Optional[Dict[str, Any]], table: str) -> Tuple[int, ...]:
    """Ranks holding ``table``'s row shards in shard order (``()``: all ranks, the ``hashed`` layout), for a table
    not split by columns (:func:`column_shards` gives each column shard's)."""
    if plan is None:
        return ()
    shards: List[Dict[str, Any]] = sorted(plan["tables"][table]["shards"], key=lambda s: s["rows"][0])
    return tuple(int(s["rank"]) for s in shards)


@dataclasses.dataclass(frozen=True)
class ColumnShard:
    """Columns ``[first_col, first_col + dim)`` of a table's rows, held row-wise by ``owners`` (in row-shard order;
    ``()``: every rank) in the store named ``store``."""

    table: str
    store: str
    first_col: int
    dim: int
    owners: Tuple[int, ...]


def column_store_name(table: str, j: int) -> str:
    return f"{table}@c{j}"


def column_shards(plan: Optional[Dict[str, Any]], table: str, dim: int, where: str = "plan") -> List[ColumnShard]:
    """The column shards of ``table`` (row width ``dim``) in column order: one store named ``table`` holding whole
    rows unless the plan splits the table by columns. The plan's column ranges are in its own ``dim``; they are
    scaled to ``dim`` (each boundary must land on a whole column) and must tile the row, and every column range's
    row shards must sit on distinct ranks."""
    spec = plan["tables"].get(table) if plan is not None else None
    if spec is None or int(spec.get("col_shards", 1)) <= 1:
        return [ColumnShard(table, table, 0, dim, table_owners(plan, table))]
    pdim = int(spec["dim"])
    groups: Dict[Tuple[int, int], List[Dict[str, Any]]] = {}
    for s in spec["shards"]:
        groups.setdefault((int(s["cols"][0]), int(s["cols"][1])), []).append(s)
    ranges = sorted(groups)
    if ranges[0][0] != 0 or ranges[-1][1] != pdim or any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
        raise ValueError(f"{where}: table {table!r}: the column ranges {ranges} do not tile its {pdim} columns")
    out = []
    for j, (lo, hi) in enumerate(ranges):
        if (lo * dim) % pdim or (hi * dim) % pdim:
            raise ValueError(f"{where}: table {table!r}: columns [{lo}, {hi}) of the plan's {pdim} do not map onto "
                             f"whole columns of the run's {dim}; re-plan with the run's embedding.dim")
        owners = tuple(int(s["rank"]) for s in sorted(groups[(lo, hi)], key=lambda s: s["rows"][0]))
        if len(set(owners)) != len(owners):
            raise ValueError(f"{where}: table {table!r}: columns [{lo}, {hi}) place two row shards on one rank "
                             f"({list(owners)})")
        out.append(ColumnShard(table, column_store_name(table, j), lo * dim // pdim, (hi - lo) * dim // pdim, owners))
    return out


__all__ = ["HARDWARE_OF_DEVICE", "ColumnShard", "column_shards", "column_store_name", "plan_kinds", "resolve_plan",
           "table_owners"]
