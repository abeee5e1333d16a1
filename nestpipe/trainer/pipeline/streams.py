"""Stage execution resources on each device kind, and the hand-off between stages.

- CUDA / NPU: each device stage of the dual-buffer pipeline has its own stream (:class:`StageStream`: ``h2d`` for
  the dense inputs, ``retrieve`` for the copy of the owner's rows into the batch's device buffer, ``writeback`` for
  the copy of the updated rows back to host memory). A stage enqueues its copies on its stream (:meth:`StageStream.copy`:
  non-blocking, from pinned host memory lent by a :class:`PinnedPool`; the retrieval gathers the store's rows
  straight into it, :meth:`StageStream.host_buffer`), records an event after them (:meth:`StageStream.handoff`) and
  passes the event along with its outputs; the compute thread makes its current stream wait on the event
  (:func:`wait_handoff`) and marks the tensors as used on its stream (``record_stream``) so the caching allocator
  does not recycle them early. The write-back runs the other way (:meth:`StageStream.write_back`): its stream waits
  on an event recorded on the compute stream after the update, copies into pinned memory and records ``done``; the
  host scatter into the store (:class:`PendingWriteBack`) waits on ``done`` and runs on the retrieval thread before
  the next gather that may read those rows. Collectives run on NCCL/HCCL's internal streams; the issuing thread
  waits on the work handle. None of this has run on accelerator hardware yet (``benchmarks/gpu_check.py`` is the
  check that will).
- CPU: a stage's thread *is* its stream. Everything a stage produces is complete when it is put on the bounded
  queue to the next stage, and the queue hand-off is the happens-before edge; events are ``None``, copies are the
  plain ``.to(device)`` (a no-op for CPU tensors), the update writes back at once and nothing is pinned (torch has
  no accelerator to pin for).

The backend (``torch.cuda``, ``torch.npu`` or none) is resolved from the device unless one is given: the test-only
:class:`RecordingBackend` stands in for a device's stream API on CPU and records the order of every stream
operation (copy, event record, wait, host synchronize), so the ordering the pipeline relies on is tested without a
GPU (:func:`check_handoffs`, :func:`check_write_backs`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterable, List, Optional, Tuple

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


def _pinned_bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


class PinnedPool:
    """Page-locked host buffers lent per transfer and reused: an H2D source goes back to the free list when the
    event recorded after its copy has completed, a D2H target when the host work that read it returns it. Sizes
    round up to a power of two (at least 1 MiB), so a handful of buffers serves every batch. Only where an
    accelerator exists: :meth:`make` returns None otherwise (torch has nothing to pin for)."""

    MIN_BYTES = 1 << 20

    def __init__(self, pinned: bool = True):
        self.pinned = pinned  # False: plain memory (the recording backend's stand-in on CPU)
        self._free: List[torch.Tensor] = []
        self._in_flight: List[Tuple[object, List[torch.Tensor]]] = []  # (event, buffers): back when event is done
        self._lock = threading.Lock()
        self.allocated = 0

    @staticmethod
    def make(device: torch.device) -> Optional["PinnedPool"]:
        return PinnedPool() if device.type != "cpu" and accelerator_present() else None

    def take(self, shape, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """(a pinned view of ``shape`` / ``dtype``, the buffer to :meth:`give` back when it has been read)."""
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        with self._lock:
            self._reclaim()
            fits = [b for b in self._free if b.numel() >= nbytes]
            buf = min(fits, key=lambda b: b.numel()) if fits else None
            if buf is not None:
                self._free = [b for b in self._free if b is not buf]
        if buf is None:
            size = max(self.MIN_BYTES, 1 << max(0, nbytes - 1).bit_length())
            buf = _pinned_bytes(size) if self.pinned else torch.empty(size, dtype=torch.uint8)
            self.allocated += 1
        return buf[:nbytes].view(dtype).view(shape), buf

    def give(self, buffers: List[torch.Tensor], event: Optional[object] = None) -> None:
        """Return ``buffers``: now (``event`` None: nothing reads them any more) or once ``event`` has completed."""
        if not buffers:
            return
        with self._lock:
            if event is None:
                self._free.extend(buffers)
            else:
                self._in_flight.append((event, list(buffers)))

    def _reclaim(self) -> None:
        keep = []
        for event, buffers in self._in_flight:
            if event.query():
                self._free.extend(buffers)
            else:
                keep.append((event, buffers))
        self._in_flight = keep


class PendingWriteBack:
    """A batch's updated rows on their way to the host store: the device-to-host copies are enqueued on the
    write-back stream after the update (``done`` is recorded after them); :meth:`finish` waits for ``done`` on
    the host, then scatters the rows into the store (``apply``) and returns the pinned buffers. Until
    :meth:`finish` returns the store does not hold the batch's update: whoever reads those rows from the store
    next finishes it first (the retrieval stage, before its gather: :class:`~.dual_buffer.DualBuffer`)."""

    def __init__(self, host: List[torch.Tensor], apply: Callable[[List[torch.Tensor]], None], done: Optional[object],
                 pool: Optional[PinnedPool] = None, buffers: Optional[List[torch.Tensor]] = None):
        self.host, self.apply, self.done = host, apply, done
        self.pool, self.buffers = pool, buffers or []
        self.finished = False

    def finish(self) -> None:
        if self.finished:
            return
        if self.done is not None:
            self.done.synchronize()  # the copies into host memory have landed
        self.apply(self.host)
        self.finished = True
        self.host = []
        if self.pool is not None:
            self.pool.give(self.buffers)


class StageStream:
    """One device stage's stream (``name``: h2d, retrieve, writeback). On CPU without a backend every method is a
    no-op, :meth:`copy` is ``t.to(device)`` and :meth:`host_buffer` gives None."""

    def __init__(self, device: torch.device, name: str = "", backend=None):
        self.device, self.name = device, name
        self.mod = backend if backend is not None else _backend(device)
        self.stream = self.mod.Stream(device=device) if self.mod is not None else None
        if self.stream is not None and hasattr(self.mod, "label"):
            self.mod.label(self.stream, name)
        # a recording backend (tests, CPU) lends plain memory through the same pool: the gather-into path runs
        self.pool = (None if self.stream is None else PinnedPool.make(device) if backend is None
                     else PinnedPool(pinned=False))
        self._lent: List[torch.Tensor] = []  # pool buffers read by copies enqueued since the last handoff

    @contextlib.contextmanager
    def run(self):
        """Make this stage's stream current for the enclosed work (no-op on CPU)."""
        if self.stream is None:
            yield
        else:
            with self.mod.stream(self.stream):
                yield

    def host_buffer(self, shape, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """Pinned host memory for a tensor this stage will :meth:`copy` to the device before its next
        :meth:`handoff` (a gather writes straight into it: no second host copy); None where nothing is pinned."""
        if self.pool is None:
            return None
        view, buf = self.pool.take(shape, dtype)
        self._lent.append(buf)
        return view

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the device, the copy enqueued on this stream (call inside :meth:`run`): non-blocking from
        pinned memory where an accelerator exists (``t`` itself when it came from :meth:`host_buffer`, else staged
        into a pooled pinned buffer); the plain ``.to(device)`` on CPU."""
        if self.stream is None:
            return t.to(self.device)
        if hasattr(self.mod, "copy"):  # a recording backend logs the copy
            return self.mod.copy(self.stream, t, self.device)
        if self.pool is None or t.device.type != "cpu":
            return t.to(self.device, non_blocking=True)
        if not t.is_pinned():
            pinned, buf = self.pool.take(t.shape, t.dtype)
            pinned.copy_(t)
            self._lent.append(buf)
            t = pinned
        return t.to(self.device, non_blocking=True)

    def handoff(self) -> Optional[object]:
        """An event marking the end of the work enqueued so far on this stream (None on CPU); the pinned buffers
        its copies read go back to the pool once it has completed."""
        if self.stream is None:
            return None
        ev = self.mod.Event()
        ev.record(self.stream)
        if self.pool is not None:
            self.pool.give(self._lent, ev)
        self._lent = []
        return ev

    def write_back(self, tensors: List[torch.Tensor], apply: Callable[[List[torch.Tensor]], None]
                   ) -> PendingWriteBack:
        """Enqueue copies of the device ``tensors`` (updated by work already enqueued on the caller's current
        stream) into pinned host memory on this stream, ordered after that work by an event; ``apply`` gets the
        host copies when :meth:`PendingWriteBack.finish` is called. The device tensors are marked as used on this
        stream, so freeing them on the compute stream cannot recycle their memory before the copies have run."""
        if self.stream is None:
            return PendingWriteBack(list(tensors), apply, None)
        updated = self.mod.Event()
        updated.record(self.mod.current_stream(self.device))
        host, buffers = [], []
        with self.run():
            self.stream.wait_event(updated)
            for t in tensors:
                if hasattr(self.mod, "copy"):  # a recording backend logs the copy (a host clone)
                    host.append(self.mod.copy(self.stream, t, torch.device("cpu")))
                    continue
                if self.pool is not None:
                    view, buf = self.pool.take(t.shape, t.dtype)
                    view.copy_(t, non_blocking=True)
                    host.append(view)
                    buffers.append(buf)
                else:
                    host.append(t.to("cpu"))
                if t.device.type != "cpu":
                    t.record_stream(self.stream)
            done = self.mod.Event()
            done.record(self.stream)
        return PendingWriteBack(host, apply, done, self.pool, buffers)


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
    event)``, ``("wait", stream, event)``, ``("sync", stream, event)`` (the host waited for an event recorded on
    ``stream``). The compute thread's current stream is ``"compute"``."""

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
        return t.to(device, copy=True)  # a device copy is memory of its own


class _RecordingStream:
    def __init__(self, backend: RecordingBackend, name: str):
        self.backend, self.name = backend, name

    def wait_event(self, event: "_RecordingEvent") -> None:
        self.backend._add("wait", self, event.id)


class _RecordingEvent:
    def __init__(self, backend: RecordingBackend, id_: int):
        self.backend, self.id = backend, id_
        self.stream: Optional[_RecordingStream] = None

    def record(self, stream: _RecordingStream) -> None:
        self.stream = stream
        self.backend._add("record", stream, self.id)

    def synchronize(self) -> None:
        """The host waits for the event: logged as ``("sync", the stream it was recorded on, id)``."""
        self.backend._add("sync", self.stream or self.backend.compute, self.id)

    def query(self) -> bool:
        return True


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


def check_write_backs(log: List[Tuple[str, str, object]], steps: int) -> List[str]:
    """The write-back's ordering, checked on a :class:`RecordingBackend` log: one ``done`` event per batch on the
    ``writeback`` stream, after the batch's copies, which come after a wait on an event the compute stream recorded
    (the update's kernels precede the copies); the host waits on every ``done`` (the scatter into the store follows
    it) before the retrieval stream copies anything of batch k+2, the first batch that may gather those rows from
    the store (batch k+1's shared rows come from the dual-buffer sync). Returns the violations (empty: it holds)."""
    problems: List[str] = []
    compute_events = {e: i for i, (op, s, e) in enumerate(log) if op == "record" and s == "compute"}
    synced = {e: i for i, (op, s, e) in enumerate(log) if op == "sync" and s == "writeback"}
    dones = [(i, e) for i, (op, s, e) in enumerate(log) if op == "record" and s == "writeback"]
    retrieved = [i for i, (op, s, _) in enumerate(log) if op == "record" and s == "retrieve"]
    if len(dones) != steps:
        problems.append(f"writeback: {len(dones)} events recorded for {steps} batches")
    prev = -1
    for k, (i, e) in enumerate(dones):
        span = log[prev + 1:i]
        waits = [j for j, (op, s, ev) in enumerate(span, prev + 1) if op == "wait" and s == "writeback"]
        copies = [j for j, (op, s, _) in enumerate(span, prev + 1) if op == "copy" and s == "writeback"]
        if not copies:
            problems.append(f"writeback: batch {k} copied nothing on its stream")
        elif not any(j < copies[0] and compute_events.get(log[j][2], i) < j for j in waits):
            problems.append(f"writeback: batch {k}'s copies are not ordered after the update on the compute stream")
        if e not in synced:
            problems.append(f"writeback: batch {k}'s copies are never waited on by the host")
        elif k + 1 < len(retrieved):
            first = next((j for j in range(retrieved[k + 1] + 1, len(log))
                          if log[j][0] == "copy" and log[j][1] == "retrieve"), None)
            if first is not None and synced[e] > first:
                problems.append(f"writeback: batch {k} reached the store after batch {k + 2}'s retrieval")
        prev = i
    return problems
