"""The float64 reference arithmetic the trainer tests compare against: written out, independent of the trainer's
code paths (no stores, exchanges or fused kernels)."""

from __future__ import annotations

from typing import Callable, Dict

import torch


def adamw_step_(params: Dict[str, torch.Tensor], state: Dict[str, tuple], optim, k: int, lr=None) -> None:
    """AdamW written out (decoupled weight decay, bias correction at step ``k`` >= 1) on every parameter with a
    gradient in ``params``; ``state[name]`` is its (exp_avg, exp_avg_sq). ``lr``: this step's rate (default
    ``optim.lr``; the decay uses it too, as torch's AdamW does). Clears the gradients."""
    b0, b1 = optim.betas
    lr = optim.lr if lr is None else lr
    for n, p in params.items():
        m, v = state[n]
        g = p.grad
        p.mul_(1 - lr * optim.weight_decay)
        m.mul_(b0).add_((1 - b0) * g)
        v.mul_(b1).add_((1 - b1) * g * g)
        p -= lr * (m / (1 - b0 ** k)) / ((v / (1 - b1 ** k)).sqrt() + optim.eps)
        p.grad = None


def micro_batch_embeddings(table: Callable[[str], torch.Tensor], manifest, batch, mbd, dims: Dict[str, int],
                           names) -> Dict[str, torch.Tensor]:
    """The dense model's embedding inputs of one micro-batch, gathered from full tables (``table(name)``):
    sequence tables per token, pooled and single tables summed per sample, the batch's shared negatives."""
    emb = {}
    for t in names:
        rows = table(t).index_select(0, torch.from_numpy(batch.keys[t][mbd.value_key[t]]))
        if manifest.tables[t].kind == "sequence":
            emb[t] = rows
        else:
            emb[t] = rows.new_zeros(len(mbd.samples), dims[t]).index_add(0, torch.from_numpy(mbd.value_sample[t]), rows)
    if batch.negatives is not None:
        emb["item#neg"] = table("item").index_select(0, torch.from_numpy(batch.negatives))
    return emb


def compare(exported: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], rtol=1e-5, atol=1e-6) -> None:
    """Every tensor of ``ref`` is in ``exported`` and close to it (float64 comparison)."""
    for k, v in ref.items():
        assert k in exported, k
        torch.testing.assert_close(exported[k].double(), v, rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")
