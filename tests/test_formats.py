"""Public datasets in: MovieLens (100K, 1M, 20M-style CSV), Amazon (ratings CSV, review JSON lines) and atomic files,
each written here in its published layout from one set of interactions, then detected, converted and ingested.

The same interactions in different formats give the same shards (byte for byte) where the formats carry the same
ids; the shards hold each user's items in time order with the action from the rating and the side token from the
genre; malformed lines are kept with file, line and reason; an interrupted conversion resumes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import polars as pl
import pytest

from nestpipe.cli import main
from nestpipe.datasets import shards
from nestpipe.ingest import formats
from nestpipe.ingest.formats.convert import LOG_DIR
from nestpipe.ingest.formats.samples import (GENRES, ITEMS, USERS, WRITERS, _tok, _write, sample_events,
                                             write_amazon_jsonl_2014, write_atomic, write_ml100k, write_ml1m)
from nestpipe.ingest import IngestConfig, ingest


@pytest.fixture(scope="module")
def events():
    return sample_events(7)


def _gr(raw, out, **kw):
    cfg = dict(raw=raw, out=out, task="gr", batch_size=16, micro_batches=2, max_seq_len=12, progress=False,
               batches_per_shard=2)
    cfg.update(kw)
    return ingest(IngestConfig(**cfg))


def _digests(m):
    return {split: [(e.path, e.sha256) for e in entries] for split, entries in m.sets.items()}


@pytest.mark.parametrize("key", list(WRITERS), ids=["-".join(k) for k in WRITERS])
def test_each_format_is_detected_and_named_by_check_raw(key, events, tmp_path, capsys):
    d = WRITERS[key](str(tmp_path / "raw"), events)
    src = formats.detect(d)
    assert (src.format, src.variant) == (key[0], key[1].replace("-2023", ""))
    assert main(["check-raw", d]) == 0
    out = capsys.readouterr().out
    assert f"{key[0]} data, release {src.variant}" in out and "interactions:" in out
    with pytest.raises(formats.FormatError, match="no kuairand|no movielens|no atomic|no amazon"):
        other = next(f for f in ("movielens", "atomic") if f != key[0])
        formats.detect(d, other)


def test_movielens_releases_give_the_same_shards(events, tmp_path):
    """100K (tab, flags per genre), 1M (``::``, Latin-1, a title with a comma and an accent) and the CSV releases
    (quoted titles, ratings as 4.0) of the same ratings: the same gr shards, byte for byte."""
    made = {}
    for variant in ("ml-100k", "ml-1m", "ml-latest"):
        raw = WRITERS[("movielens", variant)](str(tmp_path / variant), events)
        m = _gr(raw, str(tmp_path / f"out-{variant}"))
        assert m.stats["source"]["variant"] == variant and m.rejected_rows == 0
        made[variant] = _digests(m)
    assert made["ml-100k"] == made["ml-1m"] == made["ml-latest"]
    assert len(made["ml-100k"]["train"]) >= 2


def test_token_formats_give_the_same_shards(events, tmp_path):
    """Atomic files, the Amazon ratings CSV and both Amazon review releases (seconds, and milliseconds in gzipped
    JSON lines) of the same interactions: ids mapped in sorted token order, the same gr shards."""
    made = {}
    for key in (("atomic", "mini"), ("amazon", "ratings-csv"), ("amazon", "reviews-jsonl"),
                ("amazon", "reviews-jsonl-2023")):
        raw = WRITERS[key](str(tmp_path / key[1]), events)
        made[key] = _digests(_gr(raw, str(tmp_path / f"out-{key[1]}")))
    first = next(iter(made.values()))
    assert all(v == first for v in made.values()), {k: v["eval"][:1] for k, v in made.items()}


def test_converted_logs_hold_every_rating_with_its_flags_and_ids(events, tmp_path):
    raw = write_atomic(str(tmp_path / "raw"), events)
    _gr(raw, str(tmp_path / "out"), keep_work=True)
    logs = pl.read_parquet(os.path.join(str(tmp_path / "out"), "_work", "s0", LOG_DIR, "*.parquet"))
    users = sorted({_tok("u", u) for u, *_ in events["rows"]})
    items = sorted({_tok("i", i) for _, i, *_ in events["rows"]})
    want = pl.DataFrame({
        "user_id": [users.index(_tok("u", u)) for u, *_ in events["rows"]],
        "video_id": [items.index(_tok("i", i)) for _, i, *_ in events["rows"]],
        "time_ms": [t * 1000 for *_, t in events["rows"]],
        "is_click": [int(r >= 4) for _, _, r, _ in events["rows"]],
        "is_like": [int(r >= 5) for _, _, r, _ in events["rows"]],
        "is_hate": [int(r < 3) for _, _, r, _ in events["rows"]],
    })
    assert logs.select(want.columns).equals(want)  # every row, in file order
    assert (logs["date"] // 10000).min() == 1997  # 880,000,000 s is in 1997 (UTC)
    videos = pl.read_parquet(os.path.join(str(tmp_path / "out"), "_work", "s0", "video_features_basic_pure.parquet"))
    token = {g: k + 1 for k, g in enumerate(sorted(GENRES))}
    for vid, author, tag in videos.select("video_id", "author_id", "tag").iter_rows():
        genres = events["genres"][int(items[vid][1:])]
        assert author == token[genres[0]] and tag == ",".join(str(token[g]) for g in genres)


def test_gr_shards_hold_each_users_items_in_time_order_with_actions_and_genres(events, tmp_path):
    """The eval split's windows, read back from the shards: each user's last items by time, the action bits from the
    ratings (click >= 4, like >= 5, hate < 3) and the author table holding the item's first genre."""
    raw = write_ml100k(str(tmp_path / "raw"), events)
    out = str(tmp_path / "out")
    m = _gr(raw, out)
    by_user = {}
    for u, i, r, t in sorted(events["rows"], key=lambda x: (x[0], x[3])):
        by_user.setdefault(u, []).append((i, r))
    token = {g: k + 1 for k, g in enumerate(sorted(GENRES))}
    seen = 0
    for path in shards.shard_paths(out, m, "eval"):
        for rec in shards.iter_shard(path):
            off = np.concatenate([[0], np.cumsum(rec["item.lengths"])])
            for s, u in enumerate(rec["user"]):
                items = rec["item.values"][off[s]:off[s + 1]].tolist()
                want = by_user[int(u)][-m.max_seq_len:]
                assert items == [i for i, _ in want]
                actions = rec["action.values"][off[s]:off[s + 1]].tolist()
                assert actions == [int(r >= 4) | (int(r >= 5) << 1) | (int(r < 3) << 5) for _, r in want]
                authors = rec["author.values"][off[s]:off[s + 1]].tolist()
                assert authors == [token[events["genres"][i][0]] for i, _ in want]
                seen += 1
    assert seen == USERS


def test_ctr_label_is_the_rating_against_positive_rating(events, tmp_path):
    raw = write_ml1m(str(tmp_path / "raw"), events)
    for p in (4.0, 3.0):
        out = str(tmp_path / f"out-{p}")
        m = ingest(IngestConfig(raw=raw, out=out, task="ctr", batch_size=8, micro_batches=2, ctr_eval_days=20,
                                positive_rating=p, progress=False))
        clicks = n = 0
        for split in m.sets:
            for path in shards.shard_paths(out, m, split):
                for rec in shards.iter_shard(path):
                    clicks += int(np.asarray(rec["labels"])[:, m.labels.index("is_click")].sum())
                    n += len(rec["labels"])
        # every rating is a sample except the training remainder that does not fill a batch
        assert n == len(events["rows"]) - m.dropped_samples["train"]
        want = sum(r >= p for _, _, r, _ in events["rows"])
        assert want - m.dropped_samples["train"] <= clicks <= want
        assert m.stats["source"]["rating"]["positives"] == want


def test_malformed_lines_are_kept_with_file_line_and_reason(events, tmp_path):
    raw = write_ml100k(str(tmp_path / "raw"), events)
    with open(os.path.join(raw, "u.data"), "a") as f:
        f.write("1\t2\t3\n")             # a field short
        f.write("x\t2\t3\t881250949\n")  # a user id that is no integer
        f.write("1\t2\tgood\t881250949\n")
        f.write("1\t2\t3\t-5\n")
    with open(os.path.join(raw, "u.item"), "a", encoding="latin-1") as f:
        f.write("77|Broken|01-Jan-1995||http://x|1|0\n")
    n = len(events["rows"])
    m = _gr(raw, str(tmp_path / "out"), max_reject_fraction=0.1)
    assert m.rejected_rows == 5
    with open(os.path.join(str(tmp_path / "out"), "rejects.csv")) as f:
        rows = list(__import__("csv").reader(f))[1:]
    got = [(r[0], int(r[1]), r[2].split(":")[0]) for r in rows]
    assert got == [("u.data", n + 1, "wrong number of fields (expected 4, separated by '\\t')"),
                   ("u.data", n + 2, "user id"), ("u.data", n + 3, "rating"), ("u.data", n + 4, "time"),
                   ("u.item", ITEMS + 1, "wrong number of fields (expected 24, separated by '|')")]
    assert rows[1][3] == "x\t2\t3\t881250949"
    assert m.stats["source"]["rows"] == n + 4 and m.stats["source"]["rejected"] == 4
    # every good line is there: as many eval windows as users, and the same shards as without the bad lines
    ref = _gr(write_ml100k(str(tmp_path / "clean"), events), str(tmp_path / "out-clean"))
    assert _digests(m) == _digests(ref)


def test_json_lines_rejects_and_a_clear_error_when_nothing_is_usable(events, tmp_path):
    raw = write_amazon_jsonl_2014(str(tmp_path / "raw"), events)
    with open(os.path.join(raw, "reviews_Mini_5.json"), "a") as f:
        f.write('{"reviewerID": "u001", "asin": "i001"\n')
        f.write('{"reviewerID": "u001", "asin": "i001", "overall": 5.0}\n')
        f.write('[1, 2]\n')
    m = _gr(raw, str(tmp_path / "out"), max_reject_fraction=0.1)
    n = len(events["rows"])
    with open(os.path.join(str(tmp_path / "out"), "rejects.csv")) as f:
        rows = list(__import__("csv").reader(f))[1:]
    assert [(r[0], int(r[1]), r[2].split(":")[0]) for r in rows] == [
        ("reviews_Mini_5.json", n + 1, "not a JSON object"), ("reviews_Mini_5.json", n + 2, "time"),
        ("reviews_Mini_5.json", n + 3, "not a JSON object")]
    assert m.rejected_rows == 3
    bad = str(tmp_path / "bad")
    os.makedirs(bad)
    _write(os.path.join(bad, "u.data"), ["a\tb\tc\td"])
    with pytest.raises(formats.FormatError, match="no usable interaction in u.data"):
        _gr(bad, str(tmp_path / "out-bad"))


def test_format_options_are_checked(events, tmp_path):
    raw = write_ml100k(str(tmp_path / "raw"), events)
    with pytest.raises(formats.FormatError, match="--release chooses among KuaiRand releases"):
        _gr(raw, str(tmp_path / "o1"), release="27k")
    with pytest.raises(formats.FormatError, match="no atomic files found"):
        _gr(raw, str(tmp_path / "o2"), format="atomic")
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    with pytest.raises(formats.FormatError, match="no dataset recognised"):
        formats.detect(empty)
    with pytest.raises(ValueError, match="--format must be one of"):
        IngestConfig(raw=raw, out=str(tmp_path / "o3"), format="csv").validate()


def _ingest_cli(raw, out, crash_at=None):
    env = dict(os.environ)
    if crash_at:
        env["NESTPIPE_INGEST_CRASH_AT"] = crash_at
    cmd = [sys.executable, "-m", "nestpipe", "ingest", "--raw", raw, "--out", out, "--task", "gr", "--batch-size",
           "16", "--micro-batches", "2", "--max-seq-len", "12", "--batches-per-shard", "2", "--quiet",
           "--chunk-mb", "0.005", "--workers", "1"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_sigkill_during_conversion_or_after_it_resumes_to_the_same_shards(events, tmp_path):
    raw = write_ml1m(str(tmp_path / "raw"), events)
    ref = str(tmp_path / "ref")
    assert _ingest_cli(raw, ref).returncode == 0
    reference = _digests(shards.load_manifest(ref))
    out = str(tmp_path / "out")
    r = _ingest_cli(raw, out, crash_at="convert:1")  # killed while converting its second chunk
    assert r.returncode == -9
    assert not os.path.exists(os.path.join(out, "_work", "s0", "conversion.json"))
    r = _ingest_cli(raw, out, crash_at="shard:0")  # the conversion finishes, then the run dies
    assert r.returncode == -9
    record = os.path.join(out, "_work", "s0", "conversion.json")
    before = os.stat(record).st_mtime_ns
    r = _ingest_cli(raw, out, crash_at="shard:1")
    assert r.returncode == -9 and os.stat(record).st_mtime_ns == before  # the conversion was not redone
    r = _ingest_cli(raw, out)
    assert r.returncode == 0, r.stderr
    assert _digests(shards.load_manifest(out)) == reference
    assert "already complete" in _ingest_cli(raw, out).stderr


def test_no_public_dataset_is_vendored():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    names = {"u.data", "ratings.dat", "movies.dat", "ratings.csv"}
    found = [os.path.join(d, n) for d, _, files in os.walk(root) if ".venv" not in d and ".git" not in d
             for n in files if n in names or n.endswith(".inter")]
    assert found == []


@pytest.mark.parametrize("damage", ["flipped", "cut"])
def test_a_damaged_gzip_input_fails_in_one_message_naming_the_file(events, tmp_path, capsys, damage):
    """An Amazon 2023 review file (JSON lines, gzipped) with bytes changed inside the stream (a bad CRC or a corrupt
    block) or cut short: the command fails with one line naming the file (gzip's and zlib's errors name none, and
    zlib's escaped as a traceback). Control: the same files undamaged ingest."""
    raw = WRITERS[("amazon", "reviews-jsonl-2023")](str(tmp_path / "raw"), events)
    args = ["ingest", "--raw", raw, "--task", "gr", "--batch-size", "16", "--micro-batches", "2", "--max-seq-len",
            "12", "--quiet", "--workers", "1"]
    assert main(args + ["--out", str(tmp_path / "good")]) == 0
    capsys.readouterr()
    path = os.path.join(raw, "Mini.jsonl.gz")
    data = open(path, "rb").read()
    mid = len(data) // 2
    open(path, "wb").write(data[:mid] + bytes(b ^ 0x55 for b in data[mid:mid + 16]) + data[mid + 16:]
                           if damage == "flipped" else data[:mid])
    assert main(args + ["--out", str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Mini.jsonl.gz: cannot be read, the file is damaged or cut short" in err[0], err
