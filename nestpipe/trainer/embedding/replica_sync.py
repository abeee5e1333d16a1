"""2D sparse parallelism: synchronising the replicas of every shard across groups after each batch's update.

Layout (:mod:`nestpipe.trainer.distributed.sparse_groups`): ``G`` groups of ``M`` workers; worker ``j`` of every group owns the
same shard ``j`` of every sharded table, so each shard has ``G`` replicas, one per group, on ranks
``j, j + M, ..., j + (G - 1) M`` (the ``replica`` process group, group rank = group index).

Semantics (TorchRec ``DMPCollection.sync``: weights and optimizer state averaged over the replica group; here only
over the rows some group touched, so untouched rows keep their exact bits for any ``G``). Per batch ``t``:

1. Every group ``k`` updates its own replica with its own gradient (its ranks' micro-batches, summed in entry
   order as in plain training, loss normalised by the global batch ``B * W``): row-wise AdaGrad, or the 2D-SP
   momentum-scaled variant (accumulator divided by ``G``), gives ``(w_k, v_k)`` for the rows ``R_k`` it touched.
2. For every row ``u`` in ``U = R_0 ∪ ... ∪ R_{G-1}`` (the rows touched by ANY group), every replica sets
       ``x(u) = ((x_0(u) + x_1(u)) + ... + x_{G-1}(u)) / G``   for ``x`` = weight and AdaGrad state,
   with ``x_k(u)`` group ``k``'s updated value if ``u ∈ R_k``, else the value before batch ``t`` (identical on every
   replica). The sum runs in group order from ``x_0``; every replica computes it from the same gathered operands, so
   all replicas of a shard end bitwise identical (by induction from the identical deterministic initialisation).
   Rows outside ``U`` are not touched.
3. Communication, on the ``replica`` group, issued by the compute thread: one ``all_gather`` of the per-table row
   counts, one of the touched rows (int64) and one of the updated values (weight and state packed, padded to the
   largest replica's size).

With ``G = 1`` (``M = world``) this module is not used: plain training.

Consequence for the Dual-Buffer Pipeline (the invariant enforced by :meth:`ReplicaSync.refresh_prefetch`, called
from :meth:`nestpipe.trainer.pipeline.dual_buffer.DualBuffer.sync`): the synchronisation changes rows of this rank's
shard that its own group did not touch (``U`` minus ``R_mine``), and the prefetch buffer of batch t+1 may have
gathered them before batch t's synchronisation wrote them back. So the dual-buffer sync must copy every row of
``U ∩ keys(t+1)``, not only ``keys(t) ∩ keys(t+1)``; the ``replica_refresh_own_keys_only`` testing hook restricts it to
the group's own keys (the negative control, which breaks nested == off).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from nestpipe.trainer.distributed.process_groups import StageGroups
from nestpipe.trainer.distributed.sparse_groups import SparseLayout, momentum_scale


class ReplicaSync:
    """Averages the replicas of this rank's shard over its ``replica`` group (see the module docstring).

    ``get_group()`` returns the ``replica`` process group (checked against its one issuing thread)."""

    def __init__(self, emb, num_groups: int, get_group, skip: bool = False):
        self.emb = emb
        self.num_groups = num_groups
        self.get_group = get_group
        self.skip = skip  # debug: no synchronisation (negative control: replicas diverge)
        self._last_step: Optional[int] = None
        self._last: Dict[str, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.stats = {"syncs": 0, "rows_synced": 0, "rows_from_other_groups": 0, "prefetch_rows_refreshed": 0,
                      "prefetch_rows_refreshed_outside_own_keys": 0}

    # -- called by ShardedEmbeddingCollection.update ---------------------------------------------------------------
    @torch.no_grad()
    def snapshot(self, routing) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        """The batch's buffered rows before the update: the pre-batch values of the rows this group touches."""
        return {st: (o.buf_w.clone(), o.buf_s.clone()) for st, o in routing.own.items()}

    @torch.no_grad()
    def sync(self, routing, before: Dict[str, Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """After the owner's update and write-back: average the touched rows over the replicas (store and the
        batch's buffer), and keep the result for :meth:`refresh_prefetch`."""
        self._last, self._last_step = {}, routing.batch.step
        if self.skip:
            return
        emb = self.emb
        names = list(routing.own)
        G = self.num_groups
        dims = [emb.stores[st].dim for st in names]
        with emb.timer.span("replica.comm"):
            all_counts, g_rows, g_vals = self._gather_replicas(routing, names, dims)
        with emb.timer.span("replica.average"):
            row_off = [0] * G
            val_off = [0] * G
            for si, st in enumerate(names):
                D = dims[si]
                per_k: List[Tuple[np.ndarray, torch.Tensor]] = []
                for k in range(G):
                    c = int(all_counts[k, si])
                    r = g_rows[k, row_off[k]:row_off[k] + c].numpy()
                    v = g_vals[k, val_off[k]:val_off[k] + c * (D + 1)].view(c, D + 1)
                    row_off[k] += c
                    val_off[k] += c * (D + 1)
                    if len(r) > 1 and not bool(np.all(r[1:] > r[:-1])):
                        raise RuntimeError(f"table {st}: replica {k} of shard {emb.rank} sent unsorted or duplicate "
                                           "rows")
                    per_k.append((r, v))
                self._average_store(st, routing.own[st], per_k, before[st])
        self.stats["syncs"] += 1

    def _gather_replicas(self, routing, names: List[str], dims: List[int]):
        """Every group's touched rows of this shard and their updated values (weights + state), all-gathered over
        the replica group: (row counts [G, stores], rows [G, ...], values [G, ...])."""
        G, group = self.num_groups, self.get_group()
        mine_rows = [routing.own[st].rows.to(torch.int64) for st in names]
        counts = torch.tensor([len(r) for r in mine_rows], dtype=torch.int64)
        all_counts = self._all_gather(counts, group).view(G, len(names))  # [G, S]
        n_rows = all_counts.sum(1)
        n_vals = (all_counts * torch.tensor([d + 1 for d in dims], dtype=torch.int64)).sum(1)
        rows_flat = torch.cat(mine_rows) if mine_rows else torch.zeros(0, dtype=torch.int64)
        vals = [torch.cat([routing.own[st].buf_w, routing.own[st].buf_s.unsqueeze(1)], 1).reshape(-1).cpu()
                for st in names]
        vals_flat = torch.cat(vals) if vals else torch.zeros(0, dtype=self.emb.dtype)
        g_rows = self._all_gather(_pad(rows_flat, int(n_rows.max())), group).view(G, -1)
        g_vals = self._all_gather(_pad(vals_flat, int(n_vals.max())), group).view(G, -1)
        self.emb.timer.add_bytes("replica", (G - 1) * (rows_flat.numel() * 8 + vals_flat.numel() * vals_flat.element_size()))
        return all_counts, g_rows, g_vals

    def _average_store(self, st: str, o, per_k: List[Tuple[np.ndarray, torch.Tensor]],
                       before: Tuple[torch.Tensor, torch.Tensor]) -> None:
        """One store: the average over the replicas (in group order) of every row some group touched, written to the
        store and to this group's buffer; a row a group did not touch counts with its value before batch t."""
        emb = self.emb
        D = emb.stores[st].dim
        union = np.unique(np.concatenate([r for r, _ in per_k])) if per_k else np.zeros(0, np.int64)
        mine = o.rows.numpy()
        pos_mine = np.searchsorted(union, mine)
        # values before batch t of every row in U: this group's own rows from the pre-update buffer, the others
        # from the store (not written since the previous synchronisation)
        base = torch.empty(len(union), D + 1, dtype=emb.dtype)
        bw, bs = before
        base[torch.from_numpy(pos_mine), :D] = bw.cpu()
        base[torch.from_numpy(pos_mine), D] = bs.cpu()
        other = np.setdiff1d(np.arange(len(union)), pos_mine, assume_unique=True)
        if len(other):
            w, s = emb.stores[st].gather(torch.from_numpy(union[other]))
            base[torch.from_numpy(other), :D] = w
            base[torch.from_numpy(other), D] = s
        acc = None
        for r, v in per_k:  # group order
            x = base.clone()
            x[torch.from_numpy(np.searchsorted(union, r))] = v
            acc = x if acc is None else acc.add_(x)
        new = acc / self.num_groups
        u_t = torch.from_numpy(union)
        new_w, new_s = new[:, :D].contiguous(), new[:, D].contiguous()
        emb.stores[st].write_back(u_t, new_w, new_s)
        if o.buf_w is not None:
            pm = torch.from_numpy(pos_mine).to(o.buf_w.device)
            o.buf_w.copy_(new_w.to(o.buf_w.device).index_select(0, pm))
            o.buf_s.copy_(new_s.to(o.buf_s.device).index_select(0, pm))
        self._last[st] = (u_t, new_w, new_s)
        self.stats["rows_synced"] += len(union)
        self.stats["rows_from_other_groups"] += len(union) - len(mine)

    def _all_gather(self, t: torch.Tensor, group) -> torch.Tensor:
        """``all_gather`` on the collection's device (NCCL/HCCL need device tensors); the result on the host."""
        t = t.contiguous().to(self.emb.device)
        out = [torch.empty_like(t) for _ in range(self.num_groups)]
        dist.all_gather(out, t, group=group)
        return torch.cat(out).cpu()

    # -- called by DualBuffer.sync (the DBP hand-over) -------------------------------------------------------------
    @torch.no_grad()
    def refresh_prefetch(self, active, prefetch) -> int:
        """The DBP invariant under 2D-SP: when batch t+1's buffer serves its first request, every row in it equals
        the store's row after batch t's update AND replica synchronisation. Enforced here by copying every row of
        ``U(t) ∩ keys(t+1)`` (``U(t)``: rows touched by ANY group in batch t, all of them changed by the
        averaging) from the synchronised values into the prefetch buffer; ``U(t) ⊇ keys(t)`` of this group, so this
        covers the plain sync of ``keys(t) ∩ keys(t+1)`` too. Rows of t+1 outside ``U(t)`` were not changed by
        batch t, and retrieval of t+1 started after batch t-1's synchronisation (buffer permits). Returns the number
        of rows copied."""
        if self.skip:
            return self.emb.sync_dual_buffer(active, prefetch)
        if self._last_step != active.batch.step:
            raise RuntimeError(f"replica sync holds step {self._last_step}, the dual-buffer sync hands over step "
                               f"{active.batch.step}: the active batch was not synchronised")
        n = 0
        for st, p in prefetch.own.items():
            union, new_w, new_s = self._last[st]
            if p.buf_w is None:
                raise RuntimeError(f"table {st}: dual-buffer sync needs the retrieved prefetch buffer")
            _, iu, ip = np.intersect1d(union.numpy(), p.rows.numpy(), assume_unique=True, return_indices=True)
            if len(iu):
                iu_t, ip_t = torch.from_numpy(iu.astype(np.int64)), torch.from_numpy(ip.astype(np.int64))
                p.buf_w.index_copy_(0, ip_t.to(p.buf_w.device), new_w.index_select(0, iu_t).to(p.buf_w.device))
                p.buf_s.index_copy_(0, ip_t.to(p.buf_s.device), new_s.index_select(0, iu_t).to(p.buf_s.device))
                n += len(iu)
                outside = ~np.isin(union.numpy()[iu], active.own[st].rows.numpy(), assume_unique=True)
                self.stats["prefetch_rows_refreshed_outside_own_keys"] += int(outside.sum())
        self.stats["prefetch_rows_refreshed"] += n
        return n


def _pad(t: torch.Tensor, n: int) -> torch.Tensor:
    n = max(n, 1)  # no empty collectives
    if t.numel() == n:
        return t
    out = torch.zeros(n, dtype=t.dtype)
    out[:t.numel()] = t
    return out


def attach(emb, layout: SparseLayout, optimizer: str, explicit_scale: int, groups: Optional[StageGroups],
           skip_sync: bool = False) -> None:
    """Give the collection (built over the group: ``layout.local_rank`` of ``layout.group_size``) its sharded
    tables' optimizer scale and, with more than one group, the replica synchronisation."""
    emb.sparse_momentum_scale = momentum_scale(optimizer, layout, explicit_scale)
    emb.layout = layout
    if not layout.enabled:
        return
    if groups is None or "replica" not in groups.groups:
        raise RuntimeError(f"--sparse-groups {layout.group_size}: the stage groups were not created for 2D sparse "
                           "parallelism (use sparse_groups.create_stage_groups)")
    emb.replica_sync = ReplicaSync(emb, layout.num_groups, lambda: groups.get("replica"),
                                   skip=skip_sync)


def metrics(emb) -> dict:
    """Per-rank figures for ``metrics.json`` (empty in plain training)."""
    layout = getattr(emb, "layout", None)
    if layout is None or not layout.enabled:
        return {}
    return {"sparse_groups": {"group_size": layout.group_size, "num_groups": layout.num_groups,
                              "group": layout.group, "local_rank": layout.local_rank,
                              **(emb.replica_sync.stats if emb.replica_sync is not None else {})}}
