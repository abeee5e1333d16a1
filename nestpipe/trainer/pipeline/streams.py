"""Stage execution resources on each device kind, and the hand-off between stages.

- CUDA / NPU: a stage given a :class:`StageStream` (the scheduler gives one to the h2d stage; the other stages
  enqueue on the device's default stream) enqueues its copies on that stream, records an event, and passes the event
  along with its outputs; the consumer makes its current stream wait on the event (:func:`wait_handoff`) and marks
  the tensors as used on its stream (``record_stream``) so the caching allocator does not recycle them early. The
  copies are plain ``.to(device)`` calls from pageable host memory (nothing is pinned, so they do not overlap the
  host thread). Collectives run on NCCL/HCCL's internal streams; the issuing thread waits on the work handle. None
  of this has run on accelerator hardware yet.
- CPU: a stage's thread *is* its stream. Everything a stage produces is complete when it is put on the bounded
  queue to the next stage, and the queue hand-off is the happens-before edge; events are ``None``.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch


def _backend(device: torch.device):
    if device.type == "cuda":
        return torch.cuda
    if device.type == "npu":
        return getattr(torch, "npu")  # torch_npu registers torch.npu (imported by the device layer)
    return None


class StageStream:
    def __init__(self, device: torch.device):
        self.device = device
        self.mod = _backend(device)
        self.stream = self.mod.Stream(device=device) if self.mod is not None else None

    @contextlib.contextmanager
    def run(self):
        """Make this stage's stream current for the enclosed work (no-op on CPU)."""
        if self.stream is None:
            yield
        else:
            with self.mod.stream(self.stream):
                yield

    def handoff(self) -> Optional[object]:
        """An event marking the end of the work enqueued so far on this stream (None on CPU)."""
        if self.stream is None:
            return None
        ev = self.mod.Event()
        ev.record(self.stream)
        return ev


def wait_handoff(device: torch.device, event: Optional[object], tensors: Iterable[torch.Tensor] = ()) -> None:
    """Order the consumer's current stream after the producer's ``event``; keep ``tensors`` alive for it."""
    mod = _backend(device)
    if mod is None or event is None:
        return
    cur = mod.current_stream(device)
    cur.wait_event(event)
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == device.type:
            t.record_stream(cur)
