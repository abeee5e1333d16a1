"""What every public-dataset adapter shares: the :class:`Source` it describes, line chunks of a (possibly gzipped)
file, and the parsing of one chunk of interaction lines into the standard interaction frame.

The standard interaction frame, one row per rated or logged interaction, in file order:

    user    Utf8 (a token) or Int64 (a numeric id kept as it is)
    item    Utf8 or Int64, as ``user``
    rating  Float64, null where the data has no rating
    time_ms Int64, milliseconds since the epoch
    line    Int64, the 1-based line of the file the row came from

Every line that cannot give such a row is a :class:`~nestpipe.ingest.parse.Reject` (file, line, reason, raw text),
never dropped in silence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import io
import json
import zlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import polars as pl

from nestpipe.ingest.parse import Reject
from nestpipe.utils import storage

INTERACTION_SCHEMA = {"user": pl.Utf8, "item": pl.Utf8, "rating": pl.Float64, "time_ms": pl.Int64, "line": pl.Int64}
# A timestamp at or above this is read as milliseconds, below it as seconds: 1e11 s is the year 5138, 1e11 ms 1973.
MS_THRESHOLD = 1e11

# Header names each role goes by in the public releases (compared without a ``:type`` suffix, case-insensitively).
USER_NAMES = ("user_id", "userid", "user", "reviewerid", "uid")
ITEM_NAMES = ("item_id", "movieid", "itemid", "item", "parent_asin", "asin", "iid", "business_id")
RATING_NAMES = ("rating", "overall", "stars", "score", "label")
TIME_NAMES = ("timestamp", "unixreviewtime", "time", "date_ts", "ts")


class FormatError(ValueError):
    """The files of a public dataset are missing, unrecognised or cannot be read as their format says."""


@dataclasses.dataclass
class Source:
    """A public dataset found in a directory: its format, the variant (release) of it, and its files by role.

    ``interactions`` are read in line chunks (any size); ``items`` and ``users`` are side tables small enough to hold
    (a row per item or user). ``numeric_ids``: the ids are integers and are kept as they are (MovieLens); otherwise
    they are tokens, mapped to dense ids ``0..n-1`` in sorted token order (deterministic, independent of file
    order)."""

    format: str
    variant: str
    root: str
    interactions: List[str]
    items: List[str] = dataclasses.field(default_factory=list)
    users: List[str] = dataclasses.field(default_factory=list)
    numeric_ids: bool = False
    # chunk parser: (lines, path, first line) -> (standard frame, rejects)
    parse: Optional[Callable[[List[str], str, int], Tuple[pl.DataFrame, List[Reject]]]] = None
    header_lines: int = 0  # lines before the data of every interaction file
    encoding: str = "utf-8"
    side: Optional[Callable[["Source"], "SideTables"]] = None

    def files(self) -> List[Tuple[str, str]]:
        """(role, path) of every file read, in reading order."""
        return ([("interactions", p) for p in self.interactions] + [("items", p) for p in self.items]
                + [("users", p) for p in self.users])


@dataclasses.dataclass
class SideTables:
    """The side tables of a dataset, read whole.

    ``items``: item (Utf8 or Int64, as the interactions' ids) and ``tokens`` (List[Utf8], the item's side tokens in
    the order the data lists them: genres, categories; the first is the item's main token). ``users``: user and the
    three categorical columns ``gender`` (0 female, 1 male), ``age_group`` (0..6, MovieLens-1M's seven groups) and
    ``occupation`` (0..49), each null where unknown."""

    items: Optional[pl.DataFrame] = None
    users: Optional[pl.DataFrame] = None
    rejects: List[Reject] = dataclasses.field(default_factory=list)
    rows: int = 0


def open_text(path: str, encoding: str = "utf-8") -> io.TextIOBase:
    """A text stream of ``path`` (a path or an fsspec URL), decompressed when it ends in ``.gz``. Undecodable bytes
    become U+FFFD rather than an error: the row is then judged by its fields."""
    raw = storage.open_read(path)
    if path.endswith(".gz"):
        raw = gzip.GzipFile(fileobj=raw)
    return io.TextIOWrapper(raw, encoding=encoding, errors="replace", newline="")


@contextlib.contextmanager
def _reading(path: str):
    """A damaged gzip file (a bad CRC, a cut stream, a corrupt block) fails in gzip or zlib with an error that names
    no file: name it, in one message."""
    try:
        yield
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise FormatError(f"{path}: cannot be read, the file is damaged or cut short ({type(e).__name__}: {e})") from e


def line_chunks(path: str, chunk_bytes: int, encoding: str = "utf-8",
                skip: int = 0) -> Iterator[Tuple[int, List[str]]]:
    """(first line number, lines without their line ends) of consecutive chunks of about ``chunk_bytes`` characters;
    the first ``skip`` lines (a header) are not returned. Chunks depend only on the file and ``chunk_bytes``."""
    with _reading(path), open_text(path, encoding) as f:
        line_no = 1
        for _ in range(skip):
            if not f.readline():
                return
            line_no += 1
        while True:
            lines = f.readlines(max(1, chunk_bytes))
            if not lines:
                return
            yield line_no, [ln.rstrip("\r\n") for ln in lines]
            line_no += len(lines)


def first_line(path: str, encoding: str = "utf-8") -> str:
    with _reading(path), open_text(path, encoding) as f:
        return f.readline().rstrip("\r\n")


def column_role(name: str, names: Sequence[str]) -> bool:
    return name.split(":")[0].strip().strip('"').lower() in names


def header_positions(header: Sequence[str], path: str, rating_required: bool = False) -> Dict[str, Optional[int]]:
    """The positions of the user, item, rating and time columns in a header, by their usual names."""
    pos: Dict[str, Optional[int]] = {}
    for role, names in (("user", USER_NAMES), ("item", ITEM_NAMES), ("rating", RATING_NAMES), ("time", TIME_NAMES)):
        hits = [i for i, h in enumerate(header) if column_role(h, names)]
        # the first name in the list wins where several columns match (parent_asin before asin)
        hits.sort(key=lambda i: names.index(header[i].split(":")[0].strip().strip('"').lower()))
        pos[role] = hits[0] if hits else None
    for role in ("user", "item", "time"):
        if pos[role] is None:
            raise FormatError(f"{path}: no {role} column in the header {list(header)} (looked for "
                              f"{', '.join({'user': USER_NAMES, 'item': ITEM_NAMES, 'time': TIME_NAMES}[role])})")
    if rating_required and pos["rating"] is None:
        raise FormatError(f"{path}: no rating column in the header {list(header)}")
    return pos


def parse_delimited(lines: List[str], path: str, first: int, *, separator: str, ncols: int,
                    positions: Dict[str, Optional[int]], exact: bool = True) -> Tuple[pl.DataFrame, List[Reject]]:
    """Split ``lines`` on ``separator`` (one or more characters) and take the user, item, rating and time fields at
    ``positions``. A line with another number of fields than ``ncols`` (at least ``ncols`` when not ``exact``), an
    empty id, a rating that is not a finite number or a time that is not a non-negative number is rejected."""
    raw = pl.Series("raw", lines, dtype=pl.Utf8)
    parts = raw.str.split(separator)
    nfields = parts.list.len()
    count_ok = (nfields == ncols) if exact else (nfields >= ncols)

    def field(role: str) -> pl.Series:
        i = positions[role]
        if i is None:
            return pl.Series([None] * len(lines), dtype=pl.Utf8)
        return parts.list.get(i, null_on_oob=True).str.strip_chars(' "')

    user, item, rating_s, time_s = field("user"), field("item"), field("rating"), field("time")
    rating = rating_s.cast(pl.Float64, strict=False)
    t = time_s.cast(pl.Float64, strict=False)
    time_ms = pl.select(pl.when(t >= MS_THRESHOLD).then(t).otherwise(t * 1000.0).round(0)).to_series()
    reason = pl.select(
        pl.when(raw.str.len_chars() == 0).then(pl.lit("empty line"))
        .when(~count_ok).then(pl.lit(f"wrong number of fields (expected {ncols}{'' if exact else ' or more'}, "
                                     f"separated by {separator!r})"))
        .when(user.is_null() | (user == "")).then(pl.lit("user id: missing value"))
        .when(item.is_null() | (item == "")).then(pl.lit("item id: missing value"))
        .when(pl.lit(positions["rating"] is not None) & ~(rating.is_finite().fill_null(False)))
        .then(pl.lit("rating: not a number"))
        .when(~(t.is_finite().fill_null(False)) | (t < 0).fill_null(True)).then(pl.lit("time: not a non-negative number"))
        .otherwise(pl.lit(None, dtype=pl.Utf8))
    ).to_series()
    return _frame_and_rejects(raw, user, item, rating, time_ms, reason, path, first)


def parse_json_lines(lines: List[str], path: str, first: int) -> Tuple[pl.DataFrame, List[Reject]]:
    """One JSON object per line (Amazon reviews: ``reviewerID``/``asin``/``overall``/``unixReviewTime``, or the 2023
    release's ``user_id``/``parent_asin``/``rating``/``timestamp``). Ids may be strings or numbers."""
    users: List[Optional[str]] = []
    items: List[Optional[str]] = []
    ratings: List[Optional[float]] = []
    times: List[Optional[float]] = []
    reasons: List[Optional[str]] = []
    for text in lines:
        u = i = r = t = reason = None
        if not text.strip():
            reason = "empty line"
        else:
            try:
                obj = json.loads(text)
            except ValueError as e:
                reason = f"not a JSON object: {e}"
                obj = None
            if obj is not None and not isinstance(obj, dict):
                reason, obj = "not a JSON object", None
            if obj is not None:
                keys = {k.lower(): k for k in obj}
                pick = lambda names: next((obj[keys[n]] for n in names if n in keys), None)  # noqa: E731
                u, i, r, t = pick(USER_NAMES), pick(ITEM_NAMES), pick(RATING_NAMES), pick(TIME_NAMES)
                u = None if u is None else str(u)
                i = None if i is None else str(i)
                if not u:
                    reason = "user id: missing value"
                elif not i:
                    reason = "item id: missing value"
                if reason is None and r is not None:
                    try:
                        r = float(r)
                    except (TypeError, ValueError):
                        reason, r = "rating: not a number", None
                try:
                    t = float(t) if t is not None else None
                except (TypeError, ValueError):
                    t = None
                if reason is None and (t is None or t != t or t < 0 or t == float("inf")):
                    reason = "time: not a non-negative number"
                if reason is None and r is not None and not (r == r and abs(r) != float("inf")):
                    reason = "rating: not a number"
        users.append(u)
        items.append(i)
        ratings.append(r)
        times.append(t)
        reasons.append(reason)
    t = pl.Series(times, dtype=pl.Float64)
    time_ms = pl.select(pl.when(t >= MS_THRESHOLD).then(t).otherwise(t * 1000.0).round(0)).to_series()
    return _frame_and_rejects(pl.Series("raw", lines, dtype=pl.Utf8), pl.Series(users, dtype=pl.Utf8),
                              pl.Series(items, dtype=pl.Utf8), pl.Series(ratings, dtype=pl.Float64), time_ms,
                              pl.Series(reasons, dtype=pl.Utf8), path, first)


def _frame_and_rejects(raw, user, item, rating, time_ms, reason, path, first) -> Tuple[pl.DataFrame, List[Reject]]:
    n = len(raw)
    df = pl.DataFrame({
        "user": user, "item": item, "rating": rating,
        "time_ms": time_ms.cast(pl.Int64, strict=False),
        "line": pl.int_range(first, first + n, dtype=pl.Int64, eager=True),
        "_reason": reason,
    })
    bad = df.filter(pl.col("_reason").is_not_null())
    rejects = [Reject(path, int(ln), str(rs), str(rw or "")) for ln, rs, rw in
               zip(bad["line"], bad["_reason"], raw.gather(bad["line"] - first))]
    return df.filter(pl.col("_reason").is_null()).drop("_reason"), rejects


def numeric_ids(df: pl.DataFrame, path: str, lines: List[str], first: int) -> Tuple[pl.DataFrame, List[Reject]]:
    """Ids of a numeric-id format as Int64 (``lines`` and ``first``: the chunk the frame came from): a row whose user
    or item id is not a non-negative integer is rejected."""
    u = df["user"].str.to_integer(strict=False)
    i = df["item"].str.to_integer(strict=False)
    bad_user = u.is_null() | (u < 0).fill_null(True)
    bad = bad_user | i.is_null() | (i < 0).fill_null(True)
    rejects = [Reject(path, int(ln), "user id: not a non-negative integer" if bu else
                      "item id: not a non-negative integer", lines[int(ln) - first])
               for ln, bu in zip(df["line"].filter(bad), bad_user.filter(bad))]
    return df.with_columns(u.alias("user"), i.alias("item")).filter(~bad), rejects
