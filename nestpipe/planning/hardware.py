"""Hardware description for the cost model, and presets.

All bandwidths are bytes/s per device (per worker), latencies seconds. The presets hold public nominal
figures of the parts (datasheet bandwidths, typical message latencies); they set the *shape* of the model
(how costs split between resources and how they grow with the worker count). Absolute levels are then fixed
by calibration (:mod:`nestpipe.planning.calibration`), which scales whole cost categories, never single tasks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from . import _io

ALL2ALL_ALGORITHMS = ("direct", "hierarchical")


@dataclasses.dataclass
class HardwareConfig:
    """One accelerator and the cluster around it.

    Assumptions: workers are laid out rank-contiguously, ``node_size`` per host (sharing an intra-node fabric of
    ``intra_bw`` per device), ``pod_size`` per non-blocking network pod; traffic leaving a pod runs at
    ``net_bw / oversubscription``. Embedding rows live in the host DRAM tier: a retrieval costs
    ``host_key_ns`` per key (hash-table probe, random access) plus its bytes at ``dram_bw``, then its bytes over
    PCIe at ``pcie_bw``. An owner handles one request list per peer, ``request_overhead_us`` each.
    """

    name: str = "custom"
    device_flops: float = 300e12  # peak dense FLOP/s at the training precision
    mfu: float = 0.4  # achieved fraction of peak on the dense model
    hbm_bw: float = 1.6e12
    dram_bw: float = 20e9  # host DRAM bandwidth available to one device's retrieval
    host_key_ns: float = 60.0  # per-key host work of a retrieval (hash probe, random DRAM access)
    pcie_bw: float = 25e9
    intra_bw: float = 50e9  # intra-node fabric per device
    net_bw: float = 25e9  # NIC per device
    latency_us: float = 10.0  # per message on the network
    intra_latency_us: float = 3.0
    request_overhead_us: float = 5.0  # owner-side handling of one peer's request list
    node_size: int = 8
    pod_size: int = 256
    oversubscription: float = 2.0
    all2all: str = "direct"  # direct | hierarchical

    def validate(self, where: str = "hardware") -> None:
        for f in ("device_flops", "mfu", "hbm_bw", "dram_bw", "pcie_bw", "intra_bw", "net_bw", "oversubscription"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{where}: {f} must be > 0 (got {getattr(self, f)!r})")
        for f in ("host_key_ns", "latency_us", "intra_latency_us", "request_overhead_us"):
            if getattr(self, f) < 0:
                raise ValueError(f"{where}: {f} must be >= 0 (got {getattr(self, f)!r})")
        if self.node_size < 1 or self.pod_size < self.node_size:
            raise ValueError(f"{where}: need 1 <= node_size <= pod_size (got {self.node_size}, {self.pod_size})")
        if self.all2all not in ALL2ALL_ALGORITHMS:
            raise ValueError(f"{where}: all2all must be one of {ALL2ALL_ALGORITHMS} (got {self.all2all!r})")


HARDWARE_PRESETS: Dict[str, HardwareConfig] = {
    # Ascend 910B-class servers: 8 NPUs on HCCS, one 200 GbE RoCE port per NPU, PCIe 4.0 x16 to the host.
    "ascend-910b": HardwareConfig(
        name="ascend-910b", device_flops=313e12, mfu=0.4, hbm_bw=1.6e12, dram_bw=20e9, host_key_ns=60.0,
        pcie_bw=25e9, intra_bw=56e9, net_bw=25e9, latency_us=10.0, intra_latency_us=3.0,
        request_overhead_us=5.0, node_size=8, pod_size=256, oversubscription=2.0, all2all="direct"),
    # NVIDIA H100 SXM servers: NVLink 4 (450 GB/s per direction), 400 Gb/s InfiniBand per GPU, PCIe 5.0.
    "h100": HardwareConfig(
        name="h100", device_flops=989e12, mfu=0.4, hbm_bw=3.35e12, dram_bw=25e9, host_key_ns=50.0,
        pcie_bw=50e9, intra_bw=450e9, net_bw=50e9, latency_us=5.0, intra_latency_us=2.0,
        request_overhead_us=5.0, node_size=8, pod_size=1024, oversubscription=1.0, all2all="hierarchical"),
    # A100 SXM servers: NVLink 3, 200 Gb/s InfiniBand per GPU, PCIe 4.0.
    "a100": HardwareConfig(
        name="a100", device_flops=312e12, mfu=0.4, hbm_bw=2.0e12, dram_bw=20e9, host_key_ns=60.0,
        pcie_bw=25e9, intra_bw=300e9, net_bw=25e9, latency_us=6.0, intra_latency_us=2.0,
        request_overhead_us=5.0, node_size=8, pod_size=512, oversubscription=1.0, all2all="hierarchical"),
    # CPU training with gloo over loopback on one small host (the trainer's CPU path): no accelerator, rows are
    # copied within DRAM (pcie_bw stands for that copy), TCP messages cost tens of microseconds.
    "cpu-gloo": HardwareConfig(
        name="cpu-gloo", device_flops=50e9, mfu=0.5, hbm_bw=10e9, dram_bw=10e9, host_key_ns=40.0,
        pcie_bw=10e9, intra_bw=2e9, net_bw=2e9, latency_us=30.0, intra_latency_us=30.0,
        request_overhead_us=10.0, node_size=1, pod_size=1024, oversubscription=1.0, all2all="direct"),
}


def load_hardware(spec: str, overrides: Optional[Dict[str, Any]] = None) -> HardwareConfig:
    """A preset name or a JSON/TOML file of :class:`HardwareConfig` fields (``"preset"`` key: start from one)."""
    return _io.resolve(HardwareConfig, HARDWARE_PRESETS, spec, overrides or {}, "hardware")
