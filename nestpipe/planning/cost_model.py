"""Per-step task durations of one training configuration (the inputs of :mod:`nestpipe.planning.timeline`).

One step of one worker, weak scaling (fixed per-worker batch). Tasks, their resource and their cost category:

| task | resource | category | cost |
|---|---|---|---|
| ``data`` | host CPU | compute | prepare the batch (``data_ns_per_key`` per key) |
| ``h2d`` | PCIe (to device) | compute | copy the batch's keys |
| ``route`` | network (key communicator) | lookup | All2All of the worker's distinct keys (8 B each) |
| ``gather`` | host DRAM | lookup | owner rows x (``host_key_ns`` + row bytes / ``dram_bw``) + one request list per peer |
| ``copy`` | PCIe (to device) | lookup | owner rows to the device buffer |
| ``fwd[i]``, ``bwd[i]`` | network (embedding communicator) | comm | All2All of micro-batch i's rows / gradients |
| ``compute[i]`` | device | compute | dense forward + backward of micro-batch i |
| ``replica`` | network | comm | 2D-SP: AllReduce of the touched rows over the replica groups |
| ``update`` | device | compute | row-wise AdaGrad on the owner's rows, dense AdamW |
| ``writeback`` | PCIe (to host) | lookup | updated rows back to the DRAM store |
| ``sync`` | device | lookup | DBP: copy rows of keys(t) & keys(t+1) from the active to the prefetch buffer |

Owner rows: every requester sends its distinct keys, so an owner receives ``U(B)`` keys per step whatever the
worker count; with owner-side deduplication (the DBP retrieval stage deduplicates across requesters) it retrieves
``U(P B) / P`` of them. Micro-batch i's All2All carries ``U(B) R(N) / N`` rows, ``R`` the micro-batching
redundancy (:meth:`WorkloadConfig.redundancy`). Inside a 2D-SP group of G workers every exchange has G peers.
The dense AllReduce is folded into ``update`` (its cost does not depend on the sparse layout).

Calibration (:class:`Scales`) multiplies the *volumes* of a category: the rows and keys of the lookup, the bytes
of the All2Alls, the dense FLOPs. Latencies and per-peer overheads are the hardware's and are not scaled: a
workload whose true volumes are larger than the preset's shows up as a volume factor, and the way costs grow
with the worker count stays the network's and the memory system's.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from . import network
from .hardware import HardwareConfig
from .workload import WorkloadConfig

MODES = ("off", "2dsp", "dbp", "fwp", "nested", "nested+2dsp")
MODE_LABELS = {"off": "off (TorchRec-like)", "2dsp": "2D-SP", "dbp": "DBP", "fwp": "FWP", "nested": "nested",
               "nested+2dsp": "nested + 2D-SP"}
CATEGORY = {"data": "compute", "h2d": "compute", "route": "lookup", "gather": "lookup", "copy": "lookup",
            "fwd": "comm", "bwd": "comm", "compute": "compute", "replica": "comm", "update": "compute",
            "writeback": "lookup", "sync": "lookup"}
DATA_NS_PER_KEY = 2.0


@dataclasses.dataclass
class Scales:
    """Volume factors per cost category (1.0 = the preset workload): dense FLOPs and batch keys (``compute``),
    rows and keys retrieved, written back, synced, updated (``lookup``), embedding All2All and replica bytes
    (``comm``)."""

    compute: float = 1.0
    lookup: float = 1.0
    comm: float = 1.0

    def of(self, category: str) -> float:
        return getattr(self, category)


@dataclasses.dataclass
class Scenario:
    """One configuration to simulate.

    ``micro_batches``: None = the workload's count in FWP modes, 1 otherwise. ``group_size``: 2D-SP group size
    (must divide ``workers``); None = ``workers`` (no 2D-SP) or, in 2D-SP modes, the best power of two (see
    :func:`nestpipe.planning.simulate.best_group`). ``owner_dedup``: None = on exactly in the DBP modes.
    ``fwp_overlap=False`` is a negative control: micro-batch All2Alls no longer overlap compute.
    """

    workers: int
    mode: str = "off"
    micro_batches: Optional[int] = None
    group_size: Optional[int] = None
    clustered: bool = True
    owner_dedup: Optional[bool] = None
    fwp_overlap: bool = True
    exchange: Optional[str] = None

    EXCHANGES = ("token", "unique")

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} (got {self.mode!r})")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1 (got {self.workers})")
        if self.group_size is not None and (self.group_size < 1 or self.workers % self.group_size):
            raise ValueError(f"group_size {self.group_size} must divide workers {self.workers}")
        if self.exchange is not None and self.exchange not in self.EXCHANGES:
            raise ValueError(f"exchange must be one of {self.EXCHANGES} (got {self.exchange!r})")

    @property
    def unique_exchange(self) -> bool:
        """NestPipe's exchange sends each micro-batch's distinct rows; the TorchRec baselines (``off``, ``2dsp``)
        send one row per token (EmbeddingCollection without index dedup) and look up every received index."""
        if self.exchange is not None:
            return self.exchange == "unique"
        return self.mode not in ("off", "2dsp")

    @property
    def dbp(self) -> bool:
        return self.mode in ("dbp", "nested", "nested+2dsp")

    @property
    def fwp(self) -> bool:
        return self.mode in ("fwp", "nested", "nested+2dsp")

    @property
    def twod(self) -> bool:
        return self.mode in ("2dsp", "nested+2dsp")

    def n_micro(self, wl: WorkloadConfig) -> int:
        if self.micro_batches is not None:
            return self.micro_batches
        return wl.micro_batches if self.fwp else 1

    def group(self) -> int:
        return self.group_size if self.group_size is not None else self.workers


@dataclasses.dataclass
class StepCosts:
    """Durations (seconds) of one step's tasks; ``fwd``, ``bwd``, ``compute`` are per micro-batch."""

    data: float
    h2d: float
    route: float
    gather: float
    copy: float
    fwd: List[float]
    compute: List[float]
    bwd: List[float]
    replica: float
    update: float
    writeback: float
    sync: float
    info: Dict[str, float] = dataclasses.field(default_factory=dict)

    def category_totals(self) -> Dict[str, float]:
        out = {"compute": 0.0, "lookup": 0.0, "comm": 0.0}
        for name, cat in CATEGORY.items():
            v = getattr(self, name)
            out[cat] += sum(v) if isinstance(v, list) else v
        return out


def step_costs(wl: WorkloadConfig, hw: HardwareConfig, sc: Scenario, scales: Optional[Scales] = None) -> StepCosts:
    """Durations of every task of one step of ``sc`` (scaled by ``scales`` per category)."""
    s = scales or Scales()
    n = sc.n_micro(wl)
    if n < 1 or n > wl.batch_per_worker:
        raise ValueError(f"micro_batches must be in 1..{wl.batch_per_worker} (got {n})")
    peers = sc.group()
    replicas = sc.workers // peers
    lk, cm, cp = s.lookup, s.comm, s.compute
    uniq = wl.unique_per_batch() * lk
    dedup = sc.dbp if sc.owner_dedup is None else sc.owner_dedup
    rho = wl.owner_dedup_factor(peers) if dedup else 1.0
    rows_owner = uniq * rho  # distinct rows an owner updates and writes back
    unique_x = sc.unique_exchange
    # rows an owner looks up: its share of the requesters' distinct keys, or every received token (TorchRec)
    rows_lookup = rows_owner if unique_x else wl.keys_per_batch * lk
    keys_routed = uniq if unique_x else wl.keys_per_batch * lk
    red = wl.redundancy(n, sc.clustered)
    rb = wl.row_bytes
    remote = (peers - 1) / peers

    mb_rows = wl.unique_per_batch() * red / n if unique_x else wl.keys_per_batch / n
    mb_bytes = mb_rows * rb * remote * cm
    a2a = network.all2all_seconds(hw, peers, mb_bytes)
    dense = wl.dense_flops_per_sample * cp * wl.batch_per_worker / n / (hw.device_flops * hw.mfu)
    # replica groups: a shard's replicas sit ``peers`` ranks apart; the gradients of the rows the group touched
    # (distinct rows of the group's G batches on this owner) are averaged
    touched = wl.unique_per_batch() * cm * wl.owner_dedup_factor(peers)
    replica = network.allreduce_seconds(hw, replicas, touched * rb, stride=peers) if replicas > 1 else 0.0
    overlap = wl.consecutive_overlap(peers if dedup else 1)
    return StepCosts(
        data=wl.keys_per_batch * cp * DATA_NS_PER_KEY * 1e-9,
        h2d=wl.keys_per_batch * cp * wl.key_bytes / hw.pcie_bw,
        route=network.all2all_seconds(hw, peers, keys_routed * wl.key_bytes * remote),
        gather=rows_lookup * (hw.host_key_ns * 1e-9 + rb / hw.dram_bw) + (peers - 1) * hw.request_overhead_us * 1e-6,
        copy=rows_lookup * rb / hw.pcie_bw,
        fwd=[a2a] * n,
        compute=[dense] * n,
        bwd=[a2a] * n,
        replica=replica,
        update=rows_owner * rb * 4 / hw.hbm_bw,
        writeback=rows_owner * rb / hw.pcie_bw,
        sync=rows_owner * overlap * rb * 2 / hw.hbm_bw if sc.dbp else 0.0,
        info={"unique_per_batch": uniq, "owner_rows": rows_owner, "lookup_rows": rows_lookup,
              "owner_dedup_factor": rho, "redundancy": red,
              "micro_batches": n, "group_size": peers, "replica_groups": replicas,
              "all2all_bytes_per_step": 2 * n * mb_bytes},
    )
