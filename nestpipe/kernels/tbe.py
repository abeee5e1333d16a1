"""fbgemm's table-batched embedding (TBE) CPU backward with fused row-wise AdaGrad, called on one table's rows.

``torch.ops.fbgemm.split_embedding_backward_codegen_rowwise_adagrad_cpu`` is the op under fbgemm's
``SplitTableBatchedEmbeddingBagsCodegen`` (HOST location, ``EXACT_ROWWISE_ADAGRAD``). It is called here directly
on a single table whose weights are any contiguous ``[R, D]`` float32 tensor the caller owns (a store or a
buffer), so that NestPipe keeps its own row ownership and buffers while fbgemm does the arithmetic: it groups the
bags' indices by row (a stable sort), sums each row's bag gradients, and applies ``v += mean(g^2)``,
``w -= lr / (sqrt(v) + eps) * g`` to every touched row once, in place.

Determinism: given the same (indices, offsets, grad_output) the result is bitwise the same (tested); the
summation order depends only on the indices' relative order and the bag order, so a monotone renumbering of the
rows (store rows -> buffer positions of the sorted distinct rows) gives the same arithmetic.
"""

from __future__ import annotations

import torch

_ZERO_I32 = torch.zeros(1, dtype=torch.int32)
_ZERO_I64 = torch.zeros(1, dtype=torch.int64)
_NO_WEIGHTS = torch.empty(0, dtype=torch.float32)
POOLING_SUM = 0


def adagrad_bags(weight: torch.Tensor, state: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                 grad_output: torch.Tensor, lr: float, eps: float) -> None:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm; selected only when it imports)

    rows, dim = weight.shape
    torch.ops.fbgemm.split_embedding_backward_codegen_rowwise_adagrad_cpu(
        grad_output, weight.view(-1), _ZERO_I32, _ZERO_I64, torch.tensor([0, dim], dtype=torch.int32), dim,
        torch.tensor([0, rows], dtype=torch.int64), max(1, int(rows).bit_length()), indices, offsets, POOLING_SUM,
        _NO_WEIGHTS, False, state, _ZERO_I32, _ZERO_I64, torch.tensor(float(lr), dtype=torch.float32), eps=float(eps))
