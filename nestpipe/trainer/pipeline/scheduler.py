"""The schedule of one training segment (steps ``[start, stop)``) in each ``--pipeline`` mode.

Every mode runs the same stage functions of :mod:`nestpipe.trainer.step` on the same data with the same process
groups; only where (which thread) and when they run differs:

    off     prefetch, h2d, route, retrieve, [embed a2a, dense, grad a2a] x N, update   - all on the compute thread
    fwp     as off, but the N micro-batches run in the Frozen-Window Pipeline (``embed-comm``/``grad-comm`` threads)
    dbp     the five-stage Dual-Buffer Pipeline; micro-batches as in off
    nested  DBP between batches and FWP inside each batch (the default)

DBP, per rank (threads joined by bounded queues; stages 1-3 run up to ``pipe.depth`` batches ahead, retrieval at
most one, see :mod:`.dual_buffer`):

    data     : read + prepare batch t+k              (1 data prefetch)
    h2d      : model inputs of batch t+k to device    (2 H2D; its own stream on CUDA/NPU)
    route    : key routing All2All of batch t+k       (3 key routing, group ``route``)
    retrieve : gather batch t+1's rows from the store (4 embedding retrieval, into the prefetch buffer)
    compute  : sync(t-1 -> t), forward/backward of t, update of t (5; groups ``embed``, ``grad``, ``dense``)

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

from nestpipe.trainer import testing_hooks
from nestpipe.trainer.config import PIPELINE_MODES
from nestpipe.trainer.pipeline.dual_buffer import DualBuffer, Stopped
from nestpipe.trainer.pipeline.frozen_window import CommWorker, FrozenWindow
from nestpipe.trainer.distributed.process_groups import issuers
from nestpipe.trainer.pipeline.streams import StageStream, wait_handoff
from nestpipe.trainer.step import (StepState, _span, stage_forward_backward, stage_h2d, stage_prefetch,
                                   stage_route, stage_update, train_step, update_begin, update_dense)



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
        self.hooks = testing_hooks.active()
        if self.hooks.update_per_micro_batch and not self.fwp:
            raise ValueError("the update_per_micro_batch testing hook needs --pipeline fwp or nested")
        self.rows_synced = 0
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
                if self.comm_threads == 2:
                    workers = [CommWorker("embed-comm"), CommWorker("grad-comm")]
                    fw = FrozenWindow(st, workers[0], workers[1], update_fn=self._intermediate_update)
                else:  # one thread, embedding and gradient All2Alls in submission order (fixed, same on all ranks)
                    workers = [CommWorker("comm")]
                    fw = FrozenWindow(st, workers[0], workers[0], update_fn=self._intermediate_update)
                threads.update({w.name: w.thread for w in workers})
            if self.dbp:
                yield from self._run_dbp(records, start, stop, before_step, fw, threads)
            else:
                self._bind(threads)
                yield from self._run_sequential(records, start, stop, before_step, fw)
        finally:
            for w in workers:
                w.close()
            if st.groups is not None:
                st.groups.unbind_all()

    # -- helpers -------------------------------------------------------------------------------------------------
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
        if st.timeline is not None:
            st.timeline.record("wait.batch", step, -1, t0, t1)

    def _hook_sleep(self) -> None:
        if self.hooks.step_sleep_s:
            time.sleep(self.hooks.step_sleep_s)  # testing hook: a window to kill the run with a batch in flight

    # -- off / fwp: stages 1-4 on the compute thread -------------------------------------------------------------
    def _run_sequential(self, records, start, stop, before_step, fw):
        """``off`` and ``fwp``: :func:`~nestpipe.trainer.step.train_step` itself, with FWP's forward/backward."""
        st = self.state
        for step in range(start, stop):
            if before_step:
                before_step(step)
            s, record, path = next(records)
            if s != step:
                raise RuntimeError(f"data stream at step {s}, expected {step}")
            yield step, train_step(st, step, record, path,
                                   forward_backward=lambda routing, feats: self._forward_backward(fw, routing, feats))

    # -- dbp / nested: the five-stage pipeline -------------------------------------------------------------------
    def _run_dbp(self, records, start, stop, before_step, fw, threads):
        st = self.state
        tl = st.timeline
        pc = st.cfg.pipe
        n = stop - start
        halt = threading.Event()
        dual = DualBuffer(st.emb, skip_sync=self.hooks.skip_dual_buffer_sync,
                          replica_own_keys_only=self.hooks.replica_refresh_own_keys_only)
        q_data, q_h2d, q_route = (queue.Queue(maxsize=pc.depth) for _ in range(3))
        q_ready: queue.Queue = queue.Queue(maxsize=1)  # retrieval: at most one batch ahead of compute
        h2d_stream = StageStream(st.device)

        def data_fn(k, _):
            step = start + k
            s, record, path = next(records)
            if s != step:
                raise RuntimeError(f"data stream at step {s}, expected {step}")
            with _span(tl, "prefetch", step):
                return stage_prefetch(st, step, record, path)

        def h2d_fn(k, batch):
            with _span(tl, "h2d", batch.step), h2d_stream.run():
                feats = stage_h2d(st, batch)
                return batch, feats, h2d_stream.handoff()

        def route_fn(k, item):
            batch, feats, ev = item
            t0 = time.perf_counter()
            with _span(tl, "route", batch.step):
                routing = stage_route(st, batch)
            return routing, feats, ev, {"route": (t0, time.perf_counter())}

        def retrieve_fn(k, item):
            routing, feats, ev, when = item
            t0 = dual.retrieve(routing, halt, tl)
            when["retrieve"] = (t0, time.perf_counter())
            return routing, feats, ev, when

        def stage(name, fn, q_in, q_out):
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

        stage_threads = [stage("data", data_fn, None, q_data), stage("h2d", h2d_fn, q_data, q_h2d),
                         stage("route", route_fn, q_h2d, q_route), stage("retrieve", retrieve_fn, q_route, q_ready)]
        self._bind(dict(threads, route=stage_threads[2]))  # before any stage thread can issue
        for t in stage_threads:
            t.start()
        active = None
        finished = False

        synced = None  # the active batch, already synced into the next one, whose buffer is still held

        def take(step, early=False):
            """Batch ``step`` from the retrieval stage (its buffer gathered), then the DBP sync from the active batch:
            after it the buffer is final (the invariant of dual_buffer.py) and the window is frozen. ``early``: the
            active batch's buffer and permit are kept until :func:`release_synced` (so the retrieval of the batch
            after ``step`` starts when ``step`` starts computing, as without ``early``)."""
            nonlocal active, synced
            t0 = time.perf_counter()
            item = _get(q_ready, halt)
            t1 = time.perf_counter()
            if isinstance(item, _Failure):
                raise RuntimeError(f"pipeline stage {item.stage!r} failed at or before step {step}: "
                                   f"{type(item.exc).__name__}: {item.exc}") from item.exc
            routing, feats, ev, when = item
            self._account_wait(step, t0, t1, when)
            if routing.batch.step != step:
                raise RuntimeError(f"pipeline delivered step {routing.batch.step}, expected {step}")
            wait_handoff(st.device, ev, [t for f in feats for t in f.values()])
            if active is not None:
                with _span(tl, "dbp.sync", step):
                    dual.sync(active, routing)  # the DBP invariant: see dual_buffer.py
                if early:
                    synced = active
                else:
                    dual.release(active)
                active = None
            return routing, feats

        def release_synced():
            nonlocal synced
            if synced is not None:
                dual.release(synced)
                synced = None

        try:
            nxt = None
            for step in range(start, stop):
                if before_step:
                    before_step(step)
                routing, feats = nxt if nxt is not None else take(step)
                nxt = None
                self._hook_sleep()
                with _span(tl, "fwd_bwd", step):
                    release_synced()  # batch step-1's buffer: the retrieval of step+1 starts as step computes
                    loss = self._forward_backward(fw, routing, feats)
                with _span(tl, "update", step):
                    # dense all-reduce in flight while the owner's sparse update runs (disjoint tensors)
                    red = update_begin(st, loss, async_op=True)
                    st.emb.update(routing, release=False)
                active = routing  # its updated rows stay until synced into batch step+1's buffer
                if fw is not None and step + 1 < stop and not self.hooks.update_per_micro_batch:
                    # the next batch's buffer is final once synced: its first embedding All2Alls start now,
                    # while this batch's dense all-reduce and AdamW finish
                    nxt = take(step + 1, early=True)
                    fw.prime(nxt[0], st.cfg.pipe.boundary_prime)
                with _span(tl, "update.dense", step):
                    loss = update_dense(st, red)
                yield step, loss
            release_synced()
            if active is not None:
                dual.hand_over(active, None)
                active = None
            finished = True
        finally:
            self.rows_synced += dual.rows_synced
            if not finished:
                halt.set()
            for t in stage_threads:
                t.join(timeout=None if finished else 5.0)
