"""Shared model helpers: explicit, generator-driven parameter initialisation (the global RNG is never used)."""

from __future__ import annotations

import math

import torch
from torch import nn


@torch.no_grad()
def init_parameters(module: nn.Module, generator: torch.Generator) -> None:
    """Re-initialise every parameter in name order from ``generator``: Linear weights U(-1/sqrt(fan_in), ..),
    biases 0, LayerNorm 1/0, other tensors N(0, 0.02)."""
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        leaf = name.rsplit(".", 1)[-1]
        owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        if isinstance(owner, nn.LayerNorm):
            p.fill_(1.0 if leaf == "weight" else 0.0)
        elif leaf == "bias":
            p.zero_()
        elif p.dim() == 2 and isinstance(owner, nn.Linear):
            bound = 1.0 / math.sqrt(p.shape[1])
            p.copy_(torch.rand(p.shape, generator=generator, dtype=torch.float64).mul_(2 * bound).sub_(bound))
        else:
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64).mul_(0.02))


def mlp(sizes, final_activation: bool = True) -> nn.Sequential:
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if final_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)
