"""``cluster-report``: how much the stored partition of ingested shards saves over a random one, per table.

Figures are volume-weighted over batches: ``redundancy = sum of per-micro-batch unique rows / sum of batch
unique rows``, i.e. the All2All row volume relative to ideal over the whole set. ``excess cut`` is
``1 - (R_stored - 1) / (R_random - 1)``: the share of the avoidable volume that the clustering removed.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Optional

import numpy as np

from nestpipe.clustering.core import assign
from nestpipe.clustering.incidence import distinct_codes, sample_of_occurrence, unique_inverse
from nestpipe.datasets.shards import iter_shard, load_manifest, shard_paths, table_offsets


@dataclasses.dataclass
class TableFigures:
    table: str
    kind: str
    batches: int = 0
    unique_rows: int = 0  # sum over batches of the batch's unique keys (the lower bound)
    stored_rows: int = 0  # sum over batches and micro-batches of unique keys, stored partition
    random_rows: int = 0  # the same for a random balanced partition
    lists_consistent: bool = True  # stored per-micro-batch lists match the stored partition

    @property
    def stored(self) -> float:
        return self.stored_rows / self.unique_rows if self.unique_rows else 1.0

    @property
    def random(self) -> float:
        return self.random_rows / self.unique_rows if self.unique_rows else 1.0

    @property
    def excess_cut(self) -> Optional[float]:
        if self.random - 1.0 <= 1e-12:
            return None
        return 1.0 - (self.stored - 1.0) / (self.random - 1.0)

    def to_json(self) -> Dict:
        d = dataclasses.asdict(self)
        d.update(stored_redundancy=self.stored, random_redundancy=self.random, excess_cut=self.excess_cut)
        return d


def _rows(values: np.ndarray, offsets: np.ndarray, mb: np.ndarray):
    """(batch unique count, sum over micro-batches of unique counts)."""
    keys, inverse = unique_inverse(values)
    k = max(len(keys), 1)
    return len(keys), len(distinct_codes(mb[sample_of_occurrence(offsets)] * k + inverse))


def cluster_report(directory: str, split: Optional[str] = None, max_batches: Optional[int] = None,
                   seed: int = 0) -> List[TableFigures]:
    """Per-table figures for the shards of ``directory`` (an ingest output with its manifest)."""

    manifest = load_manifest(directory)
    splits = [split] if split else sorted(manifest.sets)
    figures = {t: TableFigures(t, spec.kind) for t, spec in sorted(manifest.tables.items())}
    batches = itertools.chain.from_iterable(
        iter_shard(p) for s in splits for p in shard_paths(directory, manifest, s)
    )
    for index, batch in enumerate(itertools.islice(batches, max_batches)):
        if "mb" not in batch:
            raise ValueError(f"{directory}: batch {index} has no 'mb' field (micro-batch ids)")
        mb = np.asarray(batch["mb"]).astype(np.int64)
        n = int(batch.get("meta", {}).get("micro_batches", mb.max() + 1 if mb.size else 1))
        rand = assign(np.zeros(0, np.int64), np.zeros(len(mb) + 1, np.int64), n, method="random", seed=seed + index)
        for table, fig in figures.items():
            if f"{table}.values" not in batch:
                raise ValueError(f"{directory}: batch {index} has no field '{table}.values'")
            values = np.asarray(batch[f"{table}.values"]).astype(np.int64)
            offsets = table_offsets(batch, table)
            if len(offsets) - 1 != len(mb):
                raise ValueError(f"{directory}: batch {index} table {table!r}: {len(offsets) - 1} samples, mb has {len(mb)}")
            unique, stored = _rows(values, offsets, mb)
            _, random_rows = _rows(values, offsets, rand.astype(np.int64))
            fig.batches += 1
            fig.unique_rows += unique
            fig.stored_rows += stored
            fig.random_rows += random_rows
            listed = batch.get(f"{table}.mb_unique")
            if listed is not None and (len(listed) != stored or len(batch.get(f"{table}.unique", [])) != unique):
                fig.lists_consistent = False
    return list(figures.values())


def format_report(figures: List[TableFigures]) -> str:
    lines = [f"{'table':<16} {'kind':<9} {'batches':>7} {'unique rows':>12} {'stored R':>9} {'random R':>9} "
             f"{'excess cut':>10}  lists"]
    for f in figures:
        cut = "n/a" if f.excess_cut is None else f"{100 * f.excess_cut:.1f}%"
        lines.append(f"{f.table:<16} {f.kind:<9} {f.batches:>7} {f.unique_rows:>12} {f.stored:>9.4f} "
                     f"{f.random:>9.4f} {cut:>10}  {'ok' if f.lists_consistent else 'MISMATCH'}")
    lines.append("R = sum of per-micro-batch unique rows / batch unique rows (1.0 = ideal); excess cut = "
                 "1 - (stored R - 1) / (random R - 1). Pooled tables exchange pooled sums, so R matters for "
                 "sequence (unique-based) tables.")
    return "\n".join(lines)
