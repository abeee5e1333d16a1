"""The schedule of one training segment (steps ``[start, stop)``) in each ``--pipeline`` mode.

Every mode runs the same stage functions of :mod:`nestpipe.trainer.step` on the same data with the same process
groups; only where (which thread) and when they run differs:

    off     prefetch, h2d, route, retrieve, [embed a2a, dense, grad a2a] x N, update   - all on the compute thread
            (with ``pipe.route_ahead``, the next batch's prefetch and routing collectives are issued during this one)
    fwp     as off, but the N micro-batches run in the Frozen-Window Pipeline (``embed-comm``/``grad-comm`` threads)
            (off and fwp: :class:`SequentialSchedule`)
    dbp     the five-stage Dual-Buffer Pipeline; micro-batches as in off
    nested  DBP between batches and FWP inside each batch (the default)

DBP's five stages and their threads: :class:`DualBufferSchedule`; the invariant: :mod:`.dual_buffer`.

The train loop (:mod:`nestpipe.trainer.loop`) is then the paper's algorithm:

    for segment in segments(start, total, checkpoint_every):
        for step, loss in runner.run(records, segment):   # the pipeline fills, runs, drains
            log(step, loss)
        checkpoint()                                       # nothing in flight: drained

A segment ends drained: every stage thread has finished and joined, no buffer is held, nothing is in flight.
Checkpoints (and so export and eval, which read them) are only taken there.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Iterator, List, Optional, Tuple

import torch

from nestpipe.trainer.config import PIPELINE_MODES
from nestpipe.trainer.pipeline.dual_buffer import DualBuffer, Stopped
from nestpipe.trainer.pipeline.frozen_window import CommWorker, FrozenWindow
from nestpipe.trainer.distributed.process_groups import issuers
from nestpipe.trainer.pipeline.streams import RecordingBackend, StageStream, wait_handoff
from nestpipe.utils.jsonio import write_json_atomic
from nestpipe.trainer.step import (StepState, route_ahead, stage_forward_backward, stage_h2d, stage_prefetch,
                                   stage_retrieve, stage_route, stage_update, take_batch, train_step, update_dense,
                                   update_sparse)



class _Failure:
    def __init__(self, stage: str, exc: BaseException):
        self.stage, self.exc = stage, exc


def _put(q: queue.Queue, item, stop: threading.Event) -> None:
    while True:
        try:
            q.put(item, timeout=0.05)
            return
        except queue.Full:
            if stop.is_set():
                raise Stopped()


def _get(q: queue.Queue, stop: threading.Event):
    while True:
        try:
            return q.get(timeout=0.05)
        except queue.Empty:
            if stop.is_set():
                raise Stopped()


class PipelineRunner:
    def __init__(self, state: StepState, mode: str):
        if mode not in PIPELINE_MODES:
            raise ValueError(f"--pipeline {mode!r}: expected one of {', '.join(PIPELINE_MODES)}")
        self.state = state
        self.mode = mode
        self.dbp = mode in ("dbp", "nested")
        self.fwp = mode in ("fwp", "nested")
        pc = state.cfg.pipe
        self.hooks = state.hooks
        if self.hooks.update_per_micro_batch and not self.fwp:
            raise ValueError("the update_per_micro_batch testing hook needs --pipeline fwp or nested")
        self.rows_synced = 0
        # test-only: the device stage streams' operations recorded on CPU (the record_streams testing hook)
        self.stream_backend = RecordingBackend() if self.hooks.record_streams else None
        # FWP communication threads: 2 (one per exchange group) or 1 (both groups in one fixed order)
        self.comm_threads = int(pc.comm_threads)

    # -- public --------------------------------------------------------------------------------------------------
    def run(self, records: Iterator[Tuple[int, dict, str]], start: int, stop: int,
            before_step: Optional[Callable[[int], None]] = None) -> Iterator[Tuple[int, float]]:
        """Train steps ``[start, stop)`` with records from ``records`` (which yields (step, record, path)); yields
        (step, global loss) after each update. Returns drained."""
        st = self.state
        workers: List[CommWorker] = []
        fw = None
        try:
            threads = {"compute": threading.current_thread()}
            if self.fwp:
                # two threads, one per exchange group; or one, embedding and gradient All2Alls in submission order
                # (fixed, the same on all ranks)
                workers = ([CommWorker("embed-comm"), CommWorker("grad-comm")] if self.comm_threads == 2
                           else [CommWorker("comm")])
                fw = FrozenWindow(st, workers[0], workers[-1], update_fn=self._intermediate_update,
                                  update_per_micro_batch=self.hooks.update_per_micro_batch)
                threads.update({w.name: w.thread for w in workers})
            if self.dbp:
                schedule = DualBufferSchedule(self, records, start, stop, fw)
            else:
                schedule = SequentialSchedule(self, records, start, stop, fw)
            yield from schedule.run(threads, before_step)
        finally:
            for w in workers:
                w.close()
            if st.groups is not None:
                st.groups.unbind_all()

    # -- helpers -------------------------------------------------------------------------------------------------
    def dump_stream_log(self) -> None:
        """the record_streams testing hook: write the recorded stream operations so far to ``PREFIX.rankR.json``
        (atomic; every schedule segment rewrites it with the whole log)."""
        if self.stream_backend is None:
            return
        write_json_atomic(f"{self.hooks.record_streams}.rank{self.state.rank}.json",
                          {"rank": self.state.rank, "mode": self.mode, "log": self.stream_backend.log})

    def _bind(self, threads) -> None:
        if self.state.groups is None:
            return
        for stage, who in issuers(self.mode, self.comm_threads).items():
            self.state.groups.bind(stage, threads[who])

    def _intermediate_update(self, routing, loss) -> float:
        return stage_update(self.state, routing, loss, release=False)

    def _forward_backward(self, fw: Optional[FrozenWindow], routing, feats) -> torch.Tensor:
        if fw is not None:
            return fw.forward_backward(routing, feats)
        return stage_forward_backward(self.state, routing, feats)

    def _account_wait(self, step: int, t0: float, t1: float, when) -> None:
        """Split the compute thread's wait for batch ``step`` by what it waited on: the overlap with the batch's
        key-routing collectives is exposed communication (``wait.route.comm``), the overlap with its retrieval is
        exposed lookup (``wait.lookup``), the rest is exposed input (data prefetch / H2D, ``wait.input``)."""
        def ov(iv):
            return max(0.0, min(t1, iv[1]) - max(t0, iv[0]))

        comm, look = ov(when["route"]), ov(when["retrieve"])
        st = self.state
        st.timer.add("wait.route.comm", comm)
        st.timer.add("wait.lookup", look)
        st.timer.add("wait.input", max(0.0, (t1 - t0) - comm - look))
        st.timer.record("wait.batch", step, -1, t0, t1)



class SequentialSchedule:
    """``off`` and ``fwp``: one step after another on the compute thread.

        off   train_step: stages 1-5 in order, the next batch prepared and routed while this one's exchanges and
              all-reduce are in flight (``pipe.route_ahead``)
        fwp   the same stages with the Frozen-Window Pipeline's forward/backward, whose communication threads own
              the exchanges (the next batch is routed before this one's retrieval, its payload after the backward)
    """

    def __init__(self, runner: "PipelineRunner", records, start: int, stop: int, fw: Optional[FrozenWindow]):
        self.runner, self.state, self.records, self.fw = runner, runner.state, records, fw
        self.start, self.stop = start, stop

    def run(self, threads, before_step=None) -> Iterator[Tuple[int, float]]:
        self.runner._bind(threads)
        ahead = self.state.cfg.pipe.route_ahead  # the next batch prepared and routed during this one (in the segment)
        nxt = None
        for step in range(self.start, self.stop):
            if before_step:
                before_step(step)
            s, record, path = nxt if nxt is not None else next(self.records)
            if s != step:
                raise RuntimeError(f"data stream at step {s}, expected {step}")
            nxt = next(self.records) if ahead and step + 1 < self.stop else None
            next_record = nxt[1:] if nxt is not None else None
            if next_record is not None and self.runner.hooks.route_ahead_repeat_record:
                next_record = (record, path)  # negative control: the next step trains on this step's batch again
            if self.fw is None:
                yield step, train_step(self.state, step, record, path, next_record)
            else:
                yield step, self.frozen_window_step(step, record, path, next_record)

    def frozen_window_step(self, step: int, record, where: str, next_record) -> float:
        """:func:`~nestpipe.trainer.step.train_step` with the frozen window's forward/backward."""
        st = self.state
        batch, routing = take_batch(st, step, record, where)                  # 1 prefetch, 3 key routing
        feats = stage_h2d(st, batch)                                          # 2 H2D
        ahead = route_ahead(st, step + 1, next_record)                        # next batch: counts All2All issued
        stage_retrieve(st, routing)                                           # 4 embedding retrieval
        st.hooks.pause()
        with st.timer.span("fwd_bwd", step):
            loss = self.fw.forward_backward(routing, feats)                   # 5 inside the frozen window
        ahead.advance()                                                       # next batch: payload All2All issued
        with st.timer.span("update", step):
            reduction = update_sparse(st, routing, loss)                      # the dense all-reduce in flight
            st.routed_ahead = ahead.wait()                                    # next batch: the owner's plans
            return update_dense(st, reduction)


class DualBufferSchedule:
    """``dbp`` / ``nested``: the five-stage Dual-Buffer Pipeline over the steps ``[start, stop)`` of one segment.

    Stages 1-4 run on their own threads joined by bounded queues (prefetch, h2d and route up to ``pipe.depth``
    batches ahead; retrieval at most one batch ahead: two buffers); stage 5 runs on the calling (compute) thread:

        stage            thread     work                                           paper
        prefetch(t+k)    data       read + prepare the batch                       1 data prefetch
        h2d(t+k)         h2d        model inputs to the device                     2 H2D
        route(t+k)       route      key-routing All2All (group ``route``)           3 key routing
        retrieve(t+1)    retrieve   gather rows into the prefetch buffer           4 embedding retrieval
        receive(t)       compute    take batch t, DBP sync from batch t-1          5 forward/backward + update
        train(t)         compute    forward/backward (FWP inside with ``fw``), update

    Invariant (:mod:`.dual_buffer`): when :meth:`receive` returns batch t, every row of keys(t-1) ∩ keys(t) in t's
    buffer holds batch t-1's update, so batch t trains on exactly the parameters synchronous training would.
    The schedule ends drained: every stage thread joined, no buffer held.
    """

    def __init__(self, runner: "PipelineRunner", records, start: int, stop: int, fw: Optional[FrozenWindow]):
        self.runner, self.state, self.records, self.fw = runner, runner.state, records, fw
        self.start, self.stop = start, stop
        pc = self.state.cfg.pipe
        self.halt = threading.Event()
        self.dual = DualBuffer(self.state.emb, skip_sync=runner.hooks.skip_dual_buffer_sync,
                               replica_own_keys_only=runner.hooks.replica_refresh_own_keys_only,
                               late_write_back=runner.hooks.late_write_back)
        self.q_data, self.q_h2d, self.q_route = (queue.Queue(maxsize=pc.depth) for _ in range(3))
        self.q_ready: queue.Queue = queue.Queue(maxsize=1)  # retrieval: at most one batch ahead of compute
        backend = runner.stream_backend
        self.h2d_stream = StageStream(self.state.device, "h2d", backend)
        self.retrieve_stream = StageStream(self.state.device, "retrieve", backend)
        self.writeback_stream = StageStream(self.state.device, "writeback", backend)
        self.active = None  # the batch whose updated rows are still to be synced into the next batch's buffer
        self.synced = None  # the active batch, already synced into the next one, whose buffer is still held

    # -- the loop: the paper's five-stage table, stage 5 on this thread ------------------------------------------
    def run(self, threads, before_step=None) -> Iterator[Tuple[int, float]]:
        stage_threads = self._start_stage_threads(threads)
        finished = False
        try:
            ready = None  # batch t+1, received early at batch t's boundary (FWP primes its first All2Alls)
            for step in range(self.start, self.stop):
                if before_step:
                    before_step(step)
                routing, feats = ready if ready is not None else self.receive(step)  # stages 1-4 done, DBP sync
                ready = None
                self.state.hooks.pause()
                loss = self.forward_backward(step, routing, feats)                    # stage 5: FWP inside
                reduction = self.update_sparse(step, routing, loss)                   # dense all-reduce in flight
                if self._primes_next_batch(step):
                    ready = self.receive(step + 1, early=True)                        # t+1's window is frozen now
                    self.fw.prime(ready[0], self.state.cfg.pipe.boundary_prime)
                yield step, self.update_dense(step, reduction)
            self.drain()
            finished = True
        finally:
            self.runner.rows_synced += self.dual.rows_synced
            self.runner.dump_stream_log()
            if not finished:
                self.halt.set()
            for t in stage_threads:
                t.join(timeout=None if finished else 5.0)

    # -- stages 1-4 (stage threads) ------------------------------------------------------------------------------
    def prefetch(self, k: int, _):
        step = self.start + k
        s, record, path = next(self.records)
        if s != step:
            raise RuntimeError(f"data stream at step {s}, expected {step}")
        return stage_prefetch(self.state, step, record, path)

    def h2d(self, k: int, batch):
        with self.h2d_stream.run():
            feats = stage_h2d(self.state, batch, copy=self.h2d_stream.copy)
            return batch, feats, self.h2d_stream.handoff()

    def route(self, k: int, item):
        batch, feats, event = item
        t0 = time.perf_counter()
        routing = stage_route(self.state, batch)
        return routing, feats, event, {"route": (t0, time.perf_counter())}

    def retrieve(self, k: int, item):
        routing, feats, event, when = item
        with self.retrieve_stream.run():  # the rows' copy into the device buffer, on the retrieval's stream
            t0 = self.dual.retrieve(routing, self.halt, copy=self.retrieve_stream.copy,
                                    host_buffer=self.retrieve_stream.host_buffer)
            retrieved = self.retrieve_stream.handoff()
        when["retrieve"] = (t0, time.perf_counter())
        return routing, feats, (event, retrieved), when

    def _start_stage_threads(self, threads) -> List[threading.Thread]:
        stage_threads = [self._stage_thread("data", self.prefetch, None, self.q_data),
                         self._stage_thread("h2d", self.h2d, self.q_data, self.q_h2d),
                         self._stage_thread("route", self.route, self.q_h2d, self.q_route),
                         self._stage_thread("retrieve", self.retrieve, self.q_route, self.q_ready)]
        self.runner._bind(dict(threads, route=stage_threads[2]))  # before any stage thread can issue
        for t in stage_threads:
            t.start()
        return stage_threads

    def _stage_thread(self, name: str, fn, q_in: Optional[queue.Queue], q_out: queue.Queue) -> threading.Thread:
        """A thread running ``fn`` on each of the segment's batches from ``q_in`` into ``q_out``; a failure is
        forwarded down the queues to the compute thread, which raises it."""
        n, halt = self.stop - self.start, self.halt

        def body():
            try:
                for k in range(n):
                    item = _get(q_in, halt) if q_in is not None else None
                    if isinstance(item, _Failure):
                        _put(q_out, item, halt)
                        return
                    _put(q_out, fn(k, item), halt)
            except Stopped:
                return
            except BaseException as e:  # noqa: BLE001 - forwarded to the compute thread
                try:
                    _put(q_out, _Failure(name, e), halt)
                except Stopped:
                    pass
        return threading.Thread(target=body, name=name, daemon=True)

    # -- stage 5 (compute thread) --------------------------------------------------------------------------------
    def receive(self, step: int, early: bool = False):
        """Batch ``step`` from the retrieval stage (its buffer gathered), then the DBP sync from the active batch:
        after it the buffer is final (the invariant of dual_buffer.py) and the window is frozen. ``early``: the
        active batch's buffer and permit are kept until :meth:`forward_backward` releases them (so the retrieval
        of the batch after ``step`` starts when ``step`` starts computing, as without ``early``)."""
        t0 = time.perf_counter()
        item = _get(self.q_ready, self.halt)
        t1 = time.perf_counter()
        if isinstance(item, _Failure):
            raise RuntimeError(f"pipeline stage {item.stage!r} failed at or before step {step}: "
                               f"{type(item.exc).__name__}: {item.exc}") from item.exc
        routing, feats, (h2d_done, retrieved), when = item
        self.runner._account_wait(step, t0, t1, when)
        if routing.batch.step != step:
            raise RuntimeError(f"pipeline delivered step {routing.batch.step}, expected {step}")
        backend = self.runner.stream_backend
        wait_handoff(self.state.device, h2d_done, [t for f in feats for t in f.values()], backend)
        wait_handoff(self.state.device, retrieved, [t for o in routing.own.values() for t in (o.buf_w, o.buf_s)
                                                    if t is not None], backend)
        if self.active is not None:
            self.dual.sync(self.active, routing)  # the DBP invariant: see dual_buffer.py
            if early:
                self.synced = self.active
            else:
                self.dual.release(self.active)
            self.active = None
        return routing, feats

    def forward_backward(self, step: int, routing, feats) -> torch.Tensor:
        with self.state.timer.span("fwd_bwd", step):
            self._release_synced()  # batch step-1's buffer: the retrieval of step+1 starts as step computes
            return self.runner._forward_backward(self.fw, routing, feats)

    def update_sparse(self, step: int, routing, loss: torch.Tensor):
        """The owner's row-wise update of batch ``step`` while the dense all-reduce is in flight (disjoint
        tensors); the batch stays active until its updated rows are synced into the next batch's buffer."""
        stream = self.writeback_stream if self.writeback_stream.stream is not None else None  # CPU: at once
        with self.state.timer.span("update", step):
            reduction = update_sparse(self.state, routing, loss, release=False, write_back_stream=stream)
        self.active = routing
        return reduction

    def update_dense(self, step: int, reduction) -> float:
        t0 = time.perf_counter()
        loss = update_dense(self.state, reduction)
        self.state.timer.record("update.dense", step, -1, t0, time.perf_counter())  # the trace's (timed inside)
        return loss

    def _primes_next_batch(self, step: int) -> bool:
        """With FWP, the next batch's buffer is final once synced: its first embedding All2Alls start at the
        boundary, while this batch's dense all-reduce and AdamW finish."""
        return self.fw is not None and step + 1 < self.stop and not self.runner.hooks.update_per_micro_batch

    def drain(self) -> None:
        self._release_synced()
        if self.active is not None:
            self.dual.release(self.active)
            self.active = None
        self.dual.finish_write_backs()  # every update is in the store: the segment ends drained

    def _release_synced(self) -> None:
        if self.synced is not None:
            self.dual.release(self.synced)
            self.synced = None
