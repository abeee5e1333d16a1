"""The sharded embedding collection: one rank's tables, composed from the routing plans (:mod:`.routing`), the
exchanges (:mod:`.exchange`) and the owner's compute (:mod:`.owner_compute`).

Who owns what: every sharded table's row belongs to exactly one rank (:mod:`.placement`); that rank's
:class:`~.store.RowStore` holds it with its AdaGrad state. Replicated tables live on every rank. A table split by
columns in a plan file has one store per column shard; a *slot* is one request stream into a store (:mod:`.slots`).

Per batch, in this order (:mod:`nestpipe.trainer.step` calls them):

    input_dist     key routing: the requester's plans, the counts and payload All2Alls, the owner's plans -> Routing
    retrieve       the owner makes the batch's rows readable: the store itself or a buffer (frozen for the batch)
    embed_*        per micro-batch (or all at once): owner pooling, the embedding All2All, requester unpacking
    grad_*         the gradient All2All into the batch's gradient payload (micro-batch i at its own offset)
    update         one row-wise AdaGrad step per store (write path decided at retrieval, owner_compute.write_path)
    sync_dual_buffer / release   DBP: the updated rows copied into the next batch's buffer, then the buffer freed

The exchanges return :class:`~.exchange.InFlight` (``.wait()``): a caller that has other work issues the exchange
asynchronously and does that work before waiting. Every collective takes its process group as an argument: the
pipelined modes give each concurrent stage its own group (:mod:`nestpipe.trainer.distributed.process_groups`) and
issue each group's collectives from one thread only. The per-micro-batch exchange is split into owner work
(:meth:`embed_send`), the collective (:meth:`embed_exchange`, :meth:`grad_exchange`) and requester work
(:meth:`embed_unpack`) so that a communication thread can run the first two while the compute thread runs the dense
model.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from nestpipe.datasets.shards import Manifest
from nestpipe.trainer.embedding import owner_compute, routing as plans
from nestpipe.trainer.embedding.batch import NEG_SLOT, PreparedBatch
from nestpipe.trainer.embedding.config import EmbeddingConfig, row_shape
from nestpipe.trainer.embedding.exchange import InFlight, all_to_all, fuse_by_peer, unfuse_by_peer
from nestpipe.trainer.embedding.placement import make_placement
from nestpipe.trainer.embedding.reduction_based import ReductionBased
from nestpipe.trainer.embedding.replicated import ReplicatedTable
from nestpipe.trainer.embedding.routing import Routing
from nestpipe.trainer.embedding.slots import NEG_SUFFIX, SlotLayout
from nestpipe.trainer.embedding.store import RowStore
from nestpipe.trainer.embedding.tiered_store import TieredRowStore
from nestpipe.trainer.embedding.unique_based import UniqueBased
from nestpipe.trainer.sharding_plan import column_shards, plan_kinds, resolve_plan
from nestpipe.utils.timing import StageTimer
from nestpipe import kernels


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


def table_dims(manifest: Manifest, cfg: EmbeddingConfig, widths: Optional[Dict[str, object]] = None) -> Dict[str, int]:
    """Row width of every table: the embedding dim (``cfg.dim`` or the manifest's) times the table's number of
    blocks in ``widths`` (the model's :attr:`ModelSpec.table_widths`; 1 where absent), plus its extra columns where
    ``widths`` gives ``(blocks, extra)``."""
    out = {}
    for t, spec in manifest.tables.items():
        blocks, extra = row_shape((widths or {}).get(t, 1))
        out[t] = int(cfg.dim or spec.dim) * blocks + extra
    return out


def tiered_store(name: str, placement: TablePlacement, rank: int, dim: int, seed: int, cfg, run_dir: str,
                 world: int, table: str, first_col: int, dtype: torch.dtype,
                 write_back: bool = True) -> TieredRowStore:
    """The ``embedding.tier = mmap`` store of one table (or column shard) on ``rank``; its cache is sized by
    :func:`split_cache` once every store of the rank exists."""
    if dtype != torch.float32:
        raise ValueError(f"embedding.tier=mmap stores float32 rows; the run's dtype is {dtype}")
    store_dir = cfg.store_dir or os.path.join(run_dir or ".", "store")
    return TieredRowStore(name, placement, rank, dim, seed, cfg.init_scale, store_dir, 1,
                          os.path.abspath(run_dir or store_dir), world, table, first_col, write_back)


def split_cache(stores: Dict[str, TieredRowStore], cache_mb: float, timer) -> None:
    """``embedding.dram_cache_mb`` of this rank split over its tiered stores in proportion to their row bytes."""
    total = sum(s.num_rows * (s.dim + 1) * 4 for s in stores.values()) or 1
    for s in stores.values():
        share = cache_mb * (1 << 20) * s.num_rows * (s.dim + 1) * 4 / total
        s.resize_cache(int(share // ((s.dim + 1) * 4)))
        s.timer = timer


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
        names = sorted(manifest.tables)  # per-table keys were checked against them (trainer.config.check_tables)
        self.table_ids = {t: i for i, t in enumerate(names)}
        self.table_kind = {t: manifest.tables[t].kind for t in names}
        self.dims = table_dims(manifest, cfg, widths)
        self.kinds = plan_kinds(cfg.placement, {t: choose_kind(t, manifest.tables[t].vocab, self.table_kind[t], cfg)
                                                for t in names}, cfg.kinds)
        self.plan = resolve_plan(manifest, cfg.placement, self.kinds, self.table_kind, self.dims, world, device.type)
        self.replicated: Dict[str, ReplicatedTable] = {
            t: ReplicatedTable(t, self.table_ids[t], manifest.tables[t].vocab, self.dims[t], seed, cfg.init_scale,
                               device, dtype) for t in names if self.kinds[t] == "replicated"}
        self.stores: Dict[str, RowStore] = {}
        placements = self._build_stores(manifest, names, seed, run_dir, requester_salt, tier_write_back)
        # 2D sparse parallelism (nestpipe.trainer.distributed.sparse_groups): the sharded tables' accumulator scale
        # and the cross-group replica synchronisation run by update(); the config's scale / None in plain training
        self.sparse_momentum_scale = cfg.momentum_scale_groups
        self.replica_sync = None
        # the learning-rate schedule's factor of the current update (optim.embedding_follows; set by the step before
        # each update, 1.0 otherwise: a product by 1.0 changes no bit)
        self.lr_scale = 1.0
        self.negatives = negatives
        self.slot_layout = self._slot_layout(manifest, placements)
        self.slots = self.slot_layout.slots

    def _build_stores(self, manifest: Manifest, names: List[str], seed: int, run_dir: str, requester_salt: int,
                      tier_write_back: bool):
        """One store per sharded table, or per column shard (``table@cJ``, in column order) of a table split by
        columns in a plan file. Returns the placement requesters route each store's keys with."""
        cfg, placements = self.cfg, {}
        for t in names:
            if self.kinds[t] == "replicated":
                continue
            v = manifest.tables[t].vocab
            for cs in column_shards(self.plan, t, self.dims[t]):
                pl = make_placement(self.table_ids[t], v, self.world, owners=cs.owners)
                if cfg.tier == "mmap":
                    self.stores[cs.store] = tiered_store(cs.store, pl, self.rank, cs.dim, seed, cfg, run_dir,
                                                         self.world, t, cs.first_col, self.dtype,
                                                         write_back=tier_write_back)
                else:
                    self.stores[cs.store] = RowStore(cs.store, pl, self.rank, cs.dim, seed, cfg.init_scale,
                                                     self.dtype, eager_rows=cfg.eager_init_max_rows,
                                                     huge_pages=cfg.huge_pages, table=t, first_col=cs.first_col)
                placements[cs.store] = make_placement(self.table_ids[t], v, self.world, salt=requester_salt,
                                                      owners=cs.owners)
        if cfg.tier == "mmap":
            split_cache(self.stores, cfg.dram_cache_mb, self.timer)
        return placements

    def _slot_layout(self, manifest: Manifest, placements) -> SlotLayout:
        slots = list(self.stores)
        if self.negatives and "item" in self.kinds and self.kinds["item"] != "replicated":
            slots += [st + NEG_SUFFIX for st in self.stores if self.stores[st].table == "item"]
        # The routing payload carries local rows (< a store's rows), key positions (< a table's vocabulary: keys
        # are unique in-vocabulary ids) and sample indices (< the batch size): int32 when all of these fit (the
        # same static rule on every rank, so both sides of the All2All agree), which halves its bytes.
        bound = max([manifest.batch_size] + [manifest.tables[s.table].vocab for s in self.stores.values()])
        return SlotLayout(self.rank, self.world, self.device, slots, {st: s.table for st, s in self.stores.items()},
                          {st: s.dim for st, s in self.stores.items()},
                          {st: s.num_rows for st, s in self.stores.items()}, placements, self.kinds,
                          self.table_kind, manifest.batch_size, np.int32 if bound < 2 ** 31 else np.int64)

    @property
    def store_dims(self) -> Dict[str, int]:
        return self.slot_layout.store_dims

    def bag_update(self) -> bool:
        """Whether the owners update with :func:`nestpipe.kernels.adagrad_bags` (the TBE backward's arithmetic) instead
        of the entry update: a fixed rule (its path is a compiled one, numba or fbgemm; float32; plain row-wise
        AdaGrad, i.e. no 2D-SP momentum scale), the same on every rank and for every schedule."""
        return (kernels.select_path("adagrad_bags", self.device) in ("numba", "fbgemm") and self.dtype == torch.float32
                and self.sparse_momentum_scale == 1 and self.replica_sync is None)

    def _a2a(self, send: torch.Tensor, send_splits: List[int], recv_splits: List[int], stage: str, group,
             out: Optional[torch.Tensor] = None, async_op: bool = False) -> InFlight[torch.Tensor]:
        return all_to_all(self.timer, self.rank, send, send_splits, recv_splits, stage,
                          group if group is not None else self.group, out, async_op)

    # -- stage: key routing --------------------------------------------------------------------------------------
    def input_dist(self, batch: PreparedBatch, group=None, async_op: bool = False) -> InFlight[Routing]:
        """Key routing of one batch (two ``all_to_all_single`` on ``group``). Depends only on the batch's keys and
        the placement, never on parameter values, so it may run any number of batches ahead.

        requester: bucket each slot's keys by owner -> one fused counts All2All -> one payload All2All; owner:
        parse what every requester sent -> per-micro-batch payload sizes -> per-store owner plans. With
        ``async_op`` the requester's plans are built and the counts All2All issued on return; ``advance()`` waits
        for the counts and issues the payload All2All; ``wait()`` builds the owner's plans. The same collectives
        carry the same bytes in the same order either way, so the Routing is the same."""
        return InFlight(self._route(batch, group, async_op))

    def _route(self, batch: PreparedBatch, group, async_op: bool):
        lay = self.slot_layout
        req = {slot: plans.requester_plan(lay, batch, slot) for slot in self.slots}
        counts, payload = plans.route_payload(lay, batch, req)
        span = self.timer.span("route.total")  # the compute thread's time in the collectives and owner plans
        with span:
            C = counts.shape[1]
            got_counts = self._a2a(torch.from_numpy(counts.reshape(-1)).to(self.device), [C] * self.world,
                                   [C] * self.world, "route", group, async_op=async_op)
        yield
        with span:
            got_counts = got_counts.wait().view(self.world, C).cpu().numpy()
            send = torch.from_numpy(plans.payload_array(lay, batch, payload)).to(self.device)
            got = self._a2a(send, [len(p) for p in payload], plans.payload_receive_sizes(lay, batch, got_counts),
                            "route", group, async_op=async_op)
        yield
        with span:
            return plans.owner_routing(lay, batch, req, got_counts, got.wait().cpu().numpy(), self.bag_update(),
                                       self.negatives)

    # -- stage: embedding retrieval -----------------------------------------------------------------------------
    def retrieve(self, routing: Routing, synchronous: bool = False, copy=None, host_buffer=None) -> None:
        """Make the batch's owner rows readable (weights + AdaGrad state) and allocate its gradient payload.

        Called by the retrieval stage, possibly while the previous batch trains: rows it shares with that batch may
        be stale here and are overwritten by :meth:`sync_dual_buffer` before this buffer serves any request.
        ``synchronous`` (the synchronous schedules: nothing else touches the store during the batch): on CPU the
        batch reads and updates its rows in the store itself (owner_compute.write_path); the values read and the
        arithmetic are those of the buffered path, so both give bitwise the same results. ``copy``: how a
        gathered host tensor reaches the device (default ``.to(device)``; the DBP retrieval passes its stream's);
        ``host_buffer(shape, dtype)``: pinned memory to gather into, or None (the stream's, on an accelerator)."""
        host = self.device.type == "cpu" and self.replica_sync is None
        paths = {st: owner_compute.write_path(synchronous, host, self.cfg.dbp_update_in_store, s.in_dram)
                 for st, s in self.stores.items()}
        owner_compute.retrieve(routing, self.stores, paths, self.device, self.dtype, self.timer, self._tier_span,
                               copy=copy, host_buffer=host_buffer)

    def _tier_span(self, store, name: str, traced_as: str, step: int):
        """A memory-mapped store's gather or write-back: timed as ``name``, and a span of the run's trace
        (``traced_as``) where the store is tiered (its file reads and writes happen there)."""
        return self.timer.span(name, None if store.in_dram else step, traced_as=traced_as)

    # -- the embedding All2All ----------------------------------------------------------------------------------
    def embed_all(self, routing: Routing, group=None, async_op: bool = False
                  ) -> InFlight[List[Tuple[Dict[str, torch.Tensor], torch.Tensor]]]:
        """Every micro-batch's outputs (per table; ``item#neg`` for negatives) and received leaf through ONE
        All2All (the synchronous schedules, where nothing overlaps the exchange anyway): the owner pools every
        micro-batch from the frozen rows, the per-micro-batch payloads travel concatenated per destination, and each
        micro-batch's received payload becomes its own leaf. The values are those of per-micro-batch exchanges (the
        same rows, the same sums), so the result is bitwise that of :meth:`embed_send` / :meth:`embed_exchange` /
        :meth:`embed_unpack` micro-batch by micro-batch; only the number of collectives differs."""
        N, W = len(routing.batch.micro), self.world
        with self.timer.span("embed.owner"):
            sizes = [sum(routing.send_splits[i]) for i in range(N)]
            flat = torch.empty(sum(sizes), dtype=self.dtype, device=self.device)
            owner_compute.pool_all(routing, flat)
        if N == 1:  # one micro-batch: its payload is in peer order already
            send = flat
        else:
            send = fuse_by_peer([list(torch.split(x, routing.send_splits[i]))
                                 for i, x in enumerate(torch.split(flat, sizes))], W, self._empty())
        recv = self._a2a(send, [sum(routing.send_splits[i][r] for i in range(N)) for r in range(W)],
                         [sum(routing.recv_splits[i][r] for i in range(N)) for r in range(W)], "embed", group,
                         async_op=async_op)

        def unpack(got: torch.Tensor):
            per_mb = [got] if N == 1 else [torch.cat(p) for p in unfuse_by_peer(got, routing.recv_splits, W)]
            return [self.embed_unpack(routing, i, per_mb[i]) for i in range(N)]
        return recv.then(unpack)

    def embed_send(self, routing: Routing, i: int) -> torch.Tensor:
        """Owner side of micro-batch ``i``: its payload pooled from the frozen rows (owner_compute.pool)."""
        with self.timer.span("embed.owner"):
            send = torch.empty(sum(routing.send_splits[i]), dtype=self.dtype, device=self.device)
            owner_compute.pool(routing, i, send)
            return send

    def embed_exchange(self, routing: Routing, i: int, send: torch.Tensor, group=None,
                       async_op: bool = False) -> InFlight[torch.Tensor]:
        """The embedding All2All of micro-batch ``i`` (owner -> requester) on ``group``."""
        return self._a2a(send, routing.send_splits[i], routing.recv_splits[i], "embed", group, async_op=async_op)

    def embed_unpack(self, routing: Routing, i: int, recv: torch.Tensor) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
        """Requester side of micro-batch ``i``: the received payload becomes the autograd leaf; per-table outputs."""
        with self.timer.span("embed.requester"):
            lay, mbd, batch = self.slot_layout, routing.batch.micro[i], routing.batch
            leaf = recv.requires_grad_(True)
            pieces, blocks = self._payload_blocks(routing, i, leaf)
            out: Dict[str, torch.Tensor] = {}
            pooled_slots = [s for s in self.slots if lay.exchange(s) != "unique"]
            if pooled_slots:
                # one autograd node for all reduction-based slots (see ReductionBased.unpack_flat)
                out.update(zip(pooled_slots, ReductionBased.unpack_flat(leaf, [blocks[s] for s in pooled_slots])))
            b = len(mbd.samples)
            for slot in self.slots:
                if lay.exchange(slot) != "unique":
                    continue
                unperm = routing.req[slot].unperm[i]
                if lay.is_negatives(slot):
                    rows = torch.cat(pieces[slot], 0).index_select(0, unperm)
                    out[slot] = rows.index_select(0, routing.neg_inv)
                else:
                    t = lay.table_of(slot)
                    out[slot] = UniqueBased.unpack(pieces[slot], unperm, self._t(mbd.value_pos[t]),
                                                   self._t(mbd.value_sample[t]), b,
                                                   pooled=self.table_kind[t] != "sequence")
            out = self._whole_rows(out)
            for t, tab in self.replicated.items():
                ids = self._t(batch.keys[t][mbd.value_key[t]])
                out[t] = tab.lookup(ids, self._t(mbd.value_sample[t]), b, pooled=self.table_kind[t] != "sequence")
            if self.negatives and "item" in self.replicated and batch.negatives is not None:
                out[NEG_SLOT] = self.replicated["item"].lookup(self._t(batch.negatives), None, 0, pooled=False)
            return out, leaf

    def _payload_blocks(self, routing: Routing, i: int, leaf: torch.Tensor):
        """Micro-batch ``i``'s received payload, in (owner rank, slot) order: the row pieces of every unique-based
        slot and the (offset, samples, dim) blocks of every reduction-based one."""
        lay, b = self.slot_layout, len(routing.batch.micro[i].samples)
        pieces: Dict[str, List[torch.Tensor]] = {s: [] for s in self.slots}
        blocks: Dict[str, List[Tuple[int, int, int]]] = {s: [] for s in self.slots}
        off = 0
        for r in range(self.world):
            for slot in self.slots:
                dim = lay.store_dims[lay.store_of(slot)]
                if lay.exchange(slot) == "unique":
                    n = len(routing.req[slot].mb_lists[i][r])
                    pieces[slot].append(leaf[off:off + n * dim].view(n, dim))
                elif lay.holds(slot, r):
                    n = b
                    blocks[slot].append((off, n, dim))
                else:
                    n = 0  # rank r holds none of the table: no partial sum from it
                off += n * dim
        return pieces, blocks

    def _whole_rows(self, out: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Slot outputs -> model inputs in slot order: a table's column shards concatenated in column order (the
        slots of one table are consecutive and in column order), every other slot as it is."""
        parts: Dict[str, List[torch.Tensor]] = {}
        for slot in self.slots:
            parts.setdefault(self.slot_layout.output_of(slot), []).append(out[slot])
        return {k: v[0] if len(v) == 1 else torch.cat(v, -1) for k, v in parts.items()}

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)

    def _empty(self) -> torch.Tensor:
        return torch.zeros(0, dtype=self.dtype, device=self.device)

    # -- the gradient All2All -----------------------------------------------------------------------------------
    def grad_exchange_all(self, routing: Routing, leaves: List[torch.Tensor], group=None,
                          async_op: bool = False) -> InFlight[None]:
        """Every micro-batch's gradient exchange (after all of their backwards) through ONE All2All, received into
        each micro-batch's slice of the gradient payload: the bytes of :meth:`grad_exchange` micro-batch by
        micro-batch, in one collective."""
        N, W = len(routing.batch.micro), self.world
        grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
        send_sizes = [sum(routing.recv_splits[i][r] for i in range(N)) for r in range(W)]
        recv_sizes = [sum(routing.send_splits[i][r] for i in range(N)) for r in range(W)]
        if N == 1:  # in peer order already: received straight into the payload
            return self._a2a(grads[0].contiguous(), send_sizes, recv_sizes, "grad", group,
                             out=self._grad_slice(routing, 0), async_op=async_op).then(lambda _: None)
        send = fuse_by_peer([list(torch.split(g, routing.recv_splits[i])) for i, g in enumerate(grads)], W,
                            self._empty())
        recv = self._a2a(send, send_sizes, recv_sizes, "grad", group, async_op=async_op)

        def accumulate(got: torch.Tensor) -> None:
            with self.timer.span("grad.owner"):
                for i, parts in enumerate(unfuse_by_peer(got, routing.send_splits, W)):
                    off = routing.grad_mb_off[i]
                    for part in parts:
                        routing.grad_payload[off:off + part.numel()].copy_(part)
                        off += part.numel()
        return recv.then(accumulate)

    def _grad_slice(self, routing: Routing, i: int) -> Optional[torch.Tensor]:
        """Micro-batch ``i``'s slice of the batch's gradient payload (None before retrieval)."""
        if routing.grad_payload is None:
            return None
        off = routing.grad_mb_off[i]
        return routing.grad_payload[off:off + sum(routing.send_splits[i])]

    def grad_exchange(self, routing: Routing, i: int, g: torch.Tensor, group=None,
                      async_op: bool = False) -> InFlight[None]:
        """The gradient All2All of micro-batch ``i`` (requester -> owner) on ``group``, received straight into
        micro-batch ``i``'s slice of the batch's gradient payload. The update sums every entry's pairs over
        micro-batches in index order, then every row's entries in entry order: the arithmetic of ``index_add_``
        into per-entry gradients once per micro-batch, without materialising them."""
        return self._a2a(g.contiguous(), routing.recv_splits[i], routing.send_splits[i], "grad", group,
                         out=self._grad_slice(routing, i), async_op=async_op).then(lambda _: None)

    # -- stage: owner update -------------------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, routing: Routing, release: bool = True, write_back_stream=None) -> None:
        """One row-wise AdaGrad step per store (owner_compute.update_store); entries are summed in entry
        (= requester rank) order. The updated rows are in the DRAM store (the source of truth) when this returns,
        except with ``write_back_stream`` (DBP on a device stream, :class:`~nestpipe.trainer.pipeline.streams.StageStream`):
        the buffers' copies to the host are enqueued on it and :attr:`Routing.pending_write_back` scatters them into
        the stores when finished (the retrieval stage does, before its next gather). With ``release=False`` the
        batch's buffer (the *active* buffer) is kept for :meth:`sync_dual_buffer`, and the gradient payload restarts
        from zero."""
        # 2D-SP averages the replicas in the store right after the owner's write-back: that one stays synchronous
        defer = write_back_stream is not None and self.replica_sync is None
        with self.timer.span("update.sparse"):
            g = routing.grad_payload
            before = self.replica_sync.snapshot(routing) if self.replica_sync is not None else None
            deferred = [st for st, o in routing.own.items()
                        if owner_compute.update_store(self.stores[st], o, g, self.lr_of(self.stores[st].table),
                                                      self.cfg.eps, self.sparse_momentum_scale, routing.batch.step,
                                                      self._tier_span, defer_write_back=defer)]
            if deferred:
                self._write_back_later(routing, deferred, write_back_stream)
            if self.replica_sync is not None:  # 2D-SP: average the replicas of the touched rows (store and buffer)
                self.replica_sync.sync(routing, before)
            if release:
                self.release(routing)
            elif g is not None:
                g.zero_()  # the gradients restart from zero (only the per-micro-batch-update control updates again)

    def _write_back_later(self, routing: Routing, names: List[str], stream) -> None:
        """The updated buffers of stores ``names`` to the host on ``stream``; their scatter into the stores is
        :attr:`Routing.pending_write_back` (an earlier one still pending on this batch is finished first)."""
        if routing.pending_write_back is not None:
            routing.pending_write_back.finish()
        plans = [(self.stores[st], routing.own[st]) for st in names]
        step = routing.batch.step

        def scatter(host: List[torch.Tensor]) -> None:
            for k, (store, o) in enumerate(plans):
                owner_compute.write_back(store, o.rows, host[2 * k], host[2 * k + 1], step, self._tier_span)

        routing.pending_write_back = stream.write_back([t for _, o in plans for t in (o.buf_w, o.buf_s)], scatter)

    def sync_dual_buffer(self, active: Routing, prefetch: Routing) -> int:
        """DBP consistency (owner_compute.sync_dual_buffer): batch t's updated rows that batch t+1 shares, copied
        into t+1's buffer. Returns the number of rows copied."""
        return owner_compute.sync_dual_buffer(active, prefetch, self.stores)

    @staticmethod
    def release(routing: Routing) -> None:
        """Free a batch's buffers (after its update and, in DBP, after the sync into the next batch)."""
        owner_compute.release(routing)

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
