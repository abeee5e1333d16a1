"""Calibration from a short measured run of ``nestpipe train``, and predictions for other local configurations.

The testbed model (:class:`LocalHardware`) has a handful of physical quantities, all fitted from ONE run
(``--pipeline off``, so every cost is exposed and measured on the compute thread):

- ``key_s``: seconds per distinct key of the lookup (retrieval + the owner's gather), per owner row;
- ``row_s``: seconds of requester / owner exchange work per micro-batch row (build the send buffer, place the
  received rows, add the gradient entries);
- ``coll_latency_s`` + ``coll_s_per_byte``: one collective = latency + bytes sent by a rank x seconds per byte,
  fitted by least squares over the run's four collective kinds (key routing, embedding and gradient All2Alls,
  dense all-reduce), which differ in size;
- ``dense_flops``: effective FLOP/s of the dense forward + backward (FLOPs per sample from the model config) at the
  run's micro-batch count; at other counts it is scaled by ``dense_probe_s``, the dense model's batch time at N / 2,
  N and 2 N micro-batches from a short probe (:mod:`nestpipe.measure.dense_probe`; piecewise linear in the count,
  only ratios used): the run cannot show the per-call cost (all its micro-batches have one size);
- ``token_s``: host preparation per token (data stage); ``step_overhead_s``: the rest of a step (update, Python);
- ``coll_cpu_s`` + ``coll_cpu_s_per_byte``: the CPU one collective costs (process CPU while it ran, every thread:
  gloo's copies and the loopback's TCP stack), fitted like the collective's time; most of a loopback collective's
  time is waiting, but this part competes with the ranks' other work for the cores.

Everything else is a mechanism, not a fit:

- workload volumes come from the shards (:func:`workload_from_shards`): per-micro-batch distinct keys of the
  exchanged tables, the batch's distinct keys, tokens; a rank sends the share ``(W - 1) / W`` of them (hashed
  placement); byte counts per row / key come from the calibration run's own counters;
- the number of collectives per step: 2 for routing (counts + payload), N embedding + N gradient All2Alls, 1 dense
  all-reduce;
- ``cores``: the ranks share the machine's cores; when ``W`` ranks need more CPU than ``cores`` per step, every
  CPU task is stretched until the step holds the ranks' CPU work (fixed point, :func:`predict`), collectives'
  CPU included;
- more ranks than cores: a collective completes only when every rank has reached it, and the last one to arrive was
  waiting for a core another rank held: each collective waits one scheduler slice more (the kernel's base slice,
  :func:`scheduler_slice_s`, a property of the machine, not a fit);
- a bandwidth cap (``link_bit_per_s``, the ``tc tbf`` rate of the benchmark's namespace): every rank's traffic
  crosses the one capped loopback, so a collective whose ranks send ``b`` bytes each needs at least
  ``W b x wire overhead / rate``; the wire overhead is TCP/IP headers at the link's MTU;
- what the pipelines hide: the event timeline of :mod:`nestpipe.planning.timeline` (the same one the paper-scale
  predictions use), with the stages mapped onto its tasks; the embedding and gradient All2Alls on two streams (the
  trainer's two FWP communication threads on two process groups), on one across a cap (they share its bytes).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional, Tuple

import numpy as np

from nestpipe.datasets.shards import load_manifest
from nestpipe.measure.dense_probe import first_record, probe_call_seconds
from nestpipe.planning.cost_model import Scenario, StepCosts
from nestpipe.planning.timeline import simulate_steps
from nestpipe.trainer.data import ShardStream
from nestpipe.trainer.pipeline.timeline import load_chrome_trace
from nestpipe.utils.jsonio import read_json

ROUTE_CALLS = 2  # counts + payload all_to_all_single per step
FUSED_EXCHANGE = ("off", "dbp")  # synchronous schedules: one embedding and one gradient All2All per batch


def exchange_calls(pipeline: str, micro_batches: int) -> int:
    """Embedding (and gradient) All2Alls per step: one per batch in the synchronous schedules (nothing overlaps the
    exchange there, so the trainer fuses all micro-batches'; ``stage_forward_backward``), one per micro-batch in
    the Frozen-Window ones."""
    return 1 if pipeline in FUSED_EXCHANGE else int(micro_batches)
TCP_IP_HEADER = 52  # IPv4 20 + TCP 20 + timestamps 12 bytes per packet


class RunError(ValueError):
    pass


def _read_json(path: str, what: str) -> Dict:
    return read_json(path, what, hint=f"is {os.path.dirname(path)} the --out directory of `nestpipe train`?")


# -- workload ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class LocalWorkload:
    """Per rank and step, mean over ranks and the first ``steps`` batches of every rank."""

    world: int
    batch: int
    micro_batches: int
    tokens: float  # values of all sequence tables
    batch_unique: float  # distinct keys of the exchanged (sharded) tables in the batch
    mb_unique: float  # sum over micro-batches of each micro-batch's distinct keys (exchanged tables)
    flops_per_sample: float
    exchanged_tables: List[str]
    neg_unique: float = 0.0  # distinct GR negatives of a batch: shared by the batch, sent with every micro-batch

    @property
    def exchanged_rows(self) -> float:
        """Rows a rank requests over all micro-batch exchanges of a step (before the remote share)."""
        return self.mb_unique + self.micro_batches * self.neg_unique

    @property
    def redundancy(self) -> float:
        return self.mb_unique / max(self.batch_unique, 1e-9)

    @property
    def remote(self) -> float:
        return (self.world - 1) / self.world


def dense_flops_per_sample(cfg: Dict, manifest) -> float:
    """Forward + backward FLOPs of one sample (3 x forward multiply-adds x 2), from the model config."""
    dim = int(cfg["embedding"].get("dim") or next(iter(manifest.tables.values())).dim)
    if cfg["model"] in ("hstu", "sasrec"):
        h = cfg[cfg["model"]]
        L = min(int(manifest.max_seq_len or h["max_seq_len"]), int(h["max_seq_len"]))
        if cfg["model"] == "hstu":
            hd = int(h["num_heads"]) * int(h["linear_dim"])
            per_token = (dim * 4 * hd  # u, v, q, k projections
                         + 2 * L * hd  # q k^T and attention x v over the sequence
                         + hd * dim)  # output projection
        else:
            per_token = (dim * 3 * dim + 2 * L * dim + dim * dim  # q, k, v; attention; output projection
                         + 2 * int(h["ffn_mult"]) * dim * dim)  # point-wise feed-forward
        per_token *= int(h["num_layers"])
        per_token += (int(h["num_random_negatives"]) + int(h["num_popular_negatives"]) + 1) * dim  # logits
        fwd = per_token * L
    else:
        d = cfg["dlrm"]
        n_dense = len(manifest.dense_features or [])
        widths = [n_dense] + list(d["bottom_mlp"])
        fwd = sum(a * b for a, b in zip(widths[:-1], widths[1:]))
        x = dim * (len(manifest.tables) + 1)
        r = int(d["cross_rank"]) or x
        fwd += int(d["cross_layers"]) * 2 * x * r
        top = [x] + list(d["top_mlp"]) + [1]
        fwd += sum(a * b for a, b in zip(top[:-1], top[1:]))
    return 3.0 * 2.0 * fwd


def workload_from_shards(shards: str, cfg: Dict, world: int, steps: int = 8) -> LocalWorkload:
    """Key volumes of the first ``steps`` batches of every rank, read from the shards (no training)."""
    stream0 = ShardStream(shards, "train", 0, world, verify=False)
    man = stream0.manifest
    rep_max = int(cfg["embedding"].get("replicate_max_rows", 0))
    kinds = cfg["embedding"].get("kinds") or {}
    seq = [t for t, s in sorted(man.tables.items()) if s.kind in ("sequence", "single")]
    exch = [t for t in seq if kinds.get(t, "unique" if man.tables[t].vocab > rep_max else "replicated") == "unique"]
    n_rand, n_pop = 0, 0
    if cfg["model"] in ("hstu", "sasrec") and "item" in exch:
        h = cfg[cfg["model"]]
        n_rand, n_pop = int(h["num_random_negatives"]), int(h["num_popular_negatives"])
    tok, bu, mu, neg, n = 0.0, 0.0, 0.0, 0.0, 0
    for r in range(world):
        s = stream0 if r == 0 else ShardStream(shards, "train", r, world, verify=False)
        for k, (_, rec, path) in enumerate(s.records(0)):
            if k >= steps:
                break
            for t in seq:
                tok += len(rec[f"{t}.values"])
            for t in exch:
                if f"{t}.unique" not in rec:
                    raise RunError(f"{path}: record lacks {t}.unique")
                bu += len(rec[f"{t}.unique"])
                mu += int(np.asarray(rec[f"{t}.mb_offsets"])[-1])
            if n_rand + n_pop:
                # uniform negatives are distinct (vocab >> n_rand); popular ones are n_pop draws of the batch's tokens
                counts = np.bincount(np.asarray(rec["item.inverse"], dtype=np.int64))
                p = counts[counts > 0] / counts.sum()
                neg += n_rand + float((-np.expm1(n_pop * np.log1p(-np.minimum(p, 1 - 1e-12)))).sum())
            n += 1
    n = max(n, 1)
    return LocalWorkload(world=world, batch=man.batch_size, micro_batches=man.micro_batches, tokens=tok / n,
                         batch_unique=bu / n, mb_unique=mu / n, flops_per_sample=dense_flops_per_sample(cfg, man),
                         exchanged_tables=exch, neg_unique=neg / n)


# -- hardware ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class LocalHardware:
    """The fitted testbed (see the module docstring); byte counts per row / key are the run's own counters."""

    key_s: float
    row_s: float
    coll_latency_s: float
    coll_s_per_byte: float
    dense_flops: float
    token_s: float
    step_overhead_s: float
    embed_bytes_per_row: float  # embedding All2All bytes per remote micro-batch row
    grad_bytes_per_row: float
    route_bytes_per_key: float  # key routing bytes per remote (distinct batch key + micro-batch row)
    allreduce_bytes: float  # dense all-reduce bytes a rank sends per step at the calibration world
    calib_world: int
    cores: int
    source: str = ""
    dense_call_s: float = 0.0  # fixed cost per dense forward + backward call (the probe's slope; reported)
    dense_probe_s: Dict[str, float] = dataclasses.field(default_factory=dict)  # micro-batches -> probe batch s
    calib_micro_batches: int = 0
    coll_cpu_s: float = 0.0  # CPU of one collective: per call + per byte a rank sends
    coll_cpu_s_per_byte: float = 0.0

    def as_dict(self) -> Dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class RunMeasurement:
    run: str
    pipeline: str
    world: int
    micro_batches: int
    step_s: float
    stages: Dict[str, float]  # per rank per step, mean over ranks
    bytes: Dict[str, float]  # per rank per step, mean over ranks
    cfg: Dict
    mean_step_s: float = 0.0
    stages_cpu: Dict[str, float] = dataclasses.field(default_factory=dict)  # process CPU per rank per step
    cpu_s: float = 0.0  # process CPU per rank per step (every thread)

    @property
    def shards(self) -> str:
        return self.cfg["shards"]


def median_step_s(run: str, warm: int = 2) -> Optional[float]:
    """Median update-to-update interval over the traced steps of every rank (``RUN/trace.json``), leaving out the
    first ``warm`` steps; None without a trace of at least 4 steps. On a shared machine this is robust to
    bursts of other load that the mean over steps (``metrics.json``) absorbs."""
    path = os.path.join(run, "trace.json")
    if not os.path.exists(path):
        return None
    ends: Dict[int, Dict[int, float]] = {}
    for sp in load_chrome_trace(path):
        if sp["stage"] == "update" and sp["thread"] == "compute":
            ends.setdefault(sp["rank"], {})[sp["step"]] = sp["t1"]
    deltas = []
    for per in ends.values():
        steps = sorted(per)
        deltas += [per[b] - per[a] for a, b in zip(steps, steps[1:]) if a >= steps[0] + warm - 1 and b == a + 1]
    return float(np.median(deltas)) if len(deltas) >= 3 else None


def read_run(run: str) -> RunMeasurement:
    """Per-step stage seconds and bytes (mean over ranks). The step is the median traced step when the run has a
    trace, and the stage means are scaled by median / mean step (a burst of other load stretches all stages of
    the steps it hits alike)."""
    m = _read_json(os.path.join(run, "metrics.json"), "metrics.json")
    cfg = _read_json(os.path.join(run, "config.json"), "config.json")
    path = os.path.join(run, "metrics.json")
    for k in ("world", "pipeline", "step_s", "per_rank"):
        if k not in m:
            raise RunError(f"{path}: metrics lack {k!r} (written by an older trainer?)")
    stages: Dict[str, float] = {}
    nbytes: Dict[str, float] = {}
    cpu: Dict[str, float] = {}
    cpu_s = 0.0
    ranks = m["per_rank"]
    for r in ranks:
        n = max(int(r.get("measured_steps", 0)), 1)
        for k, v in r.get("stages_s", {}).items():
            stages[k] = stages.get(k, 0.0) + v / n / len(ranks)
        for k, v in r.get("stages_cpu_s", {}).items():
            cpu[k] = cpu.get(k, 0.0) + v / n / len(ranks)
        cpu_s += float(r.get("cpu_s", 0.0)) / n / len(ranks)
        for k, v in r.get("network_bytes", {}).items():
            nbytes[k] = nbytes.get(k, 0.0) + v / n / len(ranks)
    man = load_manifest(cfg["shards"])
    mean = float(m["step_s"])
    med = median_step_s(run)
    if med:
        stages = {k: v * med / mean for k, v in stages.items()}
    return RunMeasurement(run, m["pipeline"], int(m["world"]), man.micro_batches, med or mean, stages, nbytes, cfg,
                          mean, cpu, cpu_s)


def _collective_points(meas: RunMeasurement, n: int, st: Optional[Dict[str, float]] = None):
    """(calls per step, bytes per call, seconds per call) of each collective kind; ``st``: which seconds (default:
    the stage times; ``meas.stages_cpu``: their CPU)."""
    st, by = meas.stages if st is None else st, meas.bytes
    pts = []
    ex = exchange_calls(meas.pipeline, n)
    for name, stage, calls in (("route", "route.comm", ROUTE_CALLS), ("embed", "embed.comm", ex),
                               ("grad", "grad.comm", ex), ("dense.allreduce", "dense.allreduce.comm", 1)):
        if st.get(stage, 0.0) > 0 and calls > 0:
            pts.append((calls, by.get(name, 0.0) / calls, st[stage] / calls))
    return pts


def _fit_line(pts) -> Tuple[float, float]:
    """Weighted least squares ``y = a + b x`` with ``a, b >= 0`` (weights: calls per step, i.e. time share)."""
    w = np.array([p[0] for p in pts], dtype=float)
    x = np.array([p[1] for p in pts], dtype=float)
    y = np.array([p[2] for p in pts], dtype=float)
    A = np.stack([np.ones_like(x), x], 1) * np.sqrt(w)[:, None]
    a, b = np.linalg.lstsq(A, y * np.sqrt(w), rcond=None)[0]
    if b < 0:
        a, b = float(np.average(y, weights=w)), 0.0
    elif a < 0:
        a, b = 0.0, float((w * x * y).sum() / (w * x * x).sum())
    return float(a), float(b)


def scheduler_slice_s(cores: int) -> float:
    """The Linux scheduler's base slice: ``/sys/kernel/debug/sched/base_slice_ns`` where readable, else the
    kernel's default (0.75 ms scaled by 1 + log2 of the CPU count, at most 8 CPUs counted: EEVDF, Linux >= 6.6)."""
    try:
        with open("/sys/kernel/debug/sched/base_slice_ns") as f:
            return int(f.read().strip()) * 1e-9
    except (OSError, ValueError):
        return 0.75e-3 * (1 + int(np.log2(max(1, min(int(cores), 8)))))


def fit_hardware(meas: RunMeasurement, wl: LocalWorkload, cores: Optional[int] = None,
                 dense_probe: Optional[Dict] = None) -> LocalHardware:
    """Fit :class:`LocalHardware` to one ``--pipeline off`` run (every stage on the compute thread).
    ``dense_probe``: :func:`nestpipe.measure.dense_probe.probe_call_seconds` of the run (None: the dense time is
    taken as proportional to FLOPs at every micro-batch count)."""
    where = os.path.join(meas.run, "metrics.json")
    if meas.pipeline != "off":
        raise RunError(f"{where}: calibration needs a --pipeline off run (got {meas.pipeline!r}): in the pipelined "
                       f"modes stage times overlap and the compute thread's figures are waits")
    if meas.world < 2:
        raise RunError(f"{where}: calibration needs world >= 2 (collectives to fit; got {meas.world})")
    if meas.cfg.get("pipe", {}).get("route_ahead", False):
        raise RunError(f"{where}: calibration needs an off run that routes every batch in its own step (train with "
                       "--set pipe.route_ahead=false): routed ahead, the routing All2Alls overlap the step and their "
                       "times are not the compute thread's")
    if meas.cfg.get("pipe", {}).get("micro_batching", "clustered") in ("auto", "whole"):
        raise RunError(f"{where}: calibration needs an off run over the shards' {wl.micro_batches} micro-batches "
                       "(train with --set pipe.micro_batching=clustered): this one ran every batch as one micro-batch "
                       "(pipe.micro_batching auto or whole), and the model is fitted per micro-batch")
    st, n = meas.stages, wl.micro_batches
    pts = _collective_points(meas, n)
    if len(pts) < 2:
        raise RunError(f"{where}: fewer than two collective kinds with time and bytes: {sorted(st)}")
    a, b = _fit_line(pts)
    cpu_pts = _collective_points(meas, n, meas.stages_cpu)
    ca, cb = _fit_line(cpu_pts) if len(cpu_pts) >= 2 else (0.0, 0.0)  # runs of older trainers lack the CPU
    remote = wl.remote
    mb_remote = wl.exchanged_rows * remote
    lookup = st.get("retrieve", 0.0) + st.get("embed.owner", 0.0)
    route_keys = (wl.batch_unique + wl.exchanged_rows) * remote  # batch keys + micro-batch positions
    exch = st.get("embed.requester", 0.0) + st.get("grad.owner", 0.0)
    dense = st.get("dense.fwd_bwd", 0.0)
    if dense <= 0:
        raise RunError(f"{where}: no dense.fwd_bwd time")
    data = st.get("prefetch", 0.0) + st.get("h2d", 0.0) + max(st.get("route.total", 0.0) - st.get("route.comm", 0.0), 0)
    known = (lookup + exch + dense + data + st.get("update.sparse", 0.0) + st.get("update.dense", 0.0)
             + st.get("route.comm", 0.0) + st.get("embed.comm", 0.0) + st.get("grad.comm", 0.0)
             + st.get("dense.allreduce.comm", 0.0))
    return LocalHardware(
        key_s=lookup / max(wl.batch_unique + wl.neg_unique, 1e-9),
        row_s=exch / max(wl.exchanged_rows, 1e-9),
        coll_latency_s=float(a), coll_s_per_byte=float(b),
        dense_flops=wl.flops_per_sample * wl.batch / dense,
        dense_call_s=float((dense_probe or {}).get("call_s", 0.0)),
        dense_probe_s=dict((dense_probe or {}).get("batch_s", {})), calib_micro_batches=n,
        token_s=data / max(wl.tokens, 1e-9),
        step_overhead_s=max(meas.step_s - known, 0.0) + st.get("update.sparse", 0.0) + st.get("update.dense", 0.0),
        embed_bytes_per_row=meas.bytes.get("embed", 0.0) / max(mb_remote, 1e-9),
        grad_bytes_per_row=meas.bytes.get("grad", 0.0) / max(mb_remote, 1e-9),
        route_bytes_per_key=meas.bytes.get("route", 0.0) / max(route_keys, 1e-9),
        allreduce_bytes=meas.bytes.get("dense.allreduce", 0.0),
        calib_world=meas.world, cores=int(cores or os.cpu_count() or 1), source=meas.run,
        coll_cpu_s=ca, coll_cpu_s_per_byte=cb)


# -- prediction ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class LocalPrediction:
    pipeline: str
    world: int
    micro_batches: int
    link_bit_per_s: Optional[float]
    step_s: float
    cpu_stretch: float
    exposed_comm_s: float
    exposed_lookup_s: float
    comm_s: float  # every collective of the step, hidden or not
    cpu_s: float  # CPU work per rank per step at full speed

    def as_dict(self) -> Dict:
        return dataclasses.asdict(self)


def dense_scale(hw: LocalHardware, micro_batches: int) -> float:
    """Dense batch time at ``micro_batches`` over the calibration's, from the probe (piecewise linear in the count,
    extended linearly past its ends); 1 without a probe."""
    pts = sorted((int(k), float(v)) for k, v in hw.dense_probe_s.items())
    if len(pts) < 2 or not hw.calib_micro_batches:
        return 1.0
    x = np.array([p[0] for p in pts], dtype=float)
    y = np.array([p[1] for p in pts])

    def at(n):
        if n <= x[0]:
            return y[0] + (n - x[0]) * (y[1] - y[0]) / (x[1] - x[0])
        if n >= x[-1]:
            return y[-1] + (n - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2])
        return float(np.interp(n, x, y))

    return max(at(micro_batches), 0.1 * y.min()) / at(hw.calib_micro_batches)


def _collective(hw: LocalHardware, nbytes: float, world: int, link_bit_per_s: Optional[float], mtu: int) -> float:
    t = hw.coll_latency_s + nbytes * hw.coll_s_per_byte
    if world > hw.cores:
        t += scheduler_slice_s(hw.cores)
    if link_bit_per_s:
        wire = nbytes * mtu / (mtu - TCP_IP_HEADER)
        t = max(t, hw.coll_latency_s + world * wire * 8.0 / link_bit_per_s)
    return t


def step_costs_local(hw: LocalHardware, wl: LocalWorkload, pipeline: str, link_bit_per_s: Optional[float] = None,
                     mtu: int = 1500, stretch: float = 1.0) -> StepCosts:
    """The testbed step as the timeline's tasks (CPU tasks stretched by ``stretch``)."""
    n, W = wl.micro_batches, wl.world
    remote = wl.remote
    mb_rows = wl.exchanged_rows * remote / n
    allreduce = hw.allreduce_bytes * (2 * (W - 1) / W) / (2 * (hw.calib_world - 1) / hw.calib_world)

    def coll(b):
        return _collective(hw, b, W, link_bit_per_s, mtu) if W > 1 else 0.0

    peers = (W - 1) / max(hw.calib_world - 1, 1)

    def coll_cpu(b, calls):  # the per-call part is per peer: gloo exchanges pairwise with each of W - 1 peers
        return calls * (hw.coll_cpu_s * peers + b * hw.coll_cpu_s_per_byte) if W > 1 else 0.0

    s = stretch
    rows_cpu = hw.row_s * wl.exchanged_rows / n
    dense = wl.flops_per_sample * wl.batch / n / hw.dense_flops * dense_scale(hw, n)
    route_b = hw.route_bytes_per_key * (wl.batch_unique + wl.exchanged_rows) * remote / ROUTE_CALLS
    # one exchange per micro-batch (FWP) or all micro-batches' in one (synchronous schedules: charged to the first
    # micro-batch's forward and the last one's backward, where the trainer issues them)
    ex = exchange_calls(pipeline, n)
    fwd_b, bwd_b = hw.embed_bytes_per_row * mb_rows * n / ex, hw.grad_bytes_per_row * mb_rows * n / ex
    route, fwd, bwd, reduce = ROUTE_CALLS * coll(route_b), coll(fwd_b), coll(bwd_b), coll(allreduce)
    fwd_comm = [fwd] * n if ex == n else [fwd] + [0.0] * (n - 1)
    bwd_comm = [bwd] * n if ex == n else [0.0] * (n - 1) + [bwd]
    # the collectives' own CPU counts against the rank's share of the cores (``cpu_s``, the floor in :func:`predict`)
    comm_cpu = coll_cpu(route_b, ROUTE_CALLS) + coll_cpu(fwd_b, ex) + coll_cpu(bwd_b, ex) + coll_cpu(allreduce, 1)
    return StepCosts(
        data=hw.token_s * wl.tokens * s, h2d=0.0,
        route=route,
        gather=hw.key_s * (wl.batch_unique + wl.neg_unique) * s, copy=0.0,
        fwd=[c + 0.5 * rows_cpu * s for c in fwd_comm],
        compute=[dense * s] * n,
        bwd=[c + 0.5 * rows_cpu * s for c in bwd_comm],
        replica=0.0,
        update=hw.step_overhead_s * s + reduce,
        writeback=0.0, sync=0.0,
        info={"cpu_s": hw.token_s * wl.tokens + hw.key_s * (wl.batch_unique + wl.neg_unique)
              + hw.row_s * wl.exchanged_rows + dense * n + hw.step_overhead_s + comm_cpu,
              "comm_s": route + ex * (fwd + bwd) + reduce})


MODES_LOCAL = ("off", "dbp", "fwp", "nested")
COMM_STREAMS = {"fwd": "net", "bwd": "net.grad"}


def predict(hw: LocalHardware, wl: LocalWorkload, pipeline: str, link_bit_per_s: Optional[float] = None,
            mtu: int = 1500, split_comm: bool = True) -> LocalPrediction:
    """Step of ``pipeline`` on ``wl``: the timeline with CPU tasks stretched by ``max(1, W / cores)``, and at least
    the ranks' CPU work per step over the cores. ``split_comm``: the embedding and gradient All2Alls run on two
    streams (the trainer's two FWP comm threads on the ``embed`` and ``grad`` groups), except across a bandwidth
    cap, where they share the link's bytes; ``False`` is the negative control of one stream."""
    if pipeline not in MODES_LOCAL:
        raise ValueError(f"pipeline must be one of {MODES_LOCAL} (got {pipeline!r})")
    sc = Scenario(max(wl.world, 1), pipeline, micro_batches=wl.micro_batches)

    def run(stretch):
        c = step_costs_local(hw, wl, pipeline, link_bit_per_s, mtu, stretch)
        split = split_comm and not link_bit_per_s
        return c, simulate_steps(c, sc, stream_of=COMM_STREAMS if split else None)

    # ranks train in lockstep (every collective synchronises them), so their CPU phases coincide: with more ranks
    # than cores every CPU task runs at cores / W of a core; and a rank's threads together cannot use more than
    # cores / W per step (the CPU floor)
    stretch = max(1.0, wl.world / hw.cores)
    costs, sched = run(stretch)
    cpu = costs.info["cpu_s"]
    floor = wl.world * cpu / hw.cores
    comm = costs.info["comm_s"]
    return LocalPrediction(pipeline, wl.world, wl.micro_batches, link_bit_per_s, max(sched.step_time, floor), stretch,
                           sched.exposed["comm"], sched.exposed["lookup"], comm, cpu)


def calibrate_run(run: str, cores: Optional[int] = None, steps: int = 8, probe: bool = True):
    """(hardware, workload, measurement) of a ``--pipeline off`` run directory. ``probe``: time the run's dense
    model at N / 2, N and 2 N micro-batches for its per-call cost (about a second; ``False``: no per-call cost)."""
    meas = read_run(run)
    wl = workload_from_shards(meas.shards, meas.cfg, meas.world, steps)
    if wl.micro_batches != meas.micro_batches:
        raise RunError(f"{run}: micro-batches differ between shards and run")
    res = None
    if probe and meas.pipeline == "off":
        res = probe_call_seconds(meas.cfg, load_manifest(meas.shards), first_record(meas.shards), wl.micro_batches,
                                 threads=int(meas.cfg.get("threads", 1)))
    return fit_hardware(meas, wl, cores, dense_probe=res), wl, meas
