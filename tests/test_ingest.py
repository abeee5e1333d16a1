"""Ingest: rejects, determinism across workers, resume after SIGKILL, checksums, stock WebDataset, errors,
and the meaning of the samples (chronological windows, leave-one-out)."""

from __future__ import annotations

import io
import csv
import glob
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import polars as pl
import pytest

from nestpipe.datasets import kuairand
from nestpipe.datasets import shards
from nestpipe.datasets.synth import generate
from nestpipe.ingest import IngestConfig, IngestError, ingest, stages
from nestpipe.ingest.common import IngestTask
from nestpipe.ingest.config import TASKS

LOG1 = "log_standard_4_08_to_4_21_27k_part1.csv"


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("raw"))
    generate(d, scale="tiny", seed=3, progress=False)
    return d


def _cfg(raw, out, **kw):
    base = dict(raw=raw, out=out, task="gr", batch_size=64, micro_batches=4, max_seq_len=32, progress=False,
                batches_per_shard=3)
    base.update(kw)
    return IngestConfig(**base)


def _shard_bytes(out):
    return {os.path.basename(p): open(p, "rb").read() for p in sorted(glob.glob(os.path.join(out, "*.tar")))}


def _copy_raw(raw, dst):
    shutil.copytree(raw, dst)
    return dst


def test_gr_samples_are_chronological_windows_with_leave_one_out(raw, tmp_path):
    out = str(tmp_path / "o")
    m = ingest(_cfg(raw, out, batches_per_shard=100))
    logs = pl.concat([pl.read_csv(os.path.join(raw, n), schema=kuairand.LOG_DTYPES)
                      for n in kuairand.FILE_KINDS_BY_NAME["log_standard"].names["27k"]
                      + kuairand.FILE_KINDS_BY_NAME["log_random"].names["27k"]])
    logs = logs.sort(["user_id", "time_ms", "video_id"])
    seqs = {u: g["video_id"].to_list() for (u,), g in logs.group_by(["user_id"], maintain_order=True)}
    last = {u: s[-1] for u, s in seqs.items()}
    n_train = 0
    for entry in m.sets["train"]:
        for b in shards.iter_shard(os.path.join(out, entry.path)):
            off = shards.table_offsets(b, "item")
            assert len(off) - 1 == m.batch_size
            for s in range(m.batch_size):
                items = b["item.values"][off[s]:off[s + 1]].tolist()
                t = b["time"][off[s]:off[s + 1]]
                assert 2 <= len(items) <= 32
                assert np.all(np.diff(t) >= 0), "window not chronological"
                seq = seqs[int(b["user"][s])]
                # the window is a contiguous slice of the user's training prefix (never the held-out last one)
                train = seq[:-1]
                starts = [i for i in range(len(train) - len(items) + 1) if train[i:i + len(items)] == items]
                assert starts, "window is not a slice of the user's chronological training prefix"
            n_train += m.batch_size
    eval_users = []
    for entry in m.sets["eval"]:
        for b in shards.iter_shard(os.path.join(out, entry.path)):
            off = shards.table_offsets(b, "item")
            assert len(off) - 1 == b["meta"]["samples"] <= m.batch_size
            for s in range(len(off) - 1):
                items = b["item.values"][off[s]:off[s + 1]].tolist()
                assert items[-1] == last[int(b["user"][s])], "eval target is not the user's last interaction"
                assert items == seqs[int(b["user"][s])][-len(items):]
                eval_users.append(int(b["user"][s]))
    assert n_train == m.totals()["train"]["samples"] > 0
    # every user with a training prefix is evaluated once: the eval split keeps its incomplete last batch
    assert len(eval_users) == len(set(eval_users)) == m.totals()["eval"]["samples"]
    assert sorted(eval_users) == sorted(u for u, sq in seqs.items() if len(sq) >= 2)
    assert len(eval_users) % m.batch_size, "the fixture should leave an incomplete last eval batch"
    assert m.dropped_samples["eval"] == 0 and m.dropped_samples["train"] == n_train_all(m) - n_train


def n_train_all(m):
    return m.stats["samples"]["train"]


def test_batch_fields_partition_and_unique_keys(raw, tmp_path):
    out = str(tmp_path / "o")
    m = ingest(_cfg(raw, out))
    b = next(shards.iter_shard(os.path.join(out, m.sets["train"][0].path)))
    counts = np.bincount(b["mb"], minlength=m.micro_batches)
    assert counts.max() - counts.min() <= 1 and counts.sum() == m.batch_size
    for t in m.tables:
        assert np.array_equal(b[f"{t}.unique"][b[f"{t}.inverse"]], b[f"{t}.values"])
        assert np.all(np.diff(b[f"{t}.unique"]) > 0)
        off = shards.table_offsets(b, t)
        mo = b[f"{t}.mb_offsets"]
        for i in range(m.micro_batches):
            rows = np.flatnonzero(b["mb"] == i)
            vals = np.concatenate([b[f"{t}.values"][off[r]:off[r + 1]] for r in rows])
            got = b[f"{t}.unique"][b[f"{t}.mb_unique"][mo[i]:mo[i + 1]]]
            assert np.array_equal(got, np.unique(vals))


def test_ctr_records_keys_partition_and_history(raw, tmp_path):
    """CTR records (keyed a whole shard at once): per batch, the unique keys equal unique_keys_packed of the
    decoded values, the partition equals clustering.assign on the batch alone, and each sample's history is the
    user's previous ids in chronological order, its ``last_video`` the previous id + 1 (0 at the user's first
    interaction) and its ``log1p_gap_s`` the seconds since that interaction."""
    from nestpipe import clustering
    from nestpipe.ingest import ctr
    from nestpipe.ingest.common import batch_seed as _batch_seed

    out = str(tmp_path / "o")
    H = 5
    m = ingest(_cfg(raw, out, task="ctr", batch_size=64, history_len=H, batches_per_shard=4))
    logs = pl.concat([pl.read_csv(p, schema_overrides=kuairand.LOG_DTYPES).with_columns(pl.lit(i).alias("src"),
                                                                                 pl.int_range(pl.len()).alias("line"))
                      for i, p in enumerate(sorted(glob.glob(os.path.join(raw, "log_*.csv"))))])
    logs = logs.sort(["user_id", "time_ms", "video_id", "src", "line"])
    seqs = {int(u): g["video_id"].to_list() for (u,), g in logs.group_by(["user_id"], maintain_order=True)}
    times = {int(u): g["time_ms"].to_list() for (u,), g in logs.group_by(["user_id"], maintain_order=True)}
    gap_col = ctr.DENSE_FEATURES.index("log1p_gap_s")
    tables = list(m.tables)
    seen = 0
    for split in ("train", "eval"):
        for entry in m.sets[split]:
            for b in shards.iter_shard(os.path.join(out, entry.path)):
                mb = b["mb"]
                n_mb = b["meta"]["micro_batches"]  # fewer in an eval split's smaller last batch
                assert n_mb == (m.micro_batches if len(mb) == m.batch_size else min(m.micro_batches, len(mb)))
                packed = [(b[f"{t}.values"], shards.table_offsets(b, t)) for t in tables]
                ref = clustering.unique_keys_packed(packed, mb, num_micro_batches=n_mb)
                for t, (u, inv, mu, mo) in zip(tables, ref):
                    assert np.array_equal(b[f"{t}.unique"], u) and np.array_equal(b[f"{t}.inverse"], inv), t
                    assert np.array_equal(b[f"{t}.mb_unique"], mu) and np.array_equal(b[f"{t}.mb_offsets"], mo), t
                keys = np.stack([clustering.combine_keys(i, b[f"{t}.values"]) for i, t in
                                 enumerate(ctr.CLUSTER_TABLES)], axis=1).ravel()
                seed = _batch_seed({"seed": 0}, split, b["meta"]["index"])
                expect = clustering.assign(keys, np.arange(0, keys.size + 1, len(ctr.CLUSTER_TABLES)),
                                           n_mb, seed=seed)
                assert np.array_equal(mb, expect)
                hoff = shards.table_offsets(b, "history")
                for s_ in range(len(mb)):
                    u, v = int(b["user_id.values"][s_]), int(b["video_id.values"][s_])
                    hist = b["history.values"][hoff[s_]:hoff[s_ + 1]].tolist()
                    seq, ts = seqs[u], times[u]
                    last, gap = int(b["last_video.values"][s_]), float(b["dense"][s_, gap_col])

                    def context_at(p):
                        want_last = seq[p - 1] + 1 if p else 0
                        want_gap = np.log1p((ts[p] - ts[p - 1]) / 1000.0 if p else ctr.FIRST_GAP_S)
                        return last == want_last and np.isclose(gap, want_gap, rtol=1e-6)

                    assert any(seq[p] == v and seq[max(0, p - H):p] == hist and context_at(p)
                               for p in range(len(seq))), (u, v, hist, last, gap)
                assert b["labels"].dtype == np.float32 and set(np.unique(b["labels"])) <= {0.0, 1.0}
                seen += 1
    assert seen == sum(t["batches"] for t in m.totals().values()) > 4  # more than one shard's worth


def test_stock_webdataset_reads_every_member(raw, tmp_path):
    import webdataset as wds

    out = str(tmp_path / "o")
    m = ingest(_cfg(raw, out, task="ctr", batch_size=128))
    packed = [t for t in m.tables if m.tables[t].kind == "single"]
    bags = [t for t in m.tables if m.tables[t].kind == "pooled"]
    group_fields = ("unique", "unique_counts", "inverse", "mb_unique", "mb_offsets")
    # values are not stored (readers rebuild unique[inverse]); single-id tables need no lengths either
    expected = {"meta.json", "mb.npy", "dense.npy", "labels.npy"} | {f"single.{f}.npy" for f in group_fields} | {
        f"bags.{f}.npy" for f in group_fields + ("lengths",)}
    n = 0
    for split in ("train", "eval"):
        urls = shards.shard_paths(out, m, split)
        for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode():
            keys = {k for k in sample if not k.startswith("__")}
            assert keys == expected
            assert sorted(sample["meta.json"]["packed"]["single"]) == sorted(packed)
            assert sorted(sample["meta.json"]["packed"]["bags"]) == sorted(bags)
            batch = shards.decode_sample(sample)  # consumers see per-table fields again
            for t in m.tables:
                assert np.array_equal(batch[f"{t}.unique"][batch[f"{t}.inverse"]], batch[f"{t}.values"])
                b = sample["meta.json"]["samples"]  # 128, or fewer in the eval split's last batch
                assert len(batch[f"{t}.lengths"]) == b and len(batch[f"{t}.mb_offsets"]) == min(m.micro_batches, b) + 1
            assert b == 128 or split == "eval"
            for k in keys:
                assert sample[k] is not None
            assert sample["dense.npy"].shape == (b, len(m.dense_features))
            n += 1
    assert n == sum(t["batches"] for t in m.totals().values())
    # no pickled member anywhere
    for p in glob.glob(os.path.join(out, "*.tar")):
        import tarfile

        with tarfile.open(p) as tar:
            for mem in tar.getmembers():
                assert mem.name.endswith((".npy", ".json")) and mem.mtime == 0


def test_deterministic_across_workers(raw, tmp_path):
    a = ingest(_cfg(raw, str(tmp_path / "a"), workers=1, chunk_mb=1))
    b = ingest(_cfg(raw, str(tmp_path / "b"), workers=2, chunk_mb=1))
    sa, sb = _shard_bytes(str(tmp_path / "a")), _shard_bytes(str(tmp_path / "b"))
    assert sa.keys() == sb.keys() and len(sa) >= 2
    assert all(sa[k] == sb[k] for k in sa)
    assert a.to_json()["sets"] == b.to_json()["sets"]
    # negative control: another seed gives different shards
    c = ingest(_cfg(raw, str(tmp_path / "c"), seed=1))
    assert _shard_bytes(str(tmp_path / "c")) != sa and c.sets != a.sets


def test_input_row_order_does_not_matter(raw, tmp_path):
    src = _copy_raw(raw, str(tmp_path / "raw2"))
    logs = kuairand.FILE_KINDS_BY_NAME["log_standard"].names["27k"]
    # move rows between files and reverse them: same interactions, different order and files
    for name in logs:
        lines = open(os.path.join(src, name)).read().splitlines()
        open(os.path.join(src, name), "w").write("\n".join([lines[0]] + lines[1:][::-1]) + "\n")
    a = ingest(_cfg(raw, str(tmp_path / "a")))
    b = ingest(_cfg(src, str(tmp_path / "b")))
    ties = pl.concat([pl.read_csv(os.path.join(raw, n), schema=kuairand.LOG_DTYPES) for n in logs]).select(
        ["user_id", "time_ms", "video_id"]).is_duplicated().sum()
    assert ties == 0  # otherwise the tie-break by (file, line) legitimately differs
    for ea, eb in zip(a.sets["train"], b.sets["train"]):
        ba = list(shards.iter_shard(os.path.join(str(tmp_path / "a"), ea.path)))
        bb = list(shards.iter_shard(os.path.join(str(tmp_path / "b"), eb.path)))
        for x, y in zip(ba, bb):
            for k in ("item.values", "time", "user", "mb"):
                assert np.array_equal(x[k], y[k])


def test_rejects_are_kept_with_file_line_and_raw_text(raw, tmp_path):
    src = _copy_raw(raw, str(tmp_path / "raw2"))
    p = os.path.join(src, LOG1)
    lines = open(p).read().splitlines()
    good = lines[5]
    bad = {
        3: good.replace(good.split(",")[1], "abc", 1).replace(good.split(",")[0] + ",abc", good.split(",")[0] + ",abc"),
        5: good + ",99",  # extra column
        7: ",".join(good.split(",")[:5]),  # too few columns
    }
    bad[3] = ",".join([good.split(",")[0], "abc"] + good.split(",")[2:])  # non-numeric video id
    for i, text in bad.items():
        lines[i] = text
    body = "\r\n".join(lines)  # CRLF line endings throughout
    truncated = ",".join(good.split(",")[:7])
    open(p, "w", newline="").write(body + "\r\n" + truncated)  # truncated last line, no newline
    vb = os.path.join(src, "video_features_basic_27k.csv")
    vlines = open(vb).read().splitlines()
    vlines[2] = vlines[2] + ',"1,2"'  # an extra quoted column after the tags
    fields = vlines[4].split(",")
    vlines[4] = ",".join(fields[:3] + fields[4:])  # one column short (the tags may still be quoted)
    open(vb, "w").write("\n".join(vlines) + "\n")
    out = str(tmp_path / "o")
    # small chunks: rejects in later chunks of a file must still get absolute line numbers
    m = ingest(_cfg(src, out, max_reject_fraction=0.01, chunk_mb=0.02))
    with open(os.path.join(out, "rejects.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    got = {(r["file"], int(r["line"])): r for r in rows}
    assert len(rows) == m.rejected_rows == 6
    for i, text in bad.items():
        r = got[(LOG1, i + 1)]
        assert r["raw"] == text
    assert "not a number" in got[(LOG1, 4)]["reason"] and "video_id" in got[(LOG1, 4)]["reason"]
    assert "columns" in got[(LOG1, 6)]["reason"] and "columns" in got[(LOG1, 8)]["reason"]
    assert got[(LOG1, len(lines) + 1)]["raw"] == truncated
    assert got[("video_features_basic_27k.csv", 3)]["raw"] == vlines[2]
    assert got[("video_features_basic_27k.csv", 5)]["raw"] == vlines[4]
    assert "columns" in got[("video_features_basic_27k.csv", 5)]["reason"]
    # the good CRLF rows were all kept: every other log row made it into the samples
    assert m.stats["tokens"] == sum(
        len(open(os.path.join(raw, n)).read().splitlines()) - 1
        for n in kuairand.FILE_KINDS_BY_NAME["log_standard"].names["27k"] + kuairand.FILE_KINDS_BY_NAME["log_random"].names["27k"]
    ) - 3  # lines 3, 5, 7 replaced by bad ones; the truncated line was an extra line


def test_too_many_rejects_fail_clearly(raw, tmp_path):
    src = _copy_raw(raw, str(tmp_path / "raw2"))
    p = os.path.join(src, LOG1)
    lines = open(p).read().splitlines()
    lines[1:200] = ["x" + l for l in lines[1:200]]
    open(p, "w").write("\n".join(lines) + "\n")
    with pytest.raises(IngestError, match=r"199 of .* rejected.*max-reject-fraction.*rejects.csv"):
        ingest(_cfg(src, str(tmp_path / "o"), max_reject_fraction=0.001))
    assert os.path.exists(str(tmp_path / "o" / "rejects.csv"))


def test_clear_errors_missing_file_wrong_header_foreign_output(raw, tmp_path):
    src = _copy_raw(raw, str(tmp_path / "raw2"))
    os.remove(os.path.join(src, "log_random_4_22_to_5_08_27k.csv"))
    with pytest.raises(kuairand.SchemaError, match="log_random_4_22_to_5_08_27k.csv: missing"):
        ingest(_cfg(src, str(tmp_path / "o1")))
    src2 = _copy_raw(raw, str(tmp_path / "raw3"))
    p = os.path.join(src2, "video_features_basic_27k.csv")
    text = open(p).read().replace("author_id", "writer_id", 1)
    open(p, "w").write(text)
    with pytest.raises(kuairand.SchemaError, match=r"(?s)video_features_basic_27k.csv: wrong header.*expected: video_id,author_id"):
        ingest(_cfg(src2, str(tmp_path / "o2")))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds files of something else.*--force"):
        ingest(_cfg(raw, str(foreign)))
    assert (foreign / "notes.txt").read_text() == "mine"
    ingest(_cfg(raw, str(foreign), force=True))
    assert not (foreign / "notes.txt").exists()


def test_manifest_checksums_detect_corruption(raw, tmp_path):
    from nestpipe.ingest.report import shard_report

    out = str(tmp_path / "o")
    m = ingest(_cfg(raw, out))
    assert shard_report(out)["ok"]
    for entry in m.sets["train"]:
        shards.verify_shard(out, entry)
    p = os.path.join(out, m.sets["train"][0].path)
    data = bytearray(open(p, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(p, "wb").write(bytes(data))
    with pytest.raises(shards.ShardError, match=m.sets["train"][0].path + ": shard is corrupt"):
        shards.verify_shard(out, m.sets["train"][0])
    rep = shard_report(out)
    assert not rep["ok"] and m.sets["train"][0].path in rep["errors"][0]


def _run_subprocess(raw, out, crash_at=None, workers=1):
    env = dict(os.environ)
    if crash_at:
        env["NESTPIPE_INGEST_CRASH_AT"] = crash_at
    cmd = [sys.executable, "-m", "nestpipe", "ingest", "--raw", raw, "--out", out, "--task", "gr",
           "--batch-size", "64", "--micro-batches", "4", "--max-seq-len", "32", "--batches-per-shard", "3",
           "--quiet", "--chunk-mb", "1", "--workers", str(workers)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_sigkill_and_resume_gives_same_shards_without_redoing_finished_ones(raw, tmp_path):
    ref = str(tmp_path / "ref")
    r = _run_subprocess(raw, ref)
    assert r.returncode == 0, r.stderr
    reference = _shard_bytes(ref)
    assert len([k for k in reference if k.startswith("train")]) >= 3
    out = str(tmp_path / "o")
    r = _run_subprocess(raw, out, crash_at="parse:1")  # killed during parsing
    assert r.returncode == -9
    r = _run_subprocess(raw, out, crash_at="shard:1:mid")  # killed in the middle of writing shard 1
    assert r.returncode == -9
    assert os.path.exists(os.path.join(out, "train-000000.tar"))
    assert glob.glob(os.path.join(out, "train-000001.tar.tmp-*")), "shard 1 was not interrupted mid-write"
    assert not os.path.exists(os.path.join(out, "train-000001.tar"))
    st0 = os.stat(os.path.join(out, "train-000000.tar"))
    r = _run_subprocess(raw, out)
    assert r.returncode == 0, r.stderr
    st1 = os.stat(os.path.join(out, "train-000000.tar"))
    assert (st0.st_ino, st0.st_mtime_ns) == (st1.st_ino, st1.st_mtime_ns), "a finished shard was rewritten"
    m = shards.load_manifest(out)
    assert m.stats["resumed_shards"] >= 1
    assert _shard_bytes(out) == reference
    assert not glob.glob(os.path.join(out, "*.tmp*")) and not os.path.exists(os.path.join(out, "_work"))
    # a complete output is recognised and left alone
    r = _run_subprocess(raw, out)
    assert r.returncode == 0 and "already complete" in r.stderr


def test_killed_worker_process_fails_clearly_and_resume_gives_same_shards(raw, tmp_path):
    """With two workers a SIGKILL hits one worker (here: in the middle of shard 1): the command fails with a message
    naming the stage and how to resume, and the rerun gives the reference shards."""
    ref = str(tmp_path / "ref")
    assert _run_subprocess(raw, ref).returncode == 0
    out = str(tmp_path / "o")
    r = _run_subprocess(raw, out, crash_at="shard:1:mid", workers=2)
    assert r.returncode == 1, r.stderr
    assert "stage '4/4 shards': a worker process died" in r.stderr and "rerun the same command" in r.stderr
    assert not os.path.exists(os.path.join(out, "train-000001.tar"))
    r = _run_subprocess(raw, out, workers=2)
    assert r.returncode == 0, r.stderr
    assert _shard_bytes(out) == _shard_bytes(ref)


def test_a_worker_dead_before_a_stage_starts_fails_clearly_too():
    """A worker that died in an earlier stage (or while idle) breaks the pool: the next stage's submit raises
    BrokenProcessPool, which must come out as the same WorkerDied message, not a traceback."""
    import signal
    from types import SimpleNamespace

    from nestpipe.ingest.executor import Executor, WorkerDied

    cfg = SimpleNamespace(progress=False)
    with Executor(2) as ex:
        with pytest.raises(WorkerDied, match="stage '1/2 first': a worker process died"):
            ex.run(signal.raise_signal, [signal.SIGKILL, signal.SIGKILL], cfg, "1/2 first")
        with pytest.raises(WorkerDied, match="stage '2/2 second': a worker process died.*2 of 2 units unfinished"):
            ex.run(abs, [-1, -2], cfg, "2/2 second")


def test_cli_help_and_error_exit(raw, tmp_path):
    r = subprocess.run([sys.executable, "-m", "nestpipe", "ingest", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--max-reject-fraction" in r.stdout
    r = subprocess.run([sys.executable, "-m", "nestpipe", "ingest", "--raw", str(tmp_path / "nope"), "--out",
                        str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 1 and "not a directory" in r.stderr


def test_pack_unpack_roundtrip_and_corruption():
    rng = np.random.default_rng(0)
    batch = {"meta": {"index": 0}}
    orig = {}
    for t in ("a", "b", "c"):
        lengths = rng.integers(0, 3, 16).astype(np.int32)
        values = rng.integers(-5, 5, lengths.sum()).astype(np.int64)
        uniq, inv = np.unique(values, return_inverse=True)
        fields = {"values": values, "lengths": lengths, "unique": uniq, "inverse": inv.astype(np.int32),
                  "mb_unique": np.arange(len(uniq), dtype=np.int32), "mb_offsets": np.array([0, len(uniq)])}
        for f, v in fields.items():
            batch[f"{t}.{f}"] = v
            orig[f"{t}.{f}"] = v.copy()
    shards.pack_tables(batch, "g", ["a", "b", "c"])
    assert not any(k.startswith(("a.", "b.", "c.")) for k in batch)
    members = dict(shards.encode_record("000000001", batch))
    sample = {k.split(".", 1)[1]: (json.loads(v) if k.endswith(".json") else np.load(__import__("io").BytesIO(v)))
              for k, v in members.items()}
    out = shards.decode_sample(sample)
    for k, v in orig.items():
        assert np.array_equal(out[k], v), k
    # a corrupted group is refused, not silently misread
    bad = dict(sample)
    bad["g.unique_counts.npy"] = sample["g.unique_counts.npy"] + np.array([1, -1, 0])
    bad["g.unique_counts.npy"][0] += 5
    with pytest.raises(shards.ShardError, match="packed group 'g'"):
        shards.decode_sample(bad)


def test_short_rows_are_caught_although_polars_accepts_them():
    """Polars' reader fills a short row with nulls instead of failing: the separator count is what rejects it."""
    import io

    from nestpipe.ingest.parse import ColumnSpec, parse_chunk

    schema = {f"c{i}": pl.Int64 for i in range(5)}
    data = b"1,2,3,4,5\n1,2,3,4\n1,2,3,4,5\n"
    naive = pl.read_csv(io.BytesIO(data), has_header=False, schema=schema)
    assert naive.height == 3 and naive["c4"].null_count() == 1  # the bug a naive reader has
    spec = ColumnSpec(list(schema), schema, ["c0"])
    df, rejects = parse_chunk(data, spec, path="f.csv", first_line=2)
    assert df.height == 2 and [(r.line, r.raw) for r in rejects] == [(3, "1,2,3,4")]


def test_user_features_with_quoted_ranges_parse_and_reject(raw, tmp_path):
    """Range strings such as "(0,10]" are quoted anywhere in a user-features row: the quote-aware path keeps
    them whole and still rejects malformed rows with their line."""
    from nestpipe.ingest import ctr
    from nestpipe.ingest.parse import iter_file

    lines = open(os.path.join(raw, "user_features_27k.csv")).read().splitlines()
    assert any('"(' in l or '"[' in l for l in lines[1:])
    lines[3] = lines[3].replace(",", ";", 1)
    lines[5] = "x" + lines[5]
    lines[7] = ""
    p = tmp_path / "user_features_27k.csv"
    p.write_text("\n".join(lines) + "\n")
    (_, df, rejects), = list(iter_file(str(p), ctr.USER_SPEC))
    assert [(r.line, r.reason.split(":")[0]) for r in rejects] == [
        (4, "wrong number of columns (expected 31)"), (6, "column user_id"), (8, "empty line")]
    assert df.height == len(lines) - 1 - 3
    assert df["follow_user_num_range"].str.contains(",").any()  # a quoted range kept whole


@pytest.mark.parametrize("spans,max_len,negative", [
    ([5, 1000, 30], 1, False),  # one id per sample: presence map
    ([10**6, 40], 5, False),  # wide ids: packed sort
    ([2**61, 3, 1, 7], 3, True),  # ids too far apart for one code space: lexsort
    ([10**12, 5], 4, True),
])
@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_shard_group_keys_equal_per_batch_unique_keys(spans, max_len, negative, path, monkeypatch):
    from nestpipe.clustering import unique_keys_packed
    from nestpipe.ingest import batch_keys

    group_keys = batch_keys.group_keys if path == "compiled" else batch_keys.group_keys_numpy
    if path == "compiled":  # the compiled path must be the one that runs (occurrences grouped by batch, table)
        monkeypatch.setattr(batch_keys, "group_keys_numpy", lambda *a: pytest.fail("fell back to numpy"))

    rng = np.random.default_rng(3)
    nb, b, n, T = 6, 24, 4, len(spans)
    mb = rng.integers(0, n, (nb, b))
    per_batch, occ = [], {"v": [], "b": [], "t": [], "m": []}
    for j in range(nb):
        tabs = []
        for t in range(T):
            lens = rng.integers(0, max_len + 1, b) if max_len > 1 else np.ones(b, np.int64)
            v = rng.integers(-spans[t] if negative else 0, spans[t], lens.sum())
            tabs.append((v, np.concatenate([[0], np.cumsum(lens)])))
            for k_, x in (("v", v), ("b", np.full(len(v), j)), ("t", np.full(len(v), t)),
                          ("m", np.repeat(mb[j], lens))):
                occ[k_].append(x)
        per_batch.append(tabs)
    g = group_keys(*(np.concatenate(occ[k_]).astype(np.int64) for k_ in "vbtm"), nb, T, n)
    cur = 0
    for j in range(nb):
        ref = unique_keys_packed(per_batch[j], mb[j], num_micro_batches=n)
        u, counts, mu, mo = g.batch(j, T)
        nnz = sum(len(r[1]) for r in ref)
        assert np.array_equal(u, np.concatenate([r[0] for r in ref]))
        assert np.array_equal(counts, [len(r[0]) for r in ref])
        assert np.array_equal(g.inverse[cur:cur + nnz], np.concatenate([r[1] for r in ref]))
        assert np.array_equal(mu, np.concatenate([r[2] for r in ref]))
        assert np.array_equal(mo, np.stack([r[3] for r in ref]))
        cur += nnz
    assert cur == len(g.inverse)
    assert np.array_equal(g.mt, np.concatenate([[0], np.cumsum(g.mb_counts.reshape(nb, -1).sum(1))]))



def test_shard_group_keys_presence_path_and_int64_extremes():
    """The compiled per-segment keys rank a segment by a presence map when its ids span little (small tables) and
    sort otherwise; a segment holding both int64 extremes (whose difference overflows) must take the sort. Both
    equal the NumPy composite-code path; a presence map forced on the extremes segment would not."""
    from nestpipe.ingest import batch_keys

    lo, hi = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    segs = [np.array([7, 3, 7, 5, 3], np.int64), np.array([hi, lo, 0, hi, lo], np.int64),
            np.array([2, 2, 2], np.int64), np.array([10**15, -10**15, 10**15], np.int64)]
    values = np.concatenate(segs)
    batch = np.concatenate([np.full(len(v), j // 2) for j, v in enumerate(segs)]).astype(np.int64)
    table = np.concatenate([np.full(len(v), j % 2) for j, v in enumerate(segs)]).astype(np.int64)
    mb = (np.arange(len(values)) % 3).astype(np.int64)
    got = batch_keys.group_keys(values, batch, table, mb, 2, 2, 3)
    ref = batch_keys.group_keys_numpy(values, batch, table, mb, 2, 2, 3)
    for f in ("unique", "ut", "inverse", "mb_unique", "mt", "mb_counts"):
        assert np.array_equal(getattr(got, f), getattr(ref, f)), f
    assert got.unique[got.ut[1]:got.ut[2]].tolist() == [lo, 0, hi]


def test_gr_authors_first_row_wins_and_missing_videos_are_counted(raw, tmp_path):
    """The GR author comes from the first row of the video in file order; a video without a features row gets
    author -1 and is counted. Negative controls: the dropped video's author is no longer served, and the
    duplicate's (later) author never is."""
    src = _copy_raw(raw, str(tmp_path / "raw"))
    vb = os.path.join(src, "video_features_basic_27k.csv")
    lines = open(vb).read().splitlines()
    header, body = lines[0], lines[1:]
    cols = header.split(",")
    vi, ai = cols.index("video_id"), cols.index("author_id")
    logs = pl.concat([pl.read_csv(os.path.join(raw, n), schema=kuairand.LOG_DTYPES)
                      for n in kuairand.FILE_KINDS_BY_NAME["log_standard"].names["27k"]
                      + kuairand.FILE_KINDS_BY_NAME["log_random"].names["27k"]])
    counts = logs["video_id"].value_counts()
    by_id = {int(ln.split(",")[vi]): ln for ln in body}
    hot = [int(v) for v in counts.sort("count", descending=True)["video_id"].to_list() if int(v) in by_id][:2]
    dropped, duplicated = hot
    dup = by_id[duplicated].split(",")
    first_author = int(dup[ai])
    dup[ai] = str(first_author + 1_000)
    body = [ln for ln in body if int(ln.split(",")[vi]) != dropped] + [",".join(dup)]
    open(vb, "w").write("\n".join([header] + body) + "\n")
    out = str(tmp_path / "o")
    m = ingest(_cfg(src, out, batches_per_shard=100))
    assert m.stats["duplicate_video_rows"] == 1
    assert m.stats["missing_video_features"] == int(counts.filter(pl.col("video_id") == dropped)["count"][0])
    seen = {dropped: set(), duplicated: set()}
    for split in ("train", "eval"):
        for entry in m.sets[split]:
            for b in shards.iter_shard(os.path.join(out, entry.path)):
                for v in seen:
                    seen[v] |= set(b["author.values"][b["item.values"] == v].tolist())
    assert seen[dropped] == {-1} and seen[duplicated] == {first_author}


def test_task_registry_matches_the_command_line():
    """Every ``--task`` name has one task object of that name, and every task object overrides the whole task
    interface (a stage calling a method a task forgot would fail mid-ingest)."""
    assert tuple(stages.TASKS) == TASKS
    interface = [n for n, v in vars(IngestTask).items() if callable(v) and not n.startswith("_")]
    for name, task in stages.TASKS.items():
        assert isinstance(task, IngestTask) and task.name == name
        missing = [n for n in interface if n != "column_spec" and getattr(type(task), n) is getattr(IngestTask, n)]
        assert not missing, (name, missing)

    class Partial(IngestTask):  # negative control: a task that leaves a method out is caught
        name = "partial"

    assert [n for n in interface if n != "column_spec" and getattr(Partial, n) is getattr(IngestTask, n)]


def test_every_option_is_checked_before_work_starts(tmp_path):
    """An unknown --clustering is refused by the command line at once, naming the methods (before: at stage 4/4,
    after parsing and spilling); the names the ingest accepts are the clustering package's."""
    from nestpipe.clustering import method_names
    from nestpipe.ingest.config import CLUSTERING_METHODS

    assert list(CLUSTERING_METHODS) == method_names()
    with pytest.raises(ValueError, match="--clustering must be one of default, random, minhash, kmeans"):
        IngestConfig(raw=str(tmp_path), out=str(tmp_path / "o"), clustering="bogus").validate()
    p = subprocess.run([sys.executable, "-m", "nestpipe", "ingest", "--raw", str(tmp_path / "missing"), "--out",
                        str(tmp_path / "o"), "--clustering", "bogus"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "invalid choice: 'bogus'" in p.stderr and "minhash" in p.stderr, p.stderr
    assert not (tmp_path / "o").exists()


def test_an_explicit_batch_size_too_large_names_the_numbers_that_fit(raw, tmp_path):
    """synth --scale tiny, then ingest with --batch-size 512 given: the error names a batch size that fits the data
    (and --force, since the failed run left its work behind); rerunning without --force says what the directory
    holds; the suggested command works. (Left to the defaults, the ingest fits the size itself: the test above.)"""
    import re

    out = str(tmp_path / "o")
    with pytest.raises(IngestError, match=r"from the \d+ training samples; rerun with --batch-size \d+ .*--force") as e:
        ingest(IngestConfig(raw=raw, out=out, task="gr", batch_size=512, progress=False, workers=1))
    fit = int(re.search(r"--batch-size (\d+)", str(e.value)).group(1))
    with pytest.raises(FileExistsError, match="holds an unfinished ingest of other inputs or options"):
        ingest(IngestConfig(raw=raw, out=out, task="gr", batch_size=fit, progress=False, workers=1))
    m = ingest(IngestConfig(raw=raw, out=out, task="gr", batch_size=fit, progress=False, workers=1, force=True))
    assert m.totals()["train"]["batches"] >= 8


@pytest.mark.parametrize("engine", ["local", "dask"])
def test_workers_do_not_outlive_a_killed_driver(raw, tmp_path, engine):
    """SIGKILL of `nestpipe ingest` leaves nothing running, with either engine: the local pool's spawn workers
    (which cannot be told: the driver is gone) notice their parent changed and exit within a few seconds (before:
    they lived on, adopted by init); a LocalCluster's nannies do the same. The check sees them alive right after
    the kill (so they really outlived the driver), then gone."""
    import signal

    import psutil

    if engine == "dask":
        pytest.importorskip("dask.distributed")
    cmd = [sys.executable, "-m", "nestpipe", "ingest", "--raw", raw, "--out", str(tmp_path / "o"), "--task", "gr",
           "--batch-size", "64", "--micro-batches", "4", "--max-seq-len", "32", "--quiet", "--workers", "2",
           "--engine", engine]
    driver = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []
    t0 = time.time()
    while time.time() - t0 < 60:
        # the pool's workers: python children of the driver that are not the resource tracker
        kids = [p for p in psutil.Process(driver.pid).children()
                if "resource_tracker" not in " ".join(p.cmdline())]
        if len(kids) >= 2:
            workers = kids
            break
        assert driver.poll() is None, "the ingest ended before its workers were seen"
        time.sleep(0.01)
    assert len(workers) == 2, "no worker pool seen"
    everything = psutil.Process(driver.pid).children(recursive=True)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    alive_after_kill = [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    gone, alive = psutil.wait_procs(everything, timeout=10)
    for p in alive:  # do not leave them behind if the check fails
        p.kill()
    assert alive_after_kill, "the workers died with the driver: nothing was checked"
    assert not alive, f"processes outlived their driver by more than 10 s: {[p.pid for p in alive]}"


def test_integral_floats_in_integer_columns_are_integers():
    """`9.0` in an integer column (as tools that store missing values as NaN write them) is the integer 9, on the
    validating path the fast reader falls back to; `9.5` is a reject ("not an integer"), `x` still "not a number".
    Control: the plain integer parse of polars refuses `9.0`."""
    from nestpipe.ingest.parse import ColumnSpec, parse_chunk

    schema = {"id": pl.Int64, "n": pl.Int32, "x": pl.Float64}
    spec = ColumnSpec(list(schema), schema, ["id"])
    data = b"1,9.0,0.5\n2,9.5,1\n3,x,2\n4.0,-3.0,2.5\n5,,\n"
    df, rejects = parse_chunk(data, spec, path="f.csv", first_line=2)
    assert df["id"].to_list() == [1, 4, 5] and df["n"].to_list() == [9, -3, None]
    assert df["n"].dtype == pl.Int32
    assert [(r.line, r.reason) for r in rejects] == [(3, "column n: not an integer"), (4, "column n: not a number")]
    assert pl.Series(["9.0"]).str.to_integer(strict=False).null_count() == 1


def test_defaults_fit_small_data_and_leave_data_that_fills_them_unchanged(raw, tmp_path, capsys):
    """Left to the defaults, gr windows too few for 8 batches of 512 get the largest power-of-two batch that makes 8
    (said on stderr, recorded in the manifest); ctr rows that fill 8 batches of 512 give the same shard bytes as
    --batch-size 512 --micro-batches 8 given explicitly. An explicit size is never changed (negative control: it
    still fails on data too small for it)."""
    base = dict(raw=raw, progress=False, max_seq_len=32)
    m = ingest(IngestConfig(out=str(tmp_path / "gr"), task="gr", **base))
    n = m.stats["samples"]["train"]
    assert n < 8 * 512
    B = m.batch_size
    assert B & (B - 1) == 0 and n // B >= 8 and n // (2 * B) < 8 and m.micro_batches == min(8, B)
    assert f"batch size {B}" in capsys.readouterr().err and f"batch size {B}" in m.stats["sized_to_data"]
    assert sum(e.batches for e in m.sets["train"]) == n // B
    too_big = 1 << n.bit_length()  # more than the split holds
    with pytest.raises(IngestError, match=f"no complete training batch of {too_big} samples"):
        ingest(IngestConfig(out=str(tmp_path / "grbig"), task="gr", batch_size=too_big, **base))
    auto = ingest(IngestConfig(out=str(tmp_path / "ctr"), task="ctr", **base))
    given = ingest(IngestConfig(out=str(tmp_path / "ctr512"), task="ctr", batch_size=512, micro_batches=8, **base))
    assert auto.stats["samples"]["train"] >= 8 * 512 and (auto.batch_size, auto.micro_batches) == (512, 8)
    assert "sized_to_data" not in auto.stats
    assert _shard_bytes(str(tmp_path / "ctr")) == _shard_bytes(str(tmp_path / "ctr512"))
    assert [e.sha256 for e in auto.sets["train"]] == [e.sha256 for e in given.sets["train"]]


@pytest.mark.parametrize("quoted_any", [False, True])
def test_a_line_that_is_not_utf8_is_rejected_by_name(quoted_any):
    """A byte sequence that is not UTF-8 (a Latin-1 letter) in one line: that line is rejected ("not UTF-8 text",
    its raw text kept with a replacement character), the others parse, on the fast/validating path and on the
    quote-aware one. Control: Polars itself refuses the chunk (its strings must be UTF-8), which is what crashed the
    ingest before (found by benchmarks/chaos.py's latin1_line class)."""
    from nestpipe.ingest.parse import NOT_UTF8, ColumnSpec, parse_chunk

    schema = {"id": pl.Int64, "name": pl.Utf8, "x": pl.Float64}
    spec = ColumnSpec(list(schema), schema, ["id"], quoted_any=quoted_any)
    data = b"1,ab,0.5\n2,caf\xe9,1\n3,cd,2\n"
    df, rejects = parse_chunk(data, spec, path="f.csv", first_line=2)
    assert df["id"].to_list() == [1, 3]
    assert [(r.file, r.line, r.reason) for r in rejects] == [("f.csv", 3, NOT_UTF8)]
    assert "\ufffd" in rejects[0].raw and rejects[0].raw.startswith("2,caf")
    with pytest.raises(Exception):
        pl.read_csv(io.BytesIO(data), has_header=False, schema=schema)


def test_an_output_that_cannot_be_written_fails_in_one_message_naming_it(raw, tmp_path, capsys):
    """--out under a regular file (as under a read-only filesystem: an OSError from the first directory made) fails
    with one line naming the path, not a traceback; nothing is written. Before, the OSError escaped the command."""
    from nestpipe.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    rc = main(["ingest", "--raw", raw, "--out", str(blocker / "out"), "--task", "gr", "--quiet", "--workers", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and str(blocker / "out") in err[0] and "Not a directory" in err[0], err
    assert blocker.read_text() == "not a directory\n"


def test_a_write_error_that_names_no_file_is_told_with_the_output(raw, tmp_path, capsys, monkeypatch):
    """Arrow's write errors on a full disk name no file ("Error writing bytes to file ... No space left on
    device"): the command's one line adds the output it was writing and how to resume."""
    from nestpipe.cli import main
    from nestpipe.ingest import stages

    def full(*a, **k):
        raise OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(stages, "ingest", full)
    out = str(tmp_path / "o")
    rc = main(["ingest", "--raw", raw, "--out", out, "--task", "gr", "--quiet", "--workers", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert "No space left on device" in err[0] and f"writing under {out}" in err[0] and "rerun" in err[0]
