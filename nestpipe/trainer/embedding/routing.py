"""Routing plans (host NumPy, no communication): who sends which key where, and what every payload holds.

One batch's key routing (:meth:`~nestpipe.trainer.embedding.collection.ShardedEmbeddingCollection.input_dist`):

1. requester, per slot (:func:`requester_plan`): each key's owner and local row; the rows to send each owner
   (stable owner order); per micro-batch the lists its exchange kind sends -- positions of the micro-batch's unique
   keys (unique-based) or ``[count per sample..., entries...]`` (reduction-based);
2. requester (:func:`route_payload`): per destination, the fused counts ``[keys per slot] [list length per
   (micro-batch, slot)] [samples per micro-batch]`` and the payload (the same lists concatenated in that order);
3. the two routing All2Alls (counts, then payload) -- :mod:`.exchange`, not here;
4. owner (:func:`owner_routing`): parse what every requester sent, in (requester, slot) order (:func:`parse_route`),
   size the embedding and gradient payloads (:func:`payload_splits`) and build each store's
   :class:`OwnerPlan` (:func:`owner_plan`).

Every rank builds the same slots in the same order (:class:`~.slots.SlotLayout`), so both sides of each All2All
agree on every offset. Plans depend on keys only, never on parameter values, so they may be built any number of
batches ahead.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from nestpipe import kernels
from nestpipe.trainer.embedding.batch import PreparedBatch
from nestpipe.trainer.embedding.reduction_based import ReductionBased
from nestpipe.trainer.embedding.replicated import owner_bounds, owner_order
from nestpipe.trainer.embedding.slots import SlotLayout
from nestpipe.trainer.embedding.unique_based import UniqueBased


@dataclasses.dataclass
class RequesterPlan:
    """Requester-side plan of one slot for one batch."""

    dest: np.ndarray
    pos_in_dest: np.ndarray
    send_rows: List[np.ndarray]  # per owner: local rows
    mb_lists: List[List[np.ndarray]]  # [micro-batch][owner] int64 lists sent in the routing payload
    unperm: List[Optional[torch.Tensor]]  # unique-based: per micro-batch gather into mb_unique order


# Where an owner's update writes (set by the retrieval, read by the update and the dual-buffer sync):
IN_STORE = "store"  # no buffer: the batch reads its rows from the store and updates them there (synchronous, CPU)
BUFFER_UPDATE_IN_STORE = "buffer+store"  # a weights-only host buffer serves the forward; the update is in the store
BUFFER = "buffer"  # the buffer (weights + AdaGrad state) is updated, then written back to the store


@dataclasses.dataclass
class OwnerPlan:
    """Owner-side plan of one store for one batch.

    An *entry* is one (requester, slot, key) the owner serves; a *pair* is one use of an entry by one output
    segment of one micro-batch (reduction-based: a (sample, entry) pair of a bag; unique-based: one requested row).
    A *bag* is one output segment: the pairs of one (micro-batch, requester, sample) (reduction-based) or a single
    pair (unique-based). Bags are numbered in (micro-batch, requester, slot, segment) order whatever the schedule.

    The distinct rows of the batch (:attr:`rows`) and everything numbered by them are computed on first use
    (:meth:`dedup`): the buffered schedules need them (retrieval, dual-buffer sync), the in-store path with the bag
    update (:attr:`bags`) never does.
    """

    rows_all: np.ndarray  # [entries] local store row of every entry, in entry order
    pair_entry: List[np.ndarray]  # [i] entry of every pair of micro-batch i, grouped by segment
    base: Dict[Tuple[int, str], int]  # (requester, slot) -> first entry
    pooled: bool = False  # reduction-based (segments sum their pairs) or unique-based (one pair per segment)
    # forward, per micro-batch i: pairs grouped by output segment, ascending pair order within a segment
    fwd_offsets: Optional[List[Optional[torch.Tensor]]] = None  # [i] CSR over segments (pooled only)
    fwd_out: Optional[List[torch.Tensor]] = None  # [i] element offset of every segment in i's payload
    upd_src: Optional[List[np.ndarray]] = None  # [i] element offset in the gradient payload of every pair
    # the bag update (``nestpipe.kernels.adagrad_bags``): every bag of the batch, its store rows and the element
    # offset of its gradient row in the batch's gradient payload; unset where the entry update is used
    bags: bool = False
    bag_rows: Optional[torch.Tensor] = None
    bag_offsets: Optional[torch.Tensor] = None
    bag_grad: Optional[torch.Tensor] = None
    bag_grad_runs: Optional[List[Tuple[int, int]]] = None  # bag_grad as runs of back-to-back rows: (offset, rows)
    num_store_rows: int = 0
    # set by the retrieval (owner_compute.retrieve): where the update writes (IN_STORE, BUFFER_UPDATE_IN_STORE,
    # BUFFER), the batch's buffer, and where the forward reads rows: ``src`` at ``fwd_idx[i]``
    write_path: Optional[str] = None
    buf_w: Optional[torch.Tensor] = None
    buf_s: Optional[torch.Tensor] = None
    src: Optional[torch.Tensor] = None
    fwd_idx: Optional[List[torch.Tensor]] = None
    # computed by dedup()
    _rows: Optional[torch.Tensor] = None  # unique local rows touched by the batch (sorted)
    inv: Optional[torch.Tensor] = None  # [entries] row (position in ``rows``) of every entry, in the update's numbering
    fwd_pos: Optional[List[np.ndarray]] = None  # [i] buffer position (row in ``rows``) of every pair
    # the entry update: row i's entries are seg_order[seg_offsets[i]:seg_offsets[i + 1]] (renumbered by row, so
    # seg_order is the identity); every entry's pairs over all micro-batches in (micro-batch, pair) order: the
    # element offset of the pair's gradient row in the batch's gradient payload (:attr:`Routing.grad_payload`)
    seg_order: Optional[torch.Tensor] = None
    seg_offsets: Optional[torch.Tensor] = None
    entry_offsets: Optional[torch.Tensor] = None
    pair_src: Optional[torch.Tensor] = None

    @property
    def updates_in_store(self) -> bool:
        """Whether the update writes the store in place (no write-back); the dual-buffer sync then reads the
        updated rows from the store."""
        return self.write_path in (IN_STORE, BUFFER_UPDATE_IN_STORE)

    @property
    def rows(self) -> torch.Tensor:
        if self._rows is None:
            self.dedup()
        return self._rows

    def dedup(self) -> None:
        """The batch's distinct rows and the numbering by them (one stable sort of the entries' rows, which also
        lists each row's entries in ascending entry order: the entry update sums them in that order). A counting
        sort over the store's rows when they are few against the entries (linear; numpy's stable argsort of int64
        is a merge sort), else numpy's argsort."""
        if self._rows is not None:
            return
        rows_all = self.rows_all
        order, uniq, starts, inv_sorted, inv = kernels.dedup_rows(rows_all, self.num_store_rows)
        self._rows = torch.from_numpy(uniq.astype(np.int64, copy=False))
        self.inv = torch.from_numpy(inv_sorted)
        self.fwd_pos = [inv[e] for e in self.pair_entry]
        if self.bags:
            return
        # For the entry update, entries are renumbered in row order (entry ``order[k]`` becomes ``k``: each row's
        # entries stay in ascending entry order) and every entry's pairs are grouped by a stable sort, so they stay
        # in (micro-batch, pair) order. The update then reads its index arrays sequentially instead of through an
        # indirection per entry; the sums and their order are unchanged.
        pe = np.concatenate(self.pair_entry) if self.pair_entry else np.zeros(0, np.int64)
        ps = np.concatenate(self.upd_src) if self.upd_src else np.zeros(0, np.int64)
        renum = np.empty(len(order), dtype=np.int64)
        renum[order] = np.arange(len(order), dtype=np.int64)
        key = torch.from_numpy(renum[pe])
        p_order, self.entry_offsets = kernels.csr_by_segment(key, len(rows_all))
        self.pair_src = torch.from_numpy(ps[p_order.numpy()])
        self.seg_order = torch.arange(len(order), dtype=torch.int64)
        self.seg_offsets = torch.from_numpy(np.append(starts, len(rows_all)).astype(np.int64))


@dataclasses.dataclass
class Routing:
    """Everything one batch's exchange needs, produced by the key routing."""

    batch: PreparedBatch
    req: Dict[str, RequesterPlan]
    own: Dict[str, OwnerPlan]
    own_b: List[List[int]]  # [micro-batch][requester] sample count
    send_splits: List[List[int]]  # per micro-batch, elements owner -> requester r
    recv_splits: List[List[int]]
    neg_inv: Optional[torch.Tensor] = None
    # owner: the gradient All2All payloads of all micro-batches, concatenated (micro-batch i at grad_mb_off[i]);
    # allocated by the retrieval, written by the gradient exchange, summed by the update
    grad_mb_off: List[int] = dataclasses.field(default_factory=list)
    grad_payload: Optional[torch.Tensor] = None
    # owner: the update's write-back still on its way to the store (a PendingWriteBack, DBP on a device stream):
    # finished by the retrieval stage before its next gather (pipeline.dual_buffer), else when the batch is released
    pending_write_back: Optional[object] = None


@dataclasses.dataclass
class Received:
    """What the owner received in the routing All2All, parsed in (requester, slot) order (:func:`parse_route`)."""

    got: np.ndarray  # the whole payload
    entries: Dict[str, List[np.ndarray]]  # store -> per (requester, slot): the rows asked for
    base: Dict[str, Dict[Tuple[int, str], int]]  # store -> (requester, slot) -> its first entry
    raw_mb: List[List[Dict[str, np.ndarray]]]  # [i][r][slot]: the list requester r sent for micro-batch i
    raw_at: List[List[Dict[str, int]]]  # [i][r][slot]: where that list starts in ``got``
    own_b: List[List[int]]  # [i][r]: requester r's sample count of micro-batch i


@dataclasses.dataclass
class PayloadSplits:
    """The embedding and gradient payloads' layout on this rank (:func:`payload_splits`)."""

    send: List[List[int]]  # [i][r] elements owner -> requester r (the embedding All2All)
    recv: List[List[int]]  # [i][r] elements received from owner r
    block_off: List[Dict[Tuple[int, str], int]]  # [i] (requester, slot) -> element offset in i's payload
    grad_mb_off: List[int]  # [i] micro-batch i's offset in the batch's gradient payload


# -- requester ------------------------------------------------------------------------------------------------------
def requester_plan(layout: SlotLayout, batch: PreparedBatch, slot: str) -> RequesterPlan:
    """Requester side of one slot: each key's owner and row, the keys to send to each owner (stable owner
    order), and per micro-batch the lists the exchange kind sends (unique positions or pooled entries)."""
    W = layout.world
    keys = layout.slot_keys(batch, slot)
    pl = layout.placements[layout.store_of(slot)]
    dest, local = pl.owner_and_row(keys)
    one = pl.owner_ranks[0] if len(pl.owner_ranks) == 1 else None
    if one is not None:
        # a table-wise layout: every key goes to one owner, the stable owner sort is the identity
        pos_in_dest = np.arange(len(keys), dtype=np.int64)
        send_rows = [local if r == one else local[:0] for r in range(W)]
    else:
        order = owner_order(dest, W)
        bounds = owner_bounds(dest, W)
        pos_in_dest = np.empty(len(keys), dtype=np.int64)
        pos_in_dest[order] = np.arange(len(keys)) - np.repeat(bounds[:-1], np.diff(bounds))
        send_rows = [local[order[bounds[r]:bounds[r + 1]]] for r in range(W)]
    mb_lists, unperm = [], []
    t = layout.table_of(slot)
    for mbd in batch.micro:
        if layout.exchange(slot) == "unique":
            mk = np.arange(len(keys), dtype=np.int64) if layout.is_negatives(slot) else mbd.mb_keys[t]
            lists, up = UniqueBased.plan(dest, pos_in_dest, mk, W)
            unperm.append(torch.from_numpy(up).to(layout.device))
        else:
            lists = ReductionBased.plan(dest, pos_in_dest, mbd.value_key[t], mbd.value_sample[t], W,
                                        one, num_samples=len(mbd.samples), owners=pl.owner_ranks,
                                        lengths=mbd.lengths[t])
            unperm.append(None)
        mb_lists.append(lists)
    return RequesterPlan(dest, pos_in_dest, send_rows, mb_lists, unperm)


def route_payload(layout: SlotLayout, batch: PreparedBatch, req: Dict[str, RequesterPlan]
                  ) -> Tuple[np.ndarray, List[np.ndarray]]:
    """Per destination rank: the fused counts ([keys per slot] [list length per (micro-batch, slot)] [samples
    per micro-batch]) and the payload (the same lists concatenated in that order)."""
    W, S, N = layout.world, len(layout.slots), len(batch.micro)
    counts = np.zeros((W, S + N * S + N), dtype=np.int64)
    payload = []
    for r in range(W):
        parts = []
        for si, slot in enumerate(layout.slots):
            counts[r, si] = len(req[slot].send_rows[r])
            parts.append(req[slot].send_rows[r])
        for i, mbd in enumerate(batch.micro):
            for si, slot in enumerate(layout.slots):
                lst = req[slot].mb_lists[i][r]
                counts[r, S + i * S + si] = len(lst)
                parts.append(lst)
            counts[r, S + N * S + i] = len(mbd.samples)
        payload.append(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
    return counts, payload


def payload_array(layout: SlotLayout, batch: PreparedBatch, payload: List[np.ndarray]) -> np.ndarray:
    """The routing payload as one array of the routing dtype (int32 where the manifest bounds every value)."""
    flat = np.concatenate(payload)
    if layout.route_dtype == np.int32 and len(flat) and int(flat.max()) >= 2 ** 31:
        raise RuntimeError(f"step {batch.step}: a routing value ({int(flat.max())}) exceeds int32 although the "
                           f"manifest bounds it (batch size {layout.batch_size})")
    return flat.astype(layout.route_dtype, copy=False)


def payload_receive_sizes(layout: SlotLayout, batch: PreparedBatch, got_counts: np.ndarray) -> List[int]:
    """Elements of the routing payload each requester sends this owner, from the counts it received."""
    S, N = len(layout.slots), len(batch.micro)
    return [int(x) for x in got_counts[:, :S + N * S].sum(1)]


# -- owner ----------------------------------------------------------------------------------------------------------
def owner_routing(layout: SlotLayout, batch: PreparedBatch, req: Dict[str, RequesterPlan], got_counts: np.ndarray,
                  got: np.ndarray, bags: bool, negatives: bool) -> Routing:
    """The batch's :class:`Routing` from the requester's plans and what this rank received as owner."""
    rcv = parse_route(layout, batch, got_counts, got)
    splits = payload_splits(layout, batch, req, rcv)
    own = {st: owner_plan(layout, st, rcv, splits, bags) for st in layout.store_table}
    neg_inv = None
    if negatives and batch.negatives is not None:
        _, inv = np.unique(batch.negatives, return_inverse=True)
        neg_inv = torch.from_numpy(inv.astype(np.int64)).to(layout.device)
    return Routing(batch, req, own, rcv.own_b, splits.send, splits.recv, neg_inv, splits.grad_mb_off)


def parse_route(layout: SlotLayout, batch: PreparedBatch, got_counts: np.ndarray, got: np.ndarray) -> Received:
    """Owner side, in (requester, slot) order: the rows every requester asked for per store, the per-micro-batch
    lists and the requesters' micro-batch sample counts."""
    W, S, N = layout.world, len(layout.slots), len(batch.micro)
    stores = list(layout.store_table)
    cursor = 0
    rcv = Received(got, {s: [] for s in stores}, {s: {} for s in stores},
                   [[{} for _ in range(W)] for _ in range(N)], [[{} for _ in range(W)] for _ in range(N)],
                   [[0] * W for _ in range(N)])
    n_entries = {s: 0 for s in stores}
    for r in range(W):
        for si, slot in enumerate(layout.slots):
            st = layout.store_of(slot)
            k = int(got_counts[r, si])
            rcv.base[st][(r, slot)] = n_entries[st]
            rcv.entries[st].append(got[cursor:cursor + k])
            n_entries[st] += k
            cursor += k
        for i in range(N):
            for si, slot in enumerate(layout.slots):
                k = int(got_counts[r, S + i * S + si])
                rcv.raw_mb[i][r][slot] = got[cursor:cursor + k]
                rcv.raw_at[i][r][slot] = cursor
                cursor += k
            rcv.own_b[i][r] = int(got_counts[r, S + N * S + i])
    return rcv


def payload_splits(layout: SlotLayout, batch: PreparedBatch, req: Dict[str, RequesterPlan],
                   rcv: Received) -> PayloadSplits:
    """Per micro-batch: the embedding All2All's send and receive split sizes (elements), each (requester, slot)
    block's offset in the owner's payload, and each micro-batch's offset in the gradient buffer."""
    W, N, me = layout.world, len(batch.micro), layout.rank
    send = [[0] * W for _ in range(N)]
    recv = [[0] * W for _ in range(N)]
    block_off: List[Dict[Tuple[int, str], int]] = []
    for i, mbd in enumerate(batch.micro):
        offs, at = {}, 0
        for r in range(W):
            for slot in layout.slots:
                dim = layout.store_dims[layout.store_of(slot)]
                offs[(r, slot)] = at
                if layout.exchange(slot) == "unique":
                    n_send = len(rcv.raw_mb[i][r][slot]) * dim
                    recv[i][r] += len(req[slot].mb_lists[i][r]) * dim
                else:  # partial sums travel between a requester and the ranks holding rows of the table only
                    n_send = rcv.own_b[i][r] * dim if layout.holds(slot, me) else 0
                    recv[i][r] += len(mbd.samples) * dim if layout.holds(slot, r) else 0
                send[i][r] += n_send
                at += n_send
        block_off.append(offs)
    grad_mb_off = [0] * N
    for i in range(1, N):
        grad_mb_off[i] = grad_mb_off[i - 1] + sum(send[i - 1])
    return PayloadSplits(send, recv, block_off, grad_mb_off)


def owner_plan(layout: SlotLayout, st: str, rcv: Received, splits: PayloadSplits, bags: bool) -> OwnerPlan:
    """The owner's plan of store ``st`` for one batch: every micro-batch's pairs grouped by output segment
    (the forward), and either the bags of the whole batch (the bag update, ``bags``) or, on first use, the
    entries' dedup into rows (:meth:`OwnerPlan.dedup`: the buffered schedules and the entry update)."""
    entries = rcv.entries[st]
    rows_all = np.concatenate(entries).astype(np.int64, copy=False) if entries else np.zeros(0, np.int64)
    if len(rows_all) and (int(rows_all.min()) < 0 or int(rows_all.max()) >= layout.store_rows[st]):
        raise RuntimeError(f"table {st}: rank {layout.rank} received a request for a row it does not own")
    slots = layout.slots_of_store(st)
    pooled = layout.exchange(slots[0]) == "reduction" if slots else False
    o = OwnerPlan(rows_all, [], rcv.base[st], pooled=pooled, fwd_offsets=[], fwd_out=[], upd_src=[],
                  num_store_rows=layout.store_rows[st], bags=bags)
    if pooled:
        pooled_csr, bag_grad, pair_rows = _pooled_pairs(layout, st, slots[0], rcv, splits, o)
    else:
        _unique_pairs(layout, st, slots, rcv, splits, o)
        pooled_csr = bag_grad = pair_rows = None
    if bags:
        _plan_bags(o, layout.store_dims[st], splits.grad_mb_off, pooled_csr, bag_grad, pair_rows)
    return o


def _pooled_pairs(layout: SlotLayout, st: str, slot: str, rcv: Received, splits: PayloadSplits, o: OwnerPlan):
    """A pooled store's pairs (one slot per pooled store): its (micro-batch, requester) blocks in that order, all
    at once. A list is ``[count per sample..., entries...]`` (ReductionBased.plan) and entries come sample after
    sample, so the pairs are grouped by segment already, in ascending pair order within one (the ordered sum's
    order). Returns the plan's concatenated CSR, bag gradient offsets and pair rows (the bag update's arrays)."""
    W, N, dim = layout.world, len(rcv.raw_mb), layout.store_dims[st]
    mine = layout.holds(slot, layout.rank)
    blocks = [(i, r) for i in range(N) for r in range(W)]
    at = np.array([rcv.raw_at[i][r][slot] for i, r in blocks], dtype=np.int64)
    size = np.array([len(rcv.raw_mb[i][r][slot]) for i, r in blocks], dtype=np.int64)
    b = np.array([rcv.own_b[i][r] if mine else 0 for i, r in blocks], dtype=np.int64)
    b0 = np.array([rcv.base[st][(r, slot)] for _, r in blocks], dtype=np.int64)
    out_at = np.array([splits.block_off[i][(r, slot)] for i, r in blocks], dtype=np.int64)
    grad_at = np.repeat(np.asarray(splits.grad_mb_off, dtype=np.int64), W)
    cs, e_all, out_all, bag_grad, pair_rows, status = kernels.pooled_owner_plan(
        rcv.got, at, size, b, b0, out_at, grad_at, dim, o.rows_all)
    if status:
        raise RuntimeError(f"table {st}: rank {layout.rank} received a routing payload whose " + (
            "per-sample counts do not add up to its entries" if status == 1 else
            "entries point outside the rows requested"))
    seg_end = np.cumsum(b.reshape(N, W).sum(1))  # per micro-batch: its segments end here, its pairs at cs[]
    seg_start = np.concatenate([[0], seg_end[:-1]]).astype(np.int64)
    for i in range(N):
        s0, s1 = int(seg_start[i]), int(seg_end[i])
        out_i = out_all[s0:s1]
        o.fwd_offsets.append(torch.from_numpy(cs[s0:s1 + 1] - cs[s0]))
        o.fwd_out.append(torch.from_numpy(out_i))
        o.pair_entry.append(e_all[cs[s0]:cs[s1]])
        if not o.bags:  # every pair's gradient offset (the entry update only): its segment's
            o.upd_src.append(splits.grad_mb_off[i] + np.repeat(out_i, np.diff(cs[s0:s1 + 1])))
    return cs, bag_grad, pair_rows


def _unique_pairs(layout: SlotLayout, st: str, slots: List[str], rcv: Received, splits: PayloadSplits,
                  o: OwnerPlan) -> None:
    """A unique-based store's pairs: one per requested row, segments in (requester, slot) order."""
    W, N, dim = layout.world, len(rcv.raw_mb), layout.store_dims[st]
    for i in range(N):
        p_entry, seg_out = [], []
        for r in range(W):
            for slot in slots:
                lst = rcv.raw_mb[i][r][slot]
                p_entry.append(np.add(lst, rcv.base[st][(r, slot)], dtype=np.int64))
                seg_out.append(splits.block_off[i][(r, slot)] + dim * np.arange(len(lst), dtype=np.int64))
        e = np.concatenate(p_entry) if p_entry else np.zeros(0, np.int64)
        out_off = np.concatenate(seg_out) if seg_out else np.zeros(0, np.int64)
        o.fwd_offsets.append(None)
        if not o.bags:
            o.upd_src.append(splits.grad_mb_off[i] + out_off)
        o.pair_entry.append(e)
        o.fwd_out.append(torch.from_numpy(out_off))


def _plan_bags(o: OwnerPlan, dim: int, grad_mb_off: List[int], pooled_csr, bag_grad, pair_rows) -> None:
    """The bag update's arrays: the pooled plan's own (its micro-batches' CSRs and segment offsets,
    concatenated), or a bag of one row per pair (unique-based)."""
    if o.pooled:
        bag_offsets = pooled_csr
    else:
        pe = np.concatenate(o.pair_entry) if o.pair_entry else np.zeros(0, np.int64)
        pair_rows = o.rows_all[pe]
        bag_offsets = np.arange(len(pe) + 1, dtype=np.int64)
        bag_grad = (np.concatenate([grad_mb_off[i] + f.numpy() for i, f in enumerate(o.fwd_out)]) if o.fwd_out
                    else np.zeros(0, np.int64))
    o.bag_rows, o.bag_offsets, o.bag_grad = (torch.from_numpy(pair_rows), torch.from_numpy(bag_offsets),
                                             torch.from_numpy(bag_grad))
    o.bag_grad_runs = [(int(bag_grad[a]), b - a) for a, b in kernels.row_runs(bag_grad, dim)]
