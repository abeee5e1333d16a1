"""FWP: the Frozen-Window Pipeline inside one batch.

Between a batch's retrieval and its update the owner's buffer is frozen (no update inside the window), so the
embedding All2All of micro-batch i+1 does not depend on micro-batch i and may run while i computes. Per batch of N
micro-batches (``e i``: micro-batch i's owner send + embedding All2All on group ``embed``; ``g i``: its gradient
All2All on group ``grad``, received into micro-batch i's slice of the batch's gradient payload), default layout, one thread per exchange group:

    embed-comm:  e0 (primed)    | e1                  | e2                  | e3 ...
    compute:          wait(e0) dense(0)   | wait(e1) dense(1)   | wait(e2) dense(2)   | ...   wait(gN-1)
    grad-comm:                            | g0                  | g1                  | ...   gN-1

After dense(i) the compute thread queues e(i+2) and then g(i): the embedding All2All of micro-batch i+1 was queued
before dense(i) began and overlaps it, and the gradient All2All of i-1 overlaps dense(i). The first embedding
All2All(s) of batch t+1 (``pipe.boundary_prime``, default 1) are started by the scheduler (:meth:`prime`) as soon as
t+1's buffer is final, while batch t's dense all-reduce and AdamW finish; the others are queued as the window
advances (e1 when micro-batch 0 starts).

Alternative layout (``pipe.comm_threads = 1``): one ``comm`` thread issues on both groups in the queue order
above (e0 e1 | e2 g0 | e3 g1 | ...), the same on every rank, so blocking collectives on two groups cannot deadlock
and it is still exactly one issuing thread per group; the embeddings micro-batch i+1 needs go before gradient i-1.
Two threads stay the default: on a CPU host an All2All's time is dominated by waiting (for the peer rank, for the
GIL), not by the link's bytes, and two threads overlap that waiting where one issues the collectives in turn.

Each micro-batch's gradient lands in its own slice of the batch's gradient payload and the update sums every entry's
micro-batches in index order, the order the synchronous step uses, whatever order the All2Alls completed in; dense
gradients accumulate on the compute thread in the same
order. Hence the batch's gradient and update are bitwise those of ``--pipeline off`` in both layouts. Only the
first embedding All2All (when not primed) and the last gradient All2All are exposed.

The ``update_per_micro_batch`` parameter (a negative control only tests pass) applies the full update after every micro-batch but the
last (and stops prefetching the next micro-batch's rows so it sees the update): the window is no longer frozen.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import Callable, Dict, List, Optional

import torch

from nestpipe.trainer.embedding.collection import Routing
from nestpipe.trainer.step import StepState, dense_forward_backward

# embedding All2Alls in flight ahead of the micro-batch being computed: micro-batch i+1's during dense(i)
LOOKAHEAD = 1


class CommWorker:
    """One thread that runs jobs (collectives on one process group, plus owner work) in submission order."""

    def __init__(self, name: str):
        self.name = name
        self._jobs: "queue.Queue" = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the compute thread
                fut.set_exception(e)

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fut, fn, args))
        return fut

    def close(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        self.thread.join(timeout)


class FrozenWindow:
    def __init__(self, state: StepState, embed_worker: CommWorker, grad_worker: CommWorker,
                 update_fn: Optional[Callable[[Routing, torch.Tensor], float]] = None,
                 update_per_micro_batch: bool = False):
        self.state = state
        self.embed_worker = embed_worker
        self.grad_worker = grad_worker
        self.update_fn = update_fn  # only for the per-micro-batch-update negative control
        self.update_per_micro_batch = update_per_micro_batch  # negative control: the window is not frozen
        self._primed: Dict[int, Dict[int, concurrent.futures.Future]] = {}  # step -> micro-batch -> future

    def prime(self, routing: Routing, count: Optional[int] = None) -> None:
        """Start the batch's first ``count`` embedding All2Alls now (default: micro-batches 0..lookahead). Allowed
        from the moment the batch's buffer is final (retrieved and dual-buffer synced) -- the window is frozen from
        there on; the scheduler calls it while the previous batch's dense all-reduce is still in flight."""
        n = len(routing.batch.micro)
        k = LOOKAHEAD + 1 if count is None else max(1, int(count))
        k = 1 if self.update_per_micro_batch else min(n, k)
        t = time.perf_counter()
        self._primed[routing.batch.step] = {i: self.embed_worker.submit(self._embed_job, routing, i) for i in range(k)}
        # an instant of the trace whose micro-batch field is the number of All2Alls started
        self.state.timer.record("prime", routing.batch.step, len(self._primed[routing.batch.step]), t, t)

    # -- jobs on the comm threads ----------------------------------------------------------------------------
    def _embed_job(self, routing: Routing, i: int) -> torch.Tensor:
        st = self.state
        with st.timer.span("embed.a2a", routing.batch.step, i):
            send = st.emb.embed_send(routing, i)
            return st.emb.embed_exchange(routing, i, send, st.groups.get("embed")).wait()

    def _grad_job(self, routing: Routing, i: int, g: torch.Tensor) -> None:
        st = self.state
        with st.timer.span("grad.a2a", routing.batch.step, i):
            st.emb.grad_exchange(routing, i, g, st.groups.get("grad")).wait()

    def _wait(self, fut: concurrent.futures.Future, step: int, mb: int):
        with self.state.timer.span("wait.comm", step, mb):
            return fut.result()

    # -- the window ------------------------------------------------------------------------------------------
    def forward_backward(self, routing: Routing, feats: List[Dict[str, torch.Tensor]]) -> torch.Tensor:
        """All micro-batches of one batch; returns the loss sum / (B * W) like the synchronous step. On return
        every gradient All2All has completed and been accumulated (the update may run)."""
        n = len(routing.batch.micro)
        step = routing.batch.step
        if step not in self._primed:
            self.prime(routing)
        pending: Dict[int, concurrent.futures.Future] = self._primed.pop(step)
        grads: List[concurrent.futures.Future] = []
        total = torch.zeros((), dtype=torch.float64)
        for i in range(n):
            self._start_embedding(pending, routing, i + LOOKAHEAD)  # overlaps dense(i)
            recv = self._wait(pending.pop(i), step, i)
            loss_i, grad_i = self._dense(routing, i, recv, feats[i])
            total += loss_i
            # queued before gradient i: on one comm thread embedding i+2 goes first and overlaps dense(i+1)
            self._start_embedding(pending, routing, i + 1 + LOOKAHEAD)
            grads.append(self.grad_worker.submit(self._grad_job, routing, i, grad_i))  # overlaps dense(i+1)
            if self.update_per_micro_batch and i + 1 < n:
                self._update_inside_window(routing, i, loss_i, grads, pending)  # the negative control
        for f in grads:
            self._wait(f, step, n - 1)
        return total

    def _start_embedding(self, pending: Dict[int, concurrent.futures.Future], routing: Routing, j: int) -> None:
        """Submit micro-batch ``j``'s embedding All2All unless it is past the batch or already started (primed at
        the boundary, or by an earlier call)."""
        if j < len(routing.batch.micro) and j not in pending and not self.update_per_micro_batch:
            pending[j] = self.embed_worker.submit(self._embed_job, routing, j)

    def _dense(self, routing: Routing, i: int, recv: torch.Tensor, feats: Dict[str, torch.Tensor]):
        """Micro-batch ``i``'s dense forward/backward on its received embeddings: (loss, embedding gradient)."""
        st = self.state
        with st.timer.span("dense", routing.batch.step, i):
            emb_out, leaf = st.emb.embed_unpack(routing, i, recv)
            loss_i = dense_forward_backward(st, routing, emb_out, feats)
            grad_i = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        return loss_i, grad_i

    def _update_inside_window(self, routing: Routing, i: int, loss_i: torch.Tensor,
                              grads: List[concurrent.futures.Future], pending: Dict[int, concurrent.futures.Future]):
        """The ``update_per_micro_batch`` testing hook: apply the update after micro-batch ``i``, so the window is
        NOT frozen (must break the equality with ``off``)."""
        for f in grads:
            self._wait(f, routing.batch.step, i)
        grads.clear()
        self.update_fn(routing, loss_i)
        pending[i + 1] = self.embed_worker.submit(self._embed_job, routing, i + 1)
