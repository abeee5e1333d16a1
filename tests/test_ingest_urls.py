"""``--raw``, ``--out`` and ``--work-dir`` as fsspec URLs (``file://`` here: the same code as object storage, which
has no rename): the shards of a local run, byte for byte; the manifest, uploaded last, is the commit point (a run
killed between uploads resumes, and a shard it does not list is never read); in a URL working directory a unit's
marker, uploaded after its files, is its commit point (a run killed between units resumes; a unit whose marker
lists a missing or cut-short file is redone); clear errors for URLs that cannot be used."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile

import pytest

from nestpipe.datasets import shards
from nestpipe.ingest import IngestConfig, ingest
from nestpipe.utils import storage


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    from nestpipe.datasets import synth

    root = tmp_path_factory.mktemp("url-raw")
    synth.generate(str(root / "raw"), scale="tiny", seed=2, progress=False)
    return str(root / "raw")


def _url(path) -> str:
    return "file://" + os.path.abspath(str(path))


def _files(out) -> dict:
    return {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out))}


def _no_scratch_left(tmp) -> list:
    return [n for n in os.listdir(tmp) if n.startswith("nestpipe-ingest-")]


def _cli(raw, out, crash_at=None, work_dir=None):
    env = dict(os.environ)
    env.pop("NESTPIPE_INGEST_CRASH_AT", None)
    if crash_at:
        env["NESTPIPE_INGEST_CRASH_AT"] = crash_at
    cmd = [sys.executable, "-m", "nestpipe", "ingest", "--raw", raw, "--out", out, "--task", "gr",
           "--batch-size", "64", "--micro-batches", "4", "--max-seq-len", "32", "--batches-per-shard", "2",
           "--quiet", "--workers", "1"] + (["--work-dir", work_dir] if work_dir else [])
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_url_inputs_and_outputs_write_the_bytes_of_a_local_run(raw, tmp_path):
    opts = dict(task="ctr", batch_size=64, micro_batches=4, batches_per_shard=16, workers=1, progress=False)
    ingest(IngestConfig(raw=raw, out=str(tmp_path / "local"), **opts))
    staging = str(tmp_path / "staging")
    m = ingest(IngestConfig(raw=_url(raw), out=_url(tmp_path / "url"), work_dir=staging, **opts))
    local, url = _files(tmp_path / "local"), _files(tmp_path / "url")
    man = [json.loads(f.pop("manifest.json")) for f in (local, url)]
    assert local == url and sum(n.endswith(".tar") for n in url) >= 3  # shards, rejects.csv, synth truth
    assert man[0]["sets"] == man[1]["sets"]
    assert not os.path.exists(staging), "the staging directory outlived the run"
    assert m.stats["fingerprint"]["inputs"] == json.load(open(tmp_path / "local" / "manifest.json"))["stats"][
        "fingerprint"]["inputs"]
    # a complete output is recognised from its manifest and left alone
    before = _files(tmp_path / "url")
    again = ingest(IngestConfig(raw=_url(raw), out=_url(tmp_path / "url"), work_dir=staging, **opts))
    assert _files(tmp_path / "url") == before
    assert again.stats == json.loads(before["manifest.json"])["stats"]


def test_the_manifest_commits_a_run_killed_between_uploads_resumes_to_the_same_bytes(raw, tmp_path):
    ref = tmp_path / "ref"
    assert _cli(raw, str(ref)).returncode == 0
    out, work = tmp_path / "out", str(tmp_path / "work")
    r = _cli(_url(raw), _url(out), crash_at="shard:2", work_dir=work)  # killed as shard 2 starts
    assert r.returncode == -9, r.stderr
    assert os.path.exists(out / "train-000000.tar") and not os.path.exists(out / "manifest.json")
    # what a reader sees of an uncommitted output: no manifest, so nothing to read
    with pytest.raises(shards.ShardError, match="no manifest"):
        shards.load_manifest(str(out))
    # a shard upload cut short (object stores show no such thing; a file:// copy can) and a stray object
    (out / "train-000002.tar").write_bytes(b"partial")
    (out / "train-999999.tar").write_bytes(b"not listed")
    r = _cli(_url(raw), _url(out), work_dir=work)
    assert r.returncode == 0, r.stderr
    m = shards.load_manifest(str(out))
    assert m.stats["resumed_shards"] >= 2  # shards 0 and 1 were not rebuilt
    listed = {e.path for es in m.sets.values() for e in es}
    assert "train-999999.tar" not in listed
    assert {n: b for n, b in _files(out).items() if n in listed} == \
        {n: b for n, b in _files(ref).items() if n in listed}
    assert all(p.endswith(tuple(sorted(listed))) for s in m.sets for p in shards.shard_paths(str(out), m, s))
    for es in m.sets.values():
        for e in es:
            shards.verify_shard(str(out), e)


def test_urls_that_cannot_be_used_fail_before_any_work_naming_them(raw, tmp_path):
    with pytest.raises(storage.StorageError, match="nope://bucket/raw"):
        ingest(IngestConfig(raw="nope://bucket/raw", out=str(tmp_path / "o"), progress=False))
    with pytest.raises(storage.StorageError, match="nope://bucket/out"):
        ingest(IngestConfig(raw=raw, out="nope://bucket/out", progress=False))
    with pytest.raises(ValueError, match="--work-dir is for a URL --out"):
        IngestConfig(raw=raw, out=str(tmp_path / "o"), work_dir=str(tmp_path / "w")).validate()
    assert not os.path.exists(tmp_path / "o")


def test_a_url_out_holding_something_else_is_refused_without_force(raw, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("someone's files")
    with pytest.raises(FileExistsError, match="holds files of something else"):
        ingest(IngestConfig(raw=raw, out=_url(out), work_dir=str(tmp_path / "w"), progress=False))
    assert (out / "notes.txt").read_text() == "someone's files"


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The system temporary directory of this test and of the processes it starts (worker scratch goes there)."""
    d = tmp_path / "sys-tmp"
    d.mkdir()
    monkeypatch.setenv("TMPDIR", str(d))
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


@pytest.mark.parametrize("task", ["gr", "ctr"])
def test_a_url_work_dir_writes_the_bytes_of_a_local_run(raw, tmp_path, private_tmp, task):
    """Spills, author parts and sample arrays in a ``file://`` working directory, written by two pool workers that
    each upload their files whole and read them back from their own caches; no scratch is left anywhere."""
    opts = dict(task=task, batch_size=64, micro_batches=4, batches_per_shard=4, progress=False)
    ingest(IngestConfig(raw=raw, out=str(tmp_path / "local"), workers=1, **opts))
    work = tmp_path / "work"
    ingest(IngestConfig(raw=raw, out=_url(tmp_path / "url"), work_dir=_url(work), workers=2, **opts))
    local, url = _files(tmp_path / "local"), _files(tmp_path / "url")
    man = [json.loads(f.pop("manifest.json")) for f in (local, url)]
    assert local == url and sum(n.endswith(".tar") for n in url) >= 3
    assert man[0]["sets"] == man[1]["sets"]
    assert not os.path.exists(work), "the URL working directory outlived the run"
    assert _no_scratch_left(private_tmp) == []


def test_a_url_work_dir_keeps_a_marker_per_unit_listing_its_files(raw, tmp_path, private_tmp):
    """--keep-work: every unit's files are in the URL working directory with its marker listing them; GR stage 2
    wrote one part per partition and no shared table."""
    work = tmp_path / "work"
    ingest(IngestConfig(raw=raw, out=_url(tmp_path / "url"), work_dir=_url(work), task="gr", batch_size=64,
                        micro_batches=4, partitions=4, workers=1, progress=False, keep_work=True))
    w = work / "_work"
    assert sorted(os.listdir(w / "s2")) == sorted([f"authors-{p:05d}.npy" for p in range(4)] +
                                                  [f"authors-{p:05d}.stats.json" for p in range(4)])
    markers = glob.glob(str(w / "s1" / "*.stats.json")) + glob.glob(str(w / "s3" / "*" / "stats.json"))
    assert len(markers) >= 4 + 3
    for m in markers:
        files = json.load(open(m))["unit_files"]
        assert files and all(os.path.getsize(w / rel) == n for rel, n in files.items()), m
    assert _no_scratch_left(private_tmp) == []


def test_a_run_killed_between_units_resumes_from_a_url_work_dir_to_the_same_bytes(raw, tmp_path, private_tmp):
    # (a killed process leaves its scratch in its temporary directory: private_tmp keeps it out of the system's)
    ref = tmp_path / "ref"
    assert _cli(raw, str(ref)).returncode == 0
    out, work = tmp_path / "out", tmp_path / "work"
    r = _cli(_url(raw), _url(out), crash_at="parse:1", work_dir=_url(work))  # killed as input file 1 starts
    assert r.returncode == -9, r.stderr
    done = glob.glob(str(work / "_work" / "s1" / "*-000-*.stats.json"))
    assert done and not glob.glob(str(work / "_work" / "s1" / "*-001-*"))
    # a unit killed half-way through its uploads: its spill is there, cut short, but not its marker
    spill = done[0][:-len(".stats.json")]
    os.remove(done[0])
    open(spill, "r+b").truncate(100)
    r = _cli(_url(raw), _url(out), crash_at="shard:1:mid", work_dir=_url(work))  # killed writing shard 1
    assert r.returncode == -9, r.stderr
    assert os.path.exists(out / "train-000000.tar") and not os.path.exists(out / "manifest.json")
    r = _cli(_url(raw), _url(out), work_dir=_url(work))
    assert r.returncode == 0, r.stderr
    m = shards.load_manifest(str(out))
    assert m.stats["resumed_shards"] >= 1
    listed = {e.path for es in m.sets.values() for e in es}
    assert {n: b for n, b in _files(out).items() if n in listed} == \
        {n: b for n, b in _files(ref).items() if n in listed}
    assert json.load(open(out / "manifest.json"))["sets"] == json.load(open(ref / "manifest.json"))["sets"]
    assert not os.path.exists(work)


def test_a_marker_whose_files_are_missing_or_cut_short_is_not_trusted(raw, tmp_path, private_tmp):
    """Negative control: units whose markers exist but whose objects do not match them (a sample array cut short, a
    spill deleted, as a store's lifecycle rule or a partial copy would leave them) are detected, named and redone;
    trusting them would fail or change the shards."""
    ref = tmp_path / "ref"
    assert _cli(raw, str(ref)).returncode == 0
    out, work = tmp_path / "out", tmp_path / "work"
    r = _cli(_url(raw), _url(out), crash_at="shard:0", work_dir=_url(work))  # every unit of stages 1-3 done
    assert r.returncode == -9, r.stderr
    w = work / "_work"
    cut = w / "s3" / "samples-00001" / "item.npy"
    open(cut, "r+b").truncate(os.path.getsize(cut) // 2)
    gone = sorted(glob.glob(str(w / "s1" / "log_*.arrow")))[0]
    os.remove(gone)
    r = _cli(_url(raw), _url(out), work_dir=_url(work))
    assert r.returncode == 0, r.stderr
    assert f"{_url(cut)}: " in r.stderr and "bytes where the marker records" in r.stderr
    assert f"{_url(gone)}: missing" in r.stderr and "redoing its unit" in r.stderr
    m = shards.load_manifest(str(out))
    listed = {e.path for es in m.sets.values() for e in es}
    assert {n: b for n, b in _files(out).items() if n in listed} == \
        {n: b for n, b in _files(ref).items() if n in listed}


def test_a_work_dir_url_that_cannot_be_used_fails_before_any_work_naming_it(raw, tmp_path):
    import fsspec

    class Unreachable(fsspec.AbstractFileSystem):  # a store that cannot be reached (network, credentials)
        protocol = "unreachable"

        def info(self, path, **kwargs):
            raise ConnectionError("connection refused")

    fsspec.register_implementation("unreachable", Unreachable, clobber=True)
    out = tmp_path / "o"
    with pytest.raises(storage.StorageError, match="nope://bucket/work: no usable filesystem"):
        ingest(IngestConfig(raw=raw, out=_url(out), work_dir="nope://bucket/work", progress=False))
    with pytest.raises(storage.StorageError, match="unreachable://bucket/work: cannot be reached .*refused"):
        ingest(IngestConfig(raw=raw, out=_url(out), work_dir="unreachable://bucket/work", progress=False))
    assert not os.path.exists(out)


def test_a_process_cache_holds_at_most_its_limit_and_one_run(tmp_path, private_tmp):
    """The local copies of a URL working directory: least recently used out beyond the limit, all of them gone when
    a unit of another run comes (or on release); slices of an order array read by range equal the in-place ones."""
    import numpy as np

    from nestpipe.ingest import workdir

    cache = workdir._ProcessCache(limit=250)
    made = []

    def make(n):
        def write(path):
            made.append(path)
            open(path, "wb").write(b"x" * n)
        return write

    a = cache.get(("u", "run1"), "s3/a.npy", make(100))
    cache.get(("u", "run1"), "s3/b.npy", make(100))
    assert cache.get(("u", "run1"), "s3/a.npy", make(100)) == a and len(made) == 2  # a hit, and now the newest
    cache.get(("u", "run1"), "s3/c.npy", make(100))  # 300 bytes: b, the least recently used, goes
    assert os.path.exists(a) and not os.path.exists(os.path.join(os.path.dirname(a), "b.npy"))
    run1 = cache.dir
    cache.get(("u", "run2"), "s3/a.npy", make(100))
    assert not os.path.exists(run1) and len(made) == 4
    cache.release()
    assert os.listdir(private_tmp) == []

    arr = np.arange(1000, dtype=np.int64) * 7
    local = workdir.open_work(str(tmp_path / "w"))
    os.makedirs(local.root)
    local.save_array("order.npy", arr)
    remote = workdir.open_work(_url(tmp_path / "w"))
    for start, stop in ((0, 10), (990, 1010), (500, 400), (3, 997)):
        assert np.array_equal(remote.array_slice("order.npy", start, stop), local.array_slice("order.npy", start, stop))
