"""The training loop of one rank (run under torchrun by :mod:`nestpipe.trainer.launch`).

    for step in range(start, total):        # start = 0, or the resumed checkpoint's step
        record = next(this rank's shard stream)
        loss = train_step(...)               # step.py: the synchronous stages in order
        log, checkpoint every K steps (between steps: nothing in flight)
    final checkpoint, metrics.json
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from nestpipe.trainer import checkpoint
from nestpipe.trainer.config import TrainConfig
from nestpipe.trainer.data import ShardStream
from nestpipe.trainer.device import Device
from nestpipe.trainer.metrics import ScalarLog, write_json_atomic
from nestpipe.trainer.step import build_state, train_step


def total_steps(cfg: TrainConfig, batches_per_rank: int) -> int:
    if cfg.steps is not None:
        return int(cfg.steps)
    return int(cfg.epochs or 1) * batches_per_rank


def train_worker(cfg: TrainConfig, device: Device, rank: int, world: int, resume: bool) -> dict:
    if cfg.pipeline != "off":
        raise ValueError(f"--pipeline {cfg.pipeline!r} is not available in this build; use --pipeline off")
    torch.set_num_threads(cfg.threads)
    stream = ShardStream(cfg.shards, "train", rank, world, verify=cfg.verify_shards)
    manifest = stream.manifest
    steps = total_steps(cfg, stream.batches_per_rank)
    state = build_state(cfg, manifest, rank, world, device.torch)
    start = 0
    if resume:
        ck = checkpoint.latest(cfg.out)
        if rank == 0:
            checkpoint.clean_partial(cfg.out)
        if ck is not None:
            start = checkpoint.load(ck, state)
    log = ScalarLog(os.path.join(cfg.out, "scalars.jsonl") if rank == 0 else None)
    if rank == 0:
        log.write(start, event="start", resumed_from_step=start, world=world, steps=steps,
                  dropped_batches=stream.dropped, kinds=state.emb.kinds)
    bar = None
    if rank == 0 and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, initial=start, unit="step", dynamic_ncols=True)
    B = manifest.batch_size
    t_start = time.perf_counter()
    done = 0
    loss = float("nan")
    if start < steps:
        for step, record, path in stream.records(start):
            if step == cfg.debug_fail_step and rank == cfg.debug_fail_rank:
                raise RuntimeError(f"rank {rank}: injected failure at step {step} (debug_fail_step)")
            loss = train_step(state, step, record, where=path)
            done += 1
            if rank == 0:
                el = time.perf_counter() - t_start
                sps = done * B * world / max(el, 1e-9)
                if (step + 1) % max(cfg.log_every, 1) == 0:
                    log.write(step + 1, loss=loss, samples_per_s=sps)
                if bar:
                    bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{sps:.0f}")
                    bar.update(1)
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < steps:
                checkpoint.save(cfg.out, state, step + 1, cfg.debug_checkpoint_sleep_s)
            if step + 1 >= steps:
                break
    elapsed = time.perf_counter() - t_start
    if bar:
        bar.close()
    checkpoint.save(cfg.out, state, steps)
    # metrics: per-rank throughput and stage times, gathered to rank 0
    mine = {"rank": rank, "samples_per_s": done * B / max(elapsed, 1e-9), "elapsed_s": elapsed, "steps": done,
            "stages_s": state.timer.summary(), "exposed_communication_s": state.timer.exposed_communication(),
            "exposed_lookup_s": state.timer.exposed_lookup()}
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    result = {"final_loss": loss, "steps": steps, "resumed_from_step": start}
    if rank == 0:
        total_sps = sum(g["samples_per_s"] for g in gathered)
        metrics = {"model": cfg.model, "pipeline": cfg.pipeline, "world": world, "batch_size_per_rank": B,
                   "steps_run": done, "resumed_from_step": start, "final_loss": loss,
                   "samples_per_s": total_sps, "samples_per_s_per_rank": [g["samples_per_s"] for g in gathered],
                   "per_rank": gathered, "exchange_kinds": state.emb.kinds}
        write_json_atomic(os.path.join(cfg.out, "metrics.json"), metrics)
        log.write(steps, event="end", final_loss=loss, samples_per_s=total_sps)
        log.close()
        result["metrics"] = metrics
    return result
