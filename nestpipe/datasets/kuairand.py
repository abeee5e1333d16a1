"""KuaiRand schema: file names and columns exactly as published, for the 27K, 1K and Pure releases.

The real files promise no row order, contain empty cells, quoted comma-joined tag lists, range strings such as
``(0,10]`` and float durations. This module only describes them (names, columns, Polars dtypes) and discovers
them in a directory; :mod:`nestpipe.ingest` reads them.

A table may also be given as Parquet under the same name: ``NAME.parquet`` (one file) or a directory ``NAME/`` or
``NAME.parquet/`` of ``*.parquet`` files (read in sorted name order), with the published column names in any order.
Where both a CSV file and a Parquet form of a table are present, the CSV file is read.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Dict, List, Sequence

import polars as pl

from nestpipe.utils import storage

RELEASES = ("27k", "1k", "pure")

# Real vocabulary sizes of the releases (users, videos).
VOCAB = {
    "27k": {"users": 27_285, "videos": 32_038_725},
    "1k": {"users": 1_000, "videos": 4_369_953},
    "pure": {"users": 27_285, "videos": 7_583},
}

LOG_COLUMNS: List[str] = [
    "user_id", "video_id", "date", "hourmin", "time_ms", "is_click", "is_like", "is_follow", "is_comment",
    "is_forward", "is_hate", "long_view", "play_time_ms", "duration_ms", "profile_stay_time",
    "comment_stay_time", "is_profile_enter", "is_rand", "tab",
]
LOG_DTYPES: Dict[str, pl.DataType] = {c: pl.Int64 for c in LOG_COLUMNS}

# Feedback flags packed into one action bitmask, in the order popular GR preprocessors use.
ACTION_FLAGS: List[str] = [
    "is_click", "is_like", "is_follow", "is_comment", "is_forward", "is_hate", "long_view", "is_profile_enter",
]

USER_ONEHOT_CARDINALITY: List[int] = [2, 7, 50, 1471, 15, 34, 3, 118, 454, 7, 5, 5] + [2] * 6
USER_COLUMNS: List[str] = [
    "user_id", "user_active_degree", "is_lowactive_period", "is_live_streamer", "is_video_author",
    "follow_user_num", "follow_user_num_range", "fans_user_num", "fans_user_num_range", "friend_user_num",
    "friend_user_num_range", "register_days", "register_days_range",
] + [f"onehot_feat{i}" for i in range(18)]
USER_STRING_COLUMNS = {
    "user_active_degree", "follow_user_num_range", "fans_user_num_range", "friend_user_num_range",
    "register_days_range",
}
USER_DTYPES: Dict[str, pl.DataType] = {
    c: (pl.Utf8 if c in USER_STRING_COLUMNS else pl.Int64) for c in USER_COLUMNS
}

VIDEO_BASIC_COLUMNS: List[str] = [
    "video_id", "author_id", "video_type", "upload_dt", "upload_type", "visible_status", "video_duration",
    "server_width", "server_height", "music_id", "music_type", "tag",
]
VIDEO_BASIC_DTYPES: Dict[str, pl.DataType] = {
    "video_id": pl.Int64, "author_id": pl.Int64, "video_type": pl.Utf8, "upload_dt": pl.Utf8,
    "upload_type": pl.Utf8, "visible_status": pl.Utf8, "video_duration": pl.Float64, "server_width": pl.Int64,
    "server_height": pl.Int64, "music_id": pl.Int64, "music_type": pl.Int64, "tag": pl.Utf8,
}

VIDEO_STAT_COLUMNS: List[str] = [
    "video_id", "counts", "show_cnt", "show_user_num", "play_cnt", "play_user_num", "play_duration",
    "complete_play_cnt", "complete_play_user_num", "valid_play_cnt", "valid_play_user_num", "long_time_play_cnt",
    "long_time_play_user_num", "short_time_play_cnt", "short_time_play_user_num", "play_progress",
    "comment_stay_duration", "like_cnt", "like_user_num", "click_like_cnt", "double_click_cnt", "cancel_like_cnt",
    "cancel_like_user_num", "comment_cnt", "comment_user_num", "direct_comment_cnt", "reply_comment_cnt",
    "delete_comment_cnt", "delete_comment_user_num", "comment_like_cnt", "comment_like_user_num", "follow_cnt",
    "follow_user_num", "cancel_follow_cnt", "cancel_follow_user_num", "share_cnt", "share_user_num",
    "download_cnt", "download_user_num", "report_cnt", "report_user_num", "reduce_similar_cnt",
    "reduce_similar_user_num", "collect_cnt", "collect_user_num", "cancel_collect_cnt", "cancel_collect_user_num",
    "direct_comment_user_num", "reply_comment_user_num", "share_all_cnt", "share_all_user_num",
    "outsite_share_all_cnt",
]
VIDEO_STAT_FLOAT_COLUMNS = {"play_progress", "comment_stay_duration"}
VIDEO_STAT_DTYPES: Dict[str, pl.DataType] = {
    c: (pl.Float64 if c in VIDEO_STAT_FLOAT_COLUMNS else pl.Int64) for c in VIDEO_STAT_COLUMNS
}


@dataclasses.dataclass(frozen=True)
class FileKind:
    """One kind of KuaiRand file: its columns and the file names each release uses for it."""

    name: str
    columns: Sequence[str]
    dtypes: Dict[str, pl.DataType]
    names: Dict[str, Sequence[str]]  # release -> exact published file names (one kind may span parts)
    required: bool = True


FILE_KINDS: List[FileKind] = [
    FileKind(
        "log_standard", LOG_COLUMNS, LOG_DTYPES,
        {
            "27k": [
                "log_standard_4_08_to_4_21_27k_part1.csv", "log_standard_4_08_to_4_21_27k_part2.csv",
                "log_standard_4_22_to_5_08_27k_part1.csv", "log_standard_4_22_to_5_08_27k_part2.csv",
            ],
            "1k": ["log_standard_4_08_to_4_21_1k.csv", "log_standard_4_22_to_5_08_1k.csv"],
            "pure": ["log_standard_4_08_to_4_21_pure.csv", "log_standard_4_22_to_5_08_pure.csv"],
        },
    ),
    FileKind(
        "log_random", LOG_COLUMNS, LOG_DTYPES,
        {
            "27k": ["log_random_4_22_to_5_08_27k.csv"],
            "1k": ["log_random_4_22_to_5_08_1k.csv"],
            "pure": ["log_random_4_22_to_5_08_pure.csv"],
        },
    ),
    FileKind(
        "user_features", USER_COLUMNS, USER_DTYPES,
        {"27k": ["user_features_27k.csv"], "1k": ["user_features_1k.csv"], "pure": ["user_features_pure.csv"]},
    ),
    FileKind(
        "video_features_basic", VIDEO_BASIC_COLUMNS, VIDEO_BASIC_DTYPES,
        {
            "27k": ["video_features_basic_27k.csv"],
            "1k": ["video_features_basic_1k.csv"],
            "pure": ["video_features_basic_pure.csv"],
        },
    ),
    FileKind(
        "video_features_statistic", VIDEO_STAT_COLUMNS, VIDEO_STAT_DTYPES,
        {
            "27k": [
                "video_features_statistic_27k_part1.csv", "video_features_statistic_27k_part2.csv",
                "video_features_statistic_27k_part3.csv",
            ],
            "1k": ["video_features_statistic_1k.csv"],
            "pure": ["video_features_statistic_pure.csv"],
        },
    ),
]
FILE_KINDS_BY_NAME = {k.name: k for k in FILE_KINDS}


class SchemaError(ValueError):
    """A KuaiRand file is missing or does not have the published header."""


PARQUET_SUFFIX = ".parquet"


def is_parquet(path: str) -> bool:
    return path.endswith(PARQUET_SUFFIX)


def parquet_forms(root: str, csv_name: str) -> List[str]:
    """The Parquet files standing for the published CSV file ``csv_name`` under ``root`` (empty when there are
    none): ``STEM.parquet``, else the ``*.parquet`` files of a directory ``STEM.parquet/`` or ``STEM/``."""
    stem = csv_name[:-len(".csv")] if csv_name.endswith(".csv") else csv_name
    one = storage.join(root, stem + PARQUET_SUFFIX)
    if storage.isfile(one):
        return [one]
    for d in (one, storage.join(root, stem)):
        if storage.isdir(d):
            files = [storage.join(d, n) for n in sorted(storage.listdir(d)) if n.endswith(PARQUET_SUFFIX)]
            if not files:
                raise SchemaError(f"{d}: a directory standing for {csv_name} holds no *{PARQUET_SUFFIX} files")
            return files
    return []


@dataclasses.dataclass
class Discovered:
    """The KuaiRand files found in a directory, by kind, in published order."""

    root: str
    release: str
    files: Dict[str, List[str]]  # kind name -> absolute paths

    def paths(self, kind: str) -> List[str]:
        return self.files[kind]


def read_header(path: str) -> List[str]:
    """The column names of a CSV file's header, or of a Parquet file's schema."""
    if is_parquet(path):
        import pyarrow.parquet as pq  # only for Parquet inputs

        try:
            with storage.open_read(path) as f:
                return list(pq.read_schema(f).names)
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for files that are not Parquet
            raise SchemaError(f"{path}: not a readable Parquet file ({' '.join(str(e).split())})") from e
    with storage.open_read(path) as f:
        line = f.readline().decode("utf-8", errors="replace")
    return [c.strip().strip('"') for c in line.rstrip("\r\n").split(",")] if line else []


def check_header(path: str, kind: FileKind) -> None:
    header = read_header(path)
    if is_parquet(path) and sorted(header) == sorted(kind.columns):
        return  # Parquet columns are read by name
    if header != list(kind.columns):
        missing = [c for c in kind.columns if c not in header]
        extra = [c for c in header if c not in kind.columns]
        detail = []
        if missing:
            detail.append(f"missing columns {missing}")
        if extra:
            detail.append(f"unexpected columns {extra}")
        if not missing and not extra:
            detail.append("columns in the wrong order")
        raise SchemaError(
            f"{path}: wrong header for a KuaiRand {kind.name} file ({'; '.join(detail)}).\n"
            f"  expected: {','.join(kind.columns)}\n  found:    {','.join(header) or '<empty file>'}"
        )


def detect_release(root: str) -> str:
    names = set(storage.listdir(root))
    scores = {}
    for rel in RELEASES:
        scores[rel] = sum(1 for k in FILE_KINDS for n in k.names[rel]
                          if n in names or n[:-len(".csv")] + PARQUET_SUFFIX in names or n[:-len(".csv")] in names)
    best = max(RELEASES, key=lambda r: scores[r])
    if scores[best] == 0:
        found = sorted(n for n in names if n.endswith(".csv"))
        raise SchemaError(
            f"{root}: no KuaiRand files found (expected e.g. {FILE_KINDS[0].names['27k'][0]}, or its Parquet form "
            f"{FILE_KINDS[0].names['27k'][0][:-len('.csv')]}{PARQUET_SUFFIX}); "
            f"csv files present: {found[:10]}"
        )
    return best


def discover(root: str, release: str | None = None, check_headers: bool = True) -> Discovered:
    """Find every file of a KuaiRand release under ``root``; fail naming the first missing file."""
    if not storage.isdir(root):
        raise SchemaError(f"{root}: not a directory")
    release = release or detect_release(root)
    if release not in RELEASES:
        raise SchemaError(f"unknown KuaiRand release {release!r}; expected one of {RELEASES}")
    files: Dict[str, List[str]] = {}
    for kind in FILE_KINDS:
        paths = []
        for name in kind.names[release]:
            p = storage.join(root, name)
            found = [p] if storage.exists(p) else parquet_forms(root, name)
            if not found:
                if kind.required:
                    raise SchemaError(
                        f"{p}: missing KuaiRand {release} file ({kind.name}; CSV, or Parquet as "
                        f"{name[:-len('.csv')]}{PARQUET_SUFFIX}); expected columns: {','.join(kind.columns)}"
                    )
                continue
            for f in found:
                if check_headers:
                    check_header(f, kind)
                paths.append(storage.absolute(f))
        files[kind.name] = paths
    return Discovered(storage.absolute(root), release, files)


def eval_cutoff(max_date: int, days: int) -> int:
    """The first date (``YYYYMMDD``) of the CTR eval split: the last ``days`` dates up to ``max_date``."""
    d = datetime.datetime.strptime(str(max_date), "%Y%m%d").date() - datetime.timedelta(days=max(days, 1) - 1)
    return int(d.strftime("%Y%m%d"))


def valid_date(max_date: int, eval_days: int, valid_days: int = 1) -> int:
    """The first date (``YYYYMMDD``) of the CTR valid split (``ingest --validation``): the last ``valid_days`` dates
    before the eval split."""
    d = (datetime.datetime.strptime(str(eval_cutoff(max_date, eval_days)), "%Y%m%d").date()
         - datetime.timedelta(days=max(valid_days, 1)))
    return int(d.strftime("%Y%m%d"))
