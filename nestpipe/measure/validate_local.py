"""Held-out validation of the measured-run calibration: train configurations for real, predict, compare.

One ``--pipeline off`` run (world 2, loopback) is the calibration input; every other configuration (world 2 and 3,
other micro-batch counts, the pipelined modes, with and without a bandwidth cap) is predicted from it and its
shards, then trained and measured. Used by ``benchmarks/simulator_validation.py`` (full size) and
``tests/test_planning_measured.py`` (tiny). The bandwidth cap runs the ranks in a network namespace whose
loopback carries ``tc tbf`` (root only), built as in ``benchmarks/pipeline_bench.py``: MTU 1500, 16 KB bucket.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from typing import Dict, List, Optional, Tuple

import numpy as np

from nestpipe.clustering import assign, table_fields
from nestpipe.datasets.shards import Manifest, TableSpec, pack_tables, save_manifest, write_split_shards
from nestpipe.measure import measured
from nestpipe.measure.launcher import run_plan, write_run

NS = "nestpipe-simcal"
LINK_MTU, LINK_BURST, LINK_LATENCY = 1500, "16kb", "500ms"


@dataclasses.dataclass(frozen=True)
class Config:
    world: int
    pipeline: str
    micro_batches: int
    cap_bit_per_s: Optional[float] = None

    @property
    def tag(self) -> str:
        cap = f"-cap{int(self.cap_bit_per_s / 1e6)}M" if self.cap_bit_per_s else ""
        return f"w{self.world}-{self.pipeline}-n{self.micro_batches}{cap}"


def make_gr_shards(out: str, batch: int, seq_len: int, micro_batches: int, vocab: int, batches: int,
                   n_shards: int = 6, zipf: float = 1.2, seed: int = 7) -> str:
    """GR shards (item ``vocab`` rows + action 256 rows, Zipf item ids, clustered micro-batches); ``n_shards``
    train shards (6 feed world 2 and 3 evenly), the tables in one packed group as ``nestpipe ingest`` writes them. The same seed gives the same sequences for every micro-batch count."""
    rng = np.random.default_rng(seed)
    tables = {"item": TableSpec(vocab, 64, "sequence"), "action": TableSpec(256, 64, "sequence")}

    def record(split: str, index: int) -> dict:
        lengths = np.full(batch, seq_len, dtype=np.int32)
        off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        item = ((rng.zipf(zipf, int(off[-1])) - 1) % vocab).astype(np.int64)
        action = rng.integers(0, 256, int(off[-1])).astype(np.int64)
        mb = assign(item, off, micro_batches, seed=index).astype(np.int32)
        rec = {"meta": {"index": index, "split": split, "task": "gr", "samples": batch,
                        "micro_batches": micro_batches}, "mb": mb}
        for name, v in (("item", item), ("action", action)):
            for f, arr in table_fields(v, lengths, mb).items():
                rec[f"{name}.{f}"] = arr
        rec["user"] = rng.integers(0, 1000, batch)
        rec["time"] = np.arange(len(item), dtype=np.int64) * 1000
        return pack_tables(rec, "seq", ["item", "action"])  # as the ingest writes them

    sets_ = write_split_shards(out, (("train", [batches] * n_shards), ("eval", [1])), batch, record)
    save_manifest(out, Manifest(task="gr", batch_size=batch, micro_batches=micro_batches, tables=tables, sets=sets_,
                                max_seq_len=seq_len))
    return out


def train_sets(seq_len: int, negatives: Tuple[int, int] = (32, 32)) -> Dict:
    return {"embedding": {"replicate_max_rows": 300, "dim": 64},
            "hstu": {"num_layers": 1, "num_heads": 2, "linear_dim": 32, "max_seq_len": seq_len,
                     "num_random_negatives": negatives[0], "num_popular_negatives": negatives[1],
                     # the workload the simulator's figures were measured on: item rows [input | output]
                     "transition": 0.0},
            # the model's off routes every batch in its own step over the shards' micro-batches (measured.fit_hardware
            # fits per micro-batch; micro_batching auto would run off's batch as one)
            "pipe": {"gantt_steps": 0, "trace_steps": 1000, "route_ahead": False, "micro_batching": "clustered"}}


def _ns(*cmd):
    return subprocess.run(["ip", "netns", "exec", NS, *cmd], check=True, capture_output=True, text=True)


def make_namespace(rate_bit: float) -> None:
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    subprocess.run(["ip", "netns", "add", NS], check=True)
    _ns("ip", "link", "set", "lo", "up")
    _ns("ip", "link", "set", "lo", "mtu", str(LINK_MTU))
    _ns("tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{int(rate_bit)}bit", "burst", LINK_BURST,
        "latency", LINK_LATENCY)


def drop_namespace() -> None:
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def can_cap() -> Tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "not root"
    if shutil.which("tc") is None or shutil.which("ip") is None:
        return False, "ip / tc not installed"
    r = subprocess.run(["ip", "netns", "add", NS + "-probe"], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", NS + "-probe"], capture_output=True)
    return True, ""


def train_configs(out: str, shards: Dict[int, str], configs: List[Config], steps: int, seq_len: int,
                  repeats: int = 1, warmup_run: bool = True, timeout: float = 1200,
                  keep_checkpoints: bool = False) -> Dict[Config, List[str]]:
    """Train every config ``repeats`` times, interleaved (A B C A B C ...: a burst of other load on this shared
    machine hits one repeat, not every run of one config), one launch per (world, cap); config -> run dirs."""
    runs: Dict[Config, List[str]] = {}
    groups: Dict[Tuple[int, Optional[float]], List[Config]] = {}
    for c in configs:
        groups.setdefault((c.world, c.cap_bit_per_s), []).append(c)
    for (world, cap), cs in groups.items():
        plan = []
        if warmup_run:  # one-off launch costs are not charged to the first measured run
            warm = os.path.join(out, f"warmup-w{world}{'-cap' if cap else ''}")
            shutil.rmtree(warm, ignore_errors=True)
            write_run(warm, shards[cs[0].micro_batches], "hstu", "off", 3, train_sets(seq_len))
            plan.append({"run": warm})
        for k in range(repeats):
            for c in cs:
                run = os.path.join(out, f"{c.tag}-r{k}")
                shutil.rmtree(run, ignore_errors=True)
                write_run(run, shards[c.micro_batches], "hstu", c.pipeline, steps, train_sets(seq_len))
                plan.append({"run": run})
                runs.setdefault(c, []).append(run)
        prefix = None
        if cap:
            make_namespace(cap)
            prefix = ["ip", "netns", "exec", NS]
        try:
            p = run_plan(plan, world, os.path.join(out, f"plan-w{world}{'-cap' if cap else ''}.json"),
                         timeout=timeout, prefix=prefix)
        finally:
            if cap:
                drop_namespace()
        if p.returncode != 0:
            raise RuntimeError(f"training world {world} cap {cap} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
        if not keep_checkpoints:  # only metrics.json, config.json and trace.json are read; checkpoints are large
            for item in plan:
                shutil.rmtree(os.path.join(item["run"], "checkpoints"), ignore_errors=True)
    return runs


def fastest(runs: List[str]) -> str:
    """The repeat with the shortest (median traced) step: the one least disturbed by other load."""
    return min(runs, key=lambda r: measured.read_run(r).step_s)


@dataclasses.dataclass
class Row:
    config: Config
    predicted_s: float
    measured_s: float
    role: str  # "calibration" | "held-out"

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0


def validate(calib_run: str, runs: Dict[Config, str], cores: Optional[int] = None) -> Tuple[List[Row], object]:
    """Calibrate on ``calib_run`` and predict every run of ``runs`` (one run per config; measured step: the
    median traced step, :func:`measured.read_run`)."""
    hw, _, _ = measured.calibrate_run(calib_run, cores)
    rows = []
    for c, run in runs.items():
        meas = measured.read_run(run)
        wl = measured.workload_from_shards(meas.shards, meas.cfg, c.world)
        p = measured.predict(hw, wl, c.pipeline, c.cap_bit_per_s, LINK_MTU)
        rows.append(Row(c, p.step_s, meas.step_s, "calibration" if os.path.samefile(run, calib_run) else "held-out"))
    return rows, hw


def format_rows(rows: List[Row]) -> str:
    head = f"{'configuration':<28} {'role':<11} {'predicted ms':>12} {'measured ms':>11} {'error':>7}"
    out = [head, "-" * len(head)]
    for r in rows:
        out.append(f"{r.config.tag:<28} {r.role:<11} {r.predicted_s * 1e3:12.1f} {r.measured_s * 1e3:11.1f} "
                   f"{100 * r.error:+6.1f}%")
    return "\n".join(out)
