"""Partitioned spill files: one Arrow IPC file per unit of work, the record batches of each partition one after
another, and an index (JSON sidecar ``NAME.arrow.json``) with the schema and each partition's byte range.

A reader takes one partition from many files by reading only its byte range of each (in place: memory-mapped,
zero-copy; in a working directory on object storage: one ranged read per file), never the rest of the file.

Invariant: a spill file and its index are written under temporary names and renamed when complete, so in place a
file that exists is whole; the unit that writes them commits them with its marker, written after both
(``nestpipe.ingest.workdir``), and readers read only committed spills.

Arrow IPC rather than Parquet: spills are written once and read once, where IPC's uncompressed columnar layout
writes several times faster and reads zero-copy.
"""

from __future__ import annotations

import base64
import os
from typing import Dict, List, Optional, Tuple

import polars as pl
import pyarrow as pa

from nestpipe.ingest.workdir import WorkDir
from nestpipe.utils.jsonio import write_json_atomic

SUFFIX = ".arrow"
IPC_MAGIC_BYTES = 8  # "ARROW1" and its padding, before the schema message


def write_partitioned(path: str, df: pl.DataFrame, part_col: str, num_parts: int) -> Dict[str, Tuple[int, int]]:
    """Write ``df`` grouped by ``part_col`` (values 0..num_parts-1) to ``path`` and its index ``path.json``; rows
    keep their order inside a partition. Returns the byte range of each partition present."""
    tmp = path + ".tmp"
    parts = df.partition_by(part_col, as_dict=True, include_key=False, maintain_order=True)
    schema = df.drop(part_col).to_arrow().schema
    if any(pa.types.is_dictionary(f.type) for f in schema):
        # dictionary batches would sit between the schema and the record batches, outside every partition's range
        raise ValueError(f"{path}: spill columns must not be dictionary-encoded: {schema}")
    ends: Dict[str, int] = {}
    with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for key in sorted(parts, key=lambda k: k[0]):
            for b in parts[key].to_arrow().cast(schema).to_batches():
                writer.write_batch(b)
            ends[str(key[0])] = sink.tell()
    # the first partition starts where the schema message ends (the writer writes it with the first batch)
    with pa.memory_map(tmp, "r") as f:
        f.seek(IPC_MAGIC_BYTES)
        pa.ipc.read_message(f)
        start = f.tell()
    ranges: Dict[str, Tuple[int, int]] = {}
    for key, end in ends.items():
        ranges[key] = (start, end)
        start = end
    write_json_atomic(path + ".json", {"ranges": ranges, "rows": len(df), "num_parts": num_parts,
                                       "schema": base64.b64encode(schema.serialize().to_pybytes()).decode()},
                      indent=None)
    os.replace(tmp, path)
    return ranges


def read_partition(work: WorkDir, rels: List[str], part: int, schema: Optional[pa.Schema] = None) -> pl.DataFrame:
    """Concatenate partition ``part`` of every spill file ``rels`` of working directory ``work``, in the order of
    ``rels``."""
    tables = []
    for rel in rels:
        index = work.read_json(rel + ".json", "spill index")
        if "ranges" not in index:
            raise ValueError(f"{work.path(rel)}.json: spill index of an earlier layout (no byte ranges); rerun with "
                             "--force to redo the ingest from the start")
        file_schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(index["schema"])))
        if schema is None:
            schema = file_schema
        rng = index["ranges"].get(str(part))
        if rng:
            buf = work.read_range(rel, *rng)
            try:
                batches = [pa.ipc.read_record_batch(m, file_schema) for m in pa.ipc.MessageReader.open_stream(buf)]
            except (pa.ArrowInvalid, OSError) as e:
                raise ValueError(f"{work.path(rel)}: partition {part} (bytes {rng[0]}-{rng[1]}) cannot be read: {e}") \
                    from e
            tables.append(pa.Table.from_batches(batches, schema=file_schema))
    if not tables:
        return pl.from_arrow(schema.empty_table()) if schema is not None else pl.DataFrame()
    return pl.from_arrow(pa.concat_tables(tables))
