"""Stage execution resources on each device kind, and the hand-off between stages.

- CUDA / NPU: each device stage of the dual-buffer pipeline has its own stream (:class:`StageStream`: ``h2d`` for
  the dense inputs, ``retrieve`` for the copy of the owner's rows into the batch's device buffer). A stage enqueues
  its copies on its stream (:meth:`StageStream.copy`: non-blocking, from pinned host staging memory, see
  :class:`PinnedStaging`), records an event after them (:meth:`StageStream.handoff`) and passes the event along with
  its outputs; the compute thread makes its current stream wait on the event (:func:`wait_handoff`) and marks the
  tensors as used on its stream (``record_stream``) so the caching allocator does not recycle them early.
  Collectives run on NCCL/HCCL's internal streams; the issuing thread waits on the work handle. None of this has run
  on accelerator hardware yet (``benchmarks/gpu_check.py`` is the check that will).
- CPU: a stage's thread *is* its stream. Everything a stage produces is complete when it is put on the bounded
  queue to the next stage, and the queue hand-off is the happens-before edge; events are ``None``, copies are the
  plain ``.to(device)`` (a no-op for CPU tensors) and nothing is pinned (torch has no accelerator to pin for).

The backend (``torch.cuda``, ``torch.npu`` or none) is resolved from the device unless one is given: the test-only
:class:`RecordingBackend` stands in for a device's stream API on CPU and records the order of every stream
operation (copy, event record, wait), so the ordering the pipeline relies on is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterable, List, Optional, Tuple

import torch


def _backend(device: torch.device):
    if device.type == "cuda":
        return torch.cuda
    if device.type == "npu":
        return getattr(torch, "npu")  # torch_npu registers torch.npu (imported by the device layer)
    return None


def accelerator_present() -> bool:
    """Whether torch has an accelerator here to pin host memory for (pinning is never attempted otherwise)."""
    if torch.cuda.is_available():
        return True
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and getattr(npu, "is_available", lambda: False)())


class PinnedStaging:
    """Host staging memory for a stream's host-to-device copies: a small ring of page-locked buffers, reused.

    ``stage(t)`` copies ``t`` into the next slot (grown when too small) and returns a view of it; the slot is not
    handed out again until the copy enqueued from it has completed (its event is waited first), so a slot is never
    overwritten while a DMA reads it. Only where an accelerator exists: :meth:`make` returns None otherwise."""

    def __init__(self, slots: int = 2):
        self._buffers: List[Optional[torch.Tensor]] = [None] * slots
        self._events: List[Optional[object]] = [None] * slots
        self._next = 0
        self._lock = threading.Lock()

    @staticmethod
    def make(device: torch.device, slots: int = 2) -> Optional["PinnedStaging"]:
        return PinnedStaging(slots) if device.type != "cpu" and accelerator_present() else None

    def stage(self, t: torch.Tensor) -> Tuple[torch.Tensor, int]:
        """``t``'s bytes in a pinned slot: (the pinned view, the slot to pass to :meth:`issued`)."""
        with self._lock:
            i = self._next
            self._next = (i + 1) % len(self._buffers)
        if self._events[i] is not None:
            self._events[i].synchronize()  # the slot's previous copy has been read by the device
            self._events[i] = None
        nbytes = t.numel() * t.element_size()
        buf = self._buffers[i]
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[i] = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
        view = buf[:nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        return view, i

    def issued(self, slot: int, event: object) -> None:
        """The copy from ``slot`` was enqueued before ``event``: the slot is reused after it."""
        self._events[slot] = event


class StageStream:
    """One device stage's stream (``name``: h2d, retrieve, ...). On CPU without a backend every method is a no-op
    and :meth:`copy` is ``t.to(device)``."""

    def __init__(self, device: torch.device, name: str = "", backend=None):
        self.device, self.name = device, name
        self.mod = backend if backend is not None else _backend(device)
        self.stream = self.mod.Stream(device=device) if self.mod is not None else None
        if self.stream is not None and hasattr(self.mod, "label"):
            self.mod.label(self.stream, name)
        self.staging = PinnedStaging.make(device) if self.stream is not None else None

    @contextlib.contextmanager
    def run(self):
        """Make this stage's stream current for the enclosed work (no-op on CPU)."""
        if self.stream is None:
            yield
        else:
            with self.mod.stream(self.stream):
                yield

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the device, the copy enqueued on this stream (call inside :meth:`run`): from pinned staging
        memory and non-blocking where an accelerator exists; the plain ``.to(device)`` on CPU."""
        if self.stream is None:
            return t.to(self.device)
        if hasattr(self.mod, "copy"):  # a recording backend logs the copy
            return self.mod.copy(self.stream, t, self.device)
        if self.staging is None or t.device.type != "cpu":
            return t.to(self.device, non_blocking=True)
        pinned, slot = self.staging.stage(t)
        out = pinned.to(self.device, non_blocking=True)
        ev = self.mod.Event()
        ev.record(self.stream)
        self.staging.issued(slot, ev)
        return out

    def handoff(self) -> Optional[object]:
        """An event marking the end of the work enqueued so far on this stream (None on CPU)."""
        if self.stream is None:
            return None
        ev = self.mod.Event()
        ev.record(self.stream)
        return ev


def wait_handoff(device: torch.device, event: Optional[object], tensors: Iterable[torch.Tensor] = (),
                 backend=None) -> None:
    """Order the consumer's current stream after the producer's ``event``; keep ``tensors`` alive for it."""
    mod = backend if backend is not None else _backend(device)
    if mod is None or event is None:
        return
    cur = mod.current_stream(device)
    cur.wait_event(event)
    for t in tensors:  # host tensors have no allocator stream to keep them for
        if isinstance(t, torch.Tensor) and t.device.type == device.type and device.type != "cpu":
            t.record_stream(cur)


# -- test-only: a device stream API that records what is enqueued where -------------------------------------------
class RecordingBackend:
    """Stands in for ``torch.cuda``'s stream API on CPU (the pipeline's stage streams take it as ``backend``):
    streams, events and copies do nothing to the tensors, and every operation is appended to :attr:`log` as
    ``(op, stream, arg)`` in the order it happened across threads: ``("copy", stream, numel)``, ``("record", stream,
    event)``, ``("wait", stream, event)``. The compute thread's current stream is ``"compute"``."""

    def __init__(self):
        self.log: List[Tuple[str, str, object]] = []
        self._lock = threading.Lock()
        self._current = threading.local()
        self._events = 0
        self.compute = _RecordingStream(self, "compute")

    def _add(self, op: str, stream: "_RecordingStream", arg: object) -> None:
        with self._lock:
            self.log.append((op, stream.name, arg))

    def Stream(self, device=None) -> "_RecordingStream":  # noqa: N802 - torch.cuda's name
        return _RecordingStream(self, "")

    def Event(self) -> "_RecordingEvent":  # noqa: N802
        with self._lock:
            self._events += 1
            return _RecordingEvent(self, self._events)

    @staticmethod
    def label(stream: "_RecordingStream", name: str) -> None:
        stream.name = name

    @contextlib.contextmanager
    def stream(self, s: "_RecordingStream"):
        before = getattr(self._current, "stream", None)
        self._current.stream = s
        try:
            yield
        finally:
            self._current.stream = before

    def current_stream(self, device=None) -> "_RecordingStream":
        return getattr(self._current, "stream", None) or self.compute

    def copy(self, stream: "_RecordingStream", t: torch.Tensor, device: torch.device) -> torch.Tensor:
        self._add("copy", stream, t.numel())
        return t.to(device)


class _RecordingStream:
    def __init__(self, backend: RecordingBackend, name: str):
        self.backend, self.name = backend, name

    def wait_event(self, event: "_RecordingEvent") -> None:
        self.backend._add("wait", self, event.id)


class _RecordingEvent:
    def __init__(self, backend: RecordingBackend, id_: int):
        self.backend, self.id = backend, id_

    def record(self, stream: _RecordingStream) -> None:
        self.backend._add("record", stream, self.id)

    def synchronize(self) -> None:
        pass


def check_handoffs(log: List[Tuple[str, str, object]], stages: Iterable[str], steps: int) -> List[str]:
    """The ordering the pipeline promises, checked on a :class:`RecordingBackend` log: on every stage stream one
    event per batch, recorded after the batch's copies on that stream (the copies between two of its events are the
    later batch's); the compute stream waits on every one of them, after it is recorded and in batch order (batch k's
    outputs are used only after their copies); every stage stream copies something for every batch. Returns the
    violations (empty: the order holds)."""
    problems: List[str] = []
    waited = {e: i for i, (op, s, e) in enumerate(log) if op == "wait" and s == "compute"}
    for stage in stages:
        records = [(i, e) for i, (op, s, e) in enumerate(log) if op == "record" and s == stage]
        if len(records) != steps:
            problems.append(f"{stage}: {len(records)} events recorded for {steps} batches")
        prev, prev_wait = -1, -1
        for k, (i, e) in enumerate(records):
            if e not in waited:
                problems.append(f"{stage}: batch {k}'s event is never waited on by the compute stream")
            elif waited[e] < i:
                problems.append(f"{stage}: batch {k}'s event is waited on before it is recorded")
            elif waited[e] < prev_wait:
                problems.append(f"{stage}: batch {k}'s event is waited on before batch {k - 1}'s")
            else:
                prev_wait = waited[e]
            copies = sum(1 for op, s, _ in log[prev + 1:i] if op == "copy" and s == stage)
            if not copies:
                problems.append(f"{stage}: batch {k} copied nothing on its stream")
            prev = i
    return problems
