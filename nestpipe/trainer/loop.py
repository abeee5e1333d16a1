"""The training loop of one rank (run under torchrun by :mod:`nestpipe.trainer.launch`).

    groups = one process group per concurrent stage (route, embed, grad, dense), same order on every rank
    for segment in segments(start, total, checkpoint_every):      # start = 0, or the resumed checkpoint's step
        for step, loss in pipeline.run(records, segment):         # off | dbp | fwp | nested (scheduler.py)
            log
        checkpoint                                                 # the segment ended drained: nothing in flight
    final checkpoint, metrics.json, trace.json (+ timeline.png)

All four modes do the same arithmetic in the same order; a segment boundary is where the pipeline drains, so
checkpoints (and export and eval, which read checkpoints) never see a batch in flight and resume is bitwise exact.
"""

from __future__ import annotations

import datetime
import dataclasses
import os
import time
from typing import Dict, Iterator, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from nestpipe.kernels import kernel_rule, reset_taken, taken_paths, tuning
from nestpipe.kernels.memory import huge_pages_mode
from nestpipe.trainer.step_profiler import StepProfiler
from nestpipe.planning.planner import format_plan, save_plan
from nestpipe.trainer import testing_hooks
from nestpipe.trainer import checkpoint, early_stop
from nestpipe.trainer.config import TrainConfig
from nestpipe.trainer.data import ShardStream
from nestpipe.trainer.distributed import device as devmod
from nestpipe.trainer.distributed import sparse_groups
from nestpipe.trainer.distributed.device import Device
from nestpipe.trainer.embedding import replica_sync
from nestpipe.trainer.metrics import ScalarLog
from nestpipe.trainer.models import model_spec
from nestpipe.trainer.pipeline import auto
from nestpipe.trainer.pipeline import timeline as tlmod
from nestpipe.trainer.pipeline.scheduler import PipelineRunner
from nestpipe.trainer.step import StepState, build_state
from nestpipe.utils.jsonio import read_json, write_json_atomic


def total_steps(cfg: TrainConfig, batches_per_rank: int, early: bool = False) -> int:
    if early:
        return int(cfg.early_stop.max_epochs) * batches_per_rank
    if cfg.steps is not None:
        return int(cfg.steps)
    return int(cfg.epochs or 1) * batches_per_rank


def segments(start: int, total: int, *every: int) -> Iterator[Tuple[int, int]]:
    """[start, stop) ranges ending at checkpoint steps (multiples of any of ``every``; 0 names none) and at
    ``total``."""
    s = start
    while s < total:
        stop = min([total] + [(s // e + 1) * e for e in every if e])
        yield s, stop
        s = stop


@dataclasses.dataclass
class RankRun:
    """What one rank trains in this run: its config, place in the world, data stream and state."""

    cfg: TrainConfig
    device: Device
    rank: int
    world: int
    hooks: testing_hooks.TestingHooks
    flush_denormal: bool
    stream: ShardStream
    steps: int
    state: StepState
    schedule: auto.ScheduleChoice  # the schedule this run trains with (--pipeline, or auto's choice) and why
    kernel_choice: Dict[str, Dict[str, object]]  # the kernel paths taken among equal ones, and where each came from
    early: Optional[early_stop.EarlyStop] = None  # early stopping on the valid split, where the run does it


class Progress:
    """Counts the steps trained, writes ``RUN/scalars.jsonl`` and the progress bar (rank 0), and marks the start
    of the steady state: the figures in metrics.json leave out the first ``warm`` steps (pipeline fill, first
    contact)."""

    def __init__(self, run: RankRun, start: int, log: ScalarLog):
        self.run, self.start, self.log = run, start, log
        cfg, rank = run.cfg, run.rank
        self.bar = None
        if rank == 0 and cfg.progress:
            from nestpipe.utils.progress import progress  # start-up time: tqdm only on the rank that shows it

            self.bar = progress(run.steps, "train", "step", initial=start)
        self.done, self.loss = 0, float("nan")
        self.warm = 2 if run.steps - start > 4 else 0
        self.t_start = time.perf_counter()
        self.snap, self.t_warm, self.cpu_warm = run.state.timer.snapshot(), self.t_start, time.process_time()

    def step_done(self, step: int, loss: float) -> None:
        self.done += 1
        self.loss = loss
        if self.done == self.warm:
            self.snap, self.t_warm, self.cpu_warm = (self.run.state.timer.snapshot(), time.perf_counter(),
                                                     time.process_time())
        if self.run.rank == 0:
            el = time.perf_counter() - self.t_start
            sps = self.done * self.run.stream.manifest.batch_size * self.run.world / max(el, 1e-9)
            if (step + 1) % max(self.run.cfg.log_every, 1) == 0:
                self.log.write(step + 1, loss=loss, samples_per_s=sps)
            if self.bar:
                self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{sps:.0f}")
                self.bar.update(1)

    def close(self) -> Tuple[float, float]:
        """(elapsed seconds, steady-state CPU seconds) at the end of training."""
        elapsed = time.perf_counter() - self.t_start
        steady_cpu_s = time.process_time() - self.cpu_warm
        if self.bar:
            self.bar.close()
        return elapsed, steady_cpu_s


def train_worker(cfg: TrainConfig, device: Device, rank: int, world: int, resume: bool,
                 hooks: testing_hooks.TestingHooks = testing_hooks.PRODUCTION) -> dict:
    """Train one rank: the algorithm of the module docstring. ``hooks``: test-only negative controls and faults
    (:mod:`nestpipe.trainer.testing_hooks`), production by default."""
    run = set_up(cfg, device, rank, world, hooks)
    start = resume_step(run) if resume else 0
    if resume and (start >= run.steps or (run.early is not None and run.early.done())):
        # a finished run: nothing to train, and its metrics.json and final checkpoint stay as they are
        if rank == 0 and run.early is not None:
            early_stop.prune(run.early, cfg.out, final=True)  # where the run was killed before its last pruning
            kept = run.early.best or {}
            print(f"{cfg.out}: run already finished (early stopping kept epoch {kept.get('epoch')}, step "
                  f"{kept.get('step')}); nothing to resume.", flush=True)
        elif rank == 0:
            print(f"{cfg.out}: run already finished (checkpoint at step {start}, {run.steps} steps configured); "
                  "nothing to resume. Train further with a larger --steps or --epochs.", flush=True)
        return {"final_loss": None, "steps": run.steps, "resumed_from_step": start, "already_finished": True}
    run.state.timeline = tlmod.Timeline(rank, start, cfg.pipe.trace_steps)
    runner = PipelineRunner(run.state, run.schedule.schedule)
    log = ScalarLog(os.path.join(cfg.out, "scalars.jsonl") if rank == 0 else None,
                    os.path.join(cfg.out, "tensorboard") if cfg.tensorboard else None)
    announce(run, start, log)
    progress = Progress(run, start, log)
    train_segments(run, runner, start, progress)
    elapsed, steady_cpu_s = progress.close()
    if run.early is None:
        checkpoint.save(cfg.out, run.state, run.steps)
    elif rank == 0:  # every epoch was checkpointed and scored: keep the best one only
        early_stop.prune(run.early, cfg.out, final=True)
    return report(run, runner, start, progress, elapsed, steady_cpu_s)


def set_up(cfg: TrainConfig, device: Device, rank: int, world: int,
           hooks: testing_hooks.TestingHooks = testing_hooks.PRODUCTION) -> RankRun:
    """Threads, floating-point mode, this rank's data stream, the stage process groups and the state."""
    torch.set_num_threads(cfg.threads)
    reset_taken()  # metrics.json's kernel_paths: the calls of this run, not of earlier runs in this process
    if rank == 0 and hooks.changed():
        print(f"testing hooks set (not a normal run): {hooks.changed()}", flush=True)
    flush_denormal = devmod.set_flush_denormal(cfg.flush_denormal)  # this thread; the pipeline's threads inherit it
    # the records feed prepare_batch only, which needs no per-occurrence values of packed tables
    stream = ShardStream(cfg.shards, "train", rank, world, verify=cfg.verify_shards, values=False)
    early = (early_stop.start(cfg, stream.manifest.task, stream.batches_per_rank)
             if early_stop.wanted(cfg, stream.manifest) else None)
    steps = total_steps(cfg, stream.batches_per_rank, early is not None)
    groups = sparse_groups.create_stage_groups(sparse_groups.resolve(cfg.sparse_groups, world, rank),
                                               datetime.timedelta(seconds=float(cfg.timeout_s)))
    state = build_state(cfg, stream.manifest, rank, world, device.torch, groups=groups, hooks=hooks)
    schedule = auto.choose(cfg.pipeline, device.torch, world, micro_batching=cfg.pipe.micro_batching,
                           partition_invariant=model_spec(cfg.model).partition_invariant(cfg),
                           intra_op_threads=cfg.threads)
    state.micro_batching = schedule.micro_batching
    state.total_steps = steps
    lay = state.emb.slot_layout
    shape = tuning.TuneShape.of_run(lay.store_rows, lay.store_dims, stream.manifest.batch_size, world,
                                    pooled="reduction" in state.emb.kinds.values())
    # only the ops this run calls: the bag update where it is on, the dual-buffer sync in the DBP schedules
    ops = (["lookup", "place_keys"] + (["adagrad_bags"] if state.emb.bag_update() else [])
           + (["dual_buffer_sync"] if schedule.schedule in ("dbp", "nested") else []))
    kernel_choice = tuning.choose_for_run(shape, device.torch, rank, world, cfg.tune_kernels, ops=ops)
    return RankRun(cfg, device, rank, world, hooks, flush_denormal, stream, steps, state, schedule, kernel_choice,
                   early)


def resume_step(run: RankRun) -> int:
    """Load the latest complete checkpoint into the state (rank 0 removes partial ones); its step, or 0."""
    ck = checkpoint.latest(run.cfg.out, quiet=run.rank != 0)  # every rank picks the same one (rank 0 reports)
    if run.rank == 0:
        checkpoint.clean_partial(run.cfg.out)
    return checkpoint.load(ck, run.state) if ck is not None else 0


def announce(run: RankRun, start: int, log: ScalarLog) -> None:
    """Rank 0: save and print the sharding plan, and log the run's start with its metadata."""
    if run.rank != 0:
        return
    cfg, emb = run.cfg, run.state.emb
    ch = run.schedule
    if cfg.progress or not ch.overlap_can_pay:
        print(f"pipeline: {ch.schedule} ({ch.reason}); micro-batching: {_micro_batching_line(run)}", flush=True)
    if emb.plan is not None:
        save_plan(emb.plan, os.path.join(cfg.out, "plan.json"))
        if cfg.progress:
            print(format_plan(emb.plan), flush=True)
    log.write(
        start, event="start", resumed_from_step=start, world=run.world, steps=run.steps, pipeline=run.schedule.schedule,
        pipeline_choice=run.schedule.to_dict(),
        dropped_batches=run.stream.dropped, kinds=emb.kinds, kernel_rule=kernel_rule(run.device.torch),
        kernel_choice=run.kernel_choice,
        store_huge_pages=_huge_pages(cfg), flush_denormal=run.flush_denormal, testing_hooks=run.hooks.changed())


def _micro_batching_line(run: RankRun) -> str:
    ch, n = run.schedule, run.stream.manifest.micro_batches
    if ch.micro_batching == "whole":
        how = f"the batch as one micro-batch (the shards have {n}; {ch.schedule} has no frozen window to overlap)"
    else:
        how = f"{n} {ch.micro_batching} micro-batches per batch"
        if run.cfg.pipe.micro_batching == "auto" and auto.micro_batching_for("auto", ch.schedule) == "whole":
            how += " (the model's loss depends on the partition: in-batch negatives)"
    return how + (" [pipe.micro_batching=auto]" if run.cfg.pipe.micro_batching == "auto" else "")


def train_segments(run: RankRun, runner: PipelineRunner, start: int, progress: Progress) -> None:
    """The pipeline over each segment; a checkpoint at every segment end before the last (drained there)."""
    hooks, rank = run.hooks, run.rank

    profiler = StepProfiler(run.cfg.pipe.profile_steps, rank, run.cfg.out, start)

    def before_step(step: int) -> None:
        if step == hooks.fail_step and rank == hooks.fail_rank:
            raise RuntimeError(f"rank {rank}: injected failure at step {step} (testing hook fail_step)")
        profiler.before(step)

    records = run.stream.records(start)
    epoch_len = run.stream.batches_per_rank if run.early is not None else 0
    try:
        for seg_start, seg_stop in segments(start, run.steps, run.cfg.checkpoint_every, epoch_len):
            for step, loss in runner.run(records, seg_start, seg_stop, before_step):
                progress.step_done(step, loss)
                profiler.after(step)
            # drained: every stage thread joined, no buffer held, nothing in flight
            if seg_stop < run.steps or run.early is not None:
                checkpoint.save(run.cfg.out, run.state, seg_stop, hooks.checkpoint_sleep_s)
            if epoch_len and seg_stop % epoch_len == 0 and end_of_epoch(run, seg_stop // epoch_len, seg_stop):
                return
    finally:
        profiler.close()


def end_of_epoch(run: RankRun, epoch: int, step: int) -> bool:
    """Early stopping: score the checkpoint just written on the valid split (every rank, the same number), record
    it, prune the checkpoints; True when training stops here."""
    es = run.early
    if not any(h["epoch"] == epoch for h in es.history):  # a resumed run does not score its epochs again
        value = early_stop.score(run.cfg, run.stream.manifest)
        scores = [None] * run.world
        if run.world > 1:
            dist.all_gather_object(scores, value)
        else:
            scores = [value]
        if any(not (s == value or (s != s and value != value)) for s in scores):
            raise RuntimeError(f"early stopping: the ranks scored epoch {epoch} differently ({scores})")
        early_stop.record(es, epoch, step, value, run.rank, run.cfg.out)
        if run.rank == 0 and run.cfg.progress:
            best = es.best
            print(f"epoch {epoch}: valid {es.metric} {value:.4f} (best {best['score']:.4f} at epoch {best['epoch']})",
                  flush=True)
    if run.rank == 0:
        early_stop.prune(es, run.cfg.out, final=False)
    return es.done()


def report(run: RankRun, runner: PipelineRunner, start: int, progress: Progress, elapsed: float,
           steady_cpu_s: float) -> dict:
    """Gather every rank's steady-state figures; rank 0 writes trace.json, timeline.png and metrics.json."""
    cfg, state, rank, world = run.cfg, run.state, run.rank, run.world
    B, done, warm, loss = run.stream.manifest.batch_size, progress.done, progress.warm, progress.loss
    t = state.timer.minus(progress.snap)
    steady = max(done - warm, 0) if done >= warm else done
    steady_s = progress.t_start + elapsed - progress.t_warm
    mine = {"rank": rank, "samples_per_s": steady * B / max(steady_s, 1e-9), "elapsed_s": elapsed, "steps": done,
            "measured_steps": steady, "measured_s": steady_s, "warmup_steps": done - steady,
            "step_s": steady_s / max(steady, 1),
            "stages_s": t.summary(), "cpu_s": steady_cpu_s,
            "stages_cpu_s": {k: round(v, 6) for k, v in sorted(t.cpu.items())},
            "exposed_communication_s": t.exposed_communication(),
            "exposed_lookup_s": t.exposed_lookup(), "communication_total_s": t.communication_total(),
            "exposed_tier_s": t.exposed_tier(),
            "lookup_total_s": t.lookup_total(), "dbp_rows_synced": runner.rows_synced,
            **replica_sync.metrics(state.emb),
            "network_bytes": dict(t.bytes),
            "kernel_paths": taken_paths(),  # {op: {path: calls}} this rank executed (noted at every call)
            "batch_costs": {str(k): v for k, v in sorted(state.batch_costs.items())},
            "timeline": state.timeline.export()}
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    result = {"final_loss": loss, "steps": run.steps, "resumed_from_step": start}
    if rank == 0:
        spans = tlmod.merge(g.pop("timeline") for g in gathered)
        tlmod.write_chrome_trace(os.path.join(cfg.out, "trace.json"), spans)
        if cfg.pipe.gantt_steps > 0 and spans:
            # steady state: the warm-up steps that metrics.json leaves out are not drawn either
            show = tlmod.gantt_steps(spans, max(warm, 1), cfg.pipe.gantt_steps)
            tlmod.write_gantt(os.path.join(cfg.out, "timeline.png"), spans, show,
                              title=f"{cfg.model}, --pipeline {run.schedule.schedule}, world {world}")
        total_sps = sum(g["samples_per_s"] for g in gathered)
        metrics = {"model": cfg.model, "pipeline": run.schedule.schedule, "pipeline_choice": run.schedule.to_dict(),
                   "world": world, "batch_size_per_rank": B,
                   "micro_batching": run.schedule.micro_batching,
                   "micro_batches": 1 if run.schedule.micro_batching == "whole" else run.stream.manifest.micro_batches,
                   "steps_run": done, "resumed_from_step": start, "final_loss": loss,
                   "samples_per_s": total_sps, "samples_per_s_per_rank": [g["samples_per_s"] for g in gathered],
                   "per_rank": gathered, "exchange_kinds": state.emb.kinds,
                   "kernel_paths": _union_paths(gathered), "kernel_rule": kernel_rule(run.device.torch),
                   "kernel_choice": run.kernel_choice,
                   "store_huge_pages": _huge_pages(cfg),
                   "flush_denormal": run.flush_denormal, "testing_hooks": run.hooks.changed(),
                   **exposure_summary(gathered, cfg.pipe.baseline_metrics), **balance_summary(gathered)}
        if run.early is not None:
            metrics["early_stop"] = run.early.to_dict()
        write_json_atomic(os.path.join(cfg.out, "metrics.json"), metrics)
        progress.log.write(run.steps, event="end", final_loss=loss, samples_per_s=total_sps)
        progress.log.close()
        result["metrics"] = metrics
    else:
        for g in gathered:
            g.pop("timeline", None)
    return result


def balance_summary(gathered) -> dict:
    """How evenly the ranks' batches cost (gr), from what each rank processed: ``token_imbalance``, the mean over
    steps of max / mean - 1 of the ranks' attention costs (``a n^2 + b n`` summed over the batch's sequences, the
    manifest's cost model), ``token_count_imbalance`` the same of plain token counts; and every rank's wait per
    steady-state step at the two collectives where ranks meet after their dense work (the gradient All2All and the
    dense AllReduce). Pops the per-step costs from ``gathered``."""
    per = [g.pop("batch_costs", {}) for g in gathered]
    out = {"collective_wait_s_per_step": [
        {"grad_all2all": g["stages_s"].get("grad.comm", 0.0) / max(g["measured_steps"], 1),
         "dense_allreduce": g["stages_s"].get("dense.allreduce.comm", 0.0) / max(g["measured_steps"], 1)}
        for g in gathered]}
    steps = sorted(set.intersection(*(set(p) for p in per)), key=int) if per and all(per) else []
    if steps and len(per) > 1:
        for key, col in (("token_imbalance", 1), ("token_count_imbalance", 0)):
            x = np.array([[p[s][col] for p in per] for s in steps], dtype=np.float64)
            mean = x.mean(1)
            out[key] = float(np.mean(np.where(mean > 0, x.max(1) / np.where(mean > 0, mean, 1) - 1, 0.0)))
        out["token_imbalance_steps"] = len(steps)
    return out


def _union_paths(gathered) -> dict:
    """``{op: [paths]}`` that any rank executed: what the run took, never the rule's table of possible paths."""
    out: dict = {}
    for g in gathered:
        for op, paths in g.get("kernel_paths", {}).items():
            out.setdefault(op, set()).update(paths)
    return {op: sorted(paths) for op, paths in sorted(out.items())}


def _per_step(gathered, key: str) -> float:
    return sum(g[key] / max(g["measured_steps"], 1) for g in gathered) / max(len(gathered), 1)


def exposure_summary(gathered, baseline_path: str = "") -> dict:
    """Exposed communication and lookup per step (mean over ranks), and their ratio to ``--pipeline off``.

    With ``baseline_path`` (an off run's metrics.json) the ratio is measured against that run; without it the
    off quantities are estimated from this run: in ``off`` every collective (but the dense all-reduce, in flight
    during the sparse update) and every lookup is exposed, so the estimate is this run's total time inside
    collectives / lookups (``ratio_source`` says which)."""
    out = {"step_s": _per_step(gathered, "measured_s"),
           "exposed_communication_s_per_step": _per_step(gathered, "exposed_communication_s"),
           "exposed_lookup_s_per_step": _per_step(gathered, "exposed_lookup_s"),
           "exposed_tier_s_per_step": _per_step(gathered, "exposed_tier_s"),
           "communication_s_per_step": _per_step(gathered, "communication_total_s"),
           "lookup_s_per_step": _per_step(gathered, "lookup_total_s")}
    if baseline_path:
        base = read_json(baseline_path, "metrics.json of the --pipeline off baseline (pipe.baseline_metrics)")
        off_comm, off_look = base["exposed_communication_s_per_step"], base["exposed_lookup_s_per_step"]
        out["ratio_source"] = os.path.abspath(baseline_path)
    else:
        off_comm, off_look = out["communication_s_per_step"], out["lookup_s_per_step"]
        out["ratio_source"] = "estimate: this run's time inside collectives and lookups"
    out["exposed_communication_ratio_to_off"] = out["exposed_communication_s_per_step"] / off_comm if off_comm else None
    out["exposed_lookup_ratio_to_off"] = out["exposed_lookup_s_per_step"] / off_look if off_look else None
    return out


def _huge_pages(cfg) -> str:
    """How large DRAM stores are backed in this run (run metadata)."""
    mode = cfg.embedding.huge_pages
    if mode == "never":
        return "off (embedding.huge_pages = never)"
    avail = huge_pages_mode()
    return f"{avail}, {mode} stores" if avail == "madvise" else avail
