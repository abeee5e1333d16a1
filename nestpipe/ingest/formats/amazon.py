"""Amazon reviews (McAuley lab): the ratings-only CSV files (``user,item,rating,timestamp``, without a header as
published, or with one naming those roles) and the review JSON lines (5-core files of the 2014/2018 releases:
``reviewerID``, ``asin``, ``overall``, ``unixReviewTime``; the 2023 release: ``user_id``, ``parent_asin``,
``rating``, ``timestamp`` in milliseconds), each plain or gzipped. A metadata file ``meta_*.json[l][.gz]`` beside
them gives the items' side tokens (``main_category``, else the categories listed).

Ids are tokens (``A2SUAM1J3GNN3B``, ``0000013714``), mapped to dense ids in sorted order.
"""

from __future__ import annotations

import functools
import json
from typing import List, Optional

import polars as pl

from nestpipe.ingest.formats.source import (ITEM_NAMES, FormatError, SideTables, Source, first_line,
                                              header_positions, line_chunks, parse_delimited, parse_json_lines)
from nestpipe.ingest.parse import Reject
from nestpipe.utils import storage

JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
CSV_SUFFIXES = (".csv", ".csv.gz")


def detect(root: str) -> Optional[Source]:
    names = sorted(storage.listdir(root))
    path = lambda n: storage.absolute(storage.join(root, n))  # noqa: E731
    meta = [path(n) for n in names if n.startswith("meta") and n.endswith(JSON_SUFFIXES)]
    jsonl = [path(n) for n in names if not n.startswith("meta") and n.endswith(JSON_SUFFIXES)]
    csvs = [path(n) for n in names if n.endswith(CSV_SUFFIXES)]
    if jsonl:
        return Source("amazon", "reviews-jsonl", storage.absolute(root), jsonl, items=meta,
                      parse=parse_json_lines, side=_side)
    if len(csvs) == 1:
        head = first_line(csvs[0])
        fields = [f.strip().strip('"') for f in head.split(",")]
        if len(fields) < 4:
            return None
        try:
            float(fields[-1])
            float(fields[2])
        except ValueError:  # a header: its names say where each role is
            positions = header_positions(fields, csvs[0], rating_required=False)
            return Source("amazon", "ratings-csv", storage.absolute(root), csvs, items=meta, header_lines=1,
                          parse=functools.partial(_parse_csv, ncols=len(fields), positions=positions), side=_side)
        return Source("amazon", "ratings-csv", storage.absolute(root), csvs, items=meta,
                      parse=functools.partial(_parse_csv, ncols=4,
                                              positions={"user": 0, "item": 1, "rating": 2, "time": 3}),
                      side=_side)
    if len(csvs) > 1:
        raise FormatError(f"{root}: several CSV files ({', '.join(n.rsplit('/', 1)[-1] for n in csvs)}) and none "
                          "of a known dataset: an Amazon ratings directory holds one ratings CSV file")
    return None


def _parse_csv(lines, path, first, *, ncols, positions):
    return parse_delimited(lines, path, first, separator=",", ncols=ncols, positions=positions)


def _side(src: Source) -> SideTables:
    out = SideTables()
    ids: List[str] = []
    tokens: List[List[str]] = []
    for p in src.items:
        for first, lines in line_chunks(p, 1 << 24):
            for k, text in enumerate(lines):
                out.rows += 1
                try:
                    obj = json.loads(text)
                    if not isinstance(obj, dict):
                        raise ValueError("not an object")
                except ValueError as e:
                    out.rejects.append(Reject(p, first + k, f"not a JSON object: {e}", text))
                    continue
                keys = {key.lower(): key for key in obj}
                item = next((obj[keys[n]] for n in ITEM_NAMES if n in keys), None)
                if item in (None, ""):
                    out.rejects.append(Reject(p, first + k, "item id: missing value", text))
                    continue
                ids.append(str(item))
                tokens.append(_categories(obj, keys))
    if src.items:
        out.items = pl.DataFrame({"item": pl.Series(ids, dtype=pl.Utf8),
                                  "tokens": pl.Series(tokens, dtype=pl.List(pl.Utf8))})
    return out


def _categories(obj, keys) -> List[str]:
    """``main_category`` first, then every category listed (nested lists flattened), each once."""
    out: List[str] = []
    main = obj.get(keys.get("main_category", ""), None)
    if isinstance(main, str) and main:
        out.append(main)
    cats = obj.get(keys.get("categories", keys.get("category", "")), None)
    stack = [cats]
    while stack:
        c = stack.pop(0)
        if isinstance(c, str) and c and c not in out:
            out.append(c)
        elif isinstance(c, list):
            stack[:0] = c
    return out
