"""``nestpipe ingest --engine dask``: the same shards, byte for byte, as the local engine (also with the working
directory on a URL, as a cluster without a shared filesystem needs); a scheduler that cannot be reached fails within
the connect timeout naming its address."""

from __future__ import annotations

import json
import os
import time

import pytest

from nestpipe.ingest import IngestConfig, ingest

pytest.importorskip("dask.distributed")


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    from nestpipe.datasets import synth

    root = tmp_path_factory.mktemp("dask-raw")
    synth.generate(str(root / "raw"), scale="tiny", seed=1, progress=False)
    return str(root / "raw")


def _digests(out):
    m = json.load(open(os.path.join(out, "manifest.json")))
    return {split: [(s["path"], s["sha256"]) for s in shards] for split, shards in m["sets"].items()}


@pytest.mark.slow
@pytest.mark.parametrize("task", ["gr", "ctr"])
def test_dask_engine_writes_the_local_engines_bytes(raw, tmp_path, task):
    opts = dict(raw=raw, task=task, batch_size=64, micro_batches=4, batches_per_shard=3, progress=False)
    ingest(IngestConfig(out=str(tmp_path / "local"), workers=1, **opts))
    ingest(IngestConfig(out=str(tmp_path / "dask"), workers=2, engine="dask", **opts))
    local, dask = _digests(str(tmp_path / "local")), _digests(str(tmp_path / "dask"))
    assert local == dask and sum(len(v) for v in local.values()) >= 3
    for name in ("rejects.csv",):
        a, b = (os.path.join(str(tmp_path / d), name) for d in ("local", "dask"))
        assert os.path.exists(a) == os.path.exists(b)
        if os.path.exists(a):
            assert open(a, "rb").read() == open(b, "rb").read()


def _worker_overheads():
    import dask

    return dask.config.get("distributed.worker.profile.enabled"), os.environ.get("MALLOC_TRIM_THRESHOLD_")


def test_dask_engine_with_a_url_work_dir_writes_the_local_engines_bytes(raw, tmp_path, monkeypatch):
    """Workers that share nothing but the ``file://`` URLs (object-storage semantics: no rename, no writes in place):
    each uploads its units' files and reads what it needs into its own cache, which the run removes on every
    worker of the cluster before it returns (a cluster's workers outlive the run)."""
    import tempfile

    from nestpipe.ingest.dask_engine import DaskExecutor

    scratch = tmp_path / "sys-tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # the LocalCluster's workers inherit it
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    opts = dict(raw=raw, task="gr", batch_size=64, micro_batches=4, batches_per_shard=3, progress=False)
    ingest(IngestConfig(out=str(tmp_path / "local"), workers=1, **opts))
    url = "file://" + str(tmp_path / "dask")
    with DaskExecutor(2) as ex:
        ingest(IngestConfig(out=url, work_dir="file://" + str(tmp_path / "work"), workers=2, engine="dask", **opts),
               executor=ex)
        assert [n for n in os.listdir(scratch) if n.startswith("nestpipe-ingest-")] == []
        # the LocalCluster's workers run without what slows their units down (dask_engine.LOCAL_CLUSTER_CONFIG)
        assert set(ex.client.run(_worker_overheads).values()) == {(False, None)}
    assert _digests(str(tmp_path / "local")) == _digests(str(tmp_path / "dask"))
    assert not os.path.exists(tmp_path / "work")


def test_unreachable_scheduler_fails_within_the_timeout_naming_it(raw, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.time()
    with pytest.raises(RuntimeError, match=f"tcp://127.0.0.1:{port}"):
        ingest(IngestConfig(raw=raw, out=str(tmp_path / "o"), task="gr", engine="dask",
                            scheduler=f"tcp://127.0.0.1:{port}", progress=False))
    assert time.time() - t < 20


def test_scheduler_needs_the_dask_engine(tmp_path):
    with pytest.raises(ValueError, match="needs --engine dask"):
        IngestConfig(raw="r", out="o", scheduler="tcp://h:8786").validate()
    with pytest.raises(ValueError, match="--engine must be one of local, dask"):
        IngestConfig(raw="r", out="o", engine="ray").validate()


@pytest.mark.slow
def test_a_worker_dying_mid_shard_is_rerun_and_the_bytes_are_the_same(raw, tmp_path, monkeypatch):
    """A task SIGKILLs its own worker once, half-way through writing shard 1 (guarded by a marker file); Dask's
    nanny restarts the worker, the scheduler reruns the task, and the shards equal the local engine's."""
    opts = dict(raw=raw, task="gr", batch_size=64, micro_batches=4, batches_per_shard=3, progress=False)
    ingest(IngestConfig(out=str(tmp_path / "local"), workers=1, **opts))
    marker = str(tmp_path / "crashed")
    monkeypatch.setenv("NESTPIPE_INGEST_CRASH_AT", "shard:1:mid")
    monkeypatch.setenv("NESTPIPE_INGEST_CRASH_ONCE", marker)
    ingest(IngestConfig(out=str(tmp_path / "dask"), workers=2, engine="dask", **opts))
    assert os.path.exists(marker)  # a worker did die there
    assert _digests(str(tmp_path / "local")) == _digests(str(tmp_path / "dask"))
