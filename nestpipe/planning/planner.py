"""Cost-driven greedy sharding planner (in the spirit of EMBark).

Each table becomes ``replicated`` (data-parallel: a full copy in every worker's device memory, gradients of the
touched rows all-reduced) or ``row_shards x col_shards`` shards, each on its own worker of a group of G workers
(the 2D-SP group; ``replica_groups = workers / G`` copies of the layout train data-parallel). Sharding names:
``table_wise`` (1 x 1), ``row_wise`` (r x 1), ``column_wise`` (1 x c), ``table_row_wise`` (r x c).

Per-step cost of a shard on its owner (seconds; hardware from :mod:`nestpipe.planning.hardware`):

- requests: every one of the G requesters sends its distinct keys of the table, ``U_T = hotness x B x u_T``
  (``u_T`` the table's unique-key ratio); a shard with ``r`` row shards receives ``G U_T / r`` of them, each
  costing ``host_key_ns`` plus ``dim / c`` columns of bytes from DRAM and over PCIe (the lookup);
- All2All: unique-based tables send the requested rows back and receive their gradients
  (``2 G U_T / r x dim / c x bytes``); reduction-based (pooled) tables send one partial sum per sample and
  requester whatever ``r`` is (``2 G B dim / c x bytes``): row-splitting a pooled table does not cut its traffic,
  column-splitting does (EMBark's observation);
- replicated: no requests; ``U_T x dim x bytes`` more in the AllReduce over all workers that the dense gradients
  take anyway (its bandwidth term only: no collective of its own, so a tiny table costs next to nothing).

Memory: a shard's rows x (dim / c x bytes + 4 bytes of row-wise AdaGrad state) in host DRAM (``dram_cap``);
replicated tables, the same per row in device memory (``hbm_cap``). With a local disk for the memory-mapped tier
(``disk_cap`` > 0, the trainer's ``embedding.tier = mmap``), a shard that fits no worker's DRAM goes to a worker's
disk instead, behind a DRAM cache of ``dram_cache`` bytes (reserved once on each worker holding such shards); it
costs its owner the rows it misses, read from disk, and as many written back (a 4 KiB page per row and file) at the
disk's measured random read and write bandwidth (``disk_read_bw``, ``disk_write_bw``; :mod:`nestpipe.planning.disk`):
misses = the shard's distinct requested rows times the share of the shard the cache cannot hold (uniform access: an
upper bound for skewed ids, whose hot rows stay cached).

Search: replicate every table whose AllReduce is cheaper than its table-wise cost and that fits the device cap;
place the rest table-wise, largest cost first onto the least-loaded worker with room (LPT); then repeatedly take
the most-loaded worker's costliest shard and split its table once more (by columns while ``dim / c`` stays a
multiple of ``min_col_dim``, preferred for pooled tables; else by rows), re-place, and keep the split only if
the maximum worker cost drops. The group size G is chosen by planning every candidate and adding the replica
synchronisation (AllReduce of the touched rows across groups).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional

from nestpipe.utils.jsonio import read_json, write_json_atomic

from . import network
from .hardware import HardwareConfig

PLAN_FORMAT = "nestpipe-plan"
PLAN_VERSION = 1
EXCHANGE_OF_KIND = {"sequence": "unique", "single": "unique", "pooled": "reduction"}


@dataclasses.dataclass
class TableInfo:
    """A table to place. ``hotness``: keys per sample; ``unique_ratio``: distinct / keys in one worker's batch."""

    name: str
    vocab: int
    dim: int
    kind: str = "sequence"  # sequence | single | pooled
    hotness: float = 1.0
    unique_ratio: float = 1.0
    bytes_per_value: int = 4

    def validate(self, where: str = "tables") -> None:
        if self.kind not in EXCHANGE_OF_KIND:
            raise ValueError(f"{where}: table {self.name!r}: kind must be one of {sorted(EXCHANGE_OF_KIND)}")
        if self.vocab < 1 or self.dim < 1 or self.hotness <= 0 or not 0 < self.unique_ratio <= 1:
            raise ValueError(f"{where}: table {self.name!r}: need vocab, dim >= 1, hotness > 0, 0 < unique_ratio <= 1")


@dataclasses.dataclass
class PlannerConfig:
    workers: int = 8
    batch_per_worker: int = 512
    group_size: Optional[int] = None  # None: chosen among powers of two dividing workers
    hbm_cap: float = 16e9  # device bytes per worker for replicated tables
    dram_cap: float = 256e9  # host bytes per worker for shards
    min_col_dim: int = 16
    max_iters: int = 2000
    column_split: bool = True  # False: whole rows stay on one owner (what the trainer executes)
    # table name -> replicated or not, decided by the caller (the trainer's exchange-kind rule); others: by cost
    fixed_replicated: Optional[Dict[str, bool]] = None
    # the memory-mapped tier: local disk bytes per worker (0: no tier), its DRAM cache per worker, and the disk's
    # measured random-row read and write bandwidth (bytes/s)
    disk_cap: float = 0.0
    dram_cache: float = 0.0
    disk_read_bw: float = 0.0
    disk_write_bw: float = 0.0

    def validate(self) -> None:
        if self.workers < 1 or self.batch_per_worker < 1:
            raise ValueError("plan: --workers and --batch must be >= 1")
        if self.group_size is not None and (self.group_size < 1 or self.workers % self.group_size):
            raise ValueError(f"plan: --group-size {self.group_size} must divide --workers {self.workers}")
        if self.disk_cap < 0 or self.dram_cache < 0:
            raise ValueError("plan: --disk-cap and --dram-cache must be >= 0")
        if self.disk_cap > 0 and (self.disk_read_bw <= 0 or self.disk_write_bw <= 0):
            raise ValueError("plan: --disk-cap needs the disk's bandwidths (--disk-read-bw/--disk-write-bw, or "
                             "--store-dir DIR to measure them)")
        if self.disk_cap > 0 and self.dram_cache >= self.dram_cap:
            raise ValueError(f"plan: --dram-cache {self.dram_cache:.3g} B leaves no DRAM of --dram-cap "
                             f"{self.dram_cap:.3g} B for shards")


@dataclasses.dataclass
class _Layout:
    rows: int = 1
    cols: int = 1
    replicated: bool = False


def _unique(t: TableInfo, batch: int) -> float:
    return min(t.hotness * batch * t.unique_ratio, float(t.vocab))


def shard_cost(t: TableInfo, lay: _Layout, group: int, workers: int, batch: int, hw: HardwareConfig) -> float:
    """Seconds per step that one shard of ``t`` under ``lay`` costs its owner (see the module docstring)."""
    u = _unique(t, batch)
    if lay.replicated:
        # the replicated tables' gradients ride in the one AllReduce of the dense gradients (the trainer flattens
        # them into one buffer): a table adds its bytes, not another collective's latency
        return network.allreduce_seconds(hw, workers, u * t.dim * t.bytes_per_value, latency=False)
    cb = t.dim / lay.cols * t.bytes_per_value
    keys = group * u / lay.rows
    lookup = keys * (hw.host_key_ns * 1e-9 + cb / hw.dram_bw + cb / hw.pcie_bw)
    if EXCHANGE_OF_KIND[t.kind] == "reduction":
        send = 2 * group * batch * cb
    else:
        send = 2 * keys * cb
    return lookup + send / hw.net_bw


def tier_cost(t: TableInfo, lay: _Layout, group: int, batch: int, cfg: PlannerConfig) -> float:
    """Seconds per step a shard on the memory-mapped tier adds: its missed rows read from disk and written back."""
    if cfg.disk_read_bw <= 0 or cfg.disk_write_bw <= 0:
        return 0.0
    b = _shard_bytes(t, lay)
    miss = max(0.0, 1.0 - cfg.dram_cache / b) if b else 0.0
    # a missed row costs a 4 KiB page of its weight file and one of its state file, read and later written back
    pages = math.ceil((t.dim / lay.cols * t.bytes_per_value) / 4096) + 1
    rows = group * _unique(t, batch) / lay.rows * miss
    return rows * pages * 4096 * (1.0 / cfg.disk_read_bw + 1.0 / cfg.disk_write_bw)


def _shard_bytes(t: TableInfo, lay: _Layout) -> float:
    rows = t.vocab if lay.replicated else math.ceil(t.vocab / lay.rows)
    cols = t.dim if lay.replicated else t.dim // lay.cols
    return rows * (cols * t.bytes_per_value + 4)


def _place(tables: List[TableInfo], lays: Dict[str, _Layout], group: int, workers: int, batch: int,
           hw: HardwareConfig, cfg: PlannerConfig):
    """LPT placement of all shards; returns (placement {name: [ranks]}, per-rank cost, dram, hbm) or None."""
    load = [0.0] * group
    dram = [0.0] * group
    hbm = 0.0
    shards = []
    for t in tables:
        lay = lays[t.name]
        if lay.replicated:
            hbm += _shard_bytes(t, lay)
            continue
        c = shard_cost(t, lay, group, workers, batch, hw)
        b = _shard_bytes(t, lay)
        for k in range(lay.rows * lay.cols):
            shards.append((c, b, t.name, k))
    if hbm > cfg.hbm_cap:
        return None
    shards.sort(key=lambda s: (-s[0], -s[1], s[2], s[3]))
    placement: Dict[str, List[int]] = {t.name: [] for t in tables if not lays[t.name].replicated}
    disk = [0.0] * group
    tiered: Dict[str, List[bool]] = {t.name: [] for t in tables if not lays[t.name].replicated}
    by_name = {t.name: t for t in tables}
    for c, b, name, _ in shards:
        used = set(placement[name])
        best = None
        for r in range(group):
            if r in used or dram[r] + b > cfg.dram_cap:
                continue
            if best is None or load[r] < load[best]:
                best = r
        on_disk = False
        if best is None and cfg.disk_cap > 0:  # the memory-mapped tier: disk room, and DRAM for the cache
            for r in range(group):
                cache = 0.0 if disk[r] > 0 else cfg.dram_cache
                if r in used or disk[r] + b > cfg.disk_cap or dram[r] + cache > cfg.dram_cap:
                    continue
                if best is None or load[r] < load[best]:
                    best = r
            on_disk = best is not None
        if best is None:
            return None
        placement[name].append(best)
        tiered[name].append(on_disk)
        if on_disk:
            dram[best] += 0.0 if disk[best] > 0 else cfg.dram_cache
            disk[best] += b
            load[best] += c + tier_cost(by_name[name], lays[name], group, batch, cfg)
        else:
            load[best] += c
            dram[best] += b
    rep_cost = sum(shard_cost(t, lays[t.name], group, workers, batch, hw) for t in tables if lays[t.name].replicated)
    return placement, [x + rep_cost for x in load], dram, hbm, disk, tiered


def _split_options(t: TableInfo, lay: _Layout, group: int, cfg: PlannerConfig) -> List[_Layout]:
    opts = []
    col_ok = cfg.column_split and t.dim % (lay.cols * 2) == 0 and t.dim // (lay.cols * 2) >= cfg.min_col_dim
    row_ok = lay.rows * 2 <= t.vocab
    fits = lambda l: l.rows * l.cols <= group  # noqa: E731 - shards of a table sit on distinct workers
    col = _Layout(lay.rows, lay.cols * 2)
    row = _Layout(lay.rows * 2, lay.cols)
    order = [(col_ok, col), (row_ok, row)] if t.kind == "pooled" else [(row_ok, row), (col_ok, col)]
    for ok, l in order:
        if ok and fits(l):
            opts.append(l)
    return opts


def plan_group(tables: List[TableInfo], group: int, cfg: PlannerConfig, hw: HardwareConfig) -> Dict[str, Any]:
    """Greedy plan of ``tables`` over one group of ``group`` workers. DRAM first: shards go to the memory-mapped
    tier only when the tables fit no DRAM layout (row splits included)."""
    if cfg.disk_cap > 0:
        try:
            return plan_group(tables, group, dataclasses.replace(cfg, disk_cap=0.0), hw)
        except ValueError:
            pass  # the tables do not fit the group's DRAM: place on the tier
    W, B = cfg.workers, cfg.batch_per_worker
    lays: Dict[str, _Layout] = {}
    for t in tables:
        rep = _Layout(replicated=True)
        tw = _Layout()
        lays[t.name] = tw
        if (group > 1 and _shard_bytes(t, rep) <= cfg.hbm_cap / max(len(tables), 1)
                and shard_cost(t, rep, group, W, B, hw) < shard_cost(t, tw, group, W, B, hw)):
            lays[t.name] = rep
        if group == 1:
            lays[t.name] = tw
        if cfg.fixed_replicated is not None and t.name in cfg.fixed_replicated:
            lays[t.name] = rep if cfg.fixed_replicated[t.name] else tw
    placed = _place(tables, lays, group, W, B, hw, cfg)
    # tables too big for one worker's DRAM start split by rows
    while placed is None:
        big = max((t for t in tables if not lays[t.name].replicated),
                  key=lambda t: _shard_bytes(t, lays[t.name]), default=None)
        if big is None or lays[big.name].rows * 2 * lays[big.name].cols > group:
            raise ValueError(f"plan: tables do not fit: {group} workers x dram_cap {cfg.dram_cap:.3g} B "
                             f"(hbm_cap {cfg.hbm_cap:.3g} B for replicated tables"
                             + (f", disk_cap {cfg.disk_cap:.3g} B for the memory-mapped tier)" if cfg.disk_cap else
                                "; give --disk-cap to place shards on the memory-mapped tier)"))
        lays[big.name] = _Layout(lays[big.name].rows * 2, lays[big.name].cols)
        placed = _place(tables, lays, group, W, B, hw, cfg)
    iters = 0
    tried = set()
    while iters < cfg.max_iters:
        iters += 1
        placement, load = placed[0], placed[1]
        worst = max(range(group), key=lambda r: load[r])
        on_worst = [t for t in tables if not lays[t.name].replicated and worst in placement[t.name]]
        on_worst.sort(key=lambda t: -shard_cost(t, lays[t.name], group, W, B, hw))
        improved = False
        for t in on_worst:
            for opt in _split_options(t, lays[t.name], group, cfg):
                key = (t.name, opt.rows, opt.cols)
                if key in tried:
                    continue
                tried.add(key)
                trial = dict(lays)
                trial[t.name] = opt
                res = _place(tables, trial, group, W, B, hw, cfg)
                if res is not None and max(res[1]) < max(load) * (1 - 1e-9):
                    lays, placed, improved = trial, res, True
                    break
            if improved:
                break
        if not improved:
            break
    placement, load, dram, hbm, disk, tiered = placed
    return {"layouts": lays, "placement": placement, "load": load, "dram": dram, "hbm": hbm, "disk": disk,
            "tiered": tiered, "iterations": iters}


def _sharding_name(lay: _Layout) -> str:
    if lay.replicated:
        return "replicated"
    return {(True, True): "table_wise", (False, True): "row_wise", (True, False): "column_wise"}.get(
        (lay.rows == 1, lay.cols == 1), "table_row_wise")


def replica_sync_seconds(tables: List[TableInfo], lays, group: int, cfg: PlannerConfig, hw: HardwareConfig) -> float:
    """AllReduce across the ``workers / group`` replicas of the touched rows of the busiest worker's shards."""
    m = cfg.workers // group
    if m <= 1:
        return 0.0
    rows = sum(group * _unique(t, cfg.batch_per_worker) * t.dim * t.bytes_per_value
               for t in tables if not lays[t.name].replicated) / group
    return network.allreduce_seconds(hw, m, rows, stride=group)


def group_candidates(workers: int, hw: HardwareConfig) -> List[int]:
    out = {workers}
    g = 1
    while g < workers:
        if workers % g == 0 and g >= min(hw.node_size, workers):
            out.add(g)
        g *= 2
    return sorted(out)


def make_plan(tables: List[TableInfo], cfg: PlannerConfig, hw: HardwareConfig) -> Dict[str, Any]:
    """The plan document (schema in docs/planning.md)."""
    cfg.validate()
    if not tables:
        raise ValueError("plan: no tables to place")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError("plan: duplicate table names")
    for t in tables:
        t.validate()
    cands = [cfg.group_size] if cfg.group_size else group_candidates(cfg.workers, hw)
    best, error = None, None
    for g in cands:
        try:
            res = plan_group(tables, g, cfg, hw)
        except ValueError as e:  # the tables fit no layout of this group size: the other candidates may
            error = e
            continue
        total = max(res["load"]) + replica_sync_seconds(tables, res["layouts"], g, cfg, hw)
        if best is None or total < best[0] * (1 - 1e-9):
            best = (total, g, res)
    if best is None:
        raise error
    total, group, res = best
    lays, placement = res["layouts"], res["placement"]
    out_tables = {}
    for t in tables:
        lay = lays[t.name]
        shards = []
        if not lay.replicated:
            rows_per = math.ceil(t.vocab / lay.rows)
            cols_per = t.dim // lay.cols
            for k, rank in enumerate(placement[t.name]):
                ri, ci = divmod(k, lay.cols)
                shards.append({"rank": rank, "rows": [ri * rows_per, min(t.vocab, (ri + 1) * rows_per)],
                               "cols": [ci * cols_per, (ci + 1) * cols_per],
                               "tier": "mmap" if res["tiered"][t.name][k] else "dram"})
        out_tables[t.name] = {
            "sharding": _sharding_name(lay),
            "exchange": "replicated" if lay.replicated else EXCHANGE_OF_KIND[t.kind],
            "row_shards": 0 if lay.replicated else lay.rows, "col_shards": 0 if lay.replicated else lay.cols,
            "vocab": t.vocab, "dim": t.dim, "kind": t.kind, "hotness": t.hotness, "unique_ratio": t.unique_ratio,
            "shard_cost_ms": 1e3 * shard_cost(t, lay, group, cfg.workers, cfg.batch_per_worker, hw),
            "tier": "mmap" if any(sh["tier"] == "mmap" for sh in shards) else "dram",
            "shards": shards,
        }
    load = res["load"]
    return {
        "format": PLAN_FORMAT, "version": PLAN_VERSION, "hardware": hw.name, "workers": cfg.workers,
        "group_size": group, "replica_groups": cfg.workers // group, "batch_per_worker": cfg.batch_per_worker,
        "tables": out_tables,
        "ranks": [{"rank": r, "cost_ms": 1e3 * load[r], "dram_bytes": res["dram"][r], "hbm_bytes": res["hbm"],
                   "disk_bytes": res["disk"][r]} for r in range(group)],
        "estimate": {"max_rank_cost_ms": 1e3 * max(load), "mean_rank_cost_ms": 1e3 * sum(load) / len(load),
                     "replica_sync_ms": 1e3 * replica_sync_seconds(tables, lays, group, cfg, hw),
                     "iterations": res["iterations"]},
        "trainer_config": {"embedding": dict({"kinds": {n: v["exchange"] for n, v in out_tables.items()}}, **(
            {"tier": "mmap", "dram_cache_mb": cfg.dram_cache / 2**20} if any(v["tier"] == "mmap" for v in
                                                                            out_tables.values()) else {})),
                           "sparse_groups": group},  # the trainer's --sparse-groups M: workers per group
        "tier": {"disk_cap": cfg.disk_cap, "dram_cache": cfg.dram_cache, "disk_read_bw": cfg.disk_read_bw,
                 "disk_write_bw": cfg.disk_write_bw, "tables": sorted(n for n, v in out_tables.items()
                                                                      if v["tier"] == "mmap")},
    }


def format_plan(plan: Dict[str, Any]) -> str:
    head = f"{'table':<22} {'sharding':<15} {'exchange':<10} {'shards':>7} {'vocab':>12} {'dim':>5} {'cost ms':>9}"
    lines = [f"plan for {plan['workers']} workers: groups of {plan['group_size']} x {plan['replica_groups']} "
             f"replica group(s), batch {plan['batch_per_worker']}/worker, hardware {plan['hardware']}", head,
             "-" * len(head)]
    for name, t in sorted(plan["tables"].items(), key=lambda kv: -kv[1]["shard_cost_ms"]):
        shards = "all" if t["sharding"] == "replicated" else f"{t['row_shards']}x{t['col_shards']}"
        lines.append(f"{name:<22} {t['sharding']:<15} {t['exchange']:<10} {shards:>7} {t['vocab']:>12} "
                     f"{t['dim']:>5} {t['shard_cost_ms']:>9.3f}")
    e = plan["estimate"]
    lines.append(f"busiest worker {e['max_rank_cost_ms']:.3f} ms, mean {e['mean_rank_cost_ms']:.3f} ms, replica sync "
                 f"{e['replica_sync_ms']:.3f} ms per step ({e['iterations']} greedy iterations)")
    tier = plan.get("tier") or {}
    if tier.get("tables"):
        lines.append(f"larger than DRAM: {', '.join(tier['tables'])} on the memory-mapped tier (local disk, DRAM cache "
                     f"{tier['dram_cache'] / 2**30:.2f} GiB per worker; disk {tier['disk_read_bw'] / 1e6:.0f} MB/s "
                     f"read, {tier['disk_write_bw'] / 1e6:.0f} MB/s write): train with --set embedding.tier=\"mmap\" "
                     f"--set embedding.dram_cache_mb={tier['dram_cache'] / 2**20:.0f}")
    return "\n".join(lines)


def save_plan(plan: Dict[str, Any], path: str) -> None:
    """Write ``plan`` as JSON atomically (temporary file, then rename)."""
    write_json_atomic(path, plan)


def load_plan(path: str) -> Dict[str, Any]:
    """Read a plan file, checking its format and version (for the trainer's config)."""
    d = read_json(path, "plan", expect=dict)
    if d.get("format") != PLAN_FORMAT or d.get("version") != PLAN_VERSION:
        raise ValueError(f"{path}: not a {PLAN_FORMAT} v{PLAN_VERSION} file")
    return d


def tables_from_manifest(manifest, unique_ratio: float = 1.0) -> List[TableInfo]:
    """Tables of a shard manifest. Hotness: ``sequence`` tables the mean tokens per sample (manifest stats, else
    ``max_seq_len``), ``pooled`` tables the ingest's ``history_len``, ``single`` tables 1."""
    stats, opts = manifest.stats or {}, manifest.options or {}
    out = []
    for name, spec in sorted(manifest.tables.items()):
        if spec.kind == "sequence":
            samples = sum((stats.get("samples") or {}).values()) if isinstance(stats.get("samples"), dict) else 0
            hot = (stats["tokens"] / samples) if stats.get("tokens") and samples else (manifest.max_seq_len or 1)
            hot = min(hot, manifest.max_seq_len or hot)
        elif spec.kind == "pooled":
            hot = float(opts.get("history_len", 1)) if name == "history" else 4.0
        else:
            hot = 1.0
        out.append(TableInfo(name, int(spec.vocab), int(spec.dim), spec.kind, float(hot), unique_ratio))
    return out


def tables_from_mapping(d: Dict[str, Any], where: str) -> List[TableInfo]:
    """``{"tables": [{name, vocab, dim, kind, hotness, unique_ratio}, ...]}`` or ``{"tables": {name: {...}}}``."""
    raw = d.get("tables")
    if raw is None:
        raise ValueError(f"{where}: no 'tables' list")
    items = [{"name": k, **v} for k, v in raw.items()] if isinstance(raw, dict) else list(raw)
    names = {f.name for f in dataclasses.fields(TableInfo)}
    out = []
    for i, item in enumerate(items):
        bad = set(item) - names
        if bad or "name" not in item:
            raise ValueError(f"{where}: table #{i}: unknown keys {sorted(bad)} or no name (known: {sorted(names)})")
        t = TableInfo(**item)
        t.validate(where)
        out.append(t)
    return out
