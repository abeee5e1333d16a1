"""The synchronous step (``--pipeline off``) as explicit stage functions, in pipeline order.

    prefetch -> h2d -> route -> retrieve -> forward_backward (per micro-batch: embedding All2All, dense fwd/bwd,
    gradient All2All, owner-side accumulation) -> update (dense all-reduce + AdamW, owner row-wise AdaGrad)

The arithmetic order is the specification the pipelined modes reproduce bit for bit:
- micro-batches run in their index order; each micro-batch's loss is ``sum(per-sample loss) / (B * W)``, never a
  per-micro-batch mean, so the batch gradient is the gradient of the global mean loss;
- dense and replicated gradients accumulate in ``.grad`` over micro-batches in order (autograd), then one flat
  all-reduce per batch (the batch's loss sum rides along as the last element);
- owners add each entry's row gradient over micro-batches in order (``index_add_``), then over requester ranks in
  rank order; one update per batch; embeddings are frozen between :func:`stage_retrieve` and :func:`stage_update`;
- random numbers come only from generators keyed by (seed, step, micro-batch, rank).

Every mode (``off``, ``dbp``, ``fwp``, ``nested``) calls these same functions with the same process groups
(:class:`~nestpipe.trainer.distributed.process_groups.StageGroups`: route, embed, grad, dense); the pipelined modes
(:mod:`nestpipe.trainer.pipeline.scheduler`) only run them on other threads and at other times.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from nestpipe.datasets.sequence_cost import DEFAULT_COST, SequenceCost
from nestpipe.datasets.shards import Manifest
from nestpipe.trainer import dense_optim, testing_hooks
from nestpipe.trainer.config import TrainConfig, check_tables, lr_factor
from nestpipe.trainer.data import prepare_batch
from nestpipe.trainer.distributed import sparse_groups
from nestpipe.trainer.distributed.process_groups import StageGroups
from nestpipe.trainer.embedding import replica_sync
from nestpipe.trainer.embedding.batch import NEG_SLOT, PreparedBatch
from nestpipe.trainer.embedding.collection import RouteInFlight, Routing, ShardedEmbeddingCollection
from nestpipe.trainer.models import build_model, model_spec
from nestpipe.trainer.pipeline.timeline import Timeline
from nestpipe.utils.timing import StageTimer

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclasses.dataclass
class StepState:
    """Everything a rank trains: the sharded embeddings, the replicated dense model and its optimizer."""

    cfg: TrainConfig
    manifest: Manifest
    rank: int
    world: int
    device: torch.device
    emb: ShardedEmbeddingCollection
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    timer: StageTimer
    group: Optional[object] = None  # the default group: checkpoints and metrics, only while nothing is in flight
    groups: Optional[StageGroups] = None  # one process group per concurrent stage
    timeline: Optional[Timeline] = None  # the run's trace and Gantt chart
    # GR: step -> (tokens, attention cost a n^2 + b n summed over the batch's sequences) of this rank's batch, for
    # metrics.json's token_imbalance across ranks
    batch_costs: Dict[int, Tuple[int, float]] = dataclasses.field(default_factory=dict)
    routed_ahead: Optional["RoutedAhead"] = None  # the next batch, its routing in flight (pipe.route_ahead)
    # pipe.micro_batching as resolved for the run's schedule (pipeline.auto.micro_batching_for; set by the trainer
    # once the schedule is chosen): clustered, random or whole
    micro_batching: str = "clustered"
    # the run's step count (set by the trainer): the learning-rate schedule's horizon (optim.schedule)
    total_steps: int = 0
    # test-only negative controls and faults, production unless a test passes others (train_worker's hooks)
    hooks: testing_hooks.TestingHooks = testing_hooks.PRODUCTION


def sequence_cost(manifest: Manifest) -> SequenceCost:
    """The per-sequence cost model the shards were balanced with (the default one for unbalanced shards)."""
    bal = (manifest.options or {}).get("balance")
    return SequenceCost(bal["a"], bal["b"]) if isinstance(bal, dict) else DEFAULT_COST


def num_negatives(cfg: TrainConfig):
    """(random, popular) negatives drawn per batch for the model."""
    return model_spec(cfg.model).negatives(cfg)


def model_feats(cfg: TrainConfig, manifest: Manifest, batch: PreparedBatch, i: int,
                device: torch.device) -> Dict[str, torch.Tensor]:
    """The dense model's non-embedding inputs of micro-batch ``i``."""
    return model_spec(cfg.model).dense_inputs(cfg, manifest, batch, i, device, DTYPES[cfg.dtype])


# -- stage 1: data prefetch ---------------------------------------------------------------------------------------
def stage_prefetch(state: StepState, step: int, record: Dict, where: str) -> PreparedBatch:
    with state.timer.span("prefetch"):
        batch = prepare_batch(record, state.manifest, step, state.rank, state.cfg.seed,
                              num_negatives(state.cfg), where=where, micro_batching=state.micro_batching)
        if state.manifest.task == "gr":
            lens = np.concatenate([m.lengths["item"] for m in batch.micro]) if batch.micro else np.zeros(0)
            state.batch_costs[step] = (int(lens.sum()), float(sequence_cost(state.manifest)(lens).sum()))
        return batch


# -- stage 2: H2D ---------------------------------------------------------------------------------------------------
def stage_h2d(state: StepState, batch: PreparedBatch) -> List[Dict[str, torch.Tensor]]:
    with state.timer.span("h2d"):
        return [model_feats(state.cfg, state.manifest, batch, i, state.device) for i in range(len(batch.micro))]


# -- stage 3: key routing -------------------------------------------------------------------------------------------
def stage_route(state: StepState, batch: PreparedBatch) -> Routing:
    return state.emb.input_dist(batch, _group(state, "route"))


def _group(state: StepState, stage: str):
    """The process group of ``stage``, checked against the one thread allowed to issue on it."""
    if state.groups is None:
        return state.group
    return state.groups.get(stage)


# -- stage 4: embedding retrieval ----------------------------------------------------------------------------------
def stage_retrieve(state: StepState, routing: Routing) -> None:
    """Retrieval in the synchronous schedules (``off``, ``fwp``): nothing else touches the store while the batch
    trains, so the owner reads its rows from the store and updates them there in place (``direct``: no buffer, no
    write-back). DBP retrieves into a buffer instead (:mod:`nestpipe.trainer.pipeline.dual_buffer`); both read the
    same values and do the same arithmetic, hence bitwise the same results."""
    state.emb.retrieve(routing, direct=True)


# -- stage 5: forward / backward, micro-batch by micro-batch ------------------------------------------------------
def stage_forward_backward(state: StepState, routing: Routing, feats: List[Dict[str, torch.Tensor]],
                           while_embed: Optional[Callable[[], None]] = None,
                           while_grad: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """Returns this rank's loss sum divided by ``B * W`` (a detached scalar).

    No dense work overlaps the exchange here, so all micro-batches' embedding All2Alls are one collective before
    the first dense forward, and their gradient All2Alls one after the last backward (``emb.embed_all`` /
    ``emb.grad_exchange_all``: the same bytes and values as one exchange per micro-batch, so bitwise the same
    result as the Frozen-Window Pipeline's per-micro-batch exchanges, which tests/test_pipeline.py compares).
    ``while_embed`` / ``while_grad``: work on other tensors (the next batch's routing) run while the embedding /
    gradient All2All is in flight."""
    total = torch.zeros((), dtype=torch.float64)
    step = routing.batch.step
    tl = state.timeline
    n = len(routing.batch.micro)
    if n > 1:
        with _span(tl, "embed.a2a", step, 0):
            outs = state.emb.embed_all(routing, _group(state, "embed"), during=while_embed)
        for i, (emb_out, _) in enumerate(outs):
            with _span(tl, "dense", step, i):
                total += dense_forward_backward(state, routing, emb_out, feats[i])
        with _span(tl, "grad.a2a", step, n - 1):
            state.emb.grad_exchange_all(routing, [leaf for _, leaf in outs], _group(state, "grad"), during=while_grad)
        return total
    for i in range(n):  # one micro-batch
        with _span(tl, "embed.a2a", step, i):
            emb_out, leaf = state.emb.embed(routing, i, _group(state, "embed"), during=while_embed)
        with _span(tl, "dense", step, i):
            total += dense_forward_backward(state, routing, emb_out, feats[i])
        with _span(tl, "grad.a2a", step, i):
            state.emb.grad_exchange_and_accumulate(routing, i, leaf, _group(state, "grad"), during=while_grad)
    return total


def dense_forward_backward(state: StepState, routing: Routing, emb_out: Dict[str, torch.Tensor],
                           feats_i: Dict[str, torch.Tensor]) -> torch.Tensor:
    """One micro-batch's dense forward and backward; loss ``sum(per-sample loss) / (B * W)``. Returns the detached
    float64 loss. Dense and replicated gradients accumulate in ``.grad`` (micro-batches in call order)."""
    norm = float(routing.batch.batch_size * state.world)
    t0 = time.perf_counter()
    loss = state.model(emb_out, feats_i).sum() / norm
    loss.backward()
    out = loss.detach().double().cpu()
    state.timer.add("dense.fwd_bwd", time.perf_counter() - t0)
    return out


class _NoSpan:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _span(timeline, stage: str, step: int, mb: int = -1):
    return timeline.span(stage, step, mb) if timeline is not None else _NoSpan()


def flat_dtype(grads, rep):
    return (grads + rep)[0].dtype if grads + rep else torch.float32


# -- update: one per batch -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class DenseReduce:
    """The batch's flat dense + replicated gradient buffer (the loss sum as its last element) and, when issued
    asynchronously, the all-reduce in flight."""

    params: List[torch.nn.Parameter]
    grads: List[torch.Tensor]
    rep: List[torch.Tensor]
    flat: torch.Tensor
    work: Optional[object] = None
    t_issue: float = 0.0
    t_done: Optional[float] = None  # set by the collective's completion callback (on the communication thread)


def updates_done(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps taken so far: AdamW's own count (saved and restored with its state in a checkpoint)."""
    for st in optimizer.state.values():
        if "step" in st:
            return int(st["step"])
    return 0


def set_rates(state: StepState) -> None:
    """This update's learning rates under ``optim.schedule``: AdamW's, and the sparse tables' when
    ``optim.embedding_follows``. A function of the update's index and the run's step count only, so every schedule
    and a resumed run apply the same rates; ``constant`` without warm-up leaves the configured rates untouched."""
    o = state.cfg.optim
    if o.schedule == "constant" and o.warmup_steps == 0:
        return
    if state.total_steps <= 0:
        raise RuntimeError(f"optim.schedule {o.schedule!r} needs the run's step count (StepState.total_steps)")
    factor = lr_factor(o, updates_done(state.optimizer), state.total_steps)
    for group in state.optimizer.param_groups:
        group["lr"] = o.lr * factor
    if o.embedding_follows:
        state.emb.lr_scale = factor


def update_begin(state: StepState, loss: torch.Tensor, async_op: bool = False) -> DenseReduce:
    """Set this update's learning rates (:func:`set_rates`), flatten dense + replicated gradients and the loss sum,
    and all-reduce them on the ``dense`` group (in flight on return when ``async_op``; :func:`update_dense` waits).
    Reads gradients only: the sparse update may run while it is in flight."""
    set_rates(state)
    params = [p for _, p in sorted(state.model.named_parameters(), key=lambda kv: kv[0])]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    rep = state.emb.replicated_grads()
    flat = torch.cat([g.reshape(-1) for g in grads + rep] + [loss.to(flat_dtype(grads, rep)).reshape(1).to(state.device)])
    red = DenseReduce(params, grads, rep, flat)
    t0, c0 = time.perf_counter(), time.process_time()
    if state.world > 1:
        red.work = dist.all_reduce(flat, group=_group(state, "dense"), async_op=async_op)
        if not async_op:
            red.work = None
        else:
            # its completion time: the wait comes after the sparse update, later than the collective ends
            red.work.get_future().add_done_callback(lambda _f: setattr(red, "t_done", time.perf_counter()))
        # ring all-reduce: each rank sends 2 (W - 1) / W of the buffer
        state.timer.add_bytes("dense.allreduce", 2 * (state.world - 1) * flat.numel() * flat.element_size() // state.world)
    red.t_issue = t0
    if red.work is None:
        state.timer.add("dense.allreduce.comm", time.perf_counter() - t0)
        state.timer.add_cpu("dense.allreduce.comm", time.process_time() - c0)
    return red


def update_dense(state: StepState, red: DenseReduce) -> float:
    """Wait for the all-reduce (if in flight), then AdamW and the replicated tables. Returns the global loss."""
    if red.work is not None:
        t0 = time.perf_counter()
        red.work.wait()
        t1 = time.perf_counter()
        # in flight from issue to completion (communication time); the compute thread only waited t1 - t0 (exposed)
        done = min(red.t_done, t1) if red.t_done is not None else t1
        state.timer.add_split("dense.allreduce.comm", done - red.t_issue, t1 - t0)
        red.work = None
    t0 = time.perf_counter()
    flat = red.flat
    off = 0
    for p, g in zip(red.params, red.grads):
        p.grad = flat[off:off + g.numel()].view_as(g)  # a view: the buffer lives until zero_grad below
        off += g.numel()
    rep_red = []
    for g in red.rep:
        rep_red.append(flat[off:off + g.numel()].view_as(g).clone())
        off += g.numel()
    dense_optim.step(state.optimizer)
    state.optimizer.zero_grad(set_to_none=True)
    state.emb.update_replicated(rep_red)
    state.timer.add("update.dense", time.perf_counter() - t0)
    return float(flat[-1])


def stage_update(state: StepState, routing: Routing, loss: torch.Tensor, release: bool = True,
                 while_reduce: Optional[Callable[[], None]] = None) -> float:
    """All-reduce dense + replicated gradients (one flat buffer), owner AdaGrad, AdamW. Returns the global loss.

    The all-reduce is issued asynchronously and is in flight during the owners' sparse update (as a DDP backward
    overlaps its bucket all-reduces): the collective's waiting on the other ranks and the link overlaps this rank's
    row updates. The three parts
    (:func:`update_begin`, ``emb.update``, :func:`update_dense`) read and write disjoint tensors, so the order
    between them changes no bit; the pipelined modes call the same parts in the same order.

    ``release=False`` keeps the updated rows in the batch's buffer (the DBP active buffer) for the dual-buffer
    sync into the next batch's prefetch buffer. ``while_reduce``: work on other tensors run after the sparse
    update, while the all-reduce may still be in flight."""
    red = update_begin(state, loss, async_op=True)
    state.emb.update(routing, release=release)
    if while_reduce is not None:
        while_reduce()
    return update_dense(state, red)


@dataclasses.dataclass
class RoutedAhead:
    """The next batch, prepared, with its key routing in flight (``pipe.route_ahead``): issued during the previous
    step, taken by :func:`train_step` of step ``step``."""

    step: int
    batch: PreparedBatch
    route: RouteInFlight
    routing: Optional[Routing] = None  # the owner's plans, once built (off: while this step's all-reduce flies)


def train_step(state: StepState, step: int, record: Dict, where: str = "",
               forward_backward: Optional[Callable[[Routing, List[Dict[str, torch.Tensor]]], torch.Tensor]] = None,
               next_record: Optional[Tuple[Dict, str]] = None) -> float:
    """One synchronous step: the stages above, one after another. ``forward_backward`` replaces
    :func:`stage_forward_backward` (same contract: every micro-batch in order, gradients accumulated on return):
    the ``fwp`` schedule passes the Frozen-Window Pipeline's.

    ``next_record`` (the next step's record and where it came from; ``pipe.route_ahead``): the next batch is
    prepared and its key routing issued during this step -- the preparation, the requester's plans and the counts
    All2All while this batch's embedding All2All is in flight, the payload All2All while its gradient All2All is
    (``fwp``: before this batch's retrieval and after its backward), its owner's plans while this batch's dense
    all-reduce is (``off``) -- and the next call takes it (``state.routed_ahead``) instead of preparing and
    routing ``record`` itself. Routing depends on keys only, so the step's arithmetic is unchanged; every rank
    issues the same collectives in the same order. A step without ``next_record`` leaves nothing in flight
    (segments end drained)."""
    tl = state.timeline
    ahead, state.routed_ahead = state.routed_ahead, None
    if ahead is not None and ahead.step != step:
        raise RuntimeError(f"the batch routed ahead is step {ahead.step}'s, this is step {step}")
    with _span(tl, "prefetch", step):
        batch = stage_prefetch(state, step, record, where) if ahead is None else ahead.batch
    with _span(tl, "h2d", step):
        feats = stage_h2d(state, batch)
    with _span(tl, "route", step):
        routing = (stage_route(state, batch) if ahead is None else
                   ahead.routing if ahead.routing is not None else state.emb.input_dist_finish(ahead.route))
    if next_record is not None and state.hooks.route_ahead_repeat_record:
        next_record = (record, where)  # negative control: the next step trains on this step's batch again

    def begin_next():  # prepare the next batch, its requester plans, and issue its counts All2All
        if next_record is not None:
            with _span(tl, "route.ahead", step + 1):
                nxt = stage_prefetch(state, step + 1, next_record[0], next_record[1])
                state.routed_ahead = RoutedAhead(step + 1, nxt,
                                                 state.emb.input_dist_begin(nxt, _group(state, "route")))

    def advance_next():  # the counts have arrived: issue the payload All2All
        if state.routed_ahead is not None:
            state.emb.input_dist_advance(state.routed_ahead.route)

    def finish_next():  # the payload has arrived: the owner's plans of the next batch
        if state.routed_ahead is not None:
            state.routed_ahead.routing = state.emb.input_dist_finish(state.routed_ahead.route)

    if forward_backward is not None:  # fwp: its communication threads own the exchanges; route around them
        begin_next()
    with _span(tl, "retrieve", step):
        stage_retrieve(state, routing)
    if state.hooks.step_sleep_s:
        time.sleep(state.hooks.step_sleep_s)  # testing hook: a window to kill the run with a batch in flight
    with _span(tl, "fwd_bwd", step):
        if forward_backward is None:
            # off: the next batch's routing work runs while this batch's embedding / gradient All2All is in flight
            # (nothing to route ahead: the exchanges block, and their CPU time is measured as the calibration needs)
            ahead_work = next_record is not None
            loss = stage_forward_backward(state, routing, feats, while_embed=begin_next if ahead_work else None,
                                          while_grad=advance_next if ahead_work else None)
        else:
            loss = forward_backward(routing, feats)
            advance_next()
    with _span(tl, "update", step):
        return stage_update(state, routing, loss, while_reduce=finish_next if forward_backward is None else None)


def build_state(cfg: TrainConfig, manifest: Manifest, rank: int, world: int, device: torch.device,
                group=None, groups=None, timeline=None,
                hooks: testing_hooks.TestingHooks = testing_hooks.PRODUCTION) -> StepState:
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype {cfg.dtype!r}: expected one of {sorted(DTYPES)}")
    check_tables(cfg, manifest.tables, cfg.shards or "the shards")
    timer = StageTimer()
    # 2D-SP: the tables are sharded over the rank's model-parallel group (its local rank of M); plain: over the world
    layout = sparse_groups.resolve(cfg.sparse_groups, world, rank)
    emb = ShardedEmbeddingCollection(manifest, cfg.embedding, cfg.seed, layout.local_rank, layout.group_size, device,
                                     negatives=model_spec(cfg.model).shared_negatives, group=group, timer=timer,
                                     dtype=DTYPES[cfg.dtype], widths=model_spec(cfg.model).table_widths(cfg),
                                     run_dir=cfg.out, requester_salt=hooks.requester_salt,
                                     tier_write_back=not hooks.skip_tier_write_back)
    replica_sync.attach(emb, layout, cfg.embedding.optimizer, cfg.embedding.momentum_scale_groups, groups,
                        skip_sync=hooks.skip_replica_sync)
    model = build_model(cfg, manifest, emb.dims).to(device=device, dtype=DTYPES[cfg.dtype])
    o = cfg.optim
    # one fused kernel over all parameters where torch has it (CPU, CUDA): a fixed rule by device, the same on every
    # rank and for every schedule; the per-parameter loop elsewhere
    fused = device.type in ("cpu", "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                  weight_decay=o.weight_decay, **({"fused": True} if fused else {"foreach": False}))
    emb.timeline = timeline
    # a state built outside a run (no schedule chosen) keeps the shards' partition where micro_batching is auto
    mbat = "clustered" if cfg.pipe.micro_batching == "auto" else cfg.pipe.micro_batching
    return StepState(cfg, manifest, rank, world, device, emb, model, optimizer, timer, group, groups, timeline,
                     micro_batching=mbat, hooks=hooks)


__all__ = ["NEG_SLOT", "StepState", "build_state", "train_step", "stage_prefetch", "stage_h2d", "stage_route",
           "stage_retrieve", "stage_forward_backward", "stage_update", "update_begin", "update_dense", "DenseReduce", "model_feats", "dense_forward_backward"]
