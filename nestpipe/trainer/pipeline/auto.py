"""``--pipeline auto``: one schedule for the whole run, chosen once at start and the same on every rank.

The pipelined schedules (dbp, fwp, nested) only pay where their stages really run at the same time: the
prefetch, routing and communication threads need cores of their own beside the compute, or the time they hide
must be waiting (a link slower than the compute) rather than CPU work. Every schedule is bitwise equal to
``off`` at the same micro-batching, so with ``pipe.micro_batching`` set the choice never changes the trained
parameters, only the time per step. Its default, ``auto``, follows the schedule (:func:`micro_batching_for`):
the batch as one micro-batch for ``off`` and ``dbp``, whose steps have no frozen window to overlap (where the
model's loss does not depend on the partition: the gradient is the same sum, in another order), the shard's
clustered micro-batches for ``fwp`` and ``nested``.

The rule (:func:`decide`, a pure function of the reduced measurements, so every rank computes the same answer;
rank 0's answer is broadcast anyway):

0. on the CPU with more than one intra-op thread per rank (``threads``): ``off`` -- ``threads > 1`` selects the
   parallel Numba kernels, which must not be entered from several pipeline threads at once;
1. an accelerator (CUDA, Ascend): ``nested`` -- its streams run the stages concurrently;
2. one rank: ``off`` -- no exchange to overlap;
3. at least 2 cores per rank on the slowest rank: ``nested`` (a rule, not yet a measurement on such a host: the
   stage threads get a core beside the compute, so their work comes off the step's critical path);
4. 1 core per rank but a link slower than :data:`LINK_BOUND_GBPS` (the slowest rank's probe All2All): ``nested``
   -- the wire time is waiting that the pipeline hides;
5. otherwise ``off``: each rank's pipeline threads would take turns on one core with the compute, and the link
   is fast enough that little waiting is left to hide.

Measurements: the cores this process may run on (``os.sched_getaffinity``) divided by the ranks on this machine
(``LOCAL_WORLD_SIZE``), and the bandwidth of a probe ``all_to_all_single`` of :data:`PROBE_BYTES` per rank
(median of 3 after one warm-up), each reduced over ranks (min cores, min bandwidth).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from nestpipe.trainer.config import PIPELINE_MODES

# 2 Gbit/s: well below loopback and a 10 GbE link, where a rank's
# embedding traffic takes a small part of its compute; well above a capped or congested link, where it does not
LINK_BOUND_GBPS = 0.25
PROBE_BYTES = 4 << 20


@dataclasses.dataclass
class ScheduleChoice:
    """The schedule this run trains with, and why (recorded in metrics.json as ``pipeline_choice``)."""

    requested: str  # what --pipeline said: auto or a schedule
    schedule: str  # what runs: off | dbp | fwp | nested
    reason: str
    cores_per_rank: Optional[int] = None
    link_gbps: Optional[float] = None
    overlap_can_pay: Optional[bool] = None
    micro_batching: str = "clustered"  # pipe.micro_batching as resolved for the schedule (micro_batching_for)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def micro_batching_for(requested: str, schedule: str, partition_invariant: bool = True) -> str:
    """``pipe.micro_batching`` resolved for ``schedule``: ``auto`` is ``whole`` where the schedule has no frozen
    window (``off``, ``dbp``: micro-batches would only add passes) and the model's loss does not depend on the
    partition (``partition_invariant``: the same gradient in another summation order), else ``clustered`` (``fwp``
    and ``nested`` overlap the All2All of micro-batch i+1 with the compute of micro-batch i); any other value is
    kept."""
    if requested != "auto":
        return requested
    return "whole" if schedule in ("off", "dbp") and partition_invariant else "clustered"


def decide(device_type: str, world: int, cores_per_rank: int, link_gbps: Optional[float],
           intra_op_threads: int = 1) -> Tuple[str, str, bool]:
    """(schedule, reason, whether overlap can pay) from the reduced measurements (the module's rule)."""
    if device_type == "cpu" and intra_op_threads > 1:
        # threads > 1 selects the parallel Numba kernels, not safe from several pipeline threads at once
        return "off", (f"threads = {intra_op_threads}: the parallel CPU kernels must run from one thread "
                       "(the pipelined schedules run kernels from several)"), False
    if device_type != "cpu":
        return "nested", f"{device_type} streams run the pipeline's stages concurrently", True
    if world == 1:
        return "off", "one rank: there is no exchange to overlap", False
    if cores_per_rank >= 2:
        return "nested", f"{cores_per_rank} cores per rank: the pipeline's threads run beside the compute", True
    if link_gbps is not None and link_gbps < LINK_BOUND_GBPS:
        return ("nested", f"1 core per rank, but the link carries {link_gbps:.3g} GB/s (< {LINK_BOUND_GBPS:g}): "
                "its wire time is waiting that the pipeline hides", True)
    link = f"{link_gbps:.3g} GB/s" if link_gbps is not None else "not measured"
    return ("off", f"1 core per rank and a fast link ({link}): the pipeline's threads would share each rank's core "
            "with the compute, and little waiting is left to hide (overlap cannot pay here)", False)


def local_cores_per_rank() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, cores // max(local, 1))


def probe_link_gbps(world: int, device: torch.device, group=None, nbytes: int = PROBE_BYTES) -> float:
    """This rank's bandwidth (GB/s of bytes sent to other ranks) in a probe All2All: median of 3 after a warm-up."""
    n = max(world, (nbytes // 4) // world * world)
    send = torch.ones(n, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    times = []
    for k in range(4):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if k:
            times.append(time.perf_counter() - t0)
    sent = n * 4 * (world - 1) / world
    return sent / max(statistics.median(times), 1e-9) / 1e9


def choose(requested: str, device: torch.device, world: int, group=None, micro_batching: str = "clustered",
           partition_invariant: bool = True, intra_op_threads: int = 1) -> ScheduleChoice:
    """The run's schedule. ``requested`` = auto: measured and decided (collective: every rank must call this);
    an explicit schedule is kept, with a note where overlap cannot pay. ``micro_batching`` (``pipe.micro_batching``)
    is resolved for the schedule that runs."""
    if requested != "auto" and requested not in PIPELINE_MODES:
        raise ValueError(f"--pipeline {requested!r}: expected auto or one of {', '.join(PIPELINE_MODES)}")
    if device.type == "cpu" and intra_op_threads > 1 and requested not in ("auto", "off"):
        raise ValueError(f"--pipeline {requested} with threads = {intra_op_threads}: the parallel CPU kernels must not "
                         "run from several pipeline threads at once; use --pipeline off (or auto), or threads = 1")
    cores = local_cores_per_rank()
    gbps = None
    if world > 1:
        if device.type == "cpu" and cores < 2:
            gbps = probe_link_gbps(world, device, group)
        vals = torch.tensor([float(cores), gbps if gbps is not None else float("inf")], dtype=torch.float64)
        vals = vals.to(device) if device.type != "cpu" else vals
        dist.all_reduce(vals, op=dist.ReduceOp.MIN, group=group)
        cores = int(vals[0].item())
        gbps = float(vals[1].item()) if vals[1].item() != float("inf") else None
    schedule, reason, pays = decide(device.type, world, cores, gbps, intra_op_threads)
    if requested == "auto" and world > 1:
        pick = [schedule]
        dist.broadcast_object_list(pick, src=0, group=group)  # one decision, rank 0's, on every rank
        schedule = pick[0]
    if requested != "auto":
        reason = f"--pipeline {requested} (explicit); auto would choose {schedule}: {reason}"
        schedule = requested
    return ScheduleChoice(requested, schedule, reason, cores, gbps, pays,
                          micro_batching_for(micro_batching, schedule, partition_invariant))
