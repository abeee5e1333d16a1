"""MovieLens (GroupLens): 100K (``u.data``, ``u.item``, ``u.user``), 1M and 10M (``ratings.dat``, ``movies.dat``,
``users.dat``; ``::``-separated, Latin-1), 20M / 25M / 32M / latest (``ratings.csv``, ``movies.csv``).

Ids are the published integers, kept as they are. Side tokens: the movie's genres in the order listed (the first is
its main token). Users (100K, 1M): gender, age group (100K's ages put into 1M's seven groups) and occupation.
"""

from __future__ import annotations

import csv
import functools
from typing import Dict, List, Optional

import polars as pl

from nestpipe.ingest.formats.source import (FormatError, Source, SideTables, first_line, header_positions,
                                              line_chunks, parse_delimited)
from nestpipe.ingest.parse import Reject
from nestpipe.utils import storage

# MovieLens-1M's age groups (users.dat codes): under 18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+
AGE_GROUP_STARTS = (1, 18, 25, 35, 45, 50, 56)
# 100K's occupations (u.occupation), in its published order; 1M's users.dat gives codes 0..20 directly
OCCUPATIONS_100K = (
    "administrator", "artist", "doctor", "educator", "engineer", "entertainment", "executive", "healthcare",
    "homemaker", "lawyer", "librarian", "marketing", "none", "other", "programmer", "retired", "salesman",
    "scientist", "student", "technician", "writer",
)
GENRES_100K = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
    "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western",
)


def age_group(age: int) -> int:
    """The index (0..6) of the 1M age group an age in years falls in (1M's codes are their groups' first ages)."""
    return max(i for i, start in enumerate(AGE_GROUP_STARTS) if age >= start) if age >= 1 else 0


def detect(root: str) -> Optional[Source]:
    names = set(storage.listdir(root))
    path = lambda n: storage.absolute(storage.join(root, n))  # noqa: E731
    if "u.data" in names:
        return Source(
            "movielens", "ml-100k", storage.absolute(root), [path("u.data")],
            items=[path("u.item")] if "u.item" in names else [], users=[path("u.user")] if "u.user" in names else [],
            numeric_ids=True, encoding="latin-1",
            parse=functools.partial(_parse, separator="\t", ncols=4,
                                    positions={"user": 0, "item": 1, "rating": 2, "time": 3}),
            side=_side_100k,
        )
    if "ratings.dat" in names:
        has_users = "users.dat" in names
        return Source(
            "movielens", "ml-1m" if has_users else "ml-10m", storage.absolute(root), [path("ratings.dat")],
            items=[path("movies.dat")] if "movies.dat" in names else [],
            users=[path("users.dat")] if has_users else [], numeric_ids=True, encoding="latin-1",
            parse=functools.partial(_parse, separator="::", ncols=4,
                                    positions={"user": 0, "item": 1, "rating": 2, "time": 3}),
            side=_side_dat,
        )
    if "ratings.csv" in names:
        ratings = path("ratings.csv")
        header = [h.strip() for h in first_line(ratings).split(",")]
        if [h.lower() for h in header[:2]] != ["userid", "movieid"]:
            return None  # another dataset's ratings.csv (the Amazon adapter reads it)
        positions = header_positions(header, ratings, rating_required=True)
        return Source(
            "movielens", "ml-latest", storage.absolute(root), [ratings],
            items=[path("movies.csv")] if "movies.csv" in names else [], numeric_ids=True, header_lines=1,
            parse=functools.partial(_parse, separator=",", ncols=len(header), positions=positions),
            side=_side_csv,
        )
    return None


def _parse(lines, path, first, *, separator, ncols, positions):
    return parse_delimited(lines, path, first, separator=separator, ncols=ncols, positions=positions)


def _read_rows(path: str, encoding: str, separator: str, ncols: int, skip: int = 0, min_cols: Optional[int] = None):
    """(line, fields, raw) of every line, or a reject where the field count is wrong."""
    rows, rejects = [], []
    for first, lines in line_chunks(path, 1 << 24, encoding, skip=skip):
        for k, text in enumerate(lines):
            line = first + k
            if not text:
                rejects.append(Reject(path, line, "empty line", text))
                continue
            fields = next(csv.reader([text])) if separator == "," else text.split(separator)
            if (len(fields) != ncols) if min_cols is None else (len(fields) < min_cols):
                rejects.append(Reject(path, line, f"wrong number of fields (expected {ncols}, separated by "
                                                  f"{separator!r})", text))
                continue
            rows.append((line, fields, text))
    return rows, rejects


def _int(text: str) -> Optional[int]:
    try:
        return int(text.strip())
    except ValueError:
        return None


def _items_frame(ids: List[int], tokens: List[List[str]]) -> pl.DataFrame:
    return pl.DataFrame({"item": pl.Series(ids, dtype=pl.Int64),
                         "tokens": pl.Series(tokens, dtype=pl.List(pl.Utf8))})


def _users_frame(ids, gender, age, occupation) -> pl.DataFrame:
    return pl.DataFrame({"user": pl.Series(ids, dtype=pl.Int64), "gender": pl.Series(gender, dtype=pl.Int64),
                         "age_group": pl.Series(age, dtype=pl.Int64),
                         "occupation": pl.Series(occupation, dtype=pl.Int64)})


def _side_100k(src: Source) -> SideTables:
    out = SideTables()
    if src.items:
        genre_names = list(GENRES_100K)
        rows, rej = _read_rows(src.items[0], "latin-1", "|", 5 + len(GENRES_100K))
        out.rejects += rej
        ids, tokens = [], []
        for line, f, raw in rows:
            i = _int(f[0])
            flags = f[5:]
            if i is None or any(x.strip() not in ("0", "1") for x in flags):
                out.rejects.append(Reject(src.items[0], line, "movie id or genre flags: not an integer 0/1", raw))
                continue
            ids.append(i)
            tokens.append([g for g, x in zip(genre_names, flags) if x.strip() == "1"])
        out.items = _items_frame(ids, tokens)
        out.rows += len(rows) + len(rej)
    if src.users:
        rows, rej = _read_rows(src.users[0], "latin-1", "|", 5)
        out.rejects += rej
        ids, gender, age, occ = [], [], [], []
        occupations = {o: k for k, o in enumerate(OCCUPATIONS_100K)}
        for line, f, raw in rows:
            u, a = _int(f[0]), _int(f[1])
            if u is None or a is None:
                out.rejects.append(Reject(src.users[0], line, "user id or age: not an integer", raw))
                continue
            ids.append(u)
            age.append(age_group(a))
            gender.append({"F": 0, "M": 1}.get(f[2].strip()))
            occ.append(occupations.get(f[3].strip()))
        out.users = _users_frame(ids, gender, age, occ)
        out.rows += len(rows) + len(rej)
    return out


def _side_dat(src: Source) -> SideTables:
    out = SideTables()
    if src.items:
        rows, rej = _read_rows(src.items[0], "latin-1", "::", 3)
        out.rejects += rej
        ids, tokens = [], []
        for line, f, raw in rows:
            i = _int(f[0])
            if i is None:
                out.rejects.append(Reject(src.items[0], line, "movie id: not an integer", raw))
                continue
            ids.append(i)
            tokens.append([g for g in f[2].split("|") if g and g != "(no genres listed)"])
        out.items = _items_frame(ids, tokens)
        out.rows += len(rows) + len(rej)
    if src.users:
        rows, rej = _read_rows(src.users[0], "latin-1", "::", 5)
        out.rejects += rej
        ids, gender, age, occ = [], [], [], []
        for line, f, raw in rows:
            u, a, o = _int(f[0]), _int(f[2]), _int(f[3])
            if u is None or a is None or o is None:
                out.rejects.append(Reject(src.users[0], line, "user id, age or occupation: not an integer", raw))
                continue
            ids.append(u)
            gender.append({"F": 0, "M": 1}.get(f[1].strip()))
            age.append(age_group(a))
            occ.append(o if 0 <= o < 50 else None)
        out.users = _users_frame(ids, gender, age, occ)
        out.rows += len(rows) + len(rej)
    return out


def _side_csv(src: Source) -> SideTables:
    out = SideTables()
    if src.items:
        header = next(csv.reader([first_line(src.items[0])]))
        pos: Dict[str, int] = {h.strip().lower(): k for k, h in enumerate(header)}
        if "movieid" not in pos or "genres" not in pos:
            raise FormatError(f"{src.items[0]}: expected the header movieId,title,genres; found {header}")
        rows, rej = _read_rows(src.items[0], "utf-8", ",", len(header), skip=1)
        out.rejects += rej
        ids, tokens = [], []
        for line, f, raw in rows:
            i = _int(f[pos["movieid"]])
            if i is None:
                out.rejects.append(Reject(src.items[0], line, "movieId: not an integer", raw))
                continue
            ids.append(i)
            tokens.append([g for g in f[pos["genres"]].split("|") if g and g != "(no genres listed)"])
        out.items = _items_frame(ids, tokens)
        out.rows += len(rows) + len(rej)
    return out
