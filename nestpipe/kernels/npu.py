"""Ascend path: torch ops on ``npu`` tensors, dispatched by torch_npu to Ascend kernels.

Imported only when tensors live on an npu device (``select.select_path`` returns ``"npu"`` only when
``import torch_npu`` works). No Ascend hardware is available where this project is tested, so this path is the
device-generic composition of :mod:`nestpipe.kernels.reference` run on the NPU, with the backward's segment sums
done by a stable sort + per-rank ``index_add_`` rounds, each of which writes every target row at most once, so no
accumulation order depends on the hardware.
"""

from __future__ import annotations

import torch

try:  # import guard: torch_npu exists only on Ascend hosts with CANN installed
    import torch_npu  # noqa: F401
except Exception as e:  # pragma: no cover - depends on the host
    raise ImportError(f"the Ascend kernel path needs torch_npu: {e}") from e

from . import reference

def gather_rows(weights: torch.Tensor, rows: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
    rows_ = reference.gather_rows(weights, rows)
    return out.copy_(rows_) if out is not None else rows_


csr_by_segment = reference.csr_by_segment
adagrad_update = reference.adagrad_update


def dual_buffer_sync(active_keys, active_rows, prefetch_keys, prefetch_rows) -> None:
    reference.dual_buffer_sync(active_keys, active_rows, prefetch_keys, prefetch_rows)


def segment_sum_rows(src: torch.Tensor, src_index: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Deterministic segment sums: round k adds the k-th element of every segment (targets distinct per round)."""
    counts = offsets.diff()
    num = counts.numel()
    out = torch.zeros(num, src.shape[1], dtype=src.dtype, device=src.device)
    seg = torch.repeat_interleave(torch.arange(num, device=src.device), counts)
    rank = torch.arange(src_index.numel(), device=src.device) - offsets[:-1][seg]
    for k in range(int(counts.max()) if num else 0):
        pick = (rank == k).nonzero().squeeze(1)
        out.index_add_(0, seg[pick], src.index_select(0, src_index[pick]))
    return out


def take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return values.index_select(0, index)
