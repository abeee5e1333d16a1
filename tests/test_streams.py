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
    assert s.stream is None and s.staging is None
    t = torch.arange(6.0)
    with s.run():
        assert s.copy(t) is t  # CPU -> CPU: .to(device) returns the tensor itself
    assert s.handoff() is None
    streams.wait_handoff(torch.device("cpu"), None, [t])  # nothing to wait on
    assert streams.PinnedStaging.make(torch.device("cpu")) is None


def test_pinned_staging_is_made_only_where_an_accelerator_exists(monkeypatch):
    monkeypatch.setattr(streams, "accelerator_present", lambda: False)
    assert streams.PinnedStaging.make(torch.device("cuda", 0)) is None
    monkeypatch.setattr(streams, "accelerator_present", lambda: True)
    assert isinstance(streams.PinnedStaging.make(torch.device("cuda", 0)), streams.PinnedStaging)
    assert streams.PinnedStaging.make(torch.device("cpu")) is None  # a CPU run never pins


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the pinned ring's copy runs on a GPU only")
def test_pinned_staging_copy_on_cuda():
    s = streams.StageStream(torch.device("cuda"), "retrieve")
    t = torch.randn(1000, 8)
    with s.run():
        out = s.copy(t)
    s.handoff().synchronize()
    assert torch.equal(out.cpu(), t)
