"""The sharding plan the trainer runs with: which ranks hold the row shards of each sharded table.

``embedding.placement`` chooses (see docs/trainer.md):

- ``planned`` (default): the cost-driven greedy planner of :mod:`nestpipe.planning.planner` places the tables over
  the ranks of one exchange group. The exchange kind of every table is fixed first by the trainer's rule
  (:func:`~nestpipe.trainer.embedding.collection.choose_kind`: replicated / reduction / unique, overridable per
  table), so the planner decides only the layout of the sharded tables: table-wise (one owner) or row-wise over
  ``k`` ranks, and which ranks. Column-wise splits are not offered (the trainer keeps whole rows on one owner).
- ``hashed``: every sharded table row-wise over all ranks of the group (the placement hash balances the rows).
- a path to a ``nestpipe plan --out FILE`` document made for this group size; its exchange kinds (which tables
  are replicated, which exchanged by unique rows or by partial sums) are applied unless ``embedding.kinds`` asks
  for another kind for a table (:func:`plan_kinds`).

The plan is a pure function of the manifest, the configuration, the group size and the device kind, so every
rank computes the same plan without communicating; rank 0 saves it as ``RUN/plan.json``.
"""

from __future__ import annotations

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
        if int(spec.get("col_shards", 1)) != 1:
            raise ValueError(f"{placement}: table {t!r} is split by columns ({spec['col_shards']} column shards); "
                             "the trainer keeps whole rows on one owner: re-plan with `nestpipe plan "
                             "--no-column-split`")
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
    """Ranks holding ``table``'s row shards in shard order (``()``: all ranks, the ``hashed`` layout)."""
    if plan is None:
        return ()
    shards: List[Dict[str, Any]] = sorted(plan["tables"][table]["shards"], key=lambda s: s["rows"][0])
    return tuple(int(s["rank"]) for s in shards)


__all__ = ["HARDWARE_OF_DEVICE", "plan_kinds", "resolve_plan", "table_owners"]
