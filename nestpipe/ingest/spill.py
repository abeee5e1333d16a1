"""Partitioned spill files: one Arrow IPC file per unit of work, one record batch group per partition.

Invariant: a spill file is written to a temporary name and renamed when complete, so a file that exists is whole;
an interrupted run redoes exactly the units whose files are missing. An index (JSON sidecar) maps a partition to
its record batches, so a reader fetches one partition from many files (memory-mapped) without reading the rest.

Arrow IPC rather than Parquet: spills are written once and read once on the same machine, where IPC's
uncompressed columnar layout writes several times faster and reads zero-copy.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import polars as pl
import pyarrow as pa
from nestpipe.utils.jsonio import read_json, write_json_atomic

SUFFIX = ".arrow"


def write_partitioned(path: str, df: pl.DataFrame, part_col: str, num_parts: int) -> Dict[str, List[int]]:
    """Write ``df`` grouped by ``part_col`` (values 0..num_parts-1); rows keep their order inside a partition."""
    tmp = path + ".tmp"
    parts = df.partition_by(part_col, as_dict=True, include_key=False, maintain_order=True)
    schema = df.drop(part_col).to_arrow().schema
    index: Dict[str, List[int]] = {}
    nbatch = 0
    with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for key in sorted(parts, key=lambda k: k[0]):
            batches = parts[key].to_arrow().cast(schema).to_batches()
            index[str(key[0])] = list(range(nbatch, nbatch + len(batches)))
            for b in batches:
                writer.write_batch(b)
            nbatch += len(batches)
    write_json_atomic(path + ".json", {"batches": index, "rows": len(df), "num_parts": num_parts}, indent=None)
    os.replace(tmp, path)
    return index


def read_partition(paths: List[str], part: int, schema: Optional[pa.Schema] = None) -> pl.DataFrame:
    """Concatenate partition ``part`` of every file, in the order of ``paths``."""
    tables = []
    for path in paths:
        index = read_json(path + ".json", "spill index")["batches"]
        ids = index.get(str(part))
        reader = pa.ipc.open_file(pa.memory_map(path, "r"))
        if schema is None:
            schema = reader.schema
        if ids:
            tables.append(pa.Table.from_batches([reader.get_batch(i) for i in ids], schema=reader.schema))
    if not tables:
        return pl.from_arrow(schema.empty_table()) if schema is not None else pl.DataFrame()
    return pl.from_arrow(pa.concat_tables(tables))
