"""``nestpipe plan``: per-table sharding and the 2D-SP group size (the ``simulate`` command is in
:mod:`nestpipe.measure.cli`, since ``--calibrate RUN`` fits the model to a measured run)."""

from __future__ import annotations

import json

from nestpipe.datasets.shards import load_manifest
from nestpipe.planning import planner
from nestpipe.planning._io import read_mapping
from nestpipe.planning.hardware import HARDWARE_PRESETS, load_hardware


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="choose per-table sharding and the 2D-SP group size (cost-driven greedy)",
                       description="Per table: replicated, table-wise, row-wise, column-wise or table-row-wise, "
                                   "and the 2D sparse-parallel group size. Prints a table and writes a JSON plan "
                                   "(schema: docs/planning.md).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--shards", help="a `nestpipe ingest` output directory (its manifest.json)")
    src.add_argument("--tables", help="JSON or TOML file: {\"tables\": [{name, vocab, dim, kind, hotness, "
                                      "unique_ratio}, ...]}")
    p.add_argument("--workers", type=int, required=True, help="number of workers (ranks) to plan for")
    p.add_argument("--batch", type=int, default=None, help="samples per worker (default: the manifest's, else 512)")
    p.add_argument("--group-size", type=int, default=None, help="2D-SP group size (default: chosen)")
    p.add_argument("--hardware", default="ascend-910b",
                   help=f"preset ({', '.join(HARDWARE_PRESETS)}) or a JSON/TOML file of HardwareConfig fields "
                   "(default: ascend-910b)")
    p.add_argument("--hbm-cap", type=float, default=16e9, help="device bytes per worker for replicated tables")
    p.add_argument("--dram-cap", type=float, default=256e9, help="host bytes per worker for shards")
    p.add_argument("--disk-cap", type=float, default=0.0,
                   help="local disk bytes per worker for the memory-mapped tier (embedding.tier=mmap): shards that "
                        "fit no worker's DRAM go there (0: no tier)")
    p.add_argument("--dram-cache", type=float, default=None,
                   help="with --disk-cap: the tier's DRAM cache bytes per worker (default: a quarter of --dram-cap)")
    p.add_argument("--store-dir", default=None,
                   help="with --disk-cap: measure the disk under this directory (random 4 KiB reads, synced writes)")
    p.add_argument("--disk-read-bw", type=float, default=0.0, help="with --disk-cap: random read bytes/s (measured "
                   "with --store-dir when not given)")
    p.add_argument("--disk-write-bw", type=float, default=0.0, help="with --disk-cap: write bytes/s")
    p.add_argument("--unique-ratio", type=float, default=1.0,
                   help="distinct / keys in a worker's batch for manifest tables (from cluster-report)")
    p.add_argument("--no-column-split", action="store_true",
                   help="keep whole rows on one owner (no column-wise shards; `nestpipe train` runs either kind "
                        "of plan file through --set embedding.placement=FILE)")
    p.add_argument("--out", help="write the JSON plan here")
    p.add_argument("--json", action="store_true", help="print the JSON plan instead of the table")
    p.set_defaults(func=_plan)


def _plan(args) -> int:
    hw = load_hardware(args.hardware)
    batch = args.batch
    if args.shards:
        man = load_manifest(args.shards)
        tables = planner.tables_from_manifest(man, args.unique_ratio)
        batch = batch or man.batch_size
    else:
        tables = planner.tables_from_mapping(read_mapping(args.tables, "table list"), args.tables)
    read_bw, write_bw = args.disk_read_bw, args.disk_write_bw
    if args.disk_cap and args.store_dir and not (read_bw and write_bw):
        from nestpipe.planning import disk  # only when a disk is measured

        measured = disk.measure(args.store_dir)
        read_bw, write_bw = read_bw or measured[0], write_bw or measured[1]
        print(f"disk under {args.store_dir}: {measured[0] / 1e6:.1f} MB/s random 4 KiB reads, "
              f"{measured[1] / 1e6:.1f} MB/s synced writes (measured)")
    cfg = planner.PlannerConfig(workers=args.workers, batch_per_worker=batch or 512, group_size=args.group_size,
                                hbm_cap=args.hbm_cap, dram_cap=args.dram_cap,
                                column_split=not args.no_column_split, disk_cap=args.disk_cap,
                                dram_cache=args.dram_cache if args.dram_cache is not None else args.dram_cap / 4,
                                disk_read_bw=read_bw, disk_write_bw=write_bw)
    plan = planner.make_plan(tables, cfg, hw)
    if args.out:
        planner.save_plan(plan, args.out)
    print(json.dumps(plan, indent=1, sort_keys=True) if args.json else planner.format_plan(plan))
    if args.out and not args.json:
        print(f"plan written to {args.out}")
    return 0
