"""The DRAM tier: the rows one rank owns for one table, with their row-wise AdaGrad state beside them.

Invariants
- Rank ``r`` holds exactly the rows :class:`~nestpipe.trainer.embedding.placement.TablePlacement` assigns it, as one
  contiguous ``[local_rows, dim]`` float32 tensor plus a ``[local_rows]`` accumulator. The store is the source of
  truth between batches: a batch's rows are gathered from it (retrieval) and written back after the update.
- :meth:`RowStore.gather` and :meth:`RowStore.write_back` hold the store's lock: the retrieval stage (its own
  thread in the pipelined modes) never reads a half-written batch of rows while the compute thread writes back.
- A store holds whole rows of its table, or one column range of them when the table is split by columns (a
  *column shard*, named ``table@cJ``, with its own row-wise AdaGrad state over its columns, as fbgemm's TBE keeps
  per shard).
- A row is materialised on first touch from ``init_rows(seed, table, id)``; until then its memory is never read
  (``host_empty``/``host_zeros`` pages are not touched, so a 32M-row table costs nothing until used). Stores
  initialised whole (below) sit on transparent huge pages where Linux offers them (``embedding.huge_pages``, see
  :mod:`nestpipe.kernels.memory`); lazily initialised ones keep 4 KiB pages, so memory follows the touched rows.
  Stores of at most ``eager_rows`` rows are materialised whole at construction instead (the same values:
  initialisation is a pure function of (seed, table, id)), so steady-state steps never pay for first touches.
"""

from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from nestpipe.trainer.embedding.placement import TablePlacement, init_rows
from nestpipe.kernels.memory import host_empty, host_zeros
from nestpipe import kernels


class RowStore:
    in_dram = True  # the trainer may read and update it in place (the direct and update-in-store paths)

    def __init__(self, name: str, placement: TablePlacement, rank: int, dim: int, seed: int, init_scale: float,
                 dtype: torch.dtype = torch.float32, eager_rows: int = 0, huge_pages: str = "resident",
                 table: str = "", first_col: int = 0):
        self.name = name  # the store: the table's name, or ``table@cJ`` for column shard J of a column-split table
        self.table = table or name
        self.first_col = first_col  # the store holds columns [first_col, first_col + dim) of the table's rows
        self.placement = placement
        self.rank = rank
        self.dim = dim
        self.seed = seed
        self.init_scale = init_scale
        n = placement.local_rows(rank)

        eager = 0 < n <= eager_rows
        self.huge_pages = huge_pages == "always" or (huge_pages == "resident" and eager)
        self.weight = host_empty((n, dim), dtype, self.huge_pages)
        self.state = host_zeros((n,), dtype, self.huge_pages)
        self.materialized = torch.zeros(n, dtype=torch.bool)
        self.num_materialized = 0
        self.lock = threading.Lock()
        if eager:
            for lo in range(0, n, 1 << 18):  # bounded temporaries
                self.materialize(torch.arange(lo, min(n, lo + (1 << 18))))

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    def materialize(self, rows: torch.Tensor) -> int:
        """Initialise the not yet touched rows among ``rows`` (int64, unique). Returns how many were new."""
        new = rows[~self.materialized[rows]]
        if len(new):
            ids = self.placement.ids_of_rows(self.rank, new.numpy())
            vals = init_rows(self.seed, self.placement.table_id, ids, self.dim, self.init_scale, self.first_col)
            self.weight.index_copy_(0, new, torch.from_numpy(vals).to(self.weight.dtype))
            self.materialized[new] = True
            self.num_materialized += len(new)
        return len(new)

    def ensure_materialized(self, rows: torch.Tensor) -> None:
        """Materialise the untouched rows among ``rows`` (under the lock); free once every row was touched."""
        if self.num_materialized < self.num_rows:
            with self.lock:
                self.materialize(rows)

    def gather(self, rows: torch.Tensor, with_state: bool = True,
               out: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None
               ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(weights [n, dim], state [n] or None without ``with_state``) of ``rows`` (int64, unique), materialising
        untouched ones; written into ``out`` (weights, state) when given (pinned staging memory)."""
        w_out, s_out = out if out is not None else (None, None)
        with self.lock:
            if self.num_materialized < self.num_rows:
                self.materialize(rows)
            # the row gather through the kernels' dispatch (its path is recorded); the state is one float per row
            w = kernels.gather_rows(self.weight, rows, w_out)
            if not with_state:
                return w, None
            return w, (torch.index_select(self.state, 0, rows, out=s_out) if s_out is not None
                       else self.state.index_select(0, rows))

    def write_back(self, rows: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> None:
        with self.lock:
            self.weight.index_copy_(0, rows, weight.to(self.weight.device))
            self.state.index_copy_(0, rows, state.to(self.state.device))

    # -- checkpoints: only materialised rows are saved ------------------------------------------------------------
    def state_dict(self) -> Dict[str, torch.Tensor]:
        rows = torch.nonzero(self.materialized).flatten()
        return {"rows": rows, "weight": self.weight.index_select(0, rows), "state": self.state.index_select(0, rows)}

    def load_state_dict(self, d: Dict[str, torch.Tensor], where: str = "") -> None:
        if "snapshot" in d:
            raise ValueError(f"{where}: table {self.name} was checkpointed by the memory-mapped tier (its row files); "
                             "resume with --set embedding.tier=\"mmap\"")
        rows = d["rows"].to(torch.int64)
        if len(rows) and int(rows.max()) >= self.num_rows:
            raise ValueError(f"{where}: table {self.name}: checkpoint row {int(rows.max())} >= {self.num_rows} rows")
        if d["weight"].shape != (len(rows), self.dim):
            raise ValueError(f"{where}: table {self.name}: weight shape {tuple(d['weight'].shape)} != ({len(rows)}, {self.dim})")
        self.materialized.zero_()
        self.state.zero_()
        self.weight.index_copy_(0, rows, d["weight"].to(self.weight.dtype))
        self.state.index_copy_(0, rows, d["state"].to(self.state.dtype))
        self.materialized[rows] = True
        self.num_materialized = int(self.materialized.sum())

    def full_rows(self, start: int, stop: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Local rows ``[start, stop)`` with untouched rows materialised on the fly (export)."""
        rows = torch.arange(start, stop, dtype=torch.int64)
        return self.gather(rows)


def rowwise_adagrad(weight: torch.Tensor, state: torch.Tensor, grad: torch.Tensor, lr: float, eps: float,
                    groups: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Row-wise AdaGrad (fbgemm's EXACT_ROWWISE_ADAGRAD): ``v += mean(g^2)``; ``w -= lr / (sqrt(v / M) + eps) * g``.

    ``groups = M > 1`` is 2D sparse parallelism's momentum-scaled variant; ``M = 1`` is plain row-wise AdaGrad.
    ``eps`` is outside the square root in both, the formula of ``nestpipe.kernels.adagrad_update`` (one formula
    for the whole project, see docs/kernels.md).
    """
    state = state + grad.square().mean(dim=1)
    if groups > 1:
        mult = lr / (torch.sqrt(state / groups) + eps)
    else:
        mult = lr / (torch.sqrt(state) + eps)
    return weight - mult.unsqueeze(1) * grad, state


def apply_adagrad(weight: torch.Tensor, state: torch.Tensor, rows: torch.Tensor, grad_entries: torch.Tensor,
                  lr: float, eps: float, groups: int, segments: Tuple[torch.Tensor, torch.Tensor],
                  inv: torch.Tensor, pairs: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
    """Row-wise AdaGrad (:func:`rowwise_adagrad`'s formula) of ``weight[rows]`` / ``state[rows]`` in place. Row
    ``i``'s gradient is the sum of its entries' gradients (``grad_entries[inv == i]``) in ascending entry order from
    zero; ``segments`` = (order, offsets) lists them grouped by row. With ``pairs = (entry_offsets, pair_src)``,
    ``grad_entries`` is a flat source and entry ``e``'s gradient is the sum of its pairs' rows
    (``grad_entries[pair_src[p]:pair_src[p] + D]``, ascending ``p`` from zero; see
    ``nestpipe.kernels.adagrad_update``). float32: ``nestpipe.kernels.adagrad_update`` on every device (its
    dispatch: the fused Numba pass on CPU, ordered Triton segment sums + the Triton update on CUDA); otherwise (the
    float64 test runs) ``index_add_`` on the host (ordered) and the same formula in plain torch."""
    if weight.dtype == torch.float32 and weight.is_contiguous():
        kernels.adagrad_update(weight, state, rows, grad_entries.to(torch.float32), lr, eps, float(groups),
                         grad_segments=segments, grad_pairs=pairs)
        return
    if pairs is not None:
        grad_entries = kernels.entry_grads_from_pairs(grad_entries, pairs[0], pairs[1], weight.shape[1])
    grad = torch.zeros(int(segments[1].numel() - 1), grad_entries.shape[1],
                       dtype=grad_entries.dtype, device=grad_entries.device)
    grad.index_add_(0, inv.to(grad.device), grad_entries)
    w, s = rowwise_adagrad(weight.index_select(0, rows), state.index_select(0, rows), grad.to(weight.device), lr,
                           eps, groups)
    weight.index_copy_(0, rows, w)
    state.index_copy_(0, rows, s)


def numpy_int64(t) -> np.ndarray:
    return np.asarray(t, dtype=np.int64)
