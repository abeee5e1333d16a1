"""Atomic files, the layout in which many public datasets are redistributed: ``NAME.inter`` (interactions),
``NAME.item`` and ``NAME.user`` beside it; tab-separated, a header of ``name:type`` fields (``user_id:token``,
``item_id:token``, ``rating:float``, ``timestamp:float``, ``class:token_seq``, ...), ``token_seq`` values separated by
spaces.

Ids are tokens, mapped to dense ids in sorted order. Side tokens of an item: its first ``token_seq`` or ``token``
column named like a category (``class``, ``genre``, ``categories``, ``category``, ``brand``, ``cate_id``), split on
spaces. Users: ``gender`` (``F``/``M``), ``age`` (years, or a group's first age) and ``occupation`` (its values in sorted
order) where present.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import polars as pl

from nestpipe.ingest.formats.movielens import age_group
from nestpipe.ingest.formats.source import (FormatError, SideTables, Source, first_line, header_positions,
                                              line_chunks, parse_delimited)
from nestpipe.ingest.parse import Reject
from nestpipe.utils import storage

SIDE_NAMES = ("class", "genre", "genres", "categories", "category", "brand", "cate_id", "categories_id")


def _name(field: str) -> str:
    return field.split(":")[0].strip().lower()


def detect(root: str) -> Optional[Source]:
    names = sorted(storage.listdir(root))
    inter = [n for n in names if n.endswith(".inter")]
    if not inter:
        return None
    if len(inter) > 1:
        raise FormatError(f"{root}: several .inter files ({', '.join(inter)}); put each dataset in a directory of "
                          "its own")
    stem = inter[0][:-len(".inter")]
    path = lambda n: storage.absolute(storage.join(root, n))  # noqa: E731
    header = first_line(path(inter[0])).split("\t")
    positions = header_positions(header, path(inter[0]))
    return Source(
        "atomic", stem, storage.absolute(root), [path(inter[0])],
        items=[path(stem + ".item")] if stem + ".item" in names else [],
        users=[path(stem + ".user")] if stem + ".user" in names else [],
        header_lines=1, side=_side,
        parse=functools.partial(_parse, ncols=len(header), positions=positions),
    )


def _parse(lines, path, first, *, ncols, positions):
    return parse_delimited(lines, path, first, separator="\t", ncols=ncols, positions=positions)


def _table(path: str):
    """Header names and (line, fields, raw) of every row with the header's field count; the others as rejects."""
    header = first_line(path).split("\t")
    rows, rejects = [], []
    for first, lines in line_chunks(path, 1 << 24, skip=1):
        for k, text in enumerate(lines):
            fields = text.split("\t")
            if len(fields) != len(header):
                rejects.append(Reject(path, first + k, f"wrong number of fields (expected {len(header)}, "
                                                       "separated by '\\t')", text))
            else:
                rows.append((first + k, fields, text))
    return header, rows, rejects


def _side(src: Source) -> SideTables:
    out = SideTables()
    if src.items:
        header, rows, rej = _table(src.items[0])
        out.rejects += rej
        out.rows += len(rows) + len(rej)
        names = [_name(h) for h in header]
        if "item_id" not in names:
            raise FormatError(f"{src.items[0]}: no item_id column in the header {header}")
        side = next((names.index(n) for n in SIDE_NAMES if n in names), None)
        ids: List[str] = []
        tokens: List[List[str]] = []
        for line, f, raw in rows:
            item = f[names.index("item_id")].strip()
            if not item:
                out.rejects.append(Reject(src.items[0], line, "item_id: missing value", raw))
                continue
            ids.append(item)
            tokens.append([t for t in f[side].split(" ") if t] if side is not None else [])
        out.items = pl.DataFrame({"item": pl.Series(ids, dtype=pl.Utf8),
                                  "tokens": pl.Series(tokens, dtype=pl.List(pl.Utf8))})
    if src.users:
        header, rows, rej = _table(src.users[0])
        out.rejects += rej
        out.rows += len(rows) + len(rej)
        names = [_name(h) for h in header]
        if "user_id" not in names:
            raise FormatError(f"{src.users[0]}: no user_id column in the header {header}")
        col = lambda n: names.index(n) if n in names else None  # noqa: E731
        g, a, o = col("gender"), col("age"), col("occupation")
        occupations = sorted({f[o].strip() for _, f, _ in rows if f[o].strip()}) if o is not None else []
        occ_id = {v: k for k, v in enumerate(occupations) if k < 50}
        ids, gender, age, occ = [], [], [], []
        for line, f, raw in rows:
            user = f[names.index("user_id")].strip()
            if not user:
                out.rejects.append(Reject(src.users[0], line, "user_id: missing value", raw))
                continue
            ids.append(user)
            gender.append({"F": 0, "M": 1}.get(f[g].strip().upper()) if g is not None else None)
            years = f[a].strip() if a is not None else ""
            age.append(age_group(int(years)) if years.isdigit() else None)
            occ.append(occ_id.get(f[o].strip()) if o is not None else None)
        out.users = pl.DataFrame({"user": pl.Series(ids, dtype=pl.Utf8), "gender": pl.Series(gender, dtype=pl.Int64),
                                  "age_group": pl.Series(age, dtype=pl.Int64),
                                  "occupation": pl.Series(occ, dtype=pl.Int64)})
    return out
