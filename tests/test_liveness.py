"""distributed/liveness.py: a failed collective names the ranks whose heartbeat stopped (a stopped, hung or dead
peer), read from the job's store; a rank that is only blocked keeps beating (its heartbeat is a thread of its own)."""

import datetime
import socket

import torch.distributed as dist

from nestpipe.trainer.distributed import liveness


def _store():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    return server, client


def test_a_stopped_peer_is_named_and_a_beating_one_is_not():
    server, client = _store()
    beats = [liveness.Heartbeat(client if r else server, r, 3, interval_s=0.05) for r in range(3)]
    for b in beats:
        b.start()
    try:
        assert beats[0].silent_ranks() == []  # control: everyone beating, nobody named
        beats[2].stop()  # rank 2 stops (as a SIGSTOP stops every thread of it)
        assert beats[0].silent_ranks() == [2]
        err = liveness.name_silent_peers(RuntimeError("[gloo] Timed out waiting 10000ms for recv"), beats[0])
        assert str(err).startswith("rank 2 stopped answering") and "Timed out waiting" in str(err)
        # not a communication failure: nothing to add, the error says it best
        assert liveness.name_silent_peers(ValueError("bad config"), beats[0]) is None
        assert liveness.name_silent_peers(RuntimeError("timed out"), None) is None
    finally:
        for b in beats:
            b.stop()


def test_no_heartbeat_for_one_rank_or_without_a_store(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert liveness.Heartbeat.from_env() is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert liveness.Heartbeat.from_env() is None
