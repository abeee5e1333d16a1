"""Chunked, validating CSV reading with bounded memory and nothing lost.

A file is read in byte chunks cut at line ends (fixed size, so chunk boundaries depend only on the file, never
on the number of workers). Each chunk is parsed by Polars' native CSV reader with an explicit schema (the fast
path) when a cheap exact pre-check says every line is well-formed; otherwise the chunk takes the validating
path, which splits lines itself, keeps every good row and returns every bad one with its line and raw text.

Why a hand-written validating path: Polars (like every CSV reader) either aborts on a malformed row or drops /
nulls it (``ignore_errors``, ``truncate_ragged_lines``), and then the row's line and raw text are lost. The
fast path is Polars itself; the validating path is still Polars expressions, only the row splitting differs.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import polars as pl
import pyarrow as pa

from nestpipe.utils import storage

DEFAULT_CHUNK_BYTES = 64 << 20
_NL = 10
_COMMA = 44
_QUOTE = 34


@dataclasses.dataclass
class Reject:
    """A row that could not be used: where it came from, why, and its raw text (without the line ending)."""

    file: str
    line: int  # 1-based line number in the file (the header is line 1)
    reason: str
    raw: str


@dataclasses.dataclass
class Chunk:
    """A byte range of a file that starts at a line start; ``first_line`` is its 1-based file line number."""

    path: str
    index: int
    start: int
    end: int
    first_line: int


def plan_chunks(path: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Tuple[bytes, List[Chunk]]:
    """Split ``path`` after its header into chunks of about ``chunk_bytes`` that end at a line end.

    Returns the raw header line and the chunks. Only a few bytes around each cut are read, so ``first_line`` is
    left at 0 here: line numbers are known once the chunks before have been counted (see :func:`iter_file`).
    """
    size = storage.size(path)
    with storage.open_read(path) as f:
        header = f.readline()
        start = f.tell()
        chunks: List[Chunk] = []
        while start < size:
            end = min(start + chunk_bytes, size)
            if end < size:
                f.seek(end)
                end += len(f.readline())
            chunks.append(Chunk(path, len(chunks), start, end, 0))
            start = end
    return header, chunks


def read_chunk_bytes(chunk: Chunk) -> bytes:
    with storage.open_read(chunk.path) as f:
        f.seek(chunk.start)
        return f.read(chunk.end - chunk.start)


def line_starts(data: bytes) -> np.ndarray:
    """int64 offsets of every line start plus the end; a final line without newline is a line too."""
    buf = np.frombuffer(data, dtype=np.uint8)
    nl = np.flatnonzero(buf == _NL)
    ends = nl + 1
    if len(data) and (len(nl) == 0 or nl[-1] != len(data) - 1):
        ends = np.append(ends, len(data))
    return np.concatenate([[0], ends]).astype(np.int64)


_COUNT_BLOCK = 1 << 20


def byte_counts(data: bytes, values: Sequence[int]) -> List[int]:
    """How often each byte value occurs in ``data``, in one pass over 1 MiB blocks.

    Blocked because a whole-chunk comparison (``buf == x``) allocates a chunk-sized temporary per value: fresh
    pages to fault in every time, and a pass through memory each; one cache-sized scratch is reused for every block
    and value instead."""
    buf = np.frombuffer(data, dtype=np.uint8)
    out = [0] * len(values)
    scratch = np.empty(min(len(buf), _COUNT_BLOCK), dtype=bool)
    for i in range(0, len(buf), _COUNT_BLOCK):
        block = buf[i:i + _COUNT_BLOCK]
        hit = scratch[:len(block)]
        for k, v in enumerate(values):
            np.equal(block, v, out=hit)
            out[k] += int(np.count_nonzero(hit))
    return out


def count_lines(data: bytes) -> int:
    """Lines in ``data`` (a final line without newline counts), without materialising their offsets."""
    n = byte_counts(data, (_NL,))[0]
    return n + (1 if len(data) and data[-1] != _NL else 0)


def _lines_series(data: bytes, offsets: np.ndarray) -> pl.Series:
    # Zero-copy: one Arrow string per line (with its line ending), then strip CR/LF.
    arr = pa.LargeStringArray.from_buffers(len(offsets) - 1, pa.py_buffer(offsets), pa.py_buffer(data))
    return pl.Series("raw", arr).str.strip_chars_end("\r\n")


@dataclasses.dataclass
class ColumnSpec:
    """How one file kind is parsed: ordered columns, their dtypes, which must be present, quoted last column."""

    columns: Sequence[str]
    dtypes: Dict[str, pl.DataType]
    required: Sequence[str]
    quoted_last: bool = False  # the last column may contain commas inside double quotes (KuaiRand `tag`)
    quoted_any: bool = False  # any column may be quoted (small files only: parsed with the csv module)
    keep: Optional[Sequence[str]] = None  # columns to return (default: all)


NOT_UTF8 = "not UTF-8 text"


def _utf8_lines(data: bytes) -> Tuple[bytes, Optional[np.ndarray], Optional[np.ndarray]]:
    """``(data, offsets, bad)``: where every line is UTF-8, ``data`` unchanged and no mask; else each line that is
    not valid UTF-8 decoded with replacement characters (so the reject keeps a readable copy of it), the chunk's new
    line offsets and the mask of those lines. Arrow and Polars strings must be valid UTF-8 (Polars panics on
    others), so no other path may see the original bytes."""
    if data.isascii():
        return data, None, None
    try:
        data.decode("utf-8")
        return data, None, None
    except UnicodeDecodeError:
        pass
    offsets = line_starts(data)
    lines, bad = [], []
    for i in range(len(offsets) - 1):
        ln = data[offsets[i]:offsets[i + 1]]
        try:
            ln.decode("utf-8")
            bad.append(False)
        except UnicodeDecodeError:
            ln = ln.decode("utf-8", errors="replace").encode("utf-8")
            bad.append(True)
        lines.append(ln)
    fixed = b"".join(lines)
    new_offsets = np.zeros(len(lines) + 1, dtype=np.int64)
    np.cumsum([len(ln) for ln in lines], out=new_offsets[1:])
    return fixed, new_offsets, np.asarray(bad)


def parse_chunk(data: bytes, spec: ColumnSpec, *, path: str, first_line: int) -> Tuple[pl.DataFrame, List[Reject]]:
    """Parse one chunk. Returns good rows (with a ``line`` column, 1-based) and the rejects.

    ``first_line`` is the file line number of the chunk's first line. A line that is not UTF-8 text is rejected
    (reason ``not UTF-8 text``, its raw text with replacement characters).
    """
    keep = list(spec.keep or spec.columns)
    newlines, total_commas, n_quotes = byte_counts(data, (_NL, _COMMA, _QUOTE))
    n_lines = newlines + (1 if len(data) and data[-1] != _NL else 0)
    if n_lines == 0:
        empty = pl.DataFrame(schema={**{c: spec.dtypes[c] for c in keep}, "line": pl.Int64})
        return empty, []
    ncols = len(spec.columns)
    data, offsets, not_utf8 = _utf8_lines(data)
    if spec.quoted_any:
        return _parse_csv_module(data, offsets if offsets is not None else line_starts(data), spec, path=path,
                                 first_line=first_line, keep=keep, not_utf8=not_utf8)
    if not_utf8 is not None:  # the validating path, with those lines rejected by name
        return _parse_validating(data, offsets, spec, path=path, first_line=first_line, keep=keep,
                                 not_utf8=not_utf8)
    has_quotes = n_quotes > 0  # offsets stays None (every line is UTF-8) until the validating path needs them
    if has_quotes and not spec.quoted_last:
        fast = False
    else:
        # Exact pre-check without per-line work: Polars raises on a line with too many fields, so when it parses
        # and the total separator count equals (ncols - 1) per line, no line can have too few either. Separators
        # inside the quoted last column are the commas of its parsed values; any other string column holding a
        # comma (a quoted field elsewhere) sends the chunk to the validating path.
        fast = not has_quotes or n_quotes % 2 == 0
    if fast:
        try:
            df = pl.read_csv(
                io.BytesIO(data), has_header=False, schema={c: spec.dtypes[c] for c in spec.columns},
                quote_char='"' if spec.quoted_last else None,
            )
        except (pl.exceptions.ComputeError, pl.exceptions.SchemaError, pl.exceptions.NoDataError):
            fast = False
        else:
            inside = 0
            if has_quotes:
                last = spec.columns[-1]
                inside = int(df[last].str.count_matches(",").fill_null(0).sum())
                others = [c for c in spec.columns[:-1] if spec.dtypes[c] == pl.Utf8]
                if any(df[c].str.contains(",").fill_null(False).any() for c in others):
                    inside = -1  # force the validating path
            ok = (
                len(df) == n_lines
                and total_commas - inside == (ncols - 1) * n_lines
                and not any(df[c].null_count() for c in spec.required)
            )
            if ok:
                df = df.select(keep).with_columns(
                    pl.int_range(first_line, first_line + n_lines, dtype=pl.Int64).alias("line")
                )
                return df, []
    if offsets is None:
        offsets = line_starts(data)
    return _parse_validating(data, offsets, spec, path=path, first_line=first_line, keep=keep)


def _parse_csv_module(
    data: bytes, offsets: np.ndarray, spec: ColumnSpec, *, path: str, first_line: int, keep: List[str],
    not_utf8: Optional[np.ndarray] = None,
) -> Tuple[pl.DataFrame, List[Reject]]:
    """Quote-aware validating path for small files whose fields may all be quoted (user features)."""
    ncols = len(spec.columns)
    text = [data[offsets[i]:offsets[i + 1]].decode("utf-8").rstrip("\r\n") for i in range(len(offsets) - 1)]
    rows: List[List[Optional[str]]] = []
    structural: List[Optional[str]] = []
    for k, line in enumerate(text):
        fields: List[Optional[str]] = [None] * ncols
        reason = None
        if not_utf8 is not None and not_utf8[k]:
            reason = NOT_UTF8
        elif not line:
            reason = "empty line"
        else:
            try:
                parsed = next(csv.reader([line], strict=True))
            except csv.Error as e:
                reason = f"malformed quoting: {e}"
            else:
                if len(parsed) != ncols:
                    reason = f"wrong number of columns (expected {ncols})"
                else:
                    fields = list(parsed)
        rows.append(fields)
        structural.append(reason)
    fields_df = pl.DataFrame({f"f{i}": pl.Series([r[i] for r in rows], dtype=pl.Utf8) for i in range(ncols)})
    raw = pl.Series("raw", text, dtype=pl.Utf8)
    return _convert(raw, fields_df, pl.Series("reason", structural, dtype=pl.Utf8), spec, keep, path, first_line)


def _parse_validating(
    data: bytes, offsets: np.ndarray, spec: ColumnSpec, *, path: str, first_line: int, keep: List[str],
    not_utf8: Optional[np.ndarray] = None,
) -> Tuple[pl.DataFrame, List[Reject]]:
    """Validating path for unquoted files and files whose only quoted column is the last one."""
    ncols = len(spec.columns)
    raw = _lines_series(data, offsets)
    if spec.quoted_last:
        # Split off the first ncols-1 fields; the remainder is the (possibly quoted) last column.
        parts = raw.str.splitn(",", ncols).struct.rename_fields([f"f{i}" for i in range(ncols)])
        fields = pl.DataFrame({"s": parts}).unnest("s")
        last = fields[f"f{ncols - 1}"]
        last_ok = last.is_null() | last.str.contains(r'^("[^"]*"|[^",]*)$')
        count_ok = fields[f"f{ncols - 1}"].is_not_null() & last_ok.fill_null(False)
        fields = fields.with_columns(last.str.strip_chars('"').alias(f"f{ncols - 1}"))
    else:
        parts = raw.str.split_exact(",", ncols).struct.rename_fields([f"f{i}" for i in range(ncols + 1)])
        fields = pl.DataFrame({"s": parts}).unnest("s")
        count_ok = fields[f"f{ncols - 1}"].is_not_null() & fields[f"f{ncols}"].is_null()
    bad_text = pl.Series(not_utf8 if not_utf8 is not None else np.zeros(len(raw), dtype=bool))
    structural = pl.select(
        pl.when(bad_text).then(pl.lit(NOT_UTF8))
        .when(raw.str.len_bytes() == 0).then(pl.lit("empty line"))
        .when(~count_ok).then(pl.lit(f"wrong number of columns (expected {ncols})"))
        .otherwise(pl.lit(None, dtype=pl.Utf8))
    ).to_series()
    return _convert(raw, fields, structural, spec, keep, path, first_line)


def _convert(raw: pl.Series, fields: pl.DataFrame, reasons: pl.Series, spec: ColumnSpec, keep: List[str],
             path: str, first_line: int) -> Tuple[pl.DataFrame, List[Reject]]:
    """Typed columns from the string fields ``f0..`` of every line; the first problem of a line is its reason
    (structural reasons given in ``reasons`` come first). Returns the good rows and the rejects."""
    n = len(raw)
    no = pl.Series([False] * n)
    converted = {}
    for i, c in enumerate(spec.columns):
        s = fields[f"f{i}"].str.strip_chars(" ")
        dtype = spec.dtypes[c]
        if dtype == pl.Utf8:
            val = s.replace("", None) if c not in spec.required else s
            bad = no
        elif dtype in (pl.Float64, pl.Float32):
            val = s.cast(pl.Float64, strict=False)
            bad = s.is_not_null() & (s != "") & val.is_null()
            val = val.cast(dtype, strict=False)
        else:
            # integers; an integral float ("9.0", as tools that store missing values as NaN write integer columns)
            # is that integer, a fractional one ("9.5") is not
            as_int = s.str.to_integer(strict=False)
            as_float = s.cast(pl.Float64, strict=False)
            integral = (as_int.is_null() & as_float.is_not_null() & as_float.is_finite()
                        & (as_float == as_float.floor()) & (as_float.abs() < 2.0 ** 53))
            val = pl.select(pl.when(integral).then(as_float.cast(pl.Int64, strict=False))
                            .otherwise(as_int)).to_series()
            fraction = as_int.is_null() & as_float.is_not_null() & as_float.is_finite() & ~integral
            bad = s.is_not_null() & (s != "") & val.is_null() & ~fraction
            val = val.cast(dtype, strict=False)
            reasons = pl.select(
                pl.when(reasons.is_not_null()).then(reasons)
                .when(fraction.fill_null(False)).then(pl.lit(f"column {c}: not an integer"))
                .otherwise(reasons)).to_series()
        missing = (s.is_null() | (s == "")) if c in spec.required else no
        reasons = pl.select(
            pl.when(reasons.is_not_null()).then(reasons)
            .when(bad).then(pl.lit(f"column {c}: not a number"))
            .when(missing).then(pl.lit(f"column {c}: missing value"))
            .otherwise(pl.lit(None, dtype=pl.Utf8))
        ).to_series()
        converted[c] = val
    lines = pl.int_range(first_line, first_line + n, dtype=pl.Int64, eager=True).alias("line")
    good_mask = reasons.is_null()
    df = pl.DataFrame({c: converted[c] for c in keep}).with_columns(lines).filter(good_mask)
    bad_idx = np.flatnonzero(~good_mask.to_numpy())
    rejects = [Reject(path, int(first_line + i), reasons[int(i)], raw[int(i)] or "") for i in bad_idx]
    return df, rejects


def iter_file(
    path: str, spec: ColumnSpec, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[Tuple[Chunk, pl.DataFrame, List[Reject]]]:
    """Sequentially parse a whole file (header excluded), yielding each chunk's rows and rejects."""
    _, chunks = plan_chunks(path, chunk_bytes)
    line = 2
    for ch in chunks:
        data = read_chunk_bytes(ch)
        ch.first_line = line
        df, rej = parse_chunk(data, spec, path=path, first_line=line)
        line += count_lines(data)
        yield ch, df, rej


# -- Parquet inputs --------------------------------------------------------------------------------------------------
# A Parquet chunk is a run of whole row groups (``Chunk.start``/``end`` are row-group indices, not bytes), cut at
# about the same uncompressed size as a CSV chunk. Its rows are numbered from 1 within the file (no header), and
# they take the CSV rules: a column whose Parquet type already is the published one (or a narrower integer) is
# taken as it is; any other column (strings, or floats in an integer column, as tools that keep missing values as
# NaN write them) is checked cell by cell through the CSV path's conversion, so the same cell gives the same value
# or the same reject in both formats.

@contextlib.contextmanager
def _reading_parquet(path: str):
    """Arrow's errors on a damaged Parquet file (a bad footer, a page that does not decompress) name no file: name
    it, in one message."""
    try:
        yield
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: cannot be read as Parquet ({type(e).__name__}: {' '.join(str(e).split())})") from e


def plan_parquet_chunks(path: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> List[Chunk]:
    import pyarrow.parquet as pq  # only for Parquet inputs

    with _reading_parquet(path), storage.open_read(path) as f:
        meta = pq.ParquetFile(f).metadata
    chunks: List[Chunk] = []
    start, size = 0, 0
    for g in range(meta.num_row_groups):
        size += meta.row_group(g).total_byte_size
        if size >= chunk_bytes or g == meta.num_row_groups - 1:
            chunks.append(Chunk(path, len(chunks), start, g + 1, 0))
            start, size = g + 1, 0
    return chunks


def _typed_as_is(dtype: pl.DataType, want: pl.DataType) -> bool:
    if want == pl.Utf8:
        return dtype in (pl.Utf8, pl.String)
    if want in (pl.Float64, pl.Float32):
        return dtype.is_numeric()
    return dtype.is_integer()


def _text(col: pl.Series) -> pl.Series:
    """A column as the text a CSV file would hold: null is an empty cell, floats as Polars prints them (``9.0``, the
    shortest text that reads back the same)."""
    return col.cast(pl.Utf8, strict=False)


def parse_parquet_chunk(chunk: Chunk, spec: ColumnSpec, *, first_line: int) -> Tuple[pl.DataFrame, List[Reject]]:
    """Parse row groups ``[chunk.start, chunk.end)`` of a Parquet file: good rows with a ``line`` column (the
    row number, keyed from ``first_line`` like a CSV chunk's lines) and the rejects (raw text: the row's cells
    joined by commas)."""
    import pyarrow.parquet as pq  # only for Parquet inputs

    keep = list(spec.keep or spec.columns)
    with _reading_parquet(chunk.path), storage.open_read(chunk.path) as f:
        # pages written with a CRC (pyarrow's write_page_checksum) are checked; others have none to check
        table = pq.ParquetFile(f, page_checksum_verification=True).read_row_groups(
            list(range(chunk.start, chunk.end)), columns=list(spec.columns))
    df = pl.from_arrow(table)
    if isinstance(df, pl.Series):
        df = df.to_frame()
    n = len(df)
    if n == 0:
        return pl.DataFrame(schema={**{c: spec.dtypes[c] for c in keep}, "line": pl.Int64}), []
    # NaN is a missing value (an empty CSV cell), as pandas writes one
    df = df.with_columns([pl.col(c).fill_nan(None) for c in spec.columns if df[c].dtype.is_float()])
    if all(_typed_as_is(df[c].dtype, spec.dtypes[c]) for c in spec.columns) and \
            not any(df[c].null_count() for c in spec.required):
        try:
            out = df.select([pl.col(c).cast(spec.dtypes[c], strict=True) for c in keep])
        except (pl.exceptions.InvalidOperationError, pl.exceptions.ComputeError):
            pass  # a value out of the published type's range: the checked path names it
        else:
            return out.with_columns(pl.int_range(first_line, first_line + n, dtype=pl.Int64).alias("line")), []
    fields = pl.DataFrame({f"f{i}": _text(df[c]) for i, c in enumerate(spec.columns)})
    raw = fields.select(pl.concat_str([pl.col(f"f{i}").fill_null("") for i in range(len(spec.columns))],
                                      separator=",").alias("raw")).to_series()
    reasons = pl.Series("reason", [None] * n, dtype=pl.Utf8)
    return _convert(raw, fields, reasons, spec, keep, chunk.path, first_line)
