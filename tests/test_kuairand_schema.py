"""KuaiRand schema: discovery, exact headers, clear errors for a missing file or a wrong header, `check-raw`."""

import os
import shutil

import polars as pl
import pytest

from nestpipe.cli import main as cli_main
from nestpipe.datasets import kuairand, synth


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("kuairand") / "raw"
    synth.generate(str(out), scale="tiny", seed=0, progress=False)
    return out


def _copy(raw_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(raw_dir, dst)
    return dst


def test_schema_lists_the_published_columns():
    assert len(kuairand.LOG_COLUMNS) == 19 and kuairand.LOG_COLUMNS[:5] == ["user_id", "video_id", "date", "hourmin",
                                                                             "time_ms"]
    assert len(kuairand.USER_COLUMNS) == 31 and kuairand.USER_COLUMNS[-1] == "onehot_feat17"
    assert len(kuairand.VIDEO_BASIC_COLUMNS) == 12 and kuairand.VIDEO_BASIC_COLUMNS[-1] == "tag"
    assert len(kuairand.VIDEO_STAT_COLUMNS) == 52
    assert len(kuairand.USER_ONEHOT_CARDINALITY) == 18
    for kind in kuairand.FILE_KINDS:
        assert set(kind.dtypes) == set(kind.columns), kind.name
        assert len(set(kind.columns)) == len(kind.columns), kind.name


def test_discover_finds_every_27k_file_in_published_order(raw_dir):
    found = kuairand.discover(str(raw_dir))
    assert found.release == "27k"
    for kind in kuairand.FILE_KINDS:
        assert [os.path.basename(p) for p in found.paths(kind.name)] == list(kind.names["27k"])
    assert sum(len(v) for v in found.files.values()) == 10


def test_every_header_is_exactly_the_published_one(raw_dir):
    for kind in kuairand.FILE_KINDS:
        for name in kind.names["27k"]:
            with open(raw_dir / name, "rb") as f:
                first = f.readline()
            assert first == (",".join(kind.columns) + "\n").encode(), name


def test_missing_file_error_names_the_file_and_the_expected_columns(raw_dir, tmp_path):
    d = _copy(raw_dir, tmp_path)
    victim = "video_features_statistic_27k_part2.csv"
    os.remove(d / victim)
    with pytest.raises(kuairand.SchemaError) as e:
        kuairand.discover(str(d))
    msg = str(e.value)
    assert victim in msg and "missing" in msg
    assert ",".join(kuairand.VIDEO_STAT_COLUMNS) in msg


def test_wrong_header_error_names_the_file_and_the_expected_columns(raw_dir, tmp_path):
    d = _copy(raw_dir, tmp_path)
    victim = d / "log_random_4_22_to_5_08_27k.csv"
    text = victim.read_text()
    victim.write_text(text.replace("is_click", "clicked", 1))
    with pytest.raises(kuairand.SchemaError) as e:
        kuairand.discover(str(d))
    msg = str(e.value)
    assert str(victim) in msg
    assert "expected: " + ",".join(kuairand.LOG_COLUMNS) in msg
    assert "'is_click'" in msg and "'clicked'" in msg
    # Negative control: restoring the header makes discovery pass again.
    victim.write_text(text)
    kuairand.discover(str(d))


def test_columns_in_wrong_order_are_rejected(raw_dir, tmp_path):
    d = _copy(raw_dir, tmp_path)
    victim = d / "user_features_27k.csv"
    lines = victim.read_text().split("\n")
    cols = lines[0].split(",")
    cols[1], cols[2] = cols[2], cols[1]
    victim.write_text("\n".join([",".join(cols)] + lines[1:]))
    with pytest.raises(kuairand.SchemaError, match="wrong order"):
        kuairand.discover(str(d))


def test_crlf_and_quoted_headers_are_accepted(raw_dir, tmp_path):
    d = _copy(raw_dir, tmp_path)
    victim = d / "video_features_basic_27k.csv"
    body = victim.read_bytes().split(b"\n", 1)[1]
    header = ",".join(f'"{c}"' for c in kuairand.VIDEO_BASIC_COLUMNS)
    victim.write_bytes(header.encode() + b"\r\n" + body)
    kuairand.discover(str(d))


def test_pure_release_is_detected_from_its_file_names(tmp_path):
    for kind in kuairand.FILE_KINDS:
        for name in kind.names["pure"]:
            (tmp_path / name).write_text(",".join(kind.columns) + "\n")
    found = kuairand.discover(str(tmp_path))
    assert found.release == "pure"
    assert [os.path.basename(p) for p in found.paths("video_features_statistic")] == [
        "video_features_statistic_pure.csv"]


def test_directory_without_kuairand_files_is_a_clear_error(tmp_path):
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(kuairand.SchemaError, match="no KuaiRand files found"):
        kuairand.discover(str(tmp_path))
    with pytest.raises(kuairand.SchemaError, match="not a directory"):
        kuairand.discover(str(tmp_path / "absent"))


def test_explicit_dtypes_read_every_file(raw_dir):
    found = kuairand.discover(str(raw_dir))
    for kind in kuairand.FILE_KINDS:
        for p in found.paths(kind.name):
            df = pl.read_csv(p, schema=kind.dtypes)
            assert df.columns == list(kind.columns) and df.height > 0
            assert dict(df.schema) == kind.dtypes


def test_check_raw_command_lists_files_per_kind(raw_dir, capsys):
    assert cli_main(["check-raw", str(raw_dir)]) == 0
    out = capsys.readouterr().out
    assert "27k release" in out
    for kind in kuairand.FILE_KINDS:
        assert f"{kind.name}: {len(kind.names['27k'])} file(s)" in out
        for name in kind.names["27k"]:
            assert name in out


def test_check_raw_command_reports_a_missing_file(raw_dir, tmp_path, capsys):
    d = _copy(raw_dir, tmp_path)
    os.remove(d / "user_features_27k.csv")
    assert cli_main(["check-raw", str(d)]) == 1
    err = capsys.readouterr().err
    assert "user_features_27k.csv" in err and "missing" in err and "user_active_degree" in err
