"""The device stage streams' CPU behaviour (pipeline/streams.py): without an accelerator every stream operation is a
no-op and nothing is pinned; with the recording stand-in the operations land in order on the named streams."""

import threading

import pytest
import torch

from nestpipe.trainer.pipeline import streams


def test_cpu_stage_stream_is_plain_and_never_pins(monkeypatch):
    def no_pinning(*a, **k):
        raise AssertionError("pinned memory requested without an accelerator")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning)
    s = streams.StageStream(torch.device("cpu"), "retrieve")
    assert s.stream is None and s.pool is None
    t = torch.arange(6.0)
    with s.run():
        assert s.copy(t) is t  # CPU -> CPU: .to(device) returns the tensor itself
        assert s.host_buffer((3, 2), torch.float32) is None  # the gather allocates as before
    assert s.handoff() is None
    streams.wait_handoff(torch.device("cpu"), None, [t])  # nothing to wait on
    assert streams.PinnedPool.make(torch.device("cpu")) is None
    got = []
    pending = s.write_back([t], got.extend)  # no stream: the tensors themselves, applied when finished
    assert pending.done is None and got == []
    pending.finish()
    pending.finish()  # once only
    assert len(got) == 1 and got[0] is t


def test_pinned_pool_is_made_only_where_an_accelerator_exists(monkeypatch):
    monkeypatch.setattr(streams, "accelerator_present", lambda: False)
    assert streams.PinnedPool.make(torch.device("cuda", 0)) is None
    monkeypatch.setattr(streams, "accelerator_present", lambda: True)
    assert isinstance(streams.PinnedPool.make(torch.device("cuda", 0)), streams.PinnedPool)
    assert streams.PinnedPool.make(torch.device("cpu")) is None  # a CPU run never pins


class _Event:
    def __init__(self):
        self.completed = False

    def query(self):
        return self.completed


def test_pinned_pool_reuses_a_buffer_only_after_its_copy_completed(monkeypatch):
    """A buffer an in-flight copy reads is never lent again; once the copy's event has completed it is (no new
    allocation); sizes round up so a smaller request reuses a larger buffer. Control: an event that never
    completes forces a new buffer each time."""
    monkeypatch.setattr(streams, "_pinned_bytes", lambda n: torch.empty(n, dtype=torch.uint8))  # no pinning on CPU
    pool = streams.PinnedPool()
    a, buf_a = pool.take((100, 8), torch.float32)
    assert a.shape == (100, 8) and a.dtype == torch.float32 and buf_a.numel() == pool.MIN_BYTES
    ev = _Event()
    pool.give([buf_a], ev)
    b, buf_b = pool.take((10,), torch.float32)
    assert buf_b.data_ptr() != buf_a.data_ptr() and pool.allocated == 2  # a's copy still in flight
    ev.completed = True
    c, buf_c = pool.take((50, 8), torch.float32)
    assert buf_c.data_ptr() == buf_a.data_ptr() and pool.allocated == 2  # reclaimed, not allocated
    big, buf_big = pool.take((1 << 19, 3), torch.float32)  # 6 MiB: rounded up to 8 MiB
    assert buf_big.numel() == 8 << 20 and big.numel() == 3 << 19
    pool.give([buf_b, buf_c])  # host work done: back at once
    assert pool.take((4,), torch.int64)[1].data_ptr() in (buf_b.data_ptr(), buf_c.data_ptr())
    stuck = _Event()
    pool.give([buf_big], stuck)
    pool.take((1 << 19, 3), torch.float32)
    assert pool.allocated == 4  # the stuck buffer was not lent


def test_recording_backend_logs_each_stage_on_its_own_stream_across_threads():
    rec = streams.RecordingBackend()
    h2d = streams.StageStream(torch.device("cpu"), "h2d", rec)
    ret = streams.StageStream(torch.device("cpu"), "retrieve", rec)
    events = {}

    def stage(s, k):
        with s.run():
            assert rec.current_stream() is s.stream  # this thread's current stream is the stage's
            s.copy(torch.zeros(k + 1))
            events[(s.name, k)] = s.handoff()

    for k in range(3):
        for s in (h2d, ret):
            t = threading.Thread(target=stage, args=(s, k))
            t.start()
            t.join()
        assert rec.current_stream() is rec.compute  # the compute thread never switched
        for s in (h2d, ret):
            streams.wait_handoff(torch.device("cpu"), events[(s.name, k)], (), rec)
    assert streams.check_handoffs(rec.log, ("h2d", "retrieve"), 3) == []
    assert [op for op, s, _ in rec.log if s == "retrieve"] == ["copy", "record"] * 3
    # control: a compute stream that never waits on the retrieval's events
    unwaited = [x for x in rec.log if not (x[0] == "wait" and x[2] in
                                           {events[("retrieve", k)].id for k in range(3)})]
    assert len(streams.check_handoffs(unwaited, ("h2d", "retrieve"), 3)) == 3


def test_recording_stream_lends_plain_memory_for_the_gather_until_its_handoff():
    """On the recording stand-in the retrieval gathers into memory lent by the stream (plain, not pinned), as on an
    accelerator: the buffer is not lent again before the batch's handoff, and is after it."""
    rec = streams.RecordingBackend()
    s = streams.StageStream(torch.device("cpu"), "retrieve", rec)
    with s.run():
        a = s.host_buffer((5, 4), torch.float32)
        b = s.host_buffer((5,), torch.float32)
        assert a is not None and not a.is_pinned() and a.data_ptr() != b.data_ptr()
        a.copy_(torch.arange(20.0).view(5, 4))
        dev = s.copy(a)
        s.handoff()
        c = s.host_buffer((5, 4), torch.float32)
    assert c.data_ptr() in (a.data_ptr(), b.data_ptr()) and s.pool.allocated == 2
    c.zero_()
    assert torch.equal(dev, torch.arange(20.0).view(5, 4))  # the "device" copy is memory of its own


def test_check_handoffs_counts_events_per_batch():
    rec = streams.RecordingBackend()
    s = streams.StageStream(torch.device("cpu"), "h2d", rec)
    with s.run():
        s.copy(torch.ones(3))
        ev = s.handoff()
    streams.wait_handoff(torch.device("cpu"), ev, (), rec)
    assert streams.check_handoffs(rec.log, ("h2d",), 1) == []
    assert streams.check_handoffs(rec.log, ("h2d",), 2) == ["h2d: 1 events recorded for 2 batches"]
    with s.run():
        ev = s.handoff()  # a batch whose inputs were not copied on the stream
    streams.wait_handoff(torch.device("cpu"), ev, (), rec)
    assert streams.check_handoffs(rec.log, ("h2d",), 2) == ["h2d: batch 1 copied nothing on its stream"]


def _pipeline_order(rec, steps, finish_at):
    """The DBP order on the recording backend: retrieval of batch u (copy + event), compute waits on it, updates
    and starts its write-back; the write-back of batch k is finished (host sync + scatter) when ``finish_at(k)``
    says, relative to the retrieval of batch u."""
    dev = torch.device("cpu")
    ret = streams.StageStream(dev, "retrieve", rec)
    wb = streams.StageStream(dev, "writeback", rec)
    pending, store = {}, {}
    for u in range(steps):
        for k in [k for k in list(pending) if finish_at(k) == u]:
            pending.pop(k).finish()
        with ret.run():
            ret.copy(torch.zeros(4))
            ev = ret.handoff()
        streams.wait_handoff(dev, ev, (), rec)
        buf = torch.full((2,), float(u))
        pending[u] = wb.write_back([buf], lambda host, u=u: store.__setitem__(u, host[0]))
        buf.add_(1)  # the compute stream moves on: the host got the copy taken at the write-back
    for k in sorted(pending):
        pending[k].finish()
    return store


def test_write_back_is_ordered_after_the_update_and_before_the_gather_two_batches_on():
    """The write-back stream waits on an event the compute stream recorded after the update, copies, records
    ``done``; the host waits on ``done`` before batch k+2's retrieval (streams.check_write_backs). Controls: a
    write-back finished one retrieval late, a copy not ordered after the update, a ``done`` never waited on."""
    rec = streams.RecordingBackend()
    store = _pipeline_order(rec, 4, finish_at=lambda k: k + 2)
    assert streams.check_write_backs(rec.log, 4) == []
    assert [store[k].tolist() for k in range(4)] == [[float(k)] * 2 for k in range(4)]  # the update's values
    ops = [op for op, s, _ in rec.log if s == "writeback"]
    assert ops[:3] == ["wait", "copy", "record"] and ops.count("sync") == 4
    late = streams.RecordingBackend()
    _pipeline_order(late, 4, finish_at=lambda k: k + 3)
    assert streams.check_write_backs(late.log, 4) == ["writeback: batch 0 reached the store after batch 2's "
                                                       "retrieval", "writeback: batch 1 reached the store after "
                                                       "batch 3's retrieval"]
    unordered = [x for x in rec.log if x[:2] != ("wait", "writeback")]
    assert len(streams.check_write_backs(unordered, 4)) == 4
    first_done = next(e for op, s, e in rec.log if op == "record" and s == "writeback")
    unsynced = [x for x in rec.log if x != ("sync", "writeback", first_done)]
    assert streams.check_write_backs(unsynced, 4) == ["writeback: batch 0's copies are never waited on by the host"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the pinned copies run on a GPU only")
def test_pinned_copies_on_cuda():
    dev = torch.device("cuda")
    s = streams.StageStream(dev, "retrieve")
    t = torch.randn(1000, 8)
    with s.run():
        staged = s.host_buffer(t.shape, t.dtype)
        assert staged is not None and staged.is_pinned()
        staged.copy_(t)
        out, out2 = s.copy(staged), s.copy(t)
    s.handoff().synchronize()
    assert torch.equal(out.cpu(), t) and torch.equal(out2.cpu(), t)
    wb = streams.StageStream(dev, "writeback")
    d = torch.randn(100, 8, device=dev)
    got = []
    pending = wb.write_back([d], got.extend)
    pending.finish()
    assert got[0].is_pinned() and torch.equal(got[0], d.cpu())
