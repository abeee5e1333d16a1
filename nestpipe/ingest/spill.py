"""Partitioned spill files: one Parquet file per unit of work, one row group per partition.

Invariant: a spill file is written to a temporary name and renamed when complete, so a file that exists is whole;
an interrupted run redoes exactly the units whose files are missing. An index (JSON sidecar) maps a partition to
its row group, so a reader fetches one partition from many files without scanning the rest.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq


def write_partitioned(path: str, df: pl.DataFrame, part_col: str, num_parts: int) -> Dict[str, int]:
    """Write ``df`` grouped by ``part_col`` (values 0..num_parts-1), one row group per non-empty partition."""
    tmp = path + ".tmp"
    df = df.sort(part_col, maintain_order=True)
    counts = df.group_by(part_col).len().sort(part_col)
    index: Dict[str, int] = {}
    table = df.drop(part_col).to_arrow()
    writer = pq.ParquetWriter(tmp, table.schema, compression="lz4")
    try:
        offset = 0
        rg = 0
        for p, n in zip(counts[part_col].to_list(), counts["len"].to_list()):
            writer.write_table(table.slice(offset, n), row_group_size=max(n, 1))
            index[str(p)] = rg
            offset += n
            rg += 1
        if rg == 0:
            writer.write_table(table.slice(0, 0))
    finally:
        writer.close()
    with open(path + ".json.tmp", "w") as f:
        json.dump({"row_groups": index, "rows": len(df), "num_parts": num_parts}, f)
    os.replace(path + ".json.tmp", path + ".json")
    os.replace(tmp, path)
    return index


def write_whole(path: str, df: pl.DataFrame) -> None:
    tmp = path + ".tmp"
    df.write_parquet(tmp, compression="lz4")
    os.replace(tmp, path)


def read_partition(paths: List[str], part: int, schema: Optional[pa.Schema] = None) -> pl.DataFrame:
    """Concatenate partition ``part`` of every file, in the order of ``paths``."""
    tables = []
    for path in paths:
        with open(path + ".json") as f:
            index = json.load(f)["row_groups"]
        rg = index.get(str(part))
        if rg is None:
            continue
        tables.append(pq.ParquetFile(path).read_row_group(rg))
    if not tables:
        if schema is None and paths:
            schema = pq.read_schema(paths[0])
        return pl.from_arrow(schema.empty_table()) if schema is not None else pl.DataFrame()
    return pl.from_arrow(pa.concat_tables(tables))
