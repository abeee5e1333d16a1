"""Sharded, atomic checkpoints.

Layout: ``RUN/checkpoints/step-SSSSSSSS/`` (``S`` = completed steps) holding ``rank-RRRRR.pt`` per rank and
``meta.json``. Each rank file holds that rank's materialised rows and their AdaGrad state per sharded table; rank 0's
also holds the dense parameters, the AdamW state and the replicated tables (identical on every rank). The data
position and the random state are both functions of the step (shards are read by step, generators are keyed by
(seed, step, micro-batch, rank)), so ``meta.json`` records the step, the world size, the seed and the placement.

Atomicity: ranks write into ``.tmp-step-SSSSSSSS/`` (each file via a temporary name and rename), all ranks
barrier, rank 0 writes ``meta.json`` and renames the directory. A directory without ``meta.json`` or still named
``.tmp-*`` is ignored (and removed) on resume, so a run killed during a write resumes from the previous one.
Checkpoints are taken between steps only: no batch is in flight. Files load with ``torch.load(weights_only=True)``.

Integrity: every rank hashes the files it wrote (its rank file, and a memory-mapped store's row files) and rank 0
lists them in ``meta.json`` (``files``: name -> sha256 and bytes). :func:`latest` returns the newest checkpoint
whose every listed file is present with its recorded size and sha256; a damaged one (a file truncated, changed or
missing after the checkpoint completed) is reported by name on stderr and the previous complete one is used.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from nestpipe.trainer.distributed.sparse_groups import resolve
from nestpipe.utils.jsonio import read_json, write_json_atomic

FORMAT = "nestpipe-trainer-checkpoint-1"


def ckpt_root(run: str) -> str:
    return os.path.join(run, "checkpoints")


def _rank_payload(state, step: int, directory: str) -> Dict:
    emb = state.emb
    # DRAM stores: their touched rows in the payload; memory-mapped stores: a copy of their row files beside it
    payload = {"step": step, "rank": state.rank, "world": state.world,
               "tables": {t: s.state_dict() if s.in_dram else s.snapshot(directory) for t, s in emb.stores.items()}}
    data_parallel = {"dense": {k: v.detach().cpu() for k, v in state.model.state_dict().items()},
                     "optimizer": state.optimizer.state_dict(),
                     "replicated": {t: {"weight": r.weight.detach().cpu(), "state": r.state.cpu()}
                                    for t, r in emb.replicated.items()}}
    # every rank records a digest of its data-parallel copy (rank 0 also the tensors): the export checks them
    payload["replica_digest"] = replica_digest(data_parallel)
    if state.rank == 0:
        payload.update(data_parallel)
    return payload


def replica_digest(payload: Dict) -> str:
    """sha256 over the data-parallel tensors (replicated tables, dense parameters, AdamW state) by name and bytes:
    equal on every rank when the replicas are bitwise equal."""
    h = hashlib.sha256()
    items = {f"replicated.{n}.{k}": v for n, rep in payload["replicated"].items() for k, v in rep.items()}
    items.update({f"dense.{k}": v for k, v in payload["dense"].items()})
    for idx, st in payload["optimizer"]["state"].items():
        items.update({f"optim.{idx}.{k}": v if torch.is_tensor(v) else torch.tensor(v) for k, v in st.items()})
    for name in sorted(items):
        t = items[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save(run: str, state, step: int, sleep_s: float = 0.0) -> str:
    """Collective: every rank must call it at the same step."""
    root = ckpt_root(run)
    name = f"step-{step:08d}"
    tmp = os.path.join(root, f".tmp-{name}")
    final = os.path.join(root, name)
    if state.rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    _barrier(state)
    path = os.path.join(tmp, f"rank-{state.rank:05d}.pt")
    part = f"{path}.part"
    torch.save(_rank_payload(state, step, tmp), part)
    if sleep_s:
        time.sleep(sleep_s)  # testing hook: a window for tests to kill the run mid-write
    with open(part, "rb") as f:
        os.fsync(f.fileno())
    os.replace(part, path)
    written = [os.path.basename(path)] + [n for s in state.emb.stores.values() if not s.in_dram
                                          for n in s.snapshot_names()]
    write_json_atomic(os.path.join(tmp, f".files-{state.rank:05d}.json"), {n: file_digest(os.path.join(tmp, n))
                                                                           for n in written})
    _barrier(state)
    if state.rank == 0:
        emb = state.emb
        files: Dict[str, Dict] = {}
        for r in range(state.world):
            listed = os.path.join(tmp, f".files-{r:05d}.json")
            files.update(read_json(listed, "checkpoint file list", expect=dict))
            os.remove(listed)
        meta = {"format": FORMAT, "step": step, "world": state.world, "seed": state.cfg.seed, "files": files,
                "model": state.cfg.model,
                "placement": {t: {"table_id": s.placement.table_id, "vocab": s.placement.vocab,
                                  "world": s.placement.world, "a": s.placement.a, "b": s.placement.b,
                                  "owners": list(s.placement.owners), "dim": s.dim, "table": s.table,
                                  "first_col": s.first_col} for t, s in emb.stores.items()},
                "replicated": sorted(emb.replicated), "kinds": emb.kinds}
        write_json_atomic(os.path.join(tmp, "meta.json"), meta)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    _barrier(state)
    return final


def _barrier(state) -> None:
    if state.world > 1:
        dist.barrier(group=state.group)


def file_digest(path: str) -> Dict:
    """{"sha256", "bytes"} of a file, read in 8 MiB blocks."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
            n += len(block)
    return {"sha256": h.hexdigest(), "bytes": n}


def damage(ckpt: str) -> List[str]:
    """What is wrong with a complete checkpoint's files: each file ``meta.json`` lists that is missing, or whose
    size or sha256 differs from the recorded one (empty: intact). A checkpoint without a file list (written before
    checksums were recorded) has nothing to check."""
    try:
        meta = read_meta(ckpt)
    except (OSError, ValueError) as e:
        return [f"meta.json unreadable: {e}"]
    out = []
    for name, want in sorted(meta.get("files", {}).items()):
        path = os.path.join(ckpt, name)
        if not os.path.exists(path):
            out.append(f"{name}: missing")
            continue
        size = os.path.getsize(path)
        if size != want["bytes"]:
            out.append(f"{name}: {size} bytes, {want['bytes']} recorded")
        elif file_digest(path)["sha256"] != want["sha256"]:
            out.append(f"{name}: sha256 differs from the recorded one")
    return out


def latest(run: str, quiet: bool = False) -> Optional[str]:
    """The newest complete and intact checkpoint directory of ``run`` (:func:`damage` finds nothing), or None. A
    damaged newer one is reported on stderr by name (unless ``quiet``) and skipped."""
    root = ckpt_root(run)
    if not os.path.isdir(root):
        return None
    done = sorted(d for d in os.listdir(root)
                  if d.startswith("step-") and os.path.exists(os.path.join(root, d, "meta.json")))
    for d in reversed(done):
        ckpt = os.path.join(root, d)
        problems = damage(ckpt)
        if not problems:
            return ckpt
        if not quiet:
            print(f"checkpoint {ckpt} is damaged, not used ({'; '.join(problems)}); trying the one before it",
                  file=sys.stderr, flush=True)
    return None


def read_meta(ckpt: str) -> Dict:
    meta = read_json(os.path.join(ckpt, "meta.json"), "checkpoint metadata", expect=dict)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{ckpt}: checkpoint format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def load_rank_file(ckpt: str, rank: int) -> Dict:
    path = os.path.join(ckpt, f"rank-{rank:05d}.pt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: checkpoint shard missing")
    return torch.load(path, map_location="cpu", weights_only=True)


def load(ckpt: str, state) -> int:
    """Restore ``state`` (this rank's rows, dense model, optimizer, replicated tables). Returns the step."""
    meta = read_meta(ckpt)
    if meta["world"] != state.world:
        raise ValueError(f"{ckpt}: written with world size {meta['world']}, this run has {state.world}; rows are "
                         "sharded by world size (export + retrain to change it)")
    for t, s in state.emb.stores.items():
        pm = meta["placement"].get(t)
        if pm is None or list(pm.get("owners", [])) != list(s.placement.owners):
            raise ValueError(f"{ckpt}: table {t!r} was sharded over ranks {pm and (pm.get('owners') or 'all')}, this "
                             f"run places it on {list(s.placement.owners) or 'all'}; resume with the run's own "
                             "configuration (embedding.placement), or export + retrain to change it")
    mine = load_rank_file(ckpt, state.rank)
    for t, s in state.emb.stores.items():
        s.load_state_dict(mine["tables"][t], where=ckpt)
    r0 = mine if state.rank == 0 else load_rank_file(ckpt, 0)
    state.model.load_state_dict(r0["dense"])
    state.optimizer.load_state_dict(r0["optimizer"])
    with torch.no_grad():
        for t, r in state.emb.replicated.items():
            r.weight.data.copy_(r0["replicated"][t]["weight"])
            r.state.copy_(r0["replicated"][t]["state"])
    return int(meta["step"])


def clean_partial(run: str) -> None:
    root = ckpt_root(run)
    if os.path.isdir(root):
        for d in os.listdir(root):
            if d.startswith(".tmp-"):
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def replica_mismatches(ckpt: str, group_size: int) -> List[str]:
    """Check a 2D-SP checkpoint: for every sharded table and shard ``j``, the rank files of ``j, j + M, ...`` must
    hold the same materialised rows, weights and AdaGrad state, bitwise. Returns ``table/shard j/field: ranks``
    for every difference (empty: all replicas equal)."""
    meta = read_meta(ckpt)
    layout = resolve(group_size, meta["world"])
    files = {r: load_rank_file(ckpt, r) for r in range(meta["world"])}
    out = []
    for j in range(layout.group_size):
        ranks = layout.replica_ranks(j)
        first = files[ranks[0]]["tables"]
        for r in ranks[1:]:
            for t in sorted(first):
                for k in ("rows", "weight", "state"):
                    a, b = first[t][k], files[r]["tables"][t][k]
                    if a.shape != b.shape or not torch.equal(a, b):
                        out.append(f"{t}/shard {j}/{k}: rank {ranks[0]} != rank {r}")
    return out
