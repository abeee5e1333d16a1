"""NestPipe from Python: the commands as functions, for scripts and notebooks.

``train`` launches the same ranks as ``nestpipe train`` (through torchrun, in child processes, so a notebook's
own process never joins a process group) and returns the run's ``metrics.json``; ``evaluate`` and ``export`` run
in the calling process. Errors raise (``ValueError``, ``FileNotFoundError``, ``RuntimeError``) with the messages
the command line prints.

    import nestpipe

    metrics = nestpipe.train("shards/", "runs/hstu", nproc_per_node=2, epochs=1)
    scores = nestpipe.evaluate("runs/hstu")
    nestpipe.export("runs/hstu", "runs/hstu/model.pt")
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Optional


def _flatten(prefix: str, d: Mapping[str, Any]):
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, Mapping):
            yield from _flatten(key, v)
        else:
            yield key, v


def train(shards: str, out: str, *, model: Optional[str] = None, nproc_per_node: int = 1,
          steps: Optional[int] = None, epochs: Optional[int] = None, pipeline: Optional[str] = None,
          config: Optional[Mapping[str, Any]] = None, seed: Optional[int] = None, progress: bool = False,
          resume: bool = False) -> Dict[str, Any]:
    """Train on ``shards`` into the run directory ``out``; returns ``out/metrics.json`` as a dict.

    ``model`` defaults from the shards' task (hstu for gr, dlrm for ctr); ``config``: nested config keys, as
    ``--set`` takes them (``{"embedding": {"lr": 0.05}}``; ``nestpipe train --help-config`` lists them all);
    ``resume``: continue ``out`` from its latest checkpoint (``steps`` / ``epochs`` / ``config`` may change what
    is left to train)."""
    from nestpipe.cli import build_parser  # start-up time: `import nestpipe` stays light (the API loads on use)

    argv = ["train"]
    if resume:
        argv += ["--resume", out]
    else:
        argv += ["--shards", shards, "--out", out]
        if model:
            argv += ["--model", model]
        if seed is not None:
            argv += ["--seed", str(seed)]
    if nproc_per_node != 1 or not resume:
        argv += ["--nproc-per-node", str(nproc_per_node)]
    if steps is not None:
        argv += ["--steps", str(steps)]
    if epochs is not None:
        argv += ["--epochs", str(epochs)]
    if pipeline:
        argv += ["--pipeline", pipeline]
    for key, value in _flatten("", config or {}):
        argv += ["--set", f"{key}={json.dumps(value)}"]
    if not progress:
        argv.append("--no-progress")
    args = build_parser(["nestpipe.trainer.cli"]).parse_args(argv)
    rc = args.func(args)
    if rc:
        raise RuntimeError(f"training failed (exit code {rc}); logs in {out}")
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)


def evaluate(run: str, *, split: str = "eval", shards: Optional[str] = None,
             max_batches: Optional[int] = None) -> Dict[str, Any]:
    """Score ``run``'s latest checkpoint on ``split`` beside the baselines (what ``nestpipe eval`` prints);
    ``shards``: where the run's shards are now, when they moved."""
    from nestpipe.trainer.evaluate import evaluate_run  # start-up time: torch only once it is called

    return evaluate_run(run, max_batches=max_batches, split=split, shards=shards)


def export(run: str, out_file: str, *, max_rows_in_memory: int = 50_000_000) -> Dict[str, Any]:
    """Write ``run``'s latest checkpoint as one dict of full tensors (``torch.load(out_file, weights_only=True)``)."""
    from nestpipe.trainer.export import export_run  # start-up time: torch only once it is called

    return export_run(run, out_file, max_rows_in_memory)
