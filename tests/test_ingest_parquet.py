"""KuaiRand tables given as Parquet (one file, or a directory of files, per table): the same shards as the same data
in CSV, the CSV path's reject rules with file and row number, and a schema that does not match refused by name."""

from __future__ import annotations

import csv
import json
import os
import shutil

import polars as pl
import pytest

from nestpipe.datasets import kuairand
from nestpipe.ingest import IngestConfig, ingest


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    from nestpipe.datasets import synth

    root = tmp_path_factory.mktemp("parquet-raw")
    synth.generate(str(root / "raw"), scale="tiny", seed=1, progress=False)
    return str(root / "raw")


def _read_csv(path: str, kind: kuairand.FileKind) -> pl.DataFrame:
    return pl.read_csv(path, schema=dict(kind.dtypes))


def _as_parquet(raw: str, dst: str) -> None:
    """Every table of ``raw`` as Parquet, written the ways other tools write them: logs in many row groups, the
    video table's integer columns as floats with NaN for missing values, one statistics part as a directory of two
    files, the user table as a ``NAME.parquet/`` directory."""
    os.makedirs(dst)
    found = kuairand.discover(raw)
    for kind in kuairand.FILE_KINDS:
        for path in found.paths(kind.name):
            stem = os.path.basename(path)[:-len(".csv")]
            df = _read_csv(path, kind)
            if kind.name.startswith("log_"):
                df.write_parquet(os.path.join(dst, stem + ".parquet"), row_group_size=2000)
            elif kind.name == "video_features_basic":
                ints = [c for c, t in kind.dtypes.items() if t.is_integer() and c != "video_id"]
                df = df.with_columns([pl.col(c).cast(pl.Float64).fill_null(float("nan")) for c in ints])
                df.write_parquet(os.path.join(dst, stem + ".parquet"))
            elif stem.endswith("part2"):
                os.makedirs(os.path.join(dst, stem))
                half = len(df) // 2
                df[:half].write_parquet(os.path.join(dst, stem, "a.parquet"))
                df[half:].write_parquet(os.path.join(dst, stem, "b.parquet"))
            elif kind.name == "user_features":
                os.makedirs(os.path.join(dst, stem + ".parquet"))
                df.write_parquet(os.path.join(dst, stem + ".parquet", "part-0.parquet"))
            else:
                df.write_parquet(os.path.join(dst, stem + ".parquet"))


def _digests(out):
    m = json.load(open(os.path.join(out, "manifest.json")))
    return {split: [(s["path"], s["sha256"]) for s in shards] for split, shards in m["sets"].items()}


@pytest.mark.parametrize("task", ["gr", "ctr"])
def test_parquet_tables_give_the_shards_of_the_same_data_in_csv(raw, tmp_path, task):
    # missing values in a feature column the CTR task keeps (NaN in the Parquet side's float column)
    raw = _with_video_table(raw, str(tmp_path / "csv-raw"), _video_with_missing_music_ids(raw), "csv")
    pq_raw = str(tmp_path / "pq")
    _as_parquet(raw, pq_raw)
    found = kuairand.discover(pq_raw)
    assert all(kuairand.is_parquet(p) for paths in found.files.values() for p in paths)
    assert len(found.paths("video_features_statistic")) == 4  # part2 as a directory of two files
    opts = dict(task=task, batch_size=64, micro_batches=4, batches_per_shard=3, workers=1, progress=False)
    ingest(IngestConfig(raw=raw, out=str(tmp_path / "csv"), **opts))
    ingest(IngestConfig(raw=pq_raw, out=str(tmp_path / "parquet"), chunk_mb=0.02, **opts))  # many chunks per file
    a, b = _digests(str(tmp_path / "csv")), _digests(str(tmp_path / "parquet"))
    assert a == b and sum(len(v) for v in a.values()) >= 3
    assert not os.path.exists(tmp_path / "parquet" / "rejects.csv") or \
        len(open(tmp_path / "parquet" / "rejects.csv").read().splitlines()) == \
        len(open(tmp_path / "csv" / "rejects.csv").read().splitlines())


def _with_video_table(raw: str, dst: str, video: pl.DataFrame, fmt: str = "parquet") -> str:
    """``raw`` with its video table replaced by ``video`` (as Parquet, or as CSV: the tag lists quoted)."""
    shutil.copytree(raw, dst)
    os.remove(os.path.join(dst, "video_features_basic_27k.csv"))
    if fmt == "csv":
        video.write_csv(os.path.join(dst, "video_features_basic_27k.csv"))
    elif fmt == "dir":  # rows 1-5 in part-0, the rest in part-1
        os.makedirs(os.path.join(dst, "video_features_basic_27k"))
        video[:5].write_parquet(os.path.join(dst, "video_features_basic_27k", "part-0.parquet"))
        video[5:].write_parquet(os.path.join(dst, "video_features_basic_27k", "part-1.parquet"))
    else:
        video.write_parquet(os.path.join(dst, "video_features_basic_27k.parquet"))
    return dst


def _video_with_missing_music_ids(raw: str) -> pl.DataFrame:
    kind = kuairand.FILE_KINDS_BY_NAME["video_features_basic"]
    video = _read_csv(os.path.join(raw, "video_features_basic_27k.csv"), kind)
    return video.with_columns(pl.when(pl.int_range(pl.len()) % 7 == 3).then(None).otherwise(pl.col("music_id"))
                              .alias("music_id"))


def test_parquet_cells_that_cannot_be_typed_are_rejected_with_file_and_row(raw, tmp_path):
    kind = kuairand.FILE_KINDS_BY_NAME["video_features_basic"]
    video = _read_csv(os.path.join(raw, "video_features_basic_27k.csv"), kind)
    n = len(video)
    # music_type as floats: 9.0 is the integer 9, 9.5 is not an integer, NaN is a missing value (the column is
    # optional: kept as null); author_id as text with one word in it
    music = video["music_type"].cast(pl.Float64).to_list()
    music[4], music[6], music[8] = 9.0, 9.5, float("nan")
    author = video["author_id"].cast(pl.Utf8).to_list()
    author[2] = "abc"
    video = video.with_columns(pl.Series("music_type", music), pl.Series("author_id", author))
    src = _with_video_table(raw, str(tmp_path / "raw"), video, "dir")
    out = str(tmp_path / "out")
    ingest(IngestConfig(raw=src, out=out, task="ctr", batch_size=64, micro_batches=4, workers=1, progress=False,
                        max_reject_fraction=0.5))
    rows = list(csv.DictReader(open(os.path.join(out, "rejects.csv"))))
    got = {(r["file"], int(r["line"])): r["reason"] for r in rows if r["file"].startswith("video_features_basic")}
    # named by their file under --raw and their row in it (from 1)
    assert got == {("video_features_basic_27k/part-0.parquet", 3): "column author_id: not a number",
                   ("video_features_basic_27k/part-1.parquet", 2): "column music_type: not an integer"}, got
    raw_text = [r["raw"] for r in rows if r["file"].startswith("video_features_basic") and r["line"] == "3"][0]
    assert raw_text.split(",")[:2] == [str(video["video_id"][2]), "abc"]
    assert json.load(open(os.path.join(out, "manifest.json")))["rejected_rows"] == len(rows)
    assert n > 8


def test_a_parquet_table_without_a_published_column_is_refused_by_name(raw, tmp_path):
    kind = kuairand.FILE_KINDS_BY_NAME["video_features_basic"]
    video = _read_csv(os.path.join(raw, "video_features_basic_27k.csv"), kind).drop("music_type")
    src = _with_video_table(raw, str(tmp_path / "raw"), video)
    with pytest.raises(kuairand.SchemaError, match=r"video_features_basic_27k\.parquet: wrong header.*music_type"):
        kuairand.discover(src)
    # columns in another order are fine: Parquet columns are read by name
    video = _read_csv(os.path.join(raw, "video_features_basic_27k.csv"), kind)
    video.select(list(reversed(video.columns))).write_parquet(os.path.join(src, "video_features_basic_27k.parquet"))
    assert kuairand.discover(src).paths("video_features_basic")[0].endswith(".parquet")


@pytest.mark.parametrize("damage", ["truncated", "page", "footer"])
def test_a_damaged_parquet_log_fails_in_one_message_naming_the_file(raw, tmp_path, capsys, damage):
    """A Parquet log cut short (no footer), with a data page that does not decompress, or with its footer's
    metadata scrambled: the command fails with one line naming the file (Arrow's own errors name none, and the
    metadata's spans two lines). Control: the same file undamaged ingests."""
    from nestpipe.cli import main

    src = str(tmp_path / "raw")
    shutil.copytree(raw, src)
    log = sorted(n for n in os.listdir(src) if n.startswith("log_standard") and n.endswith(".csv"))[0]
    pq = os.path.join(src, log[:-len(".csv")] + ".parquet")
    _read_csv(os.path.join(src, log), kuairand.FILE_KINDS_BY_NAME["log_standard"]).write_parquet(pq)
    os.remove(os.path.join(src, log))
    args = ["ingest", "--raw", src, "--task", "gr", "--batch-size", "32", "--quiet", "--workers", "1"]
    assert main(args + ["--out", str(tmp_path / "good")]) == 0
    capsys.readouterr()
    data = open(pq, "rb").read()
    if damage == "truncated":
        damaged = data[:len(data) // 2]
    elif damage == "footer":  # the thrift-encoded metadata just before its length and the closing magic
        damaged = data[:-48] + bytes(b ^ 0x5A for b in data[-48:-8]) + data[-8:]
    else:  # scribble over the middle of the user_id column's compressed pages
        import pyarrow.parquet as papq

        meta = papq.ParquetFile(pq).metadata
        col = next(meta.row_group(0).column(i) for i in range(meta.num_columns)
                   if meta.row_group(0).column(i).path_in_schema == "user_id")
        mid = col.data_page_offset + col.total_compressed_size // 2
        damaged = data[:mid] + bytes(b ^ 0x5A for b in data[mid:mid + 64]) + data[mid + 64:]
    open(pq, "wb").write(damaged)
    assert main(args + ["--out", str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and os.path.basename(pq) in err[0] and "Parquet" in err[0], err
    assert "Traceback" not in err[0]
