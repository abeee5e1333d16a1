"""The sparse tables' configuration (``[embedding]`` of the trainer's config): the narrow config the embedding
package is built from. Checked with the rest of the config at load time (:func:`nestpipe.trainer.config.validate`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple, Union

from nestpipe.utils.options import opt

EXCHANGE_KINDS = ("auto", "unique", "reduction", "replicated")
TIERS = ("dram", "mmap")
HUGE_PAGES = ("resident", "always", "never")


@dataclasses.dataclass
class EmbeddingConfig:
    """Sparse tables: exchange kind per table, placement, optimizer, initialisation."""

    def lr_of(self, table: str) -> float:
        """The row-wise AdaGrad learning rate of ``table`` (``table_lr``, else ``lr``)."""
        return float(self.table_lr.get(table, self.lr))

    kinds: Dict[str, str] = opt(
        factory=dict, help="exchange kind per table name (unique | reduction | replicated), overriding the automatic "
        "choice: tables of at most replicate_max_rows rows are replicated, pooled tables reduction-based, sequence "
        "and single tables unique-based")
    placement: str = opt(
        "planned", help="which ranks hold each sharded table's rows: planned (cost-driven planner) | hashed (row-wise "
        "over every rank) | path to a `nestpipe plan --out FILE` document (its column splits included: a column shard "
        "keeps its own row-wise AdaGrad state)")
    replicate_max_rows: int = opt(1024, help="tables with at most this many rows are replicated on every rank",
                                  minimum=0)
    eager_init_max_rows: int = opt(
        1_000_000, help="stores of at most this many rows on a rank are initialised whole at start, larger ones row "
        "by row on first touch (the values are the same either way)", minimum=0)
    huge_pages: str = opt(
        "resident", help="transparent huge pages for stores of 32 MiB or more: resident (the stores initialised whole "
        "at start), always, never (NESTPIPE_HUGE_PAGES=0 also turns them off)", choices=HUGE_PAGES)
    tier: str = opt(
        "dram", help="where an owner keeps its sharded rows: dram (host memory), or mmap (files on local disk with a "
        "DRAM cache of hot rows: tables larger than memory; bitwise the same training)", choices=TIERS)
    dram_cache_mb: float = opt(
        1024.0, help="tier=mmap: the DRAM row cache per rank in MiB (rows + AdaGrad state), split over the rank's "
        "stores by their size", minimum=0)
    store_dir: str = opt("", help="tier=mmap: directory of the row files (default RUN/store; local disk)")
    dbp_update_in_store: bool = opt(
        True, help="DBP with host-resident buffers: batch t's update goes to the store in place and the dual-buffer "
        "sync copies keys(t) ∩ keys(t+1) from the store; false: update the active buffer and write it back (the "
        "device path's order). Bitwise the same results")
    dim: Optional[int] = opt(None, help="embedding dimension of every table (null: each table's manifest dim)",
                             minimum=1)
    init_scale: float = opt(0.05, help="rows are initialised uniform in [-init_scale, init_scale]", minimum=0)
    lr: float = opt(0.05, help="row-wise AdaGrad learning rate", minimum=0)
    table_lr: Dict[str, float] = opt(factory=dict, help="row-wise AdaGrad learning rate per table name, overriding lr "
                                     "for those tables")
    eps: float = opt(1e-8, help="row-wise AdaGrad epsilon", minimum=0)
    momentum_scale_groups: int = opt(
        1, help="explicit accumulator scale M of row-wise AdaGrad for every table: w -= lr * g / (sqrt(v / M) + eps); "
        "1 = off", minimum=1)
    optimizer: str = opt(
        "rowwise_adagrad", help="sharded tables' optimizer: rowwise_adagrad, or rowwise_adagrad_2dsp (2D sparse "
        "parallelism's momentum-scaled variant: accumulator divided by world / sparse_groups)",
        choices=("rowwise_adagrad", "rowwise_adagrad_2dsp"))


def row_shape(width: Union[int, Tuple[int, int]]) -> Tuple[int, int]:
    """A table's entry in a model's ``table_widths`` as ``(embedding-dim blocks, extra columns)``: ``n`` is ``n``
    blocks and no extra column, ``(n, e)`` is ``n`` blocks and ``e`` columns after them."""
    blocks, extra = width if isinstance(width, tuple) else (width, 0)
    return int(blocks), int(extra)
