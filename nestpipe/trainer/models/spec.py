"""What the trainer needs to know about a dense model, in one place per model (``models/<name>.py`` defines its
config section, its module and a ``SPEC``; ``models/__init__.py`` registers it)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """``task``: the shard task it trains on (``gr`` or ``ctr``; also selects the evaluation protocol).
    ``build(cfg, manifest, dims)``: the module, before initialisation. ``dense_inputs(cfg, manifest, batch, i,
    device, dtype)``: micro-batch ``i``'s non-embedding inputs. ``negatives(cfg)``: (random, popular) negatives per
    batch. ``shared_negatives``: the batch carries one key list of negatives served by the ``item`` store.
    ``config``: the dataclass of its ``nestpipe train`` config section (named like the model); ``help``: that
    section's one-line description. ``table_widths(cfg)``: tables whose rows the model reads as several
    embedding-dim blocks, ``{table: blocks}`` (e.g. the item table holding an input and an output embedding), or
    ``{table: (blocks, extra columns)}``; every other table is one block wide. ``train_defaults``: this model's defaults for keys of the shared sections.
    ``partition_invariant(cfg)``: whether the loss is a sum of per-sample terms whatever the micro-batch partition
    (False where a micro-batch's samples serve one another, e.g. as in-batch negatives): only then may
    ``pipe.micro_batching=auto`` train a batch as one micro-batch (the same gradient, summed in another order)."""

    name: str
    task: str
    build: Callable[..., torch.nn.Module]
    dense_inputs: Callable[..., Dict[str, torch.Tensor]]
    negatives: Callable[..., Tuple[int, int]]
    shared_negatives: bool
    config: type
    help: str
    table_widths: Callable[..., Dict[str, object]] = lambda cfg: {}
    partition_invariant: Callable[..., bool] = lambda cfg: True
    # keys of the shared sections this model trains best with, nested like the config (for example
    # ``{"optim": {"lr": 0.002}}``): the defaults when this model is chosen; the config file, flags and --set still
    # override them (:func:`nestpipe.trainer.config.default_config`)
    train_defaults: Dict[str, Dict[str, Any]] = dataclasses.field(default_factory=dict)
