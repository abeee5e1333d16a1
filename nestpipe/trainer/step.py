"""The synchronous step (``--pipeline off``) as explicit stage functions, in pipeline order.

    prefetch -> h2d -> route -> retrieve -> forward_backward (embedding All2All, dense fwd/bwd per micro-batch,
    gradient All2All) -> update (dense all-reduce + AdamW, owner row-wise AdaGrad)

The arithmetic order is the specification the pipelined modes reproduce bit for bit:
- micro-batches run in their index order; each micro-batch's loss is ``sum(per-sample loss) / (B * W)``, never a
  per-micro-batch mean, so the batch gradient is the gradient of the global mean loss;
- dense and replicated gradients accumulate in ``.grad`` over micro-batches in order (autograd), then one flat
  all-reduce per batch (the batch's loss sum rides along as the last element);
- owners add each entry's row gradient over micro-batches in order, then over requester ranks in rank order; one
  update per batch; embeddings are frozen between :func:`stage_retrieve` and :func:`update_sparse`;
- random numbers come only from generators keyed by (seed, step, micro-batch, rank).

The schedules (:mod:`nestpipe.trainer.pipeline.scheduler`) run these functions with the same process groups
(:class:`~nestpipe.trainer.distributed.process_groups.StageGroups`: route, embed, grad, dense): ``off`` is
:func:`train_step`; ``fwp`` is the same sequence with the Frozen-Window Pipeline's forward/backward; DBP runs
stages 1-3 on stage threads, retrieves into its dual buffers (:mod:`nestpipe.trainer.pipeline.dual_buffer`) and
calls :func:`dense_forward_backward`, :func:`update_sparse` and :func:`update_dense` on the compute thread.
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
from nestpipe.trainer.embedding.collection import ShardedEmbeddingCollection
from nestpipe.trainer.embedding.exchange import InFlight, issued
from nestpipe.trainer.embedding.routing import Routing
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

    @property
    def timeline(self) -> Optional[Timeline]:
        """The run's trace and Gantt chart: the stage timer's trace (spans given a step are recorded there)."""
        return self.timer.trace

    @timeline.setter
    def timeline(self, timeline: Optional[Timeline]) -> None:
        self.timer.trace = timeline


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
    """The host batch of ``record`` (read from its shard ``where`` by the data stream, ahead of the step):
    micro-batches, per-table keys and positions, negatives (:func:`nestpipe.trainer.data.prepare_batch`)."""
    with state.timer.span("prefetch", step):
        batch = prepare_batch(record, state.manifest, step, state.rank, state.cfg.seed,
                              num_negatives(state.cfg), where=where, micro_batching=state.micro_batching)
        if state.manifest.task == "gr":
            lens = np.concatenate([m.lengths["item"] for m in batch.micro]) if batch.micro else np.zeros(0)
            state.batch_costs[step] = (int(lens.sum()), float(sequence_cost(state.manifest)(lens).sum()))
        return batch


# -- stage 2: H2D ---------------------------------------------------------------------------------------------------
def stage_h2d(state: StepState, batch: PreparedBatch,
              copy: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> List[Dict[str, torch.Tensor]]:
    """The micro-batches' dense inputs on the device: built on the host, then moved by ``copy`` (default
    ``.to(device)``; the DBP h2d stage passes its stream's copy, non-blocking from pinned staging memory on an
    accelerator)."""
    copy = copy or (lambda t: t.to(state.device))
    host = torch.device("cpu")
    with state.timer.span("h2d", batch.step):
        return [{k: copy(v) for k, v in model_feats(state.cfg, state.manifest, batch, i, host).items()}
                for i in range(len(batch.micro))]


# -- stage 3: key routing -------------------------------------------------------------------------------------------
def stage_route(state: StepState, batch: PreparedBatch) -> Routing:
    with state.timer.span("route", batch.step):
        return state.emb.input_dist(batch, _group(state, "route")).wait()


def _group(state: StepState, stage: str):
    """The process group of ``stage``, checked against the one thread allowed to issue on it."""
    if state.groups is None:
        return state.group
    return state.groups.get(stage)


@dataclasses.dataclass
class RoutedAhead:
    """The next batch, prepared and routed during the previous step (``pipe.route_ahead``)."""

    step: int
    batch: PreparedBatch
    routing: Routing


def take_batch(state: StepState, step: int, record: Dict, where: str) -> Tuple[PreparedBatch, Routing]:
    """Stages 1 and 3 of ``step``: the batch routed ahead during the previous step, else ``record`` prepared and
    routed now."""
    ahead, state.routed_ahead = state.routed_ahead, None
    if ahead is None:
        batch = stage_prefetch(state, step, record, where)
        return batch, stage_route(state, batch)
    if ahead.step != step:
        raise RuntimeError(f"the batch routed ahead is step {ahead.step}'s, this is step {step}")
    return ahead.batch, ahead.routing


def route_ahead(state: StepState, step: int, next_record: Optional[Tuple[Dict, str]]
                ) -> InFlight[Optional[RoutedAhead]]:
    """``pipe.route_ahead``: batch ``step`` prepared and its key routing issued now (the counts All2All in flight;
    ``advance()`` issues the payload All2All, ``wait()`` builds the owner's plans). Routing reads keys only, so
    the step's arithmetic is unchanged; every rank issues the same collectives in the same order. Nothing (done,
    None) without a next record: a segment ends drained."""
    if next_record is None:
        return InFlight.done(None)
    with state.timer.span("route.ahead", step):
        batch = stage_prefetch(state, step, next_record[0], next_record[1])
        routing = state.emb.input_dist(batch, _group(state, "route"), async_op=True)
    return routing.then(lambda r: RoutedAhead(step, batch, r))


# -- stage 4: embedding retrieval ----------------------------------------------------------------------------------
def stage_retrieve(state: StepState, routing: Routing) -> None:
    """Retrieval in the synchronous schedules (``off``, ``fwp``): nothing else touches the store while the batch
    trains, so on CPU the owner reads its rows from the store and updates them there in place (no buffer, no
    write-back). DBP retrieves into a buffer instead (:mod:`nestpipe.trainer.pipeline.dual_buffer`); both read the
    same values and do the same arithmetic, hence bitwise the same results."""
    state.emb.retrieve(routing, synchronous=True)


# -- stage 5: forward / backward ------------------------------------------------------------------------------------
def stage_embed(state: StepState, routing: Routing, async_op: bool = False
                ) -> InFlight[List[Tuple[Dict[str, torch.Tensor], torch.Tensor]]]:
    """Every micro-batch's embedding All2All as one collective (no dense work overlaps it here; the values are
    those of one exchange per micro-batch, which the Frozen-Window Pipeline makes)."""
    return state.emb.embed_all(routing, _group(state, "embed"), async_op)


def stage_dense(state: StepState, routing: Routing, feats: List[Dict[str, torch.Tensor]],
                embedded: List[Tuple[Dict[str, torch.Tensor], torch.Tensor]]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Every micro-batch's dense forward and backward in index order: (loss sum / (B * W), the received leaves)."""
    total = torch.zeros((), dtype=torch.float64)
    for i, (emb_out, _) in enumerate(embedded):
        with state.timer.span("dense", routing.batch.step, i):
            total += dense_forward_backward(state, routing, emb_out, feats[i])
    return total, [leaf for _, leaf in embedded]


def stage_grad(state: StepState, routing: Routing, leaves: List[torch.Tensor], async_op: bool = False
               ) -> InFlight[None]:
    """Every micro-batch's gradient All2All as one collective, into the batch's gradient payload."""
    return state.emb.grad_exchange_all(routing, leaves, _group(state, "grad"), async_op)


def stage_forward_backward(state: StepState, routing: Routing, feats: List[Dict[str, torch.Tensor]]) -> torch.Tensor:
    """Stage 5 without overlap (DBP without the frozen window): the exchanges around the dense compute. Returns
    this rank's loss sum divided by ``B * W`` (a detached scalar); gradients are accumulated on return."""
    step = routing.batch.step
    with state.timer.span("embed.a2a", step, 0):
        embedded = stage_embed(state, routing).wait()
    loss, leaves = stage_dense(state, routing, feats, embedded)
    with state.timer.span("grad.a2a", step, len(leaves) - 1):
        stage_grad(state, routing, leaves).wait()
    return loss


def dense_forward_backward(state: StepState, routing: Routing, emb_out: Dict[str, torch.Tensor],
                           feats_i: Dict[str, torch.Tensor]) -> torch.Tensor:
    """One micro-batch's dense forward and backward; loss ``sum(per-sample loss) / (B * W)``. Returns the detached
    float64 loss. Dense and replicated gradients accumulate in ``.grad`` (micro-batches in call order)."""
    norm = float(routing.batch.batch_size * state.world)
    with state.timer.span("dense.fwd_bwd"):
        loss = state.model(emb_out, feats_i).sum() / norm
        loss.backward()
        return loss.detach().double().cpu()


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
    reduced: Optional[InFlight[torch.Tensor]] = None  # the all-reduce in flight (async_op), waited by update_dense


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
        work = dist.all_reduce(flat, group=_group(state, "dense"), async_op=async_op)
        if async_op:  # the wait comes after the sparse update, later than the collective ends
            red.reduced = issued(work, state.timer, "dense.allreduce", flat, t0)
        # ring all-reduce: each rank sends 2 (W - 1) / W of the buffer
        state.timer.add_bytes("dense.allreduce", 2 * (state.world - 1) * flat.numel() * flat.element_size() // state.world)
    if red.reduced is None:
        state.timer.add("dense.allreduce.comm", time.perf_counter() - t0)
        state.timer.add_cpu("dense.allreduce.comm", time.process_time() - c0)
    return red


def update_dense(state: StepState, red: DenseReduce) -> float:
    """Wait for the all-reduce (if in flight), then AdamW and the replicated tables. Returns the global loss."""
    if red.reduced is not None:
        red.reduced.wait()  # in flight from issue to completion; the compute thread waited only the rest (exposed)
        red.reduced = None
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


def update_sparse(state: StepState, routing: Routing, loss: torch.Tensor, release: bool = True,
                  write_back_stream=None) -> DenseReduce:
    """Issue the all-reduce of dense + replicated gradients (one flat buffer, the loss sum last), then the owners'
    row-wise AdaGrad while it is in flight (as a DDP backward overlaps its bucket all-reduces): the collective's
    waiting on the other ranks and the link overlaps this rank's row updates. The parts read and write disjoint
    tensors, so their order changes no bit. ``release=False`` keeps the updated rows in the batch's buffer (the DBP
    active buffer) for the dual-buffer sync into the next batch's prefetch buffer; ``write_back_stream``: the DBP
    write-back's device stream (the rows reach the store when the batch's pending write-back is finished)."""
    reduction = update_begin(state, loss, async_op=True)
    state.emb.update(routing, release=release, write_back_stream=write_back_stream)
    return reduction


def stage_update(state: StepState, routing: Routing, loss: torch.Tensor, release: bool = True) -> float:
    """:func:`update_sparse` then :func:`update_dense` (AdamW and the replicated tables). Returns the global loss."""
    return update_dense(state, update_sparse(state, routing, loss, release))


def train_step(state: StepState, step: int, record: Dict, where: str = "",
               next_record: Optional[Tuple[Dict, str]] = None) -> float:
    """One synchronous step (``--pipeline off``), the stages in the order they run. ``next_record`` (the next
    step's record and where it came from; ``pipe.route_ahead``): the next batch is prepared and routed while this
    batch's exchanges and all-reduce are in flight, and the next call takes it (:func:`take_batch`)."""
    batch, routing = take_batch(state, step, record, where)                  # 1 prefetch, 3 key routing
    feats = stage_h2d(state, batch)                                           # 2 H2D
    stage_retrieve(state, routing)                                            # 4 embedding retrieval
    state.hooks.pause()
    overlap = next_record is not None
    with state.timer.span("fwd_bwd", step):                                   # 5 forward / backward
        with state.timer.span("embed.a2a", step, 0):
            embedded = stage_embed(state, routing, async_op=overlap)          # the embedding All2All in flight
            ahead = route_ahead(state, step + 1, next_record)                 # next batch: counts All2All issued
            embedded = embedded.wait()
        loss, leaves = stage_dense(state, routing, feats, embedded)
        with state.timer.span("grad.a2a", step, len(leaves) - 1):
            grads = stage_grad(state, routing, leaves, async_op=overlap)      # the gradient All2All in flight
            ahead.advance()                                                   # next batch: payload All2All issued
            grads.wait()
    with state.timer.span("update", step):
        reduction = update_sparse(state, routing, loss)                       # the dense all-reduce in flight
        state.routed_ahead = ahead.wait()                                     # next batch: the owner's plans
        return update_dense(state, reduction)


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
    # a state built outside a run (no schedule chosen) keeps the shards' partition where micro_batching is auto
    mbat = "clustered" if cfg.pipe.micro_batching == "auto" else cfg.pipe.micro_batching
    state = StepState(cfg, manifest, rank, world, device, emb, model, optimizer, timer, group, groups,
                      micro_batching=mbat, hooks=hooks)
    state.timeline = timeline
    return state


__all__ = ["NEG_SLOT", "StepState", "build_state", "train_step", "take_batch", "route_ahead", "RoutedAhead",
           "stage_prefetch", "stage_h2d", "stage_route", "stage_retrieve", "stage_embed", "stage_dense", "stage_grad",
           "stage_forward_backward", "update_sparse", "stage_update", "update_begin", "update_dense", "DenseReduce",
           "model_feats", "dense_forward_backward"]
