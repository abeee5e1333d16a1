"""The owner's compute: retrieval of a batch's rows, pooling them into the embedding payload, the row-wise AdaGrad
update, and the dual-buffer sync (the copies DBP makes between two batches' buffers).

Where the update writes is decided once per store and batch, at retrieval (:func:`write_path`):

    IN_STORE                the synchronous schedules on CPU (nothing else touches the store during the batch): no
                            buffer; the forward reads the store and the update writes it in place
    BUFFER_UPDATE_IN_STORE  DBP with host-resident buffers (CPU, ``embedding.dbp_update_in_store``): a weights-only
                            buffer serves the forward; the update writes the store in place (no write-back)
    BUFFER                  otherwise (accelerators, 2D-SP, the memory-mapped tier): weights and AdaGrad state in
                            the buffer, updated there, then written back to the store

How it sums is decided by the plan: the *bag update* (:func:`nestpipe.kernels.adagrad_bags`, ``OwnerPlan.bags``) or
the *entry update* (:func:`~nestpipe.trainer.embedding.store.apply_adagrad`). Every write path reads the same
values and does the same arithmetic (the rows read in the store equal the buffer's: the DBP invariant), so all give
bitwise the same rows.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from nestpipe import kernels
from nestpipe.trainer.embedding.routing import BUFFER, BUFFER_UPDATE_IN_STORE, IN_STORE, OwnerPlan, Routing
from nestpipe.trainer.embedding.store import RowStore, apply_adagrad
from nestpipe.utils.timing import StageTimer

# a span of the run's trace around a memory-mapped store's gather or write-back: (store, stage, step) -> context
TierSpan = Callable[[RowStore, str, str, int], contextlib.AbstractContextManager]


def write_path(synchronous: bool, host_in_place: bool, dbp_update_in_store: bool, in_dram: bool) -> str:
    """The one rule for where a store's update writes. ``host_in_place``: the rows live in host memory and no
    replica synchronisation needs the pre- and post-update rows in a buffer; a tiered store is only read and
    written through gather and write-back."""
    if not (host_in_place and in_dram):
        return BUFFER
    if synchronous:
        return IN_STORE
    return BUFFER_UPDATE_IN_STORE if dbp_update_in_store else BUFFER


def retrieve(routing: Routing, stores: Dict[str, RowStore], paths: Dict[str, str], device: torch.device,
             dtype: torch.dtype, timer: StageTimer, tier_span: TierSpan,
             copy: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
             host_buffer: Optional[Callable[..., Optional[torch.Tensor]]] = None) -> None:
    """Make every store's batch rows readable by the forward (``src`` at ``fwd_idx[i]``) and allocate the batch's
    gradient payload: the store itself (``IN_STORE``), else a fresh buffer gathered from the store (weights, and
    the AdaGrad state where the update writes the buffer), brought to the device by ``copy`` (default
    ``.to(device)``; the DBP retrieval's stream copy, non-blocking from pinned memory on an accelerator). A DRAM
    store gathers straight into ``host_buffer(shape, dtype)`` where it gives memory (pinned, on an accelerator)."""
    copy = copy or (lambda t: t.to(device))
    with timer.span("retrieve", routing.batch.step):
        for st, o in routing.own.items():
            store = stores[st]
            o.write_path = paths[st]
            if o.write_path == IN_STORE:
                if store.num_materialized < store.num_rows:
                    store.ensure_materialized(o.rows)
                o.src = store.weight
                # every pair's store row: the bag update's rows, split by micro-batch (computed once)
                o.fwd_idx = (list(torch.split(o.bag_rows, [len(e) for e in o.pair_entry])) if o.bags
                             else [torch.from_numpy(o.rows_all[e]) for e in o.pair_entry])
                continue
            with_state = o.write_path == BUFFER
            out = None
            if host_buffer is not None and store.in_dram:
                n = len(o.rows)
                out = (host_buffer((n, store.dim), store.weight.dtype),
                       host_buffer((n,), store.state.dtype) if with_state else None)
                out = out if out[0] is not None else None
            with tier_span(store, "retrieve.gather", "tier.gather", routing.batch.step):
                w, s_ = (store.gather(o.rows, with_state=with_state, out=out) if out is not None
                         else store.gather(o.rows, with_state=with_state))
            o.buf_w, o.buf_s = copy(w), copy(s_) if s_ is not None else None
            o.src = o.buf_w
            o.fwd_idx = [torch.from_numpy(p) for p in o.fwd_pos]
        total = routing.grad_mb_off[-1] + sum(routing.send_splits[-1]) if routing.send_splits else 0
        routing.grad_payload = torch.zeros(total, dtype=dtype, device=device)


def pool(routing: Routing, i: int, out: torch.Tensor) -> None:
    """Micro-batch ``i``'s payload: rows (unique-based) or partial pools (reduction-based) from the frozen rows,
    for every requester in rank order, written into ``out`` (one kernel call per store). Reads the rows only."""
    for o in routing.own.values():
        if len(o.fwd_out[i]):
            kernels.pool_segments(o.src, o.fwd_idx[i], o.fwd_offsets[i] if o.pooled else None, out, o.fwd_out[i])


def pool_all(routing: Routing, out: torch.Tensor) -> None:
    """:func:`pool` of every micro-batch with one kernel call per store: the micro-batches' payloads back to back
    in ``out`` (micro-batch ``i`` at ``grad_mb_off[i]``, the gradient payload's layout). Same sums."""
    N = len(routing.batch.micro)
    for o in routing.own.values():
        outs = [routing.grad_mb_off[i] + o.fwd_out[i] for i in range(N) if len(o.fwd_out[i])]
        if not outs:
            continue
        index = torch.cat([o.fwd_idx[i] for i in range(N) if len(o.fwd_out[i])])
        offsets = o.bag_offsets if o.bags and o.pooled else None  # planned: the same concatenated CSR
        if o.pooled and offsets is None:
            counts = torch.cat([o.fwd_offsets[i].diff() for i in range(N) if len(o.fwd_out[i])])
            offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
            torch.cumsum(counts, 0, out=offsets[1:])
        # the segments' payload offsets are the bag update's gradient offsets (same layout) where it is planned
        kernels.pool_segments(o.src, index, offsets, out, o.bag_grad if o.bags else torch.cat(outs))


@torch.no_grad()
def update_store(store: RowStore, o: OwnerPlan, g: torch.Tensor, lr: float, eps: float, momentum_scale: float,
                 step: int, tier_span: TierSpan, defer_write_back: bool = False) -> bool:
    """One row-wise AdaGrad step on every row of ``store`` the batch touched, summed as the plan says (bags or
    entries), written where :attr:`OwnerPlan.write_path` says. The rows are in the store when it returns, except
    with ``defer_write_back`` where the buffer was updated: then it returns True and the caller writes the buffer
    back (:func:`write_back`, or through the write-back stream)."""
    if o.bags and len(o.bag_grad) == 0:
        return False
    if o.updates_in_store:
        with store.lock:
            _adagrad(o, store.weight, store.state, True, g, lr, eps, momentum_scale, store.dim)
        return False
    _adagrad(o, o.buf_w, o.buf_s, False, g, lr, eps, momentum_scale, store.dim)
    if defer_write_back:
        return True
    write_back(store, o.rows, o.buf_w, o.buf_s, step, tier_span)
    return False


def write_back(store: RowStore, rows: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, step: int,
               tier_span: TierSpan) -> None:
    """A batch's updated rows of ``store`` (buffer order: ``rows``) into the store."""
    with tier_span(store, "update.write_back", "tier.write_back", step):
        store.write_back(rows, weight, state)


def _adagrad(o: OwnerPlan, weight: torch.Tensor, state: torch.Tensor, in_store: bool, g: torch.Tensor, lr: float,
             eps: float, momentum_scale: float, dim: int) -> None:
    """The arithmetic, on store rows (``in_store``) or buffer positions (the sorted distinct rows: a monotone
    renumbering, so the arithmetic is the same)."""
    if o.bags:
        positions = o.bag_rows if in_store else torch.from_numpy(np.concatenate(o.fwd_pos))
        # bag_rows index rows_all, which routing.owner_plan bounded to the store's rows
        kernels.adagrad_bags(weight, state, positions, o.bag_offsets, _bag_gradients(o, g, dim), lr, eps,
                             indices_checked=in_store)
        return
    o.dedup()
    positions = o.rows if in_store else torch.arange(len(o.rows), dtype=torch.int64)
    # the fused kernel sums each row's entries and pairs in order: no per-entry gradient is materialised
    apply_adagrad(weight, state, positions, g, lr, eps, momentum_scale, (o.seg_order, o.seg_offsets), o.inv,
                  (o.entry_offsets, o.pair_src))


def _bag_gradients(o: OwnerPlan, g: torch.Tensor, dim: int) -> torch.Tensor:
    """Each bag's gradient row, from the payload at its element offset: the bags are runs of back-to-back rows
    (a (requester, slot) block each), so the rows are one view or the concatenation of a few; else gathered
    from the payload's length-dim windows (blocks of different dims share it)."""
    runs = o.bag_grad_runs
    if runs is not None and len(runs) == 1:
        return g[runs[0][0]:runs[0][0] + runs[0][1] * dim].view(-1, dim)
    if runs is not None and len(runs) <= 64:
        return torch.cat([g[at:at + n * dim].view(n, dim) for at, n in runs])
    return g.unfold(0, dim, 1).index_select(0, o.bag_grad)


@torch.no_grad()
def sync_dual_buffer(active: Routing, prefetch: Routing, stores: Dict[str, RowStore]) -> int:
    """DBP consistency: copy the updated rows of keys(t) ∩ keys(t+1) into the prefetch buffer (batch t+1),
    weights and AdaGrad state, from the active buffer (batch t, updated there) or, when batch t was updated in
    the store (``BUFFER_UPDATE_IN_STORE``; its buffers hold weights only), from the store. Returns the number of
    rows copied.

    Invariant enforced here: when batch t+1's buffer serves its first request, every row in it equals the DRAM
    store's row after batch t's write-back. Rows of t+1 not in t were not changed by t (and retrieval of t+1
    started after batch t-1's write-back, see :class:`~nestpipe.trainer.pipeline.dual_buffer.DualBuffer`);
    rows in both are overwritten here with the exact updated values. Copies are bitwise."""
    n = 0
    for st, a in active.own.items():
        p = prefetch.own[st]
        if a.buf_w is None or p.buf_w is None:
            raise RuntimeError(f"table {st}: dual-buffer sync needs the updated active and the retrieved "
                               "prefetch buffer")
        if a.updates_in_store:  # the updated rows are in the store (the active buffer holds the old ones)
            store = stores[st]
            with store.lock:
                n += kernels.dual_buffer_sync_rows(a.rows, p.rows, store.weight, None, p.buf_w, None,
                                                   from_store=True)  # weights only: the state stays in the store
        else:
            n += kernels.dual_buffer_sync_rows(a.rows, p.rows, a.buf_w, a.buf_s, p.buf_w, p.buf_s)
    return n


def release(routing: Routing) -> None:
    """Free a batch's buffers (after its update and, in DBP, after the sync into the next batch). A write-back
    still pending on the batch (nobody took it, :attr:`Routing.pending_write_back`) is finished first: it is
    never lost."""
    if routing.pending_write_back is not None:
        routing.pending_write_back.finish()
        routing.pending_write_back = None
    for o in routing.own.values():
        o.buf_w = o.buf_s = o.src = o.fwd_idx = None
    routing.grad_payload = None


__all__ = ["IN_STORE", "BUFFER", "BUFFER_UPDATE_IN_STORE", "write_path", "retrieve", "pool", "pool_all",
           "update_store", "write_back", "sync_dual_buffer", "release"]
