"""``nestpipe train``, ``nestpipe eval`` and ``nestpipe export``."""

from __future__ import annotations

import json
import os

from nestpipe.datasets.shards import ShardError, load_manifest, verify_shard
from nestpipe.trainer.run_files import keep_manifest
from nestpipe.utils.jsonio import read_json
from nestpipe.trainer.config import (MODELS, SCHEDULES, TrainConfig, check_tables, default_config, describe,
                                     load_config_file, load_run_config, merge, save_config)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train hstu or dlrm from shards over torch.distributed (launched through torchrun)",
        description="Train from `nestpipe ingest` shards. Launches --nproc-per-node ranks through "
                    "torch.distributed.run (extra torchrun options such as --nnodes/--rdzv-endpoint go after --). "
                    "Writes RUN/config.json, RUN/plan.json, RUN/checkpoints/, RUN/scalars.jsonl and "
                    "RUN/metrics.json. Sharded tables are laid out by the cost-driven planner (table-wise or "
                    "row-wise over chosen ranks, printed at start); --set embedding.placement=hashed spreads every "
                    "table over all ranks, --set embedding.placement=FILE runs a `nestpipe plan --out FILE` plan as it is "
                    "(its exchange kinds and its row and column splits).")
    p.add_argument("--shards", help="shard directory (with manifest.json); required unless --resume or --help-config")
    p.add_argument("--out", help="run directory (config, checkpoints, metrics, trace); required unless --resume")
    p.add_argument("--model", choices=MODELS,
                   help="the model (default: from the shards' task: hstu for gr shards, dlrm for ctr shards)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks on this machine (default 1; with --resume, the world size the run's checkpoint was "
                   "written with)")
    p.add_argument("--pipeline", choices=SCHEDULES, default=None,
                   help="auto (default): chosen once at start -- nested where its threads get cores of their own "
                        "or the link is slow, else off -- printed and recorded in metrics.json; nested: DBP between "
                        "batches + FWP inside a batch; dbp or fwp alone; off: the synchronous step. All give "
                        "bitwise-identical results")
    p.add_argument("--sparse-groups", type=int, default=None, metavar="M",
                   help="2D sparse parallelism: M = number of workers in one model-parallel group. The world "
                        "(W ranks) is split into W/M groups of M consecutive ranks; inside a group every sharded "
                        "table is sharded over its M workers (key routing and All2Alls stay inside the group), so "
                        "each group holds a full replica of the tables and trains it on its own ranks' data; after "
                        "every batch the W/M replicas of each shard are averaged (weights and AdaGrad state of the "
                        "rows any group touched). Dense parameters and replicated tables stay all-reduced over all "
                        "W ranks. W must be divisible by M. M = W (or 0, the default): plain training, one group. "
                        "M = 1: every rank holds full replicas (data-parallel tables, no All2All). "
                        "--set embedding.optimizer=rowwise_adagrad_2dsp selects the momentum-scaled row-wise "
                        "AdaGrad (accumulator divided by W/M)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, help="steps (batches per rank) to train")
    g.add_argument("--epochs", type=int, help="passes over the training shards (default: chosen by early stopping "
                   "on the valid split where the shards have one, ingest --validation; else 1)")
    g.add_argument("--early-stop", action="store_true",
                   help="train epoch by epoch, score each on the valid split (NDCG@10, or AUC for dlrm), stop after "
                   "early_stop.patience (3) epochs without a better score (at most early_stop.max_epochs, 50) and "
                   "keep the best epoch; the shards need a valid split (ingest --validation). The default where "
                   "they have one and no --steps or --epochs is given; the kept epoch is in RUN/metrics.json")
    p.add_argument("--checkpoint-every", type=int, default=None, help="checkpoint every K steps (0: only at the end)")
    p.add_argument("--config", help="JSON or TOML file with the nested TrainConfig keys")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="override one config key, e.g. --set embedding.lr=0.1 (repeatable)")
    p.add_argument("--seed", type=int, help="seed of the initial rows, the dense model and the negatives (default 0)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"],
                   help="auto (default): cuda or npu where present, else cpu")
    p.add_argument("--timeout", type=float, help="process-group timeout in seconds (default 60)")
    p.add_argument("--resume", metavar="RUN", help="continue RUN from its latest complete checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write the scalars of RUN/scalars.jsonl (loss, samples/s) as TensorBoard events under "
                   "RUN/tensorboard: `tensorboard --logdir RUN/tensorboard` (needs pip install tensorboard)")
    p.add_argument("--help-config", action="store_true",
                   help="list every config key (for --config and --set) with its type, default and meaning, and exit")
    p.add_argument("torchrun_args", nargs="*", help="passed to torch.distributed.run (after --)")
    p.set_defaults(func=_train)

    e = subparsers.add_parser(
        "eval", help="evaluate a trained run beside baselines (HR/NDCG for hstu, sasrec; AUC/logloss for dlrm)",
        description="Score the run's latest checkpoint on the eval split and, on exactly the same protocol, the "
        "baselines fitted on the train split: most popular and successor counting (next item), the constant rate, "
        "a logistic regression over the model's features and a factorization machine over the same inputs (CTR: a "
        "baseline with a pairwise interaction of every pair of inputs; each fit takes seconds to minutes on large data). "
        "Writes RUN/eval.json and prints it.")
    e.add_argument("--run", required=True, help="run directory of `nestpipe train` (its --out)")
    e.add_argument("--max-batches", type=int, default=None, help="score only the first N eval batches")
    e.add_argument("--shards", default=None,
                   help="where the run's shards are now, when they moved (checked against the manifest the run kept)")
    e.add_argument("--split", default="eval", choices=["eval", "valid"],
                   help="valid: the split carved from the training data by `nestpipe ingest --validation` (for "
                   "choosing settings; writes RUN/eval-valid.json)")
    e.add_argument("--pairwise-baseline", action="store_true",
                   help="ctr: also fit a logistic regression with hashed crosses of every pair of the model's "
                   "single-id tables and its dot_pairs (an unfactorised weight per cross; minutes from 30k training "
                   "samples on, so not by default: the factorization machine fitted by every ctr eval is the "
                   "default baseline of pairwise interactions)")
    e.set_defaults(func=_eval)

    x = subparsers.add_parser(
        "export", help="export a run as one dict of full tensors (torch.load weights_only)",
        description="Gather the run's latest checkpoint (every rank's rows of every table, the dense model) into one "
        "dict of full tensors saved with torch.save, readable with torch.load(..., weights_only=True); tables above "
        "--max-rows-in-memory are streamed to files of their own. With --out FILE.safetensors: one safetensors file "
        "(the same tensor names), every table streamed block by block, and the model config beside it. Refuses a "
        "checkpoint whose data-parallel replicas differ across ranks.")
    x.add_argument("--run", required=True, help="run directory of `nestpipe train` (its --out)")
    x.add_argument("--out", required=True,
                   help="output FILE.pt (torch.save), or FILE.safetensors (streamed table by table, with "
                   "FILE.config.json beside it: the run's config, tables and step)")
    x.add_argument("--max-rows-in-memory", type=int, default=50_000_000,
                   help="tables above this are streamed as FILE.<table>.<block>.pt")
    x.set_defaults(func=_export)


def _parse_set(items):
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        try:
            val = json.loads(v)
        except json.JSONDecodeError:
            val = v
        d = out
        parts = k.split(".")
        for part in parts[:-1]:
            d = d.setdefault(part, {})
        d[parts[-1]] = val
    return out


def _train(args) -> int:
    if args.help_config:
        print(describe(), end="")
        return 0
    from nestpipe.trainer.launch import launch_training  # start-up time: torch only once a command needs it

    if args.resume:
        return _resume(args)
    if args.nproc_per_node is None:
        args.nproc_per_node = 1
    cfg = _config_from_args(args)
    _check_before_launch(cfg, args)
    cfg.shards = os.path.abspath(cfg.shards)
    cfg.out = os.path.abspath(cfg.out)
    os.makedirs(cfg.out, exist_ok=True)
    if os.path.exists(os.path.join(cfg.out, "checkpoints")) and os.listdir(os.path.join(cfg.out, "checkpoints")):
        raise FileExistsError(f"{cfg.out}: holds checkpoints already; use --resume {cfg.out} or a new --out")
    save_config(cfg, os.path.join(cfg.out, "config.json"))
    keep_manifest(cfg.out, cfg.shards)  # the run stands on its own (export needs no shards; eval takes --shards)
    rc = launch_training(cfg.out, args.nproc_per_node, False, args.torchrun_args)
    _print_metrics(cfg.out)
    return rc


def _config_from_args(args) -> TrainConfig:
    """The run's config: the defaults (with the chosen model's own for shared keys), then --config, the flags and
    --set, in that order of precedence."""
    from_file = load_config_file(args.config) if args.config else {}
    sets = _parse_set(args.set)
    model = sets.get("model") or args.model or from_file.get("model")
    if model is None and args.shards:
        # the model follows the shards' task unless one was asked for (gr -> hstu, ctr -> dlrm)
        from nestpipe.trainer.models import DEFAULT_MODEL  # start-up time: imports torch

        model = DEFAULT_MODEL[load_manifest(args.shards).task]
    d = default_config(model) if isinstance(model, str) and model in MODELS else TrainConfig().to_dict()
    d = merge(d, from_file)
    flags = {"shards": args.shards, "out": args.out, "model": args.model, "pipeline": args.pipeline,
             "steps": args.steps, "epochs": args.epochs, "checkpoint_every": args.checkpoint_every,
             "seed": args.seed, "device": args.device, "timeout_s": args.timeout,
             "sparse_groups": args.sparse_groups}
    d = merge(d, {k: v for k, v in flags.items() if v is not None})
    d = merge(d, sets)
    if args.early_stop:
        d["early_stop"] = {**d.get("early_stop", {}), "mode": "on"}
    if args.no_progress:
        d["progress"] = False
    if args.tensorboard:
        d["tensorboard"] = True
    cfg = TrainConfig.from_dict(d, where=args.config or "command line")
    _check_tensorboard(cfg)
    for k in ("shards", "out"):
        if not getattr(cfg, k):
            raise ValueError(f"--{k} is required (or set it in --config)")
    return cfg


def _check_before_launch(cfg: TrainConfig, args) -> None:
    """What the parent can refuse before any rank starts: the sparse groups, the model against the shards' task and
    tables, early stopping without a valid split, too few batches for the world (one node), corrupt shards."""
    if not _multi_node(args):
        from nestpipe.trainer.distributed import sparse_groups  # one node: the world size is known now, fail before launching

        layout = sparse_groups.resolve(cfg.sparse_groups, args.nproc_per_node)
        sparse_groups.momentum_scale(cfg.embedding.optimizer, layout, cfg.embedding.momentum_scale_groups)
    from nestpipe.trainer.models import MODEL_TASK  # start-up time: imports torch

    man = load_manifest(cfg.shards)
    if MODEL_TASK[cfg.model] != man.task:
        right = [m for m, t in MODEL_TASK.items() if t == man.task]
        raise ValueError(f"--model {cfg.model} trains on {MODEL_TASK[cfg.model]!r} shards, {cfg.shards} holds "
                         f"{man.task!r} shards (use --model {' or '.join(right) or '?'})")
    check_tables(cfg, man.tables, cfg.shards)
    from nestpipe.trainer import early_stop  # start-up time: only once the config is built

    early_stop.wanted(cfg, man)  # early stopping without a valid split is refused here, before any rank starts
    if not _multi_node(args):
        from nestpipe.trainer.data import world_problem  # one node: refuse here, not in every rank

        problem = world_problem(man, "train", args.nproc_per_node, cfg.shards)
        if problem:
            raise ValueError(problem)
    if cfg.verify_shards:
        _verify_shards(cfg.shards, man)


def _multi_node(args) -> bool:
    """Whether torchrun spans several nodes (then the world size is not known before launching)."""
    return any(a.startswith("--nnodes") or a.startswith("--rdzv") for a in args.torchrun_args)


def _verify_shards(shards: str, manifest) -> None:
    """Every shard of the run present and matching the manifest's sha256, checked here before any rank starts: one
    line per problem (the ranks check their own shards again, which on several nodes is the only check)."""
    problems = []
    for split, entries in sorted(manifest.sets.items()):
        for e in entries:
            try:
                verify_shard(shards, e)
            except ShardError as err:
                problems.append(str(err))
    if problems:
        raise ValueError(f"{len(problems)} shard problem(s), nothing launched:\n  " + "\n  ".join(problems)
                         + "\n  re-run `nestpipe ingest` into a new --out (or restore the shards); "
                         "`nestpipe shard-report` lists every shard")


def _check_tensorboard(cfg) -> None:
    import importlib.util

    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--tensorboard (tensorboard = true) needs the tensorboard package: "
                         "pip install 'nestpipe[tensorboard]' (or pip install tensorboard)")


def _resume(args) -> int:
    """``--resume RUN``: the run's own config, with what the command line changes (--steps/--epochs, --set,
    --no-progress, --pipeline, --checkpoint-every, --timeout) validated as a whole; the world size of the run's
    latest checkpoint unless --nproc-per-node says otherwise (then the checkpoint's check names both)."""
    # start-up time: torch only once a command needs it
    from nestpipe.trainer import checkpoint
    from nestpipe.trainer.launch import launch_training

    cfg = load_run_config(args.resume)
    if args.shards or args.config or args.model or args.seed is not None or args.sparse_groups is not None:
        raise ValueError("--resume continues RUN as it was configured: --shards, --config, --model, --seed and "
                         "--sparse-groups cannot change (start a new --out instead)")
    d = cfg.to_dict()
    # the run is where it is now: a copied or moved run continues there, never in the directory it was made in
    d["out"] = os.path.abspath(args.resume)
    flags = {"pipeline": args.pipeline, "checkpoint_every": args.checkpoint_every, "timeout_s": args.timeout,
             "device": args.device}
    if args.steps is not None or args.epochs is not None:  # one of them replaces the other
        flags.update(steps=args.steps, epochs=args.epochs)
        d["steps"], d["epochs"] = args.steps, args.epochs
    d = merge(d, {k: v for k, v in flags.items() if v is not None})
    d = merge(d, _parse_set(args.set))
    if args.early_stop:
        d["early_stop"] = {**d.get("early_stop", {}), "mode": "on"}
    if args.no_progress:
        d["progress"] = False
    if args.tensorboard:
        d["tensorboard"] = True
    cfg = TrainConfig.from_dict(d, where=f"{args.resume}/config.json + command line")
    _check_tensorboard(cfg)
    ckpt = checkpoint.latest(cfg.out)
    if ckpt is None:
        raise FileNotFoundError(f"{cfg.out}: no complete checkpoint to resume from (start the run again without "
                                "--resume, or with a new --out)")
    if args.nproc_per_node is None and _multi_node(args):
        raise ValueError("--resume over several nodes: give --nproc-per-node (the checkpoint knows the world size, "
                         f"{checkpoint.read_meta(ckpt)['world']}, not how it is split into nodes)")
    nproc = args.nproc_per_node or int(checkpoint.read_meta(ckpt)["world"])
    save_config(cfg, os.path.join(cfg.out, "config.json"))
    rc = launch_training(cfg.out, nproc, True, args.torchrun_args)
    _print_metrics(cfg.out)
    return rc


def _print_metrics(run: str) -> None:
    path = os.path.join(run, "metrics.json")
    if os.path.exists(path):
        m = read_json(path, "metrics")
        per = ", ".join(f"{x:.0f}" for x in m["samples_per_s_per_rank"])
        print(f"trained {m['model']} on {m['world']} rank(s): {m['steps_run']} steps, final loss {m['final_loss']:.4f}, "
              f"{m['samples_per_s']:.0f} samples/s ({per} per rank); {path}")


def _eval(args) -> int:
    from nestpipe.trainer.evaluate import evaluate_run, summary_lines  # start-up time: torch only for eval

    res = evaluate_run(args.run, max_batches=args.max_batches, split=args.split, shards=args.shards,
                       pairwise=args.pairwise_baseline)
    print(json.dumps(res, indent=1, sort_keys=True))
    for line in summary_lines(res):  # paired 95% bootstrap intervals of model - baseline
        print(line)
    return 0


def _export(args) -> int:
    from nestpipe.trainer.export import export_run  # start-up time: torch only for this command

    res = export_run(args.run, args.out, args.max_rows_in_memory)
    print(f"exported {res['tensors']} tensors at step {res['step']} to {res['file']}"
          + (f" (+{len(res['streamed_files'])} streamed table files)" if res["streamed_files"] else "")
          + (f"; model config in {res['config']}" if res.get("config") else ""))
    return 0
