"""2D sparse parallelism (2D-SP): model-parallel groups of ``M`` workers, data-parallel across groups.

``--sparse-groups M`` (``TrainConfig.sparse_groups``) is the number of workers in one model-parallel group. With
world size ``W`` there are ``G = W / M`` groups; group ``g`` is ranks ``g*M .. g*M + M - 1`` (contiguous, as in the
planner's plan files) and rank ``r`` is worker ``r % M`` inside group ``r // M``.

- Inside a group every sharded table is placed over the group's ``M`` workers exactly as plain training places it
  over ``W`` ranks (:mod:`nestpipe.trainer.embedding.placement` with world ``M``); key routing and the embedding and gradient
  All2Alls stay inside the group (their own process groups). Each group holds a full replica of every sharded table.
- Each rank still reads its own data (split by global rank) and the loss is still normalised by the global batch
  ``B * W``; dense parameters and replicated tables are all-reduced over the whole world, as in plain training.
- After each batch's sparse update, shard ``j``'s ``G`` replicas (ranks ``j, j + M, ...``) are averaged over the
  replica group: see :mod:`nestpipe.trainer.embedding.replica_sync`.

Special cases: ``M = W`` (or 0, the default) is one group: plain training, no replica groups, no synchronisation
(bitwise the same run). ``M = 1``: every worker is its own group and holds a full replica of every sharded table;
the All2Alls are trivial and the ``W`` replicas are averaged every step (pure data parallelism of the tables).
``W`` must be divisible by ``M``.

Process groups (created by :func:`create_stage_groups` in this order on every rank; ``new_group`` is collective, so
every rank creates every group, also those it is not a member of): ``route``, ``embed``, ``grad`` for group 0..G-1
(each rank keeps its own group's), ``dense`` over the world, then ``replica`` for shard 0..M-1 (each rank keeps its
shard's). ``route``/``embed``/``grad``/``dense`` keep their issuing threads of
:mod:`nestpipe.trainer.distributed.process_groups`; ``replica`` is issued by the compute thread only (the owner's
update runs there in every mode).
"""

from __future__ import annotations

import datetime
import dataclasses
from typing import List, Optional

import torch.distributed as dist

from nestpipe.trainer.distributed import process_groups

OPTIMIZERS = ("rowwise_adagrad", "rowwise_adagrad_2dsp")


@dataclasses.dataclass(frozen=True)
class SparseLayout:
    """Where rank ``rank`` of ``world`` sits in the 2D-SP layout with groups of ``group_size`` workers."""

    world: int
    rank: int
    group_size: int  # M

    @property
    def num_groups(self) -> int:  # G, the number of replicas of every shard
        return self.world // self.group_size

    @property
    def enabled(self) -> bool:
        return self.num_groups > 1

    @property
    def group(self) -> int:
        return self.rank // self.group_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.group_size

    def group_ranks(self, g: int) -> List[int]:
        return list(range(g * self.group_size, (g + 1) * self.group_size))

    def replica_ranks(self, j: int) -> List[int]:
        """The ranks holding shard ``j`` (worker ``j`` of every group), in group order."""
        return [g * self.group_size + j for g in range(self.num_groups)]


def resolve(sparse_groups: Optional[int], world: int, rank: int = 0) -> SparseLayout:
    """Validate ``--sparse-groups M`` against the world size; 0/None means ``M = world`` (plain training)."""
    m = int(sparse_groups or 0)
    if m == 0:
        m = world
    if m < 0:
        raise ValueError(f"--sparse-groups {m}: must be >= 1 (workers per model-parallel group), or 0 for plain "
                         "training")
    if m > world:
        raise ValueError(f"--sparse-groups {m}: a model-parallel group cannot have more workers than the world size "
                         f"{world} (M = {world} is plain training)")
    if world % m:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"--sparse-groups {m}: world size {world} is not divisible by {m} (M = workers per "
                         f"model-parallel group; divisors of {world}: {', '.join(map(str, divisors))}; "
                         f"{world} = plain training)")
    return SparseLayout(world, rank, m)


def momentum_scale(optimizer: str, layout: SparseLayout, explicit: int) -> int:
    """The sharded tables' row-wise AdaGrad accumulator scale (``momentum_scale`` of ``nestpipe.kernels``)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"embedding.optimizer = {optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
    if optimizer == "rowwise_adagrad":
        return int(explicit)
    if explicit != 1:
        raise ValueError(f"embedding.optimizer = {optimizer!r} sets the accumulator scale to the number of replica "
                         f"groups ({layout.num_groups}); leave embedding.momentum_scale_groups at 1 "
                         f"(got {explicit})")
    return layout.num_groups


def create_stage_groups(layout: SparseLayout,
                        timeout: Optional[datetime.timedelta] = None) -> process_groups.StageGroups:
    """The stage groups of this rank: plain (:func:`process_groups.create`) when 2D-SP is off, else the group's
    ``route``/``embed``/``grad``, the world's ``dense`` and the shard's ``replica`` (see the module docstring).
    Created once per process and layout, in the same order on every rank; ``timeout``: their collectives' (the
    run's ``timeout_s``)."""
    if not layout.enabled:
        return process_groups.create(layout.world, timeout)
    key = ("sparse", layout.world, layout.group_size, id(dist.group.WORLD))
    cache = process_groups._CACHE  # forgotten together with the plain groups (process_groups.forget)
    if key not in cache:
        mine = {}
        for stage in ("route", "embed", "grad"):
            for g in range(layout.num_groups):
                pg = dist.new_group(ranks=layout.group_ranks(g), timeout=timeout)
                if g == layout.group:
                    mine[stage] = pg
        mine["dense"] = dist.new_group(ranks=list(range(layout.world)), timeout=timeout)
        for j in range(layout.group_size):
            pg = dist.new_group(ranks=layout.replica_ranks(j), timeout=timeout)
            if j == layout.local_rank:
                mine["replica"] = pg
        cache[key] = mine
    return process_groups.StageGroups(dict(cache[key]))
