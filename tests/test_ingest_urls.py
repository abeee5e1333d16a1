"""``--raw`` and ``--out`` as fsspec URLs (``file://`` here: the same code as object storage): the shards of a local
run, byte for byte; the manifest, uploaded last, is the commit point (a run killed between uploads resumes, and a
shard it does not list is never read); clear errors for URLs that cannot be used."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
