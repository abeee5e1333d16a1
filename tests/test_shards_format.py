"""``write_shard`` writes exactly the bytes of ``tarfile`` (``addfile`` per member, then ``close``)."""

import io
import tarfile

import numpy as np
import pytest

from nestpipe.datasets import shards


def _records():
    rng = np.random.default_rng(0)
    yield "000000000", {"meta": {"index": 0}, "a": rng.integers(0, 9, 128).astype(np.int32),  # 128*4 + header
                        "empty": np.zeros(0, np.int64), "b": rng.random((3, 5))}
    yield "000000001", {"meta": {"index": 1}, "a": np.arange(1000, dtype=np.int64)}


def _tarfile_bytes(records, mtime=0):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, batch in records:
            for name, data in shards.encode_record(key, batch):
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), mtime, 0o444
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_write_shard_bytes_equal_tarfile(tmp_path):
    digest, size = shards.write_shard(str(tmp_path / "s.tar"), _records())
    data = (tmp_path / "s.tar").read_bytes()
    assert data == _tarfile_bytes(_records())
    assert size == len(data) and digest == shards.sha256_file(str(tmp_path / "s.tar"))[0]
    with tarfile.open(tmp_path / "s.tar") as tar:
        assert tar.getnames()[0] == "000000000.a.npy"


def test_negative_control_another_mtime_changes_the_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "_PINNED_MTIME", 1)
    shards.write_shard(str(tmp_path / "s.tar"), _records())
    assert (tmp_path / "s.tar").read_bytes() != _tarfile_bytes(_records())


@pytest.mark.parametrize("n", [0, 1, 2])
def test_archive_is_padded_to_whole_records(tmp_path, n):
    records = [(f"{i:09d}", {"x": np.arange(i * 300, dtype=np.int8)}) for i in range(n)]
    _, size = shards.write_shard(str(tmp_path / "s.tar"), records)
    assert size % tarfile.RECORDSIZE == 0
    assert (tmp_path / "s.tar").read_bytes() == _tarfile_bytes(records)
