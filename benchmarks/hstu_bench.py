"""Padding-free HSTU attention against the padded layer stack and a length-bucketed padded baseline, in one run.

    python benchmarks/hstu_bench.py [--work DIR] [--lengths 256 1024] [--batches 6] [--repeats 3] [--e2e-steps 12]

The workload is fixed: GR shards from ``nestpipe synth --scale medium`` (seed 0) ingested with ``--max-seq-len L``
for each L (batch 128, the ingest's default 8 micro-batches), the default HSTU config (2 layers, 2 heads x 16, the
manifest's embedding dim). For the first ``--batches`` training batches, every micro-batch's sequence lengths are
taken from the shards and the token embeddings drawn at random; one thread (the trainer's per-rank setting).

Reported per L (median over ``--repeats`` rounds; inside a round the variants alternate per micro-batch, so drift of
the machine hits all alike):

* padding fraction: padded token slots that hold no token, over all slots (micro-batches padded to their longest);
* R = padded attention FLOPs / causal jagged FLOPs = sum(b n^2) / sum(L (L + 1) / 2) over micro-batches;
* forward + backward seconds per batch of the layer stack (``HSTU.encode`` and its backward): ``jagged``
  (``attention=jagged``), ``padded`` (``attention=padded``, the whole stack on padded tokens) and ``bucketed``
  (each micro-batch's sequences grouped by length into power-of-two buckets, each bucket padded to its own
  longest, the padded stack per bucket);
* the attention alone (forward + backward of :func:`nestpipe.kernels.hstu_attention` against
  :func:`nestpipe.kernels.attention.padded_reference` on the same q, k, v): how much of R the kernel realises.

End to end (``--e2e-steps`` > 0): ``nestpipe train`` on the longest L's shards, world 2, ``--pipeline off``, with
``hstu.attention=jagged`` and ``padded`` in turn; the run's ``step_s`` from ``metrics.json``.

``--negatives``: instead, the end-to-end step time (world 2, ``--pipeline off``, jagged attention, ``--e2e-steps``
steps) on the longest L's shards of each negatives setting of :data:`NEGATIVE_SETTINGS` (the sampled-softmax
negatives: the default 4096 uniform + 1024 of the micro-batch's targets, in-batch off, 128 uniform, bfloat16 logits),
in one run; quality of the same settings: ``benchmarks/quality_bench.py --set ...``.

``--cpu-paths``: instead, the CPU paths of the attention alone on micro-batches of 16 sequences with lengths drawn
uniformly from 1..L (L = 16, 64, 256, 1024; seed 0; forward + backward with a relative bias, best of 3): the exact
Numba loops, the blocked tiles at 16, 32 and 64 tokens, and the padded reference. This is what the CPU rule in
``nestpipe/kernels/attention.py`` (loops up to 64 tokens, 32-token tiles up to 512, 64 beyond) was read from.

Writes ``WORK/results.json`` with the figures, versions and the load average before and after, and the record
``benchmarks/results/hstu.json`` (``hstu-negatives.json``, ``hstu-cpu-paths.json``; ``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from nestpipe.datasets import shards as S
from nestpipe.datasets.synth import generate
from nestpipe.ingest import IngestConfig, ingest
from nestpipe.kernels import attention as attention_paths
from nestpipe.kernels.attention import blocked_attention, hstu_attention, padded_reference
from nestpipe.trainer.config import TrainConfig
from nestpipe.trainer.data import ShardStream  # noqa: F401  (the shards' reader is the trainer's)
from nestpipe.trainer.models.hstu import HSTU

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import Recorder  # noqa: E402


def shards_for(work: str, max_len: int) -> str:
    raw = os.path.join(work, "raw")
    if not os.path.isdir(raw):
        generate(raw, scale="medium", seed=0, progress=False)
    out = os.path.join(work, f"gr{max_len}")
    cfg = IngestConfig(raw=raw, out=out, task="gr", batch_size=128, max_seq_len=max_len, workers=2, progress=False)
    try:
        ingest(cfg)  # nothing to do when the shards are this version's ingest of these options
    except FileExistsError:  # shards of an older ingest (other batches or micro-batches): this benchmark's own, redone
        print(f"{out}: written by another ingest version or options; ingesting again", file=sys.stderr)
        ingest(dataclasses.replace(cfg, force=True))
    return out


def micro_batch_lengths(shards: str, batches: int):
    """Per batch, the list of its micro-batches' length arrays (the ingest's own partition)."""
    import webdataset as wds

    m = S.load_manifest(shards)
    out = []
    for sample in wds.WebDataset(S.shard_paths(shards, m, "train"), shardshuffle=False).decode():
        rec = S.decode_sample(sample)
        lengths = np.asarray(rec["item.lengths"], dtype=np.int64)
        mb = np.asarray(rec["mb"], dtype=np.int64)
        out.append([lengths[mb == g] for g in np.unique(mb)])
        if len(out) == batches:
            break
    return m, out


def buckets(lengths: np.ndarray):
    """Sequence indices grouped by power-of-two length bucket (1, 2, 3-4, 5-8, ...)."""
    key = np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    return [np.flatnonzero(key == k) for k in np.unique(key)]


def stack_seconds(model: HSTU, emb, lengths: torch.Tensor, variant: str, grad) -> float:
    leaves = {t: e.clone().requires_grad_(True) for t, e in emb.items()}
    t0 = time.perf_counter()
    if variant == "bucketed":
        offsets = np.concatenate([[0], np.cumsum(lengths.numpy())])
        hidden = torch.empty(int(offsets[-1]), model.dim)
        for idx in buckets(lengths.numpy()):
            rows = torch.from_numpy(np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in idx]))
            part = model.encode_padded({t: x.index_select(0, rows) for t, x in leaves.items()}, lengths[idx])
            hidden = hidden.index_copy(0, rows, part)
    elif variant == "padded":
        hidden = model.encode_padded(leaves, lengths)
    else:
        hidden = model.encode(leaves, lengths)
    (hidden * grad).sum().backward()
    return time.perf_counter() - t0


def attention_seconds(q, k, v, offsets, n, dout, variant: str) -> float:
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    t0 = time.perf_counter()
    if variant == "jagged":
        out = hstu_attention(*leaves, offsets, n, 0.25, 1 / 1024, None)
    else:
        out = padded_reference(*leaves, offsets, 0.25, 1 / 1024, None)
    out.backward(dout)
    return time.perf_counter() - t0


def layer_benchmark(shards: str, batches: int, repeats: int):
    manifest, per_batch = micro_batch_lengths(shards, batches)
    cfg = TrainConfig()
    dim = manifest.tables["item"].dim
    model = HSTU(cfg.hstu, dim, ["action", "author", "item"], int(manifest.max_seq_len), manifest.tables["item"].vocab)
    heads, hd = cfg.hstu.num_heads, cfg.hstu.linear_dim
    g = torch.Generator().manual_seed(0)
    work = []
    slots = tokens = padded_pairs = causal_pairs = 0
    for mbs in per_batch:
        for ln in mbs:
            t, n = int(ln.sum()), int(ln.max())
            slots += len(ln) * n
            tokens += t
            padded_pairs += len(ln) * n * n
            causal_pairs += int((ln * (ln + 1) // 2).sum())
            lengths = torch.from_numpy(ln)
            emb = {tb: torch.randn(t, dim, generator=g) for tb in model.tables}
            qkv = [torch.randn(t, heads, hd, generator=g) for _ in range(4)]
            offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(ln)]).astype(np.int64))
            work.append((lengths, emb, torch.randn(t, dim, generator=g), qkv, offsets, n))
    variants = ("jagged", "padded", "bucketed")
    rounds = {v: [] for v in variants}
    attn_rounds = {v: [] for v in ("jagged", "padded")}
    for r in range(repeats + 1):  # round 0 warms up (compilation, allocator)
        tot = dict.fromkeys(variants, 0.0)
        atot = dict.fromkeys(attn_rounds, 0.0)
        for i, (lengths, emb, grad, (q, k, v, dout), offsets, n) in enumerate(work):
            order = variants if (i + r) % 2 == 0 else variants[::-1]
            for var in order:
                tot[var] += stack_seconds(model, emb, lengths, var, grad)
            for var in (("jagged", "padded") if (i + r) % 2 == 0 else ("padded", "jagged")):
                atot[var] += attention_seconds(q, k, v, offsets, n, dout, var)
        if r:
            for var in variants:
                rounds[var].append(tot[var] / len(per_batch))
            for var in attn_rounds:
                attn_rounds[var].append(atot[var] / len(per_batch))
    med = {v: statistics.median(x) for v, x in rounds.items()}
    amed = {v: statistics.median(x) for v, x in attn_rounds.items()}
    R = padded_pairs / causal_pairs
    return {
        "batches": len(per_batch), "micro_batches": len(work), "padding_fraction": 1 - tokens / slots,
        "flop_ratio_R": R, "stack_s_per_batch": med, "stack_rounds": rounds,
        "stack_speedup_jagged_over_padded": med["padded"] / med["jagged"],
        "stack_speedup_jagged_over_bucketed": med["bucketed"] / med["jagged"],
        "attention_s_per_batch": amed, "attention_speedup": amed["padded"] / amed["jagged"],
        "attention_speedup_over_R": amed["padded"] / amed["jagged"] / R,
        "stack_speedup_over_R": med["padded"] / med["jagged"] / R,
    }


def end_to_end(shards: str, work: str, steps: int):
    out = {attention: train_step(shards, os.path.join(work, f"e2e-{attention}"), steps,
                                 [f"hstu.attention=\"{attention}\""]) for attention in ("jagged", "padded")}
    out["speedup"] = out["padded"]["step_s"] / out["jagged"]["step_s"]
    return out


def train_step(shards: str, run: str, steps: int, sets) -> dict:
    """``nestpipe train`` of hstu at world 2, ``--pipeline off``, with ``sets``: the run's step time."""
    cmd = [sys.executable, "-m", "nestpipe", "train", "--shards", shards, "--out", run, "--model", "hstu",
           "--nproc-per-node", "2", "--pipeline", "off", "--steps", str(steps), "--no-progress"]
    for kv in sets:
        cmd += ["--set", kv]
    subprocess.run(["rm", "-rf", run], check=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    m = json.load(open(os.path.join(run, "metrics.json")))
    return {"step_s": m["step_s"], "samples_per_s": m["samples_per_s"], "command": " ".join(cmd[1:])}


# the sampled-softmax negatives settings compared by --negatives (hstu config keys)
NEGATIVE_SETTINGS = {
    "default (4096 uniform + 1024 in-batch)": [],
    "4096 uniform (in-batch off)": ["hstu.in_batch_negatives=0"],
    "128 uniform + 1024 in-batch": ["hstu.num_random_negatives=128"],
    "default, bfloat16 logits": ['hstu.negatives_dtype="bfloat16"'],
}


def negatives(shards: str, work: str, steps: int) -> dict:
    out = {}
    for i, (name, sets) in enumerate(NEGATIVE_SETTINGS.items()):
        out[name] = dict(train_step(shards, os.path.join(work, f"neg-{i}"), steps, sets), sets=sets)
        print(f"{name}: step {out[name]['step_s'] * 1e3:.0f} ms", flush=True)
    base = out["default (4096 uniform + 1024 in-batch)"]["step_s"]
    for r in out.values():
        r["step_ratio_to_default"] = r["step_s"] / base
    return out


def cpu_paths():
    rng = np.random.default_rng(0)
    out = {}
    for top in (16, 64, 256, 1024):
        lengths = rng.integers(1, top + 1, 16)
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        t = int(offsets[-1])
        q, k, v, dout = (torch.randn(t, 2, 16) for _ in range(4))
        bias = torch.randn(2, top) * 0.1
        exact = attention_paths._NumbaAttention.apply
        variants = {"numba": lambda *a: exact(*a[:4], top, 0.25, 1 / top, a[4]),
                    "padded": lambda *a: padded_reference(*a[:4], 0.25, 1 / top, a[4])}
        for b in (16, 32, 64):
            variants[f"blocked{b}"] = (lambda b: lambda *a: blocked_attention(*a[:4], 0.25, 1 / top, a[4], block=b))(b)
        row = {}
        for name, fn in variants.items():
            best = float("inf")
            for _ in range(3):
                leaves = [x.clone().requires_grad_(True) for x in (q, k, v, bias)]
                t0 = time.perf_counter()
                fn(*leaves[:3], offsets, leaves[3]).backward(dout)
                best = min(best, time.perf_counter() - t0)
            row[name] = best
        out[str(top)] = row
        print(f"lengths 1..{top}: " + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in row.items()), flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/nestpipe-hstu-bench", help="synth data, shards and results (reused)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024], help="ingest --max-seq-len values")
    ap.add_argument("--batches", type=int, default=6, help="training batches timed per length")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up round)")
    ap.add_argument("--e2e-steps", type=int, default=12, help="training steps per end-to-end run (0: skip)")
    ap.add_argument("--cpu-paths", action="store_true", help="time the CPU attention paths alone (see above)")
    ap.add_argument("--negatives", action="store_true",
                    help="end-to-end step time of each negatives setting on the longest length's shards (see above)")
    args = ap.parse_args(argv)
    rec = Recorder("hstu-negatives" if args.negatives else "hstu-cpu-paths" if args.cpu_paths else "hstu", argv,
                   __file__)
    os.makedirs(args.work, exist_ok=True)
    torch.set_num_threads(1)
    if args.negatives:
        L = max(args.lengths)
        load = os.getloadavg()
        res = {"max_seq_len": L, "steps": args.e2e_steps, "torch": torch.__version__, "load_before": load,
               "settings": negatives(shards_for(args.work, L), args.work, args.e2e_steps), "load_after": os.getloadavg()}
        with open(os.path.join(args.work, "negatives.json"), "w") as f:
            json.dump(res, f, indent=1)
        print(f"load average {load[0]:.2f} before / {res['load_after'][0]:.2f} after; "
              f"{os.path.join(args.work, 'negatives.json')}")
        rec.write(res)
        return
    if args.cpu_paths:
        res = {"seconds": cpu_paths(), "torch": torch.__version__}
        with open(os.path.join(args.work, "cpu_paths.json"), "w") as f:
            json.dump(res, f, indent=1)
        rec.write(res)
        return
    load_before = os.getloadavg()
    results = {"versions": {"python": platform.python_version(), "torch": torch.__version__,
                            "numba": __import__("numba").__version__, "machine": platform.machine(),
                            "cpus": os.cpu_count()},
               "threads": 1, "load_before": load_before, "lengths": {}}
    for L in args.lengths:
        shards = shards_for(args.work, L)
        r = layer_benchmark(shards, args.batches, args.repeats)
        results["lengths"][str(L)] = r
        s = r["stack_s_per_batch"]
        print(f"max_seq_len {L}: padding {r['padding_fraction']:.3f}, R {r['flop_ratio_R']:.2f}; layer stack fwd+bwd "
              f"per batch: jagged {s['jagged'] * 1e3:.1f} ms, padded {s['padded'] * 1e3:.1f} ms, bucketed "
              f"{s['bucketed'] * 1e3:.1f} ms -> jagged/padded speedup {r['stack_speedup_jagged_over_padded']:.2f} "
              f"({r['stack_speedup_over_R']:.2f} R), jagged/bucketed {r['stack_speedup_jagged_over_bucketed']:.2f}; "
              f"attention alone {r['attention_s_per_batch']['jagged'] * 1e3:.1f} vs "
              f"{r['attention_s_per_batch']['padded'] * 1e3:.1f} ms: {r['attention_speedup']:.2f} "
              f"({r['attention_speedup_over_R']:.2f} R)", flush=True)
    if args.e2e_steps > 0:
        L = max(args.lengths)
        e2e = end_to_end(shards_for(args.work, L), args.work, args.e2e_steps)
        layer = results["lengths"][str(L)]
        predicted = layer["stack_speedup_jagged_over_padded"]
        e2e["layer_predicted_speedup"] = predicted
        # the other reading of "faster by what the layer benchmark predicts": the time saved. Every rank trains one
        # batch per step, so the step should lose what the layer stack loses per batch; the rest of the step (the
        # objective, the embeddings, the exchanges) is the same work with either attention
        s = layer["stack_s_per_batch"]
        e2e["layer_predicted_saving_s"] = s["padded"] - s["jagged"]
        e2e["measured_saving_s"] = e2e["padded"]["step_s"] - e2e["jagged"]["step_s"]
        results["end_to_end"] = e2e
        print(f"end to end (max_seq_len {L}, world 2, off, {args.e2e_steps} steps): step "
              f"{e2e['jagged']['step_s'] * 1e3:.0f} ms jagged vs "
              f"{e2e['padded']['step_s'] * 1e3:.0f} ms padded: speedup {e2e['speedup']:.2f} "
              f"(layer benchmark {predicted:.2f}; 1 + half its excess {1 + (predicted - 1) / 2:.2f}); time saved per "
              f"step {e2e['measured_saving_s'] * 1e3:.0f} ms against the layer benchmark's "
              f"{e2e['layer_predicted_saving_s'] * 1e3:.0f} ms per batch "
              f"({e2e['measured_saving_s'] / e2e['layer_predicted_saving_s']:.2f} of it)", flush=True)
    results["load_after"] = os.getloadavg()
    with open(os.path.join(args.work, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"load average {load_before[0]:.2f} before / {results['load_after'][0]:.2f} after; "
          f"{os.path.join(args.work, 'results.json')}")
    rec.write(results)


if __name__ == "__main__":
    main()
