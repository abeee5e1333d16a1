"""The sharded embedding collection: fused key routing, retrieval, per-micro-batch exchange, owner-side update.

Who owns what
- Every sharded table's row belongs to exactly one rank (:mod:`nestpipe.trainer.embedding.placement`); that rank's
  :class:`~nestpipe.trainer.embedding.store.RowStore` holds it with its AdaGrad state. Replicated tables live on
  every rank. A table split by columns in a plan file has one store per column shard (``table@cJ``, each with
  its own owners; :func:`~nestpipe.trainer.sharding_plan.column_shards`). A *slot* is one request stream into a
  store: one per store, plus ``item#neg`` (the GR negatives) served by the ``item`` store (``item@cJ#neg`` per
  column shard). The requester concatenates a table's column shards in column order into whole rows.

Per batch (each step is a method, called in this order by :mod:`nestpipe.trainer.step`)
1. :meth:`input_dist` (key routing): the requester maps its batch keys to (owner, local row); one
   ``all_to_all_single`` of counts and one of payload carry, for all slots fused, the local rows each owner must
   serve and, per micro-batch, which of them (unique-based) or which (sample, entry) pairs (reduction-based).
   The owner concatenates what it received in (requester rank, slot) order: these are its *entries*. Their
   dedup into the batch's distinct rows is computed only where something needs it (a buffer, the entry update).
2. :meth:`retrieve` (embedding retrieval): the owner gathers its batch rows (weights and AdaGrad state) from the
   store into a buffer on the device. The buffer is frozen for the whole batch (no update inside a batch). The
   synchronous schedules on CPU read the store directly (nothing else touches it during the batch).
3. :meth:`embed` / :meth:`grad_exchange_and_accumulate`, per micro-batch in order: one fused embedding All2All (owner -> requester)
   and, after the micro-batch's backward, one fused gradient All2All (requester -> owner) received into the
   batch's gradient payload (micro-batch ``i`` at its own offset).
4. :meth:`update`: one row-wise AdaGrad step per store and batch, on every row the batch touched. The *bag update*
   (float32, the ``adagrad_bags`` rule picks a compiled path -- fbgemm's TBE backward or its bitwise Numba twin --,
   no 2D-SP momentum scale or replica sync: :meth:`bag_update`, a fixed rule) hands ``nestpipe.kernels.adagrad_bags``
   all of the batch's bags -- (micro-batch, requester, sample) segments, or single requested rows -- in that order
   with their gradient rows; the *entry update* (``nestpipe.kernels.adagrad_update``, every other case)
   sums each entry's pairs in (micro-batch, pair) order and each row's entries in entry (= requester rank) order.
   Either way the bags, and so the arithmetic, are the same in every schedule. The updated rows are in the store
   when it returns; in DBP they stay in the batch's buffer (now the *active* buffer) until
   :meth:`sync_dual_buffer` has copied the rows the next batch shares into the next batch's *prefetch* buffer;
   :meth:`release` then frees them.

Every collective takes its process group as an argument: the pipelined modes give each concurrent stage its own
group (:mod:`nestpipe.trainer.distributed.process_groups`) and issue each group's collectives from one thread only.
The per-micro-batch exchange is split into owner work (:meth:`embed_send`, :meth:`grad_accumulate`), the
collective (:meth:`embed_exchange`, :meth:`grad_exchange`) and requester work (:meth:`embed_unpack`) so that a
communication thread can run the first two while the compute thread runs the dense model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from nestpipe.datasets.shards import Manifest
from nestpipe.trainer.embedding.config import EmbeddingConfig, row_shape
from nestpipe.trainer.embedding.batch import NEG_SLOT, PreparedBatch
from nestpipe.trainer.embedding.reduction_based import ReductionBased
from nestpipe.trainer.embedding.replicated import ReplicatedTable, owner_bounds, owner_order
from nestpipe.trainer.embedding.store import RowStore, apply_adagrad
from nestpipe.trainer.embedding.tiered_store import split_cache, tiered_store
from nestpipe.trainer.embedding.unique_based import UniqueBased
from nestpipe.trainer.embedding.placement import make_placement
from nestpipe.trainer.sharding_plan import column_shards, plan_kinds, resolve_plan
from nestpipe.utils.timing import StageTimer
from nestpipe import kernels


_NEG_SUFFIX = NEG_SLOT[len("item"):]  # "#neg": the negatives' slot of an item store (``item#neg``, ``item@c0#neg``)


def choose_kind(name: str, vocab: int, table_kind: str, cfg: EmbeddingConfig) -> str:
    """Exchange kind of one table: config override, else replicated (small) / reduction (pooled) / unique."""
    kind = cfg.kinds.get(name, "auto")
    if kind not in ("auto", "unique", "reduction", "replicated"):
        raise ValueError(f"embedding.kinds[{name!r}] = {kind!r}: expected auto, unique, reduction or replicated")
    if kind == "auto":
        if vocab <= cfg.replicate_max_rows:
            return "replicated"
        return "reduction" if table_kind == "pooled" else "unique"
    if kind == "reduction" and table_kind == "sequence":
        raise ValueError(f"table {name!r} is a sequence feature: reduction-based exchange needs a pooled feature")
    return kind


def _split(x: torch.Tensor, sizes: List[int]) -> List[torch.Tensor]:
    return list(torch.split(x, sizes))


def table_dims(manifest: Manifest, cfg: EmbeddingConfig, widths: Optional[Dict[str, object]] = None) -> Dict[str, int]:
    """Row width of every table: the embedding dim (``cfg.dim`` or the manifest's) times the table's number of
    blocks in ``widths`` (the model's :attr:`ModelSpec.table_widths`; 1 where absent), plus its extra columns where
    ``widths`` gives ``(blocks, extra)``."""
    out = {}
    for t, spec in manifest.tables.items():
        blocks, extra = row_shape((widths or {}).get(t, 1))
        out[t] = int(cfg.dim or spec.dim) * blocks + extra
    return out


@dataclasses.dataclass
class _ReqSlot:
    """Requester-side plan of one slot for one batch."""

    dest: np.ndarray
    pos_in_dest: np.ndarray
    send_rows: List[np.ndarray]  # per owner: local rows
    mb_lists: List[List[np.ndarray]]  # [micro-batch][owner] int64 lists sent in the routing payload
    unperm: List[Optional[torch.Tensor]]  # unique-based: per micro-batch gather into mb_unique order


@dataclasses.dataclass
class _OwnStore:
    """Owner-side state of one store for one batch.

    An *entry* is one (requester, slot, key) the owner serves; a *pair* is one use of an entry by one output
    segment of one micro-batch (reduction-based: a (sample, entry) pair of a bag; unique-based: one requested row).
    A *bag* is one output segment: the pairs of one (micro-batch, requester, sample) (reduction-based) or a single
    pair (unique-based). Bags are numbered in (micro-batch, requester, slot, segment) order whatever the schedule.

    The distinct rows of the batch (:attr:`rows`) and everything numbered by them are computed on first use
    (:meth:`dedup`): the buffered schedules need them (retrieval, dual-buffer sync), the direct path with the bag
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
    # offset of its gradient row in the batch's gradient payload; None where the entry update is used
    bags: bool = False
    bag_rows: Optional[torch.Tensor] = None
    bag_offsets: Optional[torch.Tensor] = None
    bag_grad: Optional[torch.Tensor] = None
    bag_grad_runs: Optional[List[Tuple[int, int]]] = None  # bag_grad as runs of back-to-back rows: (offset, rows)
    # set by retrieve: rows are read from ``src`` at ``fwd_idx[i]`` -- the store itself (direct) or the buffer
    direct: bool = False
    # buffered, host-resident buffer (CPU): the update goes to the store in place and the dual-buffer sync reads the
    # updated rows from the store; the buffer only serves the forward (no write-back pass)
    update_in_store: bool = False
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
        n_rows = self.num_store_rows
        order, uniq, starts, inv_sorted, inv = kernels.dedup_rows(rows_all, n_rows)
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

    num_store_rows: int = 0


@dataclasses.dataclass
class Routing:
    """Everything one batch's exchange needs, produced by :meth:`input_dist`."""

    batch: PreparedBatch
    req: Dict[str, _ReqSlot]
    own: Dict[str, _OwnStore]
    own_b: List[List[int]]  # [micro-batch][requester] sample count
    send_splits: List[List[int]]  # per micro-batch, elements owner -> requester r
    recv_splits: List[List[int]]
    neg_inv: Optional[torch.Tensor] = None
    # owner: the gradient All2All payloads of all micro-batches, concatenated (micro-batch i at grad_mb_off[i]);
    # allocated by retrieve, written by grad_exchange, summed by the update
    grad_mb_off: List[int] = dataclasses.field(default_factory=list)
    grad_payload: Optional[torch.Tensor] = None


class AllToAllInFlight:
    """One ``all_to_all_single`` issued asynchronously on ``group``: its time from issue to completion counts as
    ``STAGE.comm`` and only the compute thread's wait for it (:meth:`wait`) as exposed. Holds both buffers until
    the collective completes."""

    def __init__(self, timer: StageTimer, rank: int, send: torch.Tensor, send_splits: List[int],
                 recv_splits: List[int], stage: str, group, out: Optional[torch.Tensor] = None):
        self.timer, self.stage = timer, stage
        self.out = send.new_empty(sum(recv_splits)) if out is None else out
        self.send = send
        self.t_issue, self.t_done = time.perf_counter(), None
        self.work = dist.all_to_all_single(self.out, send, recv_splits, send_splits, group=group, async_op=True)
        self.work.get_future().add_done_callback(lambda _f: setattr(self, "t_done", time.perf_counter()))
        timer.add_bytes(stage, (sum(send_splits) - send_splits[rank]) * send.element_size())

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        self.work.wait()
        t1 = time.perf_counter()
        done = min(self.t_done, t1) if self.t_done is not None else t1
        self.timer.add_split(self.stage + ".comm", done - self.t_issue, t1 - t0)
        self.send = None
        return self.out


@dataclasses.dataclass
class RouteInFlight:
    """One batch's key routing issued ahead (:meth:`ShardedEmbeddingCollection.input_dist_begin`): the requester's
    plans and the routing All2All in flight (first the counts, then the payload)."""

    batch: PreparedBatch
    req: Dict[str, "_ReqSlot"]
    payload: List[np.ndarray]
    group: object
    pending: Optional[AllToAllInFlight] = None
    counts: Optional[np.ndarray] = None  # the received counts, once the first All2All has arrived


class ShardedEmbeddingCollection:
    def __init__(self, manifest: Manifest, cfg: EmbeddingConfig, seed: int, rank: int, world: int,
                 device: torch.device, negatives: bool = False, group=None, timer: Optional[StageTimer] = None,
                 dtype: torch.dtype = torch.float32, widths: Optional[Dict[str, object]] = None, run_dir: str = "",
                 requester_salt: int = 0, tier_write_back: bool = True):
        # requester_salt != 0 and tier_write_back=False are negative controls (requesters route with a placement the
        # owners do not use; tiered stores lose evicted dirty rows): only tests pass them
        self.cfg, self.rank, self.world, self.device, self.group = cfg, rank, world, device, group
        self.dtype = dtype
        self.timer = timer or StageTimer()
        self.timeline = None  # the run's trace (pipeline.timeline.Timeline), set by the trainer
        names = sorted(manifest.tables)  # per-table keys were checked against them (trainer.config.check_tables)
        self.table_ids = {t: i for i, t in enumerate(names)}
        self.table_kind = {t: manifest.tables[t].kind for t in names}
        self.dims = table_dims(manifest, cfg, widths)
        self.kinds = plan_kinds(cfg.placement, {t: choose_kind(t, manifest.tables[t].vocab, self.table_kind[t], cfg)
                                                for t in names}, cfg.kinds)
        self.plan = resolve_plan(manifest, cfg.placement, self.kinds, self.table_kind, self.dims, world, device.type)
        # a sharded table is held by one store (whole rows) or, split by columns in a plan file, by one store per
        # column shard (``table@cJ``, in column order); a slot is one request stream into one store
        self.stores: Dict[str, RowStore] = {}
        self.store_dims: Dict[str, int] = {}
        self.replicated: Dict[str, ReplicatedTable] = {}
        self.req_placement = {}
        for t in names:
            v = manifest.tables[t].vocab
            if self.kinds[t] == "replicated":
                self.replicated[t] = ReplicatedTable(t, self.table_ids[t], v, self.dims[t], seed, cfg.init_scale, device,
                                                     dtype)
                continue
            for cs in column_shards(self.plan, t, self.dims[t]):
                pl = make_placement(self.table_ids[t], v, world, owners=cs.owners)
                if cfg.tier == "mmap":
                    self.stores[cs.store] = tiered_store(cs.store, pl, rank, cs.dim, seed, cfg, run_dir, world, t,
                                                         cs.first_col, dtype, write_back=tier_write_back)
                else:
                    self.stores[cs.store] = RowStore(cs.store, pl, rank, cs.dim, seed, cfg.init_scale, dtype,
                                                     eager_rows=cfg.eager_init_max_rows, huge_pages=cfg.huge_pages,
                                                     table=t, first_col=cs.first_col)
                self.store_dims[cs.store] = cs.dim
                self.req_placement[cs.store] = make_placement(
                    self.table_ids[t], v, world, salt=requester_salt, owners=cs.owners)
        self.slots = list(self.stores)
        if cfg.tier == "mmap":
            split_cache(self.stores, cfg.dram_cache_mb, self.timer)
        # 2D sparse parallelism (nestpipe.trainer.distributed.sparse_groups): the sharded tables' accumulator scale and the
        # cross-group replica synchronisation run by update(); None / the config's scale in plain training
        self.sparse_momentum_scale = cfg.momentum_scale_groups
        self.replica_sync = None
        # the learning-rate schedule's factor of the current update (optim.embedding_follows; set by the step before
        # each update, 1.0 otherwise: a product by 1.0 changes no bit)
        self.lr_scale = 1.0
        self.update_in_store = cfg.dbp_update_in_store
        self.negatives = negatives
        # The routing payload carries local rows (< a store's rows), key positions (< a table's vocabulary: keys
        # are unique in-vocabulary ids) and sample indices (< the batch size): int32 when all of these fit (the
        # same static rule on every rank, so both sides of the All2All agree), which halves its bytes.
        self.manifest_batch_size = manifest.batch_size
        bound = max([manifest.batch_size] + [manifest.tables[s.table].vocab for s in self.stores.values()])
        self.route_dtype = np.int32 if bound < 2 ** 31 else np.int64
        if negatives and "item" in self.kinds and self.kinds["item"] != "replicated":
            self.slots += [st + _NEG_SUFFIX for st in self.stores if self.stores[st].table == "item"]

    # -- helpers -------------------------------------------------------------------------------------------------
    @staticmethod
    def is_negatives(slot: str) -> bool:
        return slot.endswith(_NEG_SUFFIX)

    def store_of(self, slot: str) -> str:
        return slot[:-len(_NEG_SUFFIX)] if self.is_negatives(slot) else slot

    def table_of(self, slot: str) -> str:
        return self.stores[self.store_of(slot)].table

    def output_of(self, slot: str) -> str:
        """The model input a slot's output belongs to: its table, or ``item#neg`` for the negatives (column shards
        of one table are concatenated in column order)."""
        return NEG_SLOT if self.is_negatives(slot) else self.table_of(slot)

    def holds(self, slot: str, rank: int) -> bool:
        """Whether ``rank`` holds rows of the store behind ``slot`` (serves part of its requests)."""
        return rank in self.req_placement[self.store_of(slot)].owner_ranks

    def slot_exchange(self, slot: str) -> str:
        return "unique" if self.is_negatives(slot) else self.kinds[self.table_of(slot)]

    def _a2a(self, send: torch.Tensor, send_splits: List[int], recv_splits: List[int], stage: str,
             group=None, out: Optional[torch.Tensor] = None, during: Optional[Callable[[], None]] = None
             ) -> torch.Tensor:
        """One ``all_to_all_single``. ``during``: work that needs neither buffer, run on this thread while the
        collective is in flight (issued asynchronously, waited for after it): the collective's time counts from
        issue to completion, and only the wait as exposed."""
        grp = group if group is not None else self.group
        if during is None:
            if out is None:
                out = send.new_empty(sum(recv_splits))
            t0, c0 = time.perf_counter(), time.process_time()
            self.timer.add_bytes(stage, (sum(send_splits) - send_splits[self.rank]) * send.element_size())
            dist.all_to_all_single(out, send, recv_splits, send_splits, group=grp)
            self.timer.add(stage + ".comm", time.perf_counter() - t0)
            self.timer.add_cpu(stage + ".comm", time.process_time() - c0)
            return out
        flight = AllToAllInFlight(self.timer, self.rank, send, send_splits, recv_splits, stage, grp, out)
        during()
        return flight.wait()

    def _slot_keys(self, batch: PreparedBatch, slot: str) -> np.ndarray:
        if self.is_negatives(slot):
            return np.unique(batch.negatives)
        return batch.keys[self.table_of(slot)]

    # -- stage: key routing --------------------------------------------------------------------------------------
    def input_dist(self, batch: PreparedBatch, group=None) -> Routing:
        """Key routing of one batch (two ``all_to_all_single`` on ``group``). Depends only on the batch's keys and
        the placement, never on parameter values, so it may run any number of batches ahead.

        requester: bucket each slot's keys by owner -> one fused counts All2All -> one keys All2All;
        owner: parse what every requester sent -> per-micro-batch payload sizes -> per-store owner plans."""
        req = {slot: self._requester_slot(batch, slot) for slot in self.slots}
        counts, payload = self._route_payload(batch, req)
        t0 = time.perf_counter()
        got_counts, got = self._exchange_route(batch, counts, payload, group)
        routing = self._owner_side(batch, req, got_counts, got)
        self.timer.add("route.total", time.perf_counter() - t0)
        return routing

    def input_dist_begin(self, batch: PreparedBatch, group=None) -> "RouteInFlight":
        """:meth:`input_dist` issued ahead (``pipe.route_ahead``): the requester's plans, and the counts All2All
        issued asynchronously. Then :meth:`input_dist_advance` (the payload All2All, asynchronously, once the counts
        have arrived) and :meth:`input_dist_finish` (the owner's plans). The same collectives carry the same bytes
        in the same order on every rank, so the Routing is the one :meth:`input_dist` returns."""
        req = {slot: self._requester_slot(batch, slot) for slot in self.slots}
        counts, payload = self._route_payload(batch, req)
        C = counts.shape[1]
        rif = RouteInFlight(batch, req, payload, group if group is not None else self.group)
        rif.pending = AllToAllInFlight(self.timer, self.rank, torch.from_numpy(counts.reshape(-1)).to(self.device),
                                       [C] * self.world, [C] * self.world, "route", rif.group)
        return rif

    def input_dist_advance(self, rif: "RouteInFlight") -> None:
        """Wait for the counts (issued by :meth:`input_dist_begin`) and issue the payload All2All."""
        W, S, N = self.world, len(self.slots), len(rif.batch.micro)
        got_counts = rif.pending.wait().view(W, -1).cpu().numpy()
        rif.counts = got_counts
        rif.pending = AllToAllInFlight(self.timer, self.rank, self._route_send(rif.batch, rif.payload),
                                       [len(p) for p in rif.payload],
                                       [int(x) for x in got_counts[:, :S + N * S].sum(1)], "route", rif.group)

    def input_dist_finish(self, rif: "RouteInFlight") -> Routing:
        """Wait for the payload and build the owner's plans: the batch's Routing."""
        t0 = time.perf_counter()
        if rif.counts is None:
            self.input_dist_advance(rif)
        got = rif.pending.wait().cpu().numpy()
        routing = self._owner_side(rif.batch, rif.req, rif.counts, got)
        self.timer.add("route.total", time.perf_counter() - t0)
        return routing

    def _owner_side(self, batch: PreparedBatch, req, got_counts: np.ndarray, got: np.ndarray) -> Routing:
        entries, base, raw_mb, raw_at, own_b = self._parse_route(batch, got_counts, got)
        send_splits, recv_splits, block_off, grad_mb_off = self._payload_splits(batch, req, raw_mb, own_b)
        own = {st: self._owner_plan(st, entries[st], base[st], raw_mb, own_b, block_off, grad_mb_off, got, raw_at)
               for st in self.stores}
        return Routing(batch, req, own, own_b, send_splits, recv_splits, self._negatives_inverse(batch), grad_mb_off)

    def _negatives_inverse(self, batch: PreparedBatch) -> Optional[torch.Tensor]:
        if not (self.negatives and batch.negatives is not None):
            return None
        _, inv = np.unique(batch.negatives, return_inverse=True)
        return torch.from_numpy(inv.astype(np.int64)).to(self.device)

    def _requester_slot(self, batch: PreparedBatch, slot: str) -> "_ReqSlot":
        """Requester side of one slot: each key's owner and row, the keys to send to each owner (stable owner
        order), and per micro-batch the lists the exchange kind sends (unique positions or pooled entries)."""
        W = self.world
        keys = self._slot_keys(batch, slot)
        pl = self.req_placement[self.store_of(slot)]
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
        t = self.table_of(slot)
        for mbd in batch.micro:
            if self.slot_exchange(slot) == "unique":
                mk = np.arange(len(keys), dtype=np.int64) if self.is_negatives(slot) else mbd.mb_keys[t]
                lists, up = UniqueBased.plan(dest, pos_in_dest, mk, W)
                unperm.append(torch.from_numpy(up).to(self.device))
            else:
                lists = ReductionBased.plan(dest, pos_in_dest, mbd.value_key[t], mbd.value_sample[t], W,
                                            one, num_samples=len(mbd.samples), owners=pl.owner_ranks,
                                            lengths=mbd.lengths[t])
                unperm.append(None)
            mb_lists.append(lists)
        return _ReqSlot(dest, pos_in_dest, send_rows, mb_lists, unperm)

    def _route_payload(self, batch: PreparedBatch, req: Dict[str, "_ReqSlot"]):
        """Per destination rank: the fused counts ([keys per slot] [list length per (micro-batch, slot)] [samples
        per micro-batch]) and the payload (the same lists concatenated in that order)."""
        W, S, N = self.world, len(self.slots), len(batch.micro)
        counts = np.zeros((W, S + N * S + N), dtype=np.int64)
        payload = []
        for r in range(W):
            parts = []
            for si, slot in enumerate(self.slots):
                counts[r, si] = len(req[slot].send_rows[r])
                parts.append(req[slot].send_rows[r])
            for i, mbd in enumerate(batch.micro):
                for si, slot in enumerate(self.slots):
                    lst = req[slot].mb_lists[i][r]
                    counts[r, S + i * S + si] = len(lst)
                    parts.append(lst)
                counts[r, S + N * S + i] = len(mbd.samples)
            payload.append(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
        return counts, payload

    def _exchange_route(self, batch: PreparedBatch, counts: np.ndarray, payload: List[np.ndarray], group):
        """The two routing All2Alls: counts, then the payload (int32 where the manifest bounds every value)."""
        W, S, N = self.world, len(self.slots), len(batch.micro)
        C = counts.shape[1]
        got_counts = self._a2a(torch.from_numpy(counts.reshape(-1)).to(self.device), [C] * W, [C] * W, "route", group)
        got_counts = got_counts.view(W, C).cpu().numpy()
        got = self._a2a(self._route_send(batch, payload), [len(p) for p in payload],
                        [int(x) for x in got_counts[:, :S + N * S].sum(1)], "route", group)
        return got_counts, got.cpu().numpy()

    def _route_send(self, batch: PreparedBatch, payload: List[np.ndarray]) -> torch.Tensor:
        """The routing payload as one tensor of the routing dtype (int32 where the manifest bounds every value)."""
        flat = np.concatenate(payload)
        if self.route_dtype == np.int32 and len(flat) and int(flat.max()) >= 2 ** 31:
            raise RuntimeError(f"step {batch.step}: a routing value ({int(flat.max())}) exceeds int32 although the "
                               f"manifest bounds it (batch size {self.manifest_batch_size})")
        return torch.from_numpy(flat.astype(self.route_dtype, copy=False)).to(self.device)

    def _parse_route(self, batch: PreparedBatch, got_counts: np.ndarray, got: np.ndarray):
        """Owner side, in (requester, slot) order: the rows every requester asked for per store (``entries``, with
        each (requester, slot)'s first entry in ``base``), the per-micro-batch lists (``raw_mb[i][r][slot]``) and
        the requesters' micro-batch sample counts (``own_b[i][r]``)."""
        W, S, N = self.world, len(self.slots), len(batch.micro)
        cursor = 0
        entries: Dict[str, List[np.ndarray]] = {s: [] for s in self.stores}
        n_entries = {s: 0 for s in self.stores}
        base: Dict[str, Dict[Tuple[int, str], int]] = {s: {} for s in self.stores}
        raw_mb: List[List[Dict[str, np.ndarray]]] = [[{} for _ in range(W)] for _ in range(N)]
        raw_at: List[List[Dict[str, int]]] = [[{} for _ in range(W)] for _ in range(N)]  # each list's start in got
        own_b = [[0] * W for _ in range(N)]
        for r in range(W):
            for si, slot in enumerate(self.slots):
                st = self.store_of(slot)
                k = int(got_counts[r, si])
                base[st][(r, slot)] = n_entries[st]
                entries[st].append(got[cursor:cursor + k])
                n_entries[st] += k
                cursor += k
            for i in range(N):
                for si, slot in enumerate(self.slots):
                    k = int(got_counts[r, S + i * S + si])
                    raw_mb[i][r][slot] = got[cursor:cursor + k]
                    raw_at[i][r][slot] = cursor
                    cursor += k
                own_b[i][r] = int(got_counts[r, S + N * S + i])
        return entries, base, raw_mb, raw_at, own_b

    def _payload_splits(self, batch: PreparedBatch, req: Dict[str, "_ReqSlot"], raw_mb, own_b):
        """Per micro-batch: the embedding All2All's send and receive split sizes (elements), each (requester,
        slot) block's offset in the owner's payload, and each micro-batch's offset in the gradient buffer."""
        W, N = self.world, len(batch.micro)
        send_splits = [[0] * W for _ in range(N)]
        recv_splits = [[0] * W for _ in range(N)]
        block_off: List[Dict[Tuple[int, str], int]] = []  # [i] (requester, slot) -> element offset in i's payload
        for i, mbd in enumerate(batch.micro):
            offs, at = {}, 0
            for r in range(W):
                for slot in self.slots:
                    dim = self.store_dims[self.store_of(slot)]
                    offs[(r, slot)] = at
                    if self.slot_exchange(slot) == "unique":
                        n_send = len(raw_mb[i][r][slot]) * dim
                        recv_splits[i][r] += len(req[slot].mb_lists[i][r]) * dim
                    else:  # partial sums travel between a requester and the ranks holding rows of the table only
                        n_send = own_b[i][r] * dim if self.holds(slot, self.rank) else 0
                        recv_splits[i][r] += len(mbd.samples) * dim if self.holds(slot, r) else 0
                    send_splits[i][r] += n_send
                    at += n_send
            block_off.append(offs)
        grad_mb_off = [0] * N
        for i in range(1, N):
            grad_mb_off[i] = grad_mb_off[i - 1] + sum(send_splits[i - 1])
        return send_splits, recv_splits, block_off, grad_mb_off

    def bag_update(self) -> bool:
        """Whether the owners update with :func:`nestpipe.kernels.adagrad_bags` (the TBE backward's arithmetic) instead
        of :func:`nestpipe.kernels.adagrad_update` over entries: a fixed rule (its path is a compiled one, numba or
        fbgemm; float32; plain row-wise AdaGrad, i.e. no 2D-SP momentum scale), the same on every rank and for
        every schedule."""
        return (kernels.select_path("adagrad_bags", self.device) in ("numba", "fbgemm") and self.dtype == torch.float32
                and self.sparse_momentum_scale == 1 and self.replica_sync is None)

    def _owner_plan(self, st: str, entries: List[np.ndarray], base: Dict[Tuple[int, str], int],
                    raw_mb, own_b, block_off, grad_mb_off, got: np.ndarray, raw_at) -> _OwnStore:
        """The owner's plan of store ``st`` for one batch: every micro-batch's pairs grouped by output segment
        (the forward), and either the bags of the whole batch (the bag update) or, on first use, the entries'
        dedup into rows (:meth:`_OwnStore.dedup`: the buffered schedules and the entry update)."""

        W, N = self.world, len(raw_mb)
        dim = self.store_dims[st]
        rows_all = np.concatenate(entries).astype(np.int64, copy=False) if entries else np.zeros(0, np.int64)
        if len(rows_all) and (int(rows_all.min()) < 0 or int(rows_all.max()) >= self.stores[st].num_rows):
            raise RuntimeError(f"table {st}: rank {self.rank} received a request for a row it does not own")
        slots = [s for s in self.slots if self.store_of(s) == st]
        pooled = self.slot_exchange(slots[0]) == "reduction" if slots else False
        bags = self.bag_update()
        pair_entry, fwd_offsets, fwd_out, upd_src = [], [], [], []
        if pooled:
            # one slot per pooled store; its (micro-batch, requester) blocks in that order, all at once: a list is
            # [count per sample..., entries...] (ReductionBased.plan) and entries come sample after sample, so the
            # pairs are grouped by segment already, in ascending pair order within one (the ordered sum's order)
            slot = slots[0]
            mine = self.holds(slot, self.rank)
            at = np.array([raw_at[i][r][slot] for i in range(N) for r in range(W)], dtype=np.int64)
            size = np.array([len(raw_mb[i][r][slot]) for i in range(N) for r in range(W)], dtype=np.int64)
            b = np.array([own_b[i][r] if mine else 0 for i in range(N) for r in range(W)], dtype=np.int64)
            b0 = np.array([base[(r, slot)] for _ in range(N) for r in range(W)], dtype=np.int64)
            out_at = np.array([block_off[i][(r, slot)] for i in range(N) for r in range(W)], dtype=np.int64)
            grad_at = np.repeat(np.asarray(grad_mb_off, dtype=np.int64), W)
            cs, e_all, out_all, bag_grad, pair_rows, status = kernels.pooled_owner_plan(
                got, at, size, b, b0, out_at, grad_at, dim, rows_all)
            if status:
                raise RuntimeError(f"table {st}: rank {self.rank} received a routing payload whose " + (
                    "per-sample counts do not add up to its entries" if status == 1 else
                    "entries point outside the rows requested"))
            seg_end = np.cumsum(b.reshape(N, W).sum(1))  # per micro-batch: its segments end here, its pairs at cs[]
            seg_start = np.concatenate([[0], seg_end[:-1]]).astype(np.int64)
            for i in range(N):
                s0, s1 = int(seg_start[i]), int(seg_end[i])
                out_i = out_all[s0:s1]
                fwd_offsets.append(torch.from_numpy(cs[s0:s1 + 1] - cs[s0]))
                fwd_out.append(torch.from_numpy(out_i))
                pair_entry.append(e_all[cs[s0]:cs[s1]])
                if not bags:  # every pair's gradient offset (the entry update only): its segment's
                    upd_src.append(grad_mb_off[i] + np.repeat(out_i, np.diff(cs[s0:s1 + 1])))
        else:
            for i in range(N):
                p_entry, seg_out = [], []
                for r in range(W):
                    for slot in slots:
                        lst = raw_mb[i][r][slot]
                        p_entry.append(np.add(lst, base[(r, slot)], dtype=np.int64))
                        seg_out.append(block_off[i][(r, slot)] + dim * np.arange(len(lst), dtype=np.int64))
                e = np.concatenate(p_entry) if p_entry else np.zeros(0, np.int64)
                out_off = np.concatenate(seg_out) if seg_out else np.zeros(0, np.int64)
                fwd_offsets.append(None)
                if not bags:
                    upd_src.append(grad_mb_off[i] + out_off)
                pair_entry.append(e)
                fwd_out.append(torch.from_numpy(out_off))
        o = _OwnStore(rows_all, pair_entry, base, pooled=pooled, fwd_offsets=fwd_offsets, fwd_out=fwd_out,
                      upd_src=upd_src, num_store_rows=self.stores[st].num_rows)
        if bags:
            o.bags = True
            if pooled:  # the micro-batches' CSRs and segment offsets, concatenated (the plan's own arrays)
                bag_offsets = cs
            else:  # a bag of one row per pair
                pe = np.concatenate(pair_entry) if pair_entry else np.zeros(0, np.int64)
                pair_rows = rows_all[pe]
                bag_offsets = np.arange(len(pe) + 1, dtype=np.int64)
                bag_grad = (np.concatenate([grad_mb_off[i] + f.numpy() for i, f in enumerate(fwd_out)]) if N
                            else np.zeros(0, np.int64))
            o.bag_rows, o.bag_offsets, o.bag_grad = (torch.from_numpy(pair_rows), torch.from_numpy(bag_offsets),
                                                     torch.from_numpy(bag_grad))
            o.bag_grad_runs = [(int(bag_grad[a]), b - a) for a, b in kernels.row_runs(bag_grad, dim)]
        return o

    # -- stage: embedding retrieval -----------------------------------------------------------------------------
    def retrieve(self, routing: Routing, direct: bool = False) -> None:
        """Gather the batch's owner rows (weights + AdaGrad state) from the DRAM store into a fresh buffer.

        Called by the retrieval stage, possibly while the previous batch trains: the rows it shares with that batch
        may be stale here and are overwritten by :meth:`sync_dual_buffer` before this buffer serves any request.

        ``direct`` (the synchronous schedules, where nothing else touches the store during the batch): no buffer;
        the batch reads its rows from the store and the update writes them there in place. The values read and the
        arithmetic are those of the buffered path, so both give bitwise the same results."""
        t0 = time.perf_counter()
        for st, o in routing.own.items():
            store = self.stores[st]
            # 2D-SP's replica synchronisation reads the batch's pre- and post-update rows from the buffer
            # a tiered store is read and written only through gather / write-back (the buffered path)
            o.direct = bool(direct and self.device.type == "cpu" and self.replica_sync is None and store.in_dram)
            if o.direct:
                if store.num_materialized < store.num_rows:
                    store.ensure_materialized(o.rows)
                o.src = store.weight
                # every pair's store row: the bag update's rows, split by micro-batch (computed once)
                o.fwd_idx = (list(torch.split(o.bag_rows, [len(e) for e in o.pair_entry])) if o.bags
                             else [torch.from_numpy(o.rows_all[e]) for e in o.pair_entry])
            else:
                o.update_in_store = (self.device.type == "cpu" and self.replica_sync is None and self.update_in_store
                                     and store.in_dram)
                # the update reads the AdaGrad state from the store when it updates there: no state in the buffer
                with self._tier_span(store, "tier.gather", routing.batch.step):
                    w, s_ = store.gather(o.rows, with_state=not o.update_in_store)
                o.buf_w, o.buf_s = w.to(self.device), s_.to(self.device) if s_ is not None else None
                o.src = o.buf_w
                o.fwd_idx = [torch.from_numpy(p) for p in o.fwd_pos]
        total = routing.grad_mb_off[-1] + sum(routing.send_splits[-1]) if routing.send_splits else 0
        routing.grad_payload = torch.zeros(total, dtype=self.dtype, device=self.device)
        self.timer.add("retrieve", time.perf_counter() - t0)

    # -- per micro-batch: embedding All2All ---------------------------------------------------------------------
    def embed(self, routing: Routing, i: int, group=None, during: Optional[Callable[[], None]] = None
              ) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
        """Outputs of micro-batch ``i`` (per table; ``item#neg`` for negatives) and the received leaf tensor.
        ``during``: independent work run while the All2All is in flight (:meth:`_a2a`)."""
        send = self.embed_send(routing, i)
        recv = self.embed_exchange(routing, i, send, group, during=during)
        return self.embed_unpack(routing, i, recv)

    def embed_all(self, routing: Routing, group=None, during: Optional[Callable[[], None]] = None
                  ) -> List[Tuple[Dict[str, torch.Tensor], torch.Tensor]]:
        """Every micro-batch's :meth:`embed` through ONE All2All (the synchronous schedules, where nothing overlaps
        the exchange anyway): the owner pools every micro-batch from the frozen rows, the per-micro-batch payloads
        travel concatenated per destination, and each micro-batch's received payload becomes its own leaf. The
        values are those of per-micro-batch exchanges (the same rows, the same sums), so the result is bitwise
        that of :meth:`embed` called micro-batch by micro-batch; only the number of collectives differs."""
        N, W = len(routing.batch.micro), self.world
        sends = self._embed_send_all(routing)
        send = self._fuse_by_peer([_split(x, routing.send_splits[i]) for i, x in enumerate(sends)])
        recv = self._a2a(send, [sum(routing.send_splits[i][r] for i in range(N)) for r in range(W)],
                         [sum(routing.recv_splits[i][r] for i in range(N)) for r in range(W)], "embed", group,
                         during=during)
        per_mb = self._unfuse_by_peer(recv, routing.recv_splits)
        return [self.embed_unpack(routing, i, torch.cat(per_mb[i])) for i in range(N)]

    def _embed_send_all(self, routing: Routing) -> List[torch.Tensor]:
        """:meth:`embed_send` of every micro-batch with one pooling call per store: the micro-batches' payloads are
        laid out back to back (micro-batch ``i`` at ``grad_mb_off[i]``, the gradient payload's layout), and every
        segment of every micro-batch is pooled from the frozen rows in one call. Same sums as per micro-batch."""
        t0 = time.perf_counter()
        N = len(routing.batch.micro)
        sizes = [sum(routing.send_splits[i]) for i in range(N)]
        flat = torch.empty(sum(sizes), dtype=self.dtype, device=self.device)
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
            kernels.pool_segments(o.src, index, offsets, flat, o.bag_grad if o.bags else torch.cat(outs))
        self.timer.add("embed.owner", time.perf_counter() - t0)
        return list(torch.split(flat, sizes))

    def grad_exchange_all(self, routing: Routing, leaves: List[torch.Tensor], group=None,
                          during: Optional[Callable[[], None]] = None) -> None:
        """Every micro-batch's gradient exchange (after all of their backwards) through ONE All2All, received into
        each micro-batch's slice of the gradient payload: the bytes of :meth:`grad_exchange_and_accumulate` called
        micro-batch by micro-batch, in one collective."""
        N, W = len(routing.batch.micro), self.world
        grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
        send = self._fuse_by_peer([_split(g, routing.recv_splits[i]) for i, g in enumerate(grads)])
        recv = self._a2a(send, [sum(routing.recv_splits[i][r] for i in range(N)) for r in range(W)],
                         [sum(routing.send_splits[i][r] for i in range(N)) for r in range(W)], "grad", group,
                         during=during)
        t0 = time.perf_counter()
        for i, parts in enumerate(self._unfuse_by_peer(recv, routing.send_splits)):
            off = routing.grad_mb_off[i]
            for part in parts:
                routing.grad_payload[off:off + part.numel()].copy_(part)
                off += part.numel()
        self.timer.add("grad.owner", time.perf_counter() - t0)

    def _fuse_by_peer(self, blocks: List[List[torch.Tensor]]) -> torch.Tensor:
        """``blocks[i][r]`` (micro-batch i's part for peer r) -> one buffer ordered (peer, micro-batch)."""
        parts = [blocks[i][r] for r in range(self.world) for i in range(len(blocks))]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=self.dtype, device=self.device)

    def _unfuse_by_peer(self, buf: torch.Tensor, splits: List[List[int]]) -> List[List[torch.Tensor]]:
        """Inverse of :meth:`_fuse_by_peer` for received sizes ``splits[i][r]``: views ``[i][r]``."""
        N = len(splits)
        out: List[List[Optional[torch.Tensor]]] = [[None] * self.world for _ in range(N)]
        at = 0
        for r in range(self.world):
            for i in range(N):
                n = splits[i][r]
                out[i][r] = buf[at:at + n]
                at += n
        return out

    def embed_send(self, routing: Routing, i: int) -> torch.Tensor:
        """Owner side of micro-batch ``i``: rows (unique-based) or partial pools (reduction-based) from the frozen
        buffer (or the store, direct), for every requester in rank order, written straight into the payload (one
        kernel call per store). Reads the rows only."""

        t0 = time.perf_counter()
        send = torch.empty(sum(routing.send_splits[i]), dtype=self.dtype, device=self.device)
        for o in routing.own.values():
            if len(o.fwd_out[i]):
                kernels.pool_segments(o.src, o.fwd_idx[i], o.fwd_offsets[i] if o.pooled else None, send, o.fwd_out[i])
        self.timer.add("embed.owner", time.perf_counter() - t0)
        return send

    def embed_exchange(self, routing: Routing, i: int, send: torch.Tensor, group=None,
                       during: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """The embedding All2All of micro-batch ``i`` (owner -> requester) on ``group``."""
        return self._a2a(send, routing.send_splits[i], routing.recv_splits[i], "embed", group, during=during)

    def embed_unpack(self, routing: Routing, i: int, recv: torch.Tensor) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
        """Requester side of micro-batch ``i``: the received payload becomes the autograd leaf; per-table outputs."""
        W = self.world
        mbd = routing.batch.micro[i]
        t1 = time.perf_counter()
        leaf = recv.requires_grad_(True)
        out: Dict[str, torch.Tensor] = {}
        pieces: Dict[str, List[torch.Tensor]] = {s: [] for s in self.slots}
        blocks: Dict[str, List[Tuple[int, int, int]]] = {s: [] for s in self.slots}
        off = 0
        b = len(mbd.samples)
        for r in range(W):
            for slot in self.slots:
                dim = self.store_dims[self.store_of(slot)]
                if self.slot_exchange(slot) == "unique":
                    n = len(routing.req[slot].mb_lists[i][r])
                    pieces[slot].append(leaf[off:off + n * dim].view(n, dim))
                elif self.holds(slot, r):
                    n = b
                    blocks[slot].append((off, n, dim))
                else:
                    n = 0  # rank r holds none of the table: no partial sum from it
                off += n * dim
        pooled_slots = [s for s in self.slots if self.slot_exchange(s) != "unique"]
        if pooled_slots:
            # one autograd node for all reduction-based slots (see ReductionBased.unpack_flat)
            out.update(zip(pooled_slots, ReductionBased.unpack_flat(leaf, [blocks[s] for s in pooled_slots])))
        for slot in self.slots:
            if self.slot_exchange(slot) == "unique":
                unperm = routing.req[slot].unperm[i]
                if self.is_negatives(slot):
                    rows = torch.cat(pieces[slot], 0).index_select(0, unperm)
                    out[slot] = rows.index_select(0, routing.neg_inv)
                else:
                    t = self.table_of(slot)
                    out[slot] = UniqueBased.unpack(
                        pieces[slot], unperm, self._t(mbd.value_pos[t]), self._t(mbd.value_sample[t]), b,
                        pooled=self.table_kind[t] != "sequence")
        out = self._whole_rows(out)
        batch = routing.batch
        for t, tab in self.replicated.items():
            ids = self._t(batch.keys[t][mbd.value_key[t]])
            out[t] = tab.lookup(ids, self._t(mbd.value_sample[t]), b, pooled=self.table_kind[t] != "sequence")
        if self.negatives and "item" in self.replicated and batch.negatives is not None:
            out[NEG_SLOT] = self.replicated["item"].lookup(self._t(batch.negatives), None, 0, pooled=False)
        self.timer.add("embed.requester", time.perf_counter() - t1)
        return out, leaf

    def _whole_rows(self, out: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Slot outputs -> model inputs in slot order: a table's column shards concatenated in column order (the
        slots of one table are consecutive and in column order), every other slot as it is."""
        parts: Dict[str, List[torch.Tensor]] = {}
        for slot in self.slots:
            parts.setdefault(self.output_of(slot), []).append(out[slot])
        return {k: v[0] if len(v) == 1 else torch.cat(v, -1) for k, v in parts.items()}

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)

    # -- per micro-batch: gradient All2All ----------------------------------------------------------------------
    def grad_exchange_and_accumulate(self, routing: Routing, i: int, leaf: torch.Tensor, group=None,
                                     during: Optional[Callable[[], None]] = None) -> None:
        """Micro-batch ``i``'s backward path: :meth:`grad_exchange` (the All2All to owners) then
        :meth:`grad_accumulate` (the owner adds each entry's gradient, in order)."""
        g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        self.grad_accumulate(routing, i, self.grad_exchange(routing, i, g, group, during=during))

    def grad_exchange(self, routing: Routing, i: int, g: torch.Tensor, group=None,
                      during: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """The gradient All2All of micro-batch ``i`` (requester -> owner) on ``group``, received straight into
        micro-batch ``i``'s slice of the batch's gradient payload."""
        out = None
        if routing.grad_payload is not None:
            off = routing.grad_mb_off[i]
            out = routing.grad_payload[off:off + sum(routing.send_splits[i])]
        return self._a2a(g.contiguous(), routing.recv_splits[i], routing.send_splits[i], "grad", group, out=out,
                         during=during)

    def grad_accumulate(self, routing: Routing, i: int, got: torch.Tensor) -> None:
        """Owner side of micro-batch ``i``'s gradient: keep it in the batch's gradient payload (a no-op when
        :meth:`grad_exchange` received it there). The update sums every entry's pairs over micro-batches in index
        order, then every row's entries in entry order: the arithmetic of ``index_add_`` into per-entry gradients
        once per micro-batch, without materialising them."""
        t0 = time.perf_counter()
        off = routing.grad_mb_off[i]
        dst = routing.grad_payload[off:off + sum(routing.send_splits[i])]
        if dst.data_ptr() != got.data_ptr() or dst.numel() != got.numel():
            dst.copy_(got)
        self.timer.add("grad.owner", time.perf_counter() - t0)

    # -- stage: owner update -------------------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, routing: Routing, release: bool = True) -> None:
        """One row-wise AdaGrad step per store; entries are summed in entry (= requester rank) order.

        The updated rows are in the DRAM store (the source of truth) when this returns: updated there in place
        (direct, and buffered host buffers with ``embedding.dbp_update_in_store``) or updated in the buffer and
        written back. With ``release=False`` the batch's buffer (the *active* buffer) is kept for
        :meth:`sync_dual_buffer`, and the per-entry gradients restart from zero."""
        t0 = time.perf_counter()
        cfg = self.cfg
        g = routing.grad_payload
        before = self.replica_sync.snapshot(routing) if self.replica_sync is not None else None
        for st, o in routing.own.items():
            store = self.stores[st]
            if o.bags:
                self._update_bags(store, o, g, routing.batch.step)
                continue
            o.dedup()
            grad_pairs = (o.entry_offsets, o.pair_src)
            if o.direct or o.update_in_store:
                # in place in the store (the fused kernel sums each row's entries and pairs in order: no gradient
                # is materialised); nothing to write back. The rows read equal the buffer's (DBP invariant: the
                # buffer was final when it served the batch, and only this batch's update changes its rows before
                # this point), so the result is bitwise that of the buffered update.
                with store.lock:
                    apply_adagrad(store.weight, store.state, o.rows, g, self.lr_of(store.table), cfg.eps,
                                  self.sparse_momentum_scale,
                                  (o.seg_order, o.seg_offsets), o.inv, grad_pairs)
            else:
                # in place into the batch's buffer, then written back to the store
                buf_rows = torch.arange(len(o.rows), dtype=torch.int64)
                apply_adagrad(o.buf_w, o.buf_s, buf_rows, g, self.lr_of(store.table), cfg.eps, self.sparse_momentum_scale,
                              (o.seg_order, o.seg_offsets), o.inv, grad_pairs)
                t_wb = time.perf_counter()
                with self._tier_span(store, "tier.write_back", routing.batch.step):
                    store.write_back(o.rows, o.buf_w, o.buf_s)
                self.timer.add("update.write_back", time.perf_counter() - t_wb)
        if self.replica_sync is not None:  # 2D-SP: average the replicas of the touched rows (store and buffer)
            self.replica_sync.sync(routing, before)
        if release:
            self.release(routing)
        elif g is not None:
            g.zero_()  # the gradients restart from zero (only the per-micro-batch-update control updates again)
        self.timer.add("update.sparse", time.perf_counter() - t0)

    def _tier_span(self, store, stage: str, step: int):
        """A span of the run's trace around a memory-mapped store's gather or write-back (its file reads and
        writes happen there); nothing for DRAM stores or without a trace."""
        if store.in_dram or self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(stage, step)

    def _update_bags(self, store: RowStore, o: _OwnStore, g: torch.Tensor, step: int) -> None:
        """The bag update of one store (:func:`nestpipe.kernels.adagrad_bags`): in place in the store (direct, and
        buffered with the update in the store) with store rows as indices, else in the buffer with buffer
        positions (the sorted distinct rows: a monotone renumbering, so the arithmetic is the same) and written
        back."""
        if len(o.bag_grad) == 0:
            return
        dim = store.dim
        # each bag's gradient row, from the payload at its element offset: the bags are runs of back-to-back rows
        # (a (requester, slot) block each), so the rows are one view or the concatenation of a few; else gathered
        # from the payload's length-dim windows (blocks of different dims share it)
        runs = o.bag_grad_runs
        if runs is not None and len(runs) == 1:
            grad_output = g[runs[0][0]:runs[0][0] + runs[0][1] * dim].view(-1, dim)
        elif runs is not None and len(runs) <= 64:
            grad_output = torch.cat([g[at:at + n * dim].view(n, dim) for at, n in runs])
        else:
            grad_output = g.unfold(0, dim, 1).index_select(0, o.bag_grad)
        if o.direct or o.update_in_store:
            with store.lock:
                # bag_rows index rows_all, which _owner_plan bounded to the store's rows
                kernels.adagrad_bags(store.weight, store.state, o.bag_rows, o.bag_offsets, grad_output,
                                     self.lr_of(store.table), self.cfg.eps, indices_checked=True)
            return
        positions = torch.from_numpy(np.concatenate(o.fwd_pos))
        kernels.adagrad_bags(o.buf_w, o.buf_s, positions, o.bag_offsets, grad_output, self.lr_of(store.table),
                             self.cfg.eps)
        t_wb = time.perf_counter()
        with self._tier_span(store, "tier.write_back", step):
            store.write_back(o.rows, o.buf_w, o.buf_s)
        self.timer.add("update.write_back", time.perf_counter() - t_wb)

    @torch.no_grad()
    def sync_dual_buffer(self, active: Routing, prefetch: Routing) -> int:
        """DBP consistency: copy the updated rows of keys(t) ∩ keys(t+1) into the prefetch buffer (batch t+1),
        weights and AdaGrad state, from the active buffer (batch t, updated there) or, when batch t was updated in
        the store (``update_in_store``; its buffers hold weights only), from the store. Returns the number of rows
        copied.

        Invariant enforced here: when batch t+1's buffer serves its first request, every row in it equals the DRAM
        store's row after batch t's write-back. Rows of t+1 not in t were not changed by t (and retrieval of t+1
        started after batch t-1's write-back, see :class:`~nestpipe.trainer.pipeline.dual_buffer.DualBuffer`);
        rows in both are overwritten here with the exact updated values. Copies are bitwise."""

        t0 = time.perf_counter()
        n = 0
        for st, a in active.own.items():
            p = prefetch.own[st]
            if a.buf_w is None or p.buf_w is None:
                raise RuntimeError(f"table {st}: dual-buffer sync needs the updated active and the retrieved "
                                   "prefetch buffer")
            if a.update_in_store:  # the updated rows are in the store (the active buffer holds the old ones)
                store = self.stores[st]
                with store.lock:
                    n += kernels.dual_buffer_sync_rows(a.rows, p.rows, store.weight, None, p.buf_w, None,
                                                 from_store=True)  # weights only: the state stays in the store
            else:
                n += kernels.dual_buffer_sync_rows(a.rows, p.rows, a.buf_w, a.buf_s, p.buf_w, p.buf_s)
        self.timer.add("dbp.sync", time.perf_counter() - t0)
        return n

    @staticmethod
    def release(routing: Routing) -> None:
        """Free a batch's buffers (after its update and, in DBP, after the sync into the next batch)."""
        for o in routing.own.values():
            o.buf_w = o.buf_s = o.src = o.fwd_idx = None
        routing.grad_payload = None

    def replicated_grads(self) -> List[torch.Tensor]:
        out = []
        for t in sorted(self.replicated):
            w = self.replicated[t].weight
            out.append(w.grad if w.grad is not None else torch.zeros_like(w))
        return out

    def lr_of(self, table: str) -> float:
        """The row-wise AdaGrad rate of ``table`` in this update: its configured rate times ``lr_scale``."""
        return self.cfg.lr_of(table) * self.lr_scale

    @torch.no_grad()
    def update_replicated(self, grads: List[torch.Tensor]) -> None:
        for t, g in zip(sorted(self.replicated), grads):
            self.replicated[t].update(g, self.lr_of(t), self.cfg.eps, self.cfg.momentum_scale_groups)
