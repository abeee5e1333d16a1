"""Early stopping on the valid split: train epoch by epoch, score the model on ``valid`` after each, keep the best.

    for epoch in 1 .. max_epochs:
        train one epoch; checkpoint (the segment ends drained, as every checkpoint does)
        score = the model's metric on the valid split, from that checkpoint     (every rank, the same number)
        stop when ``patience`` epochs in a row have not beaten the best score
    the checkpoints after the best epoch are removed: the run's latest checkpoint (what eval, export and serve
    read) is the epoch it kept

The metric is the model's alone (no baselines): NDCG@10 for next-item models, AUC for CTR models (``metric``).
Every rank computes it from the same checkpoint files with the same arithmetic, so every rank takes the same
decision without waiting for another; the ranks' scores are compared, and a difference fails the run. The history
(``RUN/early_stop.json``, written by rank 0 after each epoch) makes a killed run resume where it was: its epochs
are not scored again. ``mode = auto`` stops early where the shards have a valid split (``nestpipe ingest
--validation``) and the run names neither ``steps`` nor ``epochs``; ``on`` requires the valid split.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from typing import Dict, List, Optional

from nestpipe.trainer import checkpoint
from nestpipe.utils.jsonio import read_json, write_json_atomic

HISTORY = "early_stop.json"
METRIC = {"gr": "NDCG@10", "ctr": "AUC"}


def wanted(cfg, manifest) -> bool:
    """Whether this run stops early (``cfg.early_stop.mode``); raises where ``on`` cannot be honoured."""
    mode = cfg.early_stop.mode
    has_valid = bool(manifest.sets.get("valid"))
    if mode == "on":
        if not has_valid:
            raise ValueError(f"{cfg.shards}: early stopping scores the valid split, which these shards lack; "
                             "ingest with --validation (or train with --epochs N and no early stopping)")
        if cfg.steps is not None:
            raise ValueError("early stopping chooses the number of steps: leave steps unset (early_stop.max_epochs "
                             "bounds the epochs)")
        return True
    return mode == "auto" and has_valid and cfg.steps is None and cfg.epochs is None


@dataclasses.dataclass
class EarlyStop:
    """The decision state of one run: every epoch's valid score so far."""

    metric: str
    patience: int
    max_epochs: int
    batches_per_epoch: int
    history: List[Dict] = dataclasses.field(default_factory=list)  # {"epoch", "step", "score"}, in order

    @property
    def best(self) -> Optional[Dict]:
        scored = [h for h in self.history if not math.isnan(h["score"])]
        return max(scored, key=lambda h: (h["score"], -h["epoch"])) if scored else None

    def done(self) -> bool:
        """Stop now: ``patience`` epochs since the best, or the last epoch trained."""
        if not self.history:
            return False
        last = self.history[-1]["epoch"]
        best = self.best
        return last >= self.max_epochs or (best is not None and last - best["epoch"] >= self.patience)

    def to_dict(self) -> Dict:
        best = self.best
        return {"metric": self.metric, "split": "valid", "patience": self.patience, "max_epochs": self.max_epochs,
                "batches_per_epoch": self.batches_per_epoch, "history": self.history,
                "kept_epoch": best["epoch"] if best else None, "kept_step": best["step"] if best else None,
                "kept_score": best["score"] if best else None,
                "stopped_after_epoch": self.history[-1]["epoch"] if self.history else 0}


def start(cfg, task: str, batches_per_epoch: int) -> EarlyStop:
    """The run's early-stop state: fresh, or the history a killed run left (``RUN/early_stop.json``)."""
    es = EarlyStop(METRIC[task], cfg.early_stop.patience, cfg.early_stop.max_epochs, batches_per_epoch)
    path = os.path.join(cfg.out, HISTORY)
    if os.path.exists(path):
        es.history = list(read_json(path, "early-stop history").get("history", []))
    return es


def record(es: EarlyStop, epoch: int, step: int, score: float, rank: int, out: str) -> None:
    es.history = [h for h in es.history if h["epoch"] < epoch] + [{"epoch": epoch, "step": step, "score": score}]
    if rank == 0:
        write_json_atomic(os.path.join(out, HISTORY), es.to_dict())


def prune(es: EarlyStop, out: str, final: bool) -> None:
    """Rank 0, after an epoch's decision: remove every checkpoint but the best epoch's and (while training goes on)
    the latest, which a killed run resumes from. ``final``: the latest goes too where it is not the best, so that
    the run's latest checkpoint (what eval, export and serve read) is the epoch it kept."""
    best = es.best
    root = checkpoint.ckpt_root(out)
    if best is None or not os.path.isdir(root):
        return
    steps = sorted(int(n[len("step-"):]) for n in os.listdir(root)
                   if n.startswith("step-") and os.path.exists(os.path.join(root, n, "meta.json")))
    keep = {best["step"]} | (set() if final or not steps else {steps[-1]})
    for step in steps:
        if step not in keep and (final or step < steps[-1]):
            shutil.rmtree(os.path.join(root, f"step-{step:08d}"))


def score(cfg, manifest) -> float:
    """The model's valid-split metric (:data:`METRIC`) from the run's latest checkpoint."""
    from nestpipe.trainer import evaluate  # the model and data code of evaluation, only when scoring

    return evaluate.model_score(cfg, manifest, "valid", METRIC[manifest.task])
