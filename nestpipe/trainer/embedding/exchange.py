"""The exchanges: ``all_to_all_single`` on a stage's process group, and work in flight as one type.

:class:`InFlight` is what the key routing, the embedding exchange and the gradient exchange return: work that has
been issued and whose result :meth:`InFlight.wait` returns. Work of several phases (the key routing: counts, then
payload, then the owner's plans) is a generator that yields wherever it has a collective in flight;
:meth:`InFlight.advance` runs it to its next such point (it waits for one collective and issues the next),
:meth:`InFlight.wait` to the end. A caller overlaps its own work with the collectives by doing that work between
issuing and waiting -- the order it reads in is the order it runs in.

Timing (:class:`~nestpipe.utils.timing.StageTimer`): a blocking exchange counts its time and CPU as ``STAGE.comm``
on the calling thread; an asynchronous one counts from issue to completion as ``STAGE.comm`` and only the wait as
exposed.
"""

from __future__ import annotations

import time
from typing import Callable, Generator, Generic, List, Optional, TypeVar

import torch
import torch.distributed as dist

from nestpipe.utils.timing import StageTimer

T = TypeVar("T")
U = TypeVar("U")


class InFlight(Generic[T]):
    """Issued work whose result :meth:`wait` returns (once computed, the same object on every call)."""

    def __init__(self, phases: Optional[Generator[None, None, T]] = None, value: Optional[T] = None):
        self._phases, self._value, self._finished = phases, value, phases is None
        self.advance()  # run to the first point where something is in flight: the work is issued on return

    @staticmethod
    def done(value: T) -> "InFlight[T]":
        """Work that completed when it was issued (a blocking collective, or nothing to do)."""
        return InFlight(value=value)

    @property
    def finished(self) -> bool:
        return self._finished

    def advance(self) -> None:
        """Run to the next point where a collective is in flight, or to the end."""
        if self._finished:
            return
        try:
            next(self._phases)
        except StopIteration as stop:
            self._value, self._finished, self._phases = stop.value, True, None

    def wait(self) -> T:
        while not self._finished:
            self.advance()
        return self._value

    def then(self, fn: Callable[[T], U]) -> "InFlight[U]":
        """``fn`` of the result, applied when the result is waited for (no extra phase)."""
        def phases():
            while not self._finished:
                yield
                self.advance()
            return fn(self._value)
        return InFlight(phases())


def all_to_all(timer: StageTimer, rank: int, send: torch.Tensor, send_splits: List[int], recv_splits: List[int],
               stage: str, group, out: Optional[torch.Tensor] = None, async_op: bool = False
               ) -> InFlight[torch.Tensor]:
    """One ``all_to_all_single`` of ``send`` (split ``send_splits`` by destination) into ``out`` (allocated when
    None; split ``recv_splits`` by source) on ``group``. Blocking unless ``async_op``; the buffers are held until
    it completes. Counts the bytes sent to other ranks under ``stage``."""
    if out is None:
        out = send.new_empty(sum(recv_splits))
    timer.add_bytes(stage, (sum(send_splits) - send_splits[rank]) * send.element_size())
    if not async_op:
        t0, c0 = time.perf_counter(), time.process_time()
        dist.all_to_all_single(out, send, recv_splits, send_splits, group=group)
        timer.add(stage + ".comm", time.perf_counter() - t0)
        timer.add_cpu(stage + ".comm", time.process_time() - c0)
        return InFlight.done(out)
    t_issue = time.perf_counter()
    work = dist.all_to_all_single(out, send, recv_splits, send_splits, group=group, async_op=True)
    return issued(work, timer, stage, out, t_issue, keep=send)


def issued(work, timer: StageTimer, stage: str, value: T, t_issue: float, keep=None) -> InFlight[T]:
    """A collective issued asynchronously at ``t_issue`` (its ``work``), whose ``wait()`` returns ``value``: its time
    from issue to completion counts as ``STAGE.comm`` and the caller's wait for it as exposed. ``value`` and
    ``keep`` (its other buffers) are held until it completes."""
    return InFlight(_completion(work, timer, stage, value, t_issue, keep))


def _completion(work, timer: StageTimer, stage: str, value, t_issue: float, keep):
    completed = []  # the completion time, from the collective's callback (it may fire long before the wait)
    work.get_future().add_done_callback(lambda _f: completed.append(time.perf_counter()))
    yield
    t0 = time.perf_counter()
    work.wait()
    t1 = time.perf_counter()
    done = min(completed[0], t1) if completed else t1
    timer.add_split(stage + ".comm", done - t_issue, t1 - t0)
    return value


def fuse_by_peer(blocks: List[List[torch.Tensor]], world: int, empty: torch.Tensor) -> torch.Tensor:
    """``blocks[i][r]`` (micro-batch i's part for peer r) -> one buffer ordered (peer, micro-batch); ``empty``
    when there is nothing."""
    parts = [blocks[i][r] for r in range(world) for i in range(len(blocks))]
    if not parts:
        return empty
    return torch.cat(parts)


def unfuse_by_peer(buf: torch.Tensor, splits: List[List[int]], world: int) -> List[List[torch.Tensor]]:
    """Inverse of :func:`fuse_by_peer` for received sizes ``splits[i][r]``: views ``[i][r]``."""
    N = len(splits)
    out: List[List[Optional[torch.Tensor]]] = [[None] * world for _ in range(N)]
    at = 0
    for r in range(world):
        for i in range(N):
            n = splits[i][r]
            out[i][r] = buf[at:at + n]
            at += n
    return out
