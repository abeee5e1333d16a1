"""Workload description for the cost model, and presets.

A worker trains ``batch_per_worker`` samples per step (weak scaling: the per-worker batch is fixed, the global
batch grows with the worker count). Every sample holds ``keys_per_sample`` sparse keys of unique-based tables
(sequence features: rows travel deduplicated) drawn with Zipf popularity (``zipf_exponent`` over ``vocab``),
``emb_dim`` x ``emb_bytes`` bytes per row. ``unique_ratio`` (distinct keys / keys in one worker's batch) and the
redundancy of micro-batching come from :mod:`nestpipe.planning.keys` unless given: ``unique_ratio`` as measured
by ``nestpipe cluster-report`` / the shards, ``redundancy_random`` as ``{N: R}`` of a random partition.
Clustering removes ``clustering_excess_removed`` of a random partition's excess ``R - 1``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from . import _io, keys


@dataclasses.dataclass
class WorkloadConfig:
    name: str = "custom"
    batch_per_worker: int = 512
    keys_per_sample: float = 256.0
    zipf_exponent: float = 1.2
    vocab: int = 32_038_725
    unique_ratio: Optional[float] = None  # None: from the Zipf model
    redundancy_random: Optional[Dict[str, float]] = None  # {"N": R} measured; None: from the Zipf model
    clustering_excess_removed: float = 0.8
    emb_dim: int = 128
    emb_bytes: int = 4
    key_bytes: int = 8
    dense_flops_per_sample: float = 7.7e10  # forward + backward of the dense model
    micro_batches: int = 8

    def validate(self, where: str = "workload") -> None:
        for f in ("batch_per_worker", "keys_per_sample", "vocab", "emb_dim", "emb_bytes", "key_bytes",
                  "micro_batches"):
            if not getattr(self, f) >= 1:
                raise ValueError(f"{where}: {f} must be >= 1 (got {getattr(self, f)!r})")
        if self.zipf_exponent < 0:
            raise ValueError(f"{where}: zipf_exponent must be >= 0 (got {self.zipf_exponent!r})")
        if self.unique_ratio is not None and not 0 < self.unique_ratio <= 1:
            raise ValueError(f"{where}: unique_ratio must be in (0, 1] (got {self.unique_ratio!r})")
        if not 0 <= self.clustering_excess_removed <= 1:
            raise ValueError(f"{where}: clustering_excess_removed must be in [0, 1]")
        if self.dense_flops_per_sample < 0:
            raise ValueError(f"{where}: dense_flops_per_sample must be >= 0")
        for k, v in (self.redundancy_random or {}).items():
            if not str(k).isdigit() or float(v) < 1:
                raise ValueError(f"{where}: redundancy_random needs {{N: R >= 1}} (got {k!r}: {v!r})")

    # --- derived quantities -------------------------------------------------------------------------------------
    @property
    def keys_per_batch(self) -> float:
        return self.batch_per_worker * self.keys_per_sample

    @property
    def row_bytes(self) -> int:
        return self.emb_dim * self.emb_bytes

    def unique_per_batch(self) -> float:
        """Distinct keys of one worker's batch."""
        if self.unique_ratio is not None:
            return self.unique_ratio * self.keys_per_batch
        return keys.expected_unique(self.vocab, self.zipf_exponent, self.keys_per_batch)

    def redundancy(self, micro_batches: int, clustered: bool) -> float:
        """All2All row volume of ``micro_batches`` micro-batches relative to the batch's distinct keys."""
        if micro_batches <= 1:
            return 1.0
        measured = (self.redundancy_random or {}).get(str(micro_batches))
        r = float(measured) if measured is not None else keys.redundancy_random(
            self.vocab, self.zipf_exponent, self.keys_per_batch, micro_batches)
        if clustered:
            r = 1.0 + (1.0 - self.clustering_excess_removed) * (r - 1.0)
        return r

    def owner_dedup_factor(self, workers: int) -> float:
        return keys.owner_dedup_factor(self.vocab, self.zipf_exponent, self.keys_per_batch, workers)

    def consecutive_overlap(self, workers: int) -> float:
        """Share of an owner's rows of step t that step t+1 touches again (the dual-buffer sync's rows)."""
        return keys.consecutive_overlap(self.vocab, self.zipf_exponent, self.keys_per_batch * max(workers, 1))


WORKLOAD_PRESETS: Dict[str, WorkloadConfig] = {
    # The paper's setting as far as it is public: per-worker batch 512, 8 micro-batches of 64, HSTU. The key
    # stream is a stand-in: KuaiRand-27K's video vocabulary, the project's synthetic Zipf exponent (1.2) and
    # the ingest's default window of 256 keys; clustering removes 80% of the excess (measured on the synthetic
    # community data, docs/clustering.md).
    "paper-hstu": WorkloadConfig(name="paper-hstu"),
    # A CTR model: 26 single-id features plus a 20-key pooled history per sample, small dense tower.
    "ctr-small": WorkloadConfig(
        name="ctr-small", batch_per_worker=4096, keys_per_sample=46, zipf_exponent=1.05, vocab=10_000_000,
        emb_dim=64, dense_flops_per_sample=2e7, micro_batches=4),
}


def load_workload(spec: str, overrides: Optional[Dict[str, Any]] = None) -> WorkloadConfig:
    """A preset name or a JSON/TOML file of :class:`WorkloadConfig` fields (``"preset"`` key: start from one)."""
    return _io.resolve(WorkloadConfig, WORKLOAD_PRESETS, spec, overrides or {}, "workload")
