"""Predictions and sweeps of the simulator: step time, QPS, scaling efficiency, exposed lookup and communication.

Scaling efficiency of a mode at W workers = its step time at ``reference_workers`` / its step time at W (weak
scaling: ideal throughput grows linearly with W at the reference's per-worker throughput).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional

from .cost_model import MODE_LABELS, MODES, Scales, Scenario, step_costs
from .hardware import HardwareConfig
from .timeline import Schedule, simulate_steps
from .workload import WorkloadConfig

DEFAULT_WORKERS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 4096)


@dataclasses.dataclass
class Prediction:
    mode: str
    workers: int
    group_size: int
    micro_batches: int
    step_ms: float
    qps: float
    exposed_lookup_ms: float
    exposed_comm_ms: float
    exposed_compute_ms: float
    all2all_total_ms: float  # every embedding All2All of the step, hidden or not
    lookup_total_ms: float
    scaling_efficiency: Optional[float] = None

    def as_dict(self) -> Dict:
        return dataclasses.asdict(self)


def run(wl: WorkloadConfig, hw: HardwareConfig, sc: Scenario, scales: Scales) -> (Prediction, Schedule):
    if sc.twod and sc.group_size is None:
        sc = dataclasses.replace(sc, group_size=best_group(wl, hw, sc, scales))
    costs = step_costs(wl, hw, sc, scales)
    sched = simulate_steps(costs, sc)
    tot = costs.category_totals()
    p = Prediction(
        mode=sc.mode, workers=sc.workers, group_size=sc.group(), micro_batches=sc.n_micro(wl),
        step_ms=sched.step_time * 1e3, qps=wl.batch_per_worker * sc.workers / sched.step_time,
        exposed_lookup_ms=sched.exposed["lookup"] * 1e3, exposed_comm_ms=sched.exposed["comm"] * 1e3,
        exposed_compute_ms=sched.exposed["compute"] * 1e3, all2all_total_ms=(sum(costs.fwd) + sum(costs.bwd)) * 1e3,
        lookup_total_ms=tot["lookup"] * 1e3)
    return p, sched


def predict(wl: WorkloadConfig, hw: HardwareConfig, sc: Scenario, scales: Scales) -> Prediction:
    return run(wl, hw, sc, scales)[0]


def group_candidates(workers: int, hw: HardwareConfig) -> List[int]:
    """2D-SP group sizes tried: powers of two (and ``workers``) that divide ``workers``, at least one node."""
    out = {workers}
    g = hw.node_size
    while g < workers:
        if workers % g == 0:
            out.add(g)
        g *= 2
    return sorted(out)


def best_group(wl: WorkloadConfig, hw: HardwareConfig, sc: Scenario, scales: Scales) -> int:
    """The group size with the shortest simulated step (ties: the larger group, fewer replicas)."""
    best = None
    for g in group_candidates(sc.workers, hw):
        s = dataclasses.replace(sc, group_size=g)
        t = simulate_steps(step_costs(wl, hw, s, scales), s).step_time
        if best is None or t < best[0] - 1e-12 or (abs(t - best[0]) <= 1e-12 and g > best[1]):
            best = (t, g)
    return best[1]


def sweep(wl: WorkloadConfig, hw: HardwareConfig, scales: Scales, modes: Iterable[str] = MODES,
          workers: Iterable[int] = DEFAULT_WORKERS, reference_workers: Optional[int] = None,
          clustered: bool = True) -> List[Prediction]:
    workers = sorted(set(int(w) for w in workers))
    ref = reference_workers or workers[0]
    out = []
    for mode in modes:
        base = predict(wl, hw, Scenario(ref, mode, clustered=clustered), scales)
        for w in workers:
            p = predict(wl, hw, Scenario(w, mode, clustered=clustered), scales)
            p.scaling_efficiency = base.step_ms / p.step_ms
            out.append(p)
    return out


def format_table(preds: List[Prediction]) -> str:
    head = (f"{'mode':<20} {'workers':>7} {'group':>5} {'N':>3} {'step ms':>10} {'QPS':>10} {'eff':>7} "
            f"{'exp.lookup':>10} {'exp.comm':>9}")
    lines = [head, "-" * len(head)]
    for p in preds:
        eff = f"{100 * p.scaling_efficiency:6.1f}%" if p.scaling_efficiency is not None else "      -"
        lines.append(f"{MODE_LABELS[p.mode]:<20} {p.workers:>7} {p.group_size:>5} {p.micro_batches:>3} "
                     f"{p.step_ms:>10.1f} {p.qps:>10.3g} {eff} {p.exposed_lookup_ms:>10.1f} {p.exposed_comm_ms:>9.1f}")
    return "\n".join(lines)


def plot_scaling(preds: List[Prediction], path: str, title: str) -> None:
    import matplotlib  # optional, slow to import: only when a chart is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode in MODES:
        ps = [p for p in preds if p.mode == mode]
        if ps:
            ax.plot([p.workers for p in ps], [100 * p.scaling_efficiency for p in ps], marker="o", ms=3,
                    label=MODE_LABELS[mode])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("scaling efficiency (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
